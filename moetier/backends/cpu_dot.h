/* moetier's quantized dot products: the interface every format family implements.
 *
 * A weight matrix is `rows` rows of `n` values in a stored format (GGML type id,
 * moetier/model/formats.py), each row `row_bytes` apart. Its dot products with
 * activations are computed as llama.cpp computes them: the activations are first
 * converted, once per row of activations, to the format the weight type's dot
 * product takes (llama.cpp's vec_dot_type: Q8_K for the K-quants and the IQ
 * formats, Q8_0 for Q4_0 / Q5_0 / Q8_0 / IQ4_NL, Q8_1 for Q4_1 / Q5_1, F16 for
 * F16, BF16 for BF16, F32 for F32 -- or F32 for F16 / BF16 weights in the
 * "float32 activations" mode HF checkpoints use), then each block's integer dot
 * product is scaled and summed in float32.
 *
 * A family is one C file built into its own library (cpu_dot32.c: the 32-value
 * block formats and the float formats; cpu_dotk.c: the 256-value K-quant and IQ
 * formats). Each exports three functions with these signatures, named
 * <family>_act_type, <family>_quantize and <family>_dot; Python hands their
 * addresses to the decode library (cpu_kernels.c, moe_dot_register), which calls
 * them through this table. Nothing here validates: the Python wrappers check
 * types, sizes and alignment before any call.
 */
#ifndef MOETIER_CPU_DOT_H
#define MOETIER_CPU_DOT_H
#include <stdint.h>

/* GGML type ids of the activation formats (ggml.h) */
enum { ACT_F32 = 0, ACT_F16 = 1, ACT_Q8_0 = 8, ACT_Q8_1 = 9, ACT_Q8_K = 15, ACT_BF16 = 30 };

/* The activation format weight type `wtype` dots with; float_acts != 0 asks for F32 activations where the
 * family can (F16 / BF16 weights); -1 if `wtype` is not one of this family's. */
typedef int64_t (*act_type_fn)(int64_t wtype, int64_t float_acts);

/* Bytes of one row of n activation values in format act_type: n*4 (F32), n*2 (F16, BF16), n/32*34 (Q8_0),
 * n/32*36 (Q8_1), n/256*292 (Q8_K: float d, int8 qs[256], int16 bsums[16]). */
static inline int64_t act_row_bytes(int64_t act_type, int64_t n) {
    switch (act_type) {
    case ACT_F32: return n * 4;
    case ACT_F16: case ACT_BF16: return n * 2;
    case ACT_Q8_0: return n / 32 * 34;
    case ACT_Q8_1: return n / 32 * 36;
    case ACT_Q8_K: return n / 256 * 292;
    default: return -1;
    }
}

/* x [n] float32 -> xq, one row of n values in act_type, exactly as llama.cpp's CPU backend converts it on this
 * machine (quantize_row_q8_K / q8_0 / q8_1, fp32 -> fp16 / bf16): the same bytes. */
typedef void (*quantize_fn)(int64_t act_type, const float *x, void *xq, int64_t n);

/* y[t * ldy + r] = dot(weight row r, activation row t) for r < rows, t < T.
 * w: rows x row_bytes of type wtype; xq: T rows of act_type (act_row_bytes apart), act_type = act_type_fn's
 * answer for wtype. Each weight row is read once for all T activation rows (T = 1 is decode's gemv). */
typedef void (*dot_fn)(int64_t wtype, int64_t act_type, int64_t n, const void *w, int64_t row_bytes, int64_t rows,
                       const void *xq, int64_t T, float *y, int64_t ldy);

#endif
