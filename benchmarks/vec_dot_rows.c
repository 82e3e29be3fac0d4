/* bench_kernels.py's row loop for llama.cpp: its CPU backend's vec_dot for one type (a function pointer from
 * ggml_get_type_traits_cpu) over `rows` rows of one matrix against one token's activations, one call a row, as
 * ggml's mul_mat calls it for a single token. In C, so both engines' gemvs are timed without Python between rows. */
#include <stddef.h>
#include <stdint.h>

typedef void (*vec_dot_fn)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by, int nrc);

void vec_dot_rows(void *fn, int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const void *x, float *out) {
    const vec_dot_fn dot = (vec_dot_fn)fn;
    for (int64_t r = 0; r < rows; r++) dot((int)n, out + r, 0, w + r * row_bytes, 0, x, 0, 1);
}
