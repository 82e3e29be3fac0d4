/* moetier's dot32 family (cpu_dot.h): weights in F32, F16, BF16 or a 32-value block format (Q4_0, Q4_1, Q5_0,
 * Q5_1, Q8_0, IQ4_NL, MXFP4) times activations in the format llama.cpp's dot product for that format takes.
 *
 * dot32_quantize writes the bytes llama.cpp's x86 from_float writes (moetier/backends/activations.py is the
 * judge): Q8_0 / Q8_1 with d = max|x| / 127, multiplier 127 / max|x|, round half to even (Q8_1's s = d * the
 * block's sum of quants), float16 fields and F16 by IEEE round to nearest even, BF16 as ggml_compute_fp32_to_bf16.
 *
 * Numerics of dot32_dot, as ggml's vec_dot: per 32-block the integer dot product of the weight quants and the
 * activation quants (exact in int32), times d_w * d_x in float32, plus m_w * s_x for Q4_1 / Q5_1 (q4_1_q8_1),
 * summed over the row in float32. Float formats: weight and activation values converted to float32 (exactly),
 * products summed in float32 by fused multiply-add. The sum order is this file's (vector lanes, then a tree); for
 * the block formats below WIDE_FROM tokens it depends on neither T nor the row (every (row, token) runs the same
 * operations in every tile shape: T tokens at once are bit for bit T calls of one); from WIDE_FROM tokens, on
 * AVX-512, the 16-row tiles (below) add the same per-block terms block after block: within float32 rounding of
 * the row loop, and still independent of the rows beside a row. Float formats sum in two interleaved
 * accumulators at T = 1 (AVX2: four) and in one per (row, token) in the T > 1 tiles, equal within float32
 * rounding; F32
 * weights from OUTER_FROM tokens on AVX-512 take the outer-product tiles (below), which add each (row, token)'s
 * products in k order in chunks of OUTER_CHUNK: within float32 rounding of the others, and a function of n only.
 *
 * Loop order: tiles of rows outermost, then tiles of tokens, each over the whole row: a weight block decoded
 * into registers serves the tile's tokens, and the tile's rows stay in L1 while the other token tiles pass, so
 * each weight byte comes from memory once for all T. Tiles are 4 rows x up to 4 tokens (AVX2: 2; the float
 * formats on AVX-512: 6, 24 accumulators beside 6 activation vectors and a weight vector, the activations packed
 * per token tile first so a step loads 10 vectors for 24 FMAs: tile_floats), an accumulator each; at T = 1 block
 * formats take 8 rows (AVX2: 4; Q8_0: 1 on AVX-512, its decode cheap next to its bytes; on AVX2 its own 4-row tile), floats 1 row with two (AVX2: four)
 * accumulators (one FMA chain would wait on its latency). At one token on AVX-512 each row is a prefetched stream
 * (cpu_stream.h; the float formats: or a plain one of eight, where the host reads those faster: eight_streams); else each block-format tile prefetches the next tile's rows at its own offset: a tile's
 * rows are short streams the hardware prefetcher would find anew every tile, and on AMD a masked load that
 * misses the cache stalls (measured: Q4_0 from DRAM 7 GB/s without, 36 with).
 * The SIMD paths first unpack the activations once per call (quants contiguous, scales as float32; AVX-512 also
 * each block pair's -o * sums of four and its scale lanes, which a row-at-a-time Q8_0 tile would redo per row) into
 * scratch: the stack, or malloc for large T * n (if that fails, the scalar path runs, which needs none); the
 * float formats at T > 1 pack theirs per token tile (AVX-512: malloc, or the scalar path).
 * No threads here: callers split rows.
 *
 * SIMD paths, chosen at compile time (the library is built with -march=native):
 *  - AVX-512 (F, BW, VL, VNNI, VBMI; GFNI where present, for the nibbles): two blocks per zmm. Each weight
 *    block becomes unsigned bytes u = q + o
 *    (Q8_0, IQ4_NL and MXFP4 biased by o = 128, Q4_0 / Q5_0 as stored with o = 8 / 16, Q4_1 / Q5_1 o = 0), and one
 *    vpdpbusd(u, x) started from -o * (x's sums of four), formed once per token block and shared by the rows,
 *    gives the block's dot product; F16 / BF16 weights widened in registers, 16 values a step.
 *  - AVX-512 BF16 (where present, beside the AVX-512 path): BF16 weights times BF16 activations (a GGUF's) by
 *    vdpbf16ps, 32 values a step, as llama.cpp's ggml_vec_dot_bf16 there: the same exact products, added pair by
 *    pair, subnormal bf16 inputs taken as zero (prefill of the `medium` BF16 file 1544 -> 2350 tok/s).
 *  - AVX2 (+FMA, F16C): a block per ymm, through maddubs / madd (vpdpbusd where AVX-VNNI is present): Q4_* /
 *    Q5_* as unsigned quants (Q4_0 / Q5_0 with the same -o * sum(x) start), Q8_0, IQ4_NL and MXFP4 by ggml's sign trick
 *    (|w| times x with w's sign: biased they would saturate maddubs).
 *  - scalar: any other machine, and the path without scratch.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dot.h"
#include "cpu_vnni.h"
#include "cpu_stream.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__) && \
    defined(__AVX512VBMI__) && defined(__FMA__) && defined(__F16C__)
#define PATH_AVX512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define PATH_AVX2 1
#endif
#ifndef TILE_ROWS /* a tile: rows x tokens of accumulators in registers (AVX-512: 32 of them, AVX2: 16) */
#define TILE_ROWS 4
#endif
#ifndef TILE_TOKENS
#if defined(PATH_AVX512)
#define TILE_TOKENS 4
#else
#define TILE_TOKENS 2
#endif
#endif
#ifndef ROWS_AT_ONE_TOKEN /* block formats' rows a tile at T = 1 (but Q8_0: its own tiles) */
#if defined(PATH_AVX512)
#define ROWS_AT_ONE_TOKEN 8
#else
#define ROWS_AT_ONE_TOKEN 4
#endif
#endif
#define ACC_ROWS (ROWS_AT_ONE_TOKEN > TILE_ROWS ? ROWS_AT_ONE_TOKEN : TILE_ROWS)
#define FLOAT_ROWS TILE_ROWS  /* float formats: the same tiles (a lone row at T = 1) */
#if defined(PATH_AVX512) /* float formats' token tiles: 4 x 6 accumulators, 4 weight rows and a token's vector in 32 */
#define FLOAT_TOKENS 6
#else
#define FLOAT_TOKENS TILE_TOKENS
#endif
#define INLINE static inline __attribute__((always_inline))

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, IQ4_NL = 20, BF16 = 30, MXFP4 = 39 };

/* IQ4_NL's 16 values (ggml's kvalues_iq4nl) and MXFP4's (kvalues_mxfp4: the E2M1 values doubled; its scale, an
 * E8M0 byte, is taken halved); tests/test_dot32.py checks both against the gguf package */
static const int8_t KVALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
static const int8_t KVALUES_MXFP4[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
INLINE int looked_up(int f) { return f == IQ4_NL || f == MXFP4; }  /* nibbles that index a table of values */
INLINE const int8_t *kvalues_of(int f) { return f == MXFP4 ? KVALUES_MXFP4 : KVALUES; }

/* block layout: bytes per block, where the nibbles / quants start, where the 5th bits start, whether m follows d
 * (d: a float16 at byte 0; MXFP4's an E8M0 byte, block_d) */
INLINE int block_bytes(int f) {
    return f == Q8_0 ? 34 : f == Q4_1 ? 20 : f == Q5_0 ? 22 : f == Q5_1 ? 24 : f == MXFP4 ? 17 : 18;
}
INLINE int quants_at(int f) { return f == Q4_1 ? 4 : f == Q5_0 ? 6 : f == Q5_1 ? 8 : f == MXFP4 ? 1 : 2; }
INLINE int high_bits_at(int f) { return f == Q5_0 ? 2 : 4; }
INLINE int has_min(int f) { return f == Q4_1 || f == Q5_1; }

/* How the float formats read their rows at one token on AVX-512: eight plain streams (1) or four prefetched ones
 * (0, the default; eight_streams says why both). Set once, before the first dot (moetier.backends.cpu_streams
 * chooses by the read probes); -> the way now in effect (0 where there is no eight-stream path). */
static int plain_streams = 0;
int64_t dot32_set_streams(int64_t plain) {
#if defined(PATH_AVX512)
    plain_streams = plain != 0;
#else
    (void)plain;
#endif
    return plain_streams;
}

int64_t dot32_act_type(int64_t wtype, int64_t float_acts) {
    switch (wtype) {
    case F32: return ACT_F32;
    case F16: return float_acts ? ACT_F32 : ACT_F16;
    case BF16: return float_acts ? ACT_F32 : ACT_BF16;
    case Q4_0: case Q5_0: case Q8_0: case IQ4_NL: case MXFP4: return ACT_Q8_0;
    case Q4_1: case Q5_1: return ACT_Q8_1;
    default: return -1;
    }
}

/* ---- scalar conversions ---- */

static inline float bits_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t float_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline uint16_t load16(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t load32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }

static inline float half_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, e = (h >> 10) & 0x1f, m = h & 0x3ff;
    if (e == 0x1f) return bits_float(sign | 0x7f800000 | m << 13);
    if (e == 0) return bits_float(sign | float_bits((float)m * 0x1p-24f));  /* zero or subnormal: exact */
    return bits_float(sign | (e + 112) << 23 | m << 13);
#endif
}

/* ggml_e8m0_to_fp32_half: MXFP4's scale byte e as 2^(e - 128) (e < 2: the subnormals 2^-128 and 2^-127) */
static inline float e8m0_half(uint8_t e) { return bits_float(e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23); }

/* a block's d */
INLINE float block_d(int f, const uint8_t *p) { return f == MXFP4 ? e8m0_half(p[0]) : half_float(load16(p)); }

static inline uint16_t float_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT);
#else
    uint32_t x = float_bits(f), sign = (x >> 16) & 0x8000;
    x &= 0x7fffffff;
    if (x > 0x7f800000) return sign | 0x7e00 | (x >> 13 & 0x3ff);  /* NaN, quiet */
    if (x >= 0x477ff000) return sign | 0x7c00;                      /* rounds to infinity (or is it) */
    if (x < 0x38800000) /* a subnormal half: adding 0.5 rounds to a multiple of 2**-24, in the low bits */
        return sign | (uint16_t)(float_bits(bits_float(x) + 0.5f) - 0x3f000000);
    return sign | (uint16_t)((x + 0xfff + (x >> 13 & 1) - 0x38000000) >> 13);
#endif
}

static inline uint16_t float_bf16(float f) {
    uint32_t u = float_bits(f);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)(u >> 16 | 64);
    return (uint16_t)((u + 0x7fff + (u >> 16 & 1)) >> 16);
}

/* ---- activations ---- */

static void quantize_q8(int with_sum, const float *x, uint8_t *out, int64_t n) {
    for (int64_t b = 0; b < n / 32; b++, x += 32, out += with_sum ? 36 : 34) {
        float amax = 0.0f;
        int8_t q[32];
        int sum = 0;
#if defined(PATH_AVX512)  /* the same values, 16 at a time (max is exact; cvtps rounds half to even, as rintf) */
        const __m512 lo = _mm512_loadu_ps(x), hi = _mm512_loadu_ps(x + 16);
        amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, _mm512_set1_ps(id)));
        const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, _mm512_set1_ps(id)));
        _mm_storeu_si128((__m128i *)q, _mm512_cvtepi32_epi8(qlo));
        _mm_storeu_si128((__m128i *)(q + 16), _mm512_cvtepi32_epi8(qhi));
        sum = _mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
#else
        for (int j = 0; j < 32; j++) {  /* a ternary, not fmaxf: a libm call per value here */
            const float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        for (int j = 0; j < 32; j++) {
            q[j] = (int8_t)rintf(x[j] * id);  /* round half to even, as _mm256_round_ps(_MM_ROUND_NEAREST) */
            sum += q[j];
        }
#endif
        const uint16_t dh = float_half(d), sh = float_half(d * (float)sum);
        memcpy(out, &dh, 2);
        if (with_sum) memcpy(out + 2, &sh, 2);
        memcpy(out + (with_sum ? 4 : 2), q, 32);
    }
}

void dot32_quantize(int64_t act, const float *x, void *xq, int64_t n) {
    uint16_t *out16 = xq;
    int64_t i = 0;
    switch (act) {
    case ACT_F32: memcpy(xq, x, (size_t)n * 4); return;
    case ACT_F16:
#if defined(__F16C__) && defined(__AVX__)
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(out16 + i), _mm256_cvtps_ph(_mm256_loadu_ps(x + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) out16[i] = float_half(x[i]);
        return;
    case ACT_BF16:
        for (; i < n; i++) out16[i] = float_bf16(x[i]);
        return;
    case ACT_Q8_0: case ACT_Q8_1: quantize_q8(act == ACT_Q8_1, x, xq, n); return;
    default: return;
    }
}

/* ---- scalar path: the raw activation bytes, no scratch ---- */

/* one block -> its 32 quants (signed: q - o for Q4_0 / Q5_0, the kvalues for IQ4_NL / MXFP4; q for Q4_1 / Q5_1), d, m */
static void decode_block(int f, const uint8_t *p, int8_t v[32], float *d, float *m) {
    const uint8_t *qs = p + quants_at(f);
    *d = block_d(f, p);
    *m = has_min(f) ? half_float(load16(p + 2)) : 0.0f;
    if (f == Q8_0) { memcpy(v, qs, 32); return; }
    const uint32_t qh = f == Q5_0 || f == Q5_1 ? load32(p + high_bits_at(f)) : 0;
    for (int j = 0; j < 16; j++) {
        int lo = qs[j] & 15, hi = qs[j] >> 4;
        lo |= (qh >> j & 1) << 4;
        hi |= (qh >> (j + 16) & 1) << 4;
        if (looked_up(f)) lo = kvalues_of(f)[lo], hi = kvalues_of(f)[hi];
        else if (f == Q4_0) lo -= 8, hi -= 8;
        else if (f == Q5_0) lo -= 16, hi -= 16;
        v[j] = (int8_t)lo, v[j + 16] = (int8_t)hi;
    }
}

static void blocks_scalar(int f, int64_t act, int64_t nb, const uint8_t *w, int64_t row_bytes, int64_t rows,
                          const uint8_t *xq, int64_t T, float *y, int64_t ldy) {
    const int64_t bb = block_bytes(f), xb = act == ACT_Q8_1 ? 36 : 34, xs = act == ACT_Q8_1 ? 4 : 2;
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t = 0; t < T; t++) y[t * ldy + r] = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            int8_t v[32];
            float dw, mw;
            decode_block(f, w + r * row_bytes + b * bb, v, &dw, &mw);
            for (int64_t t = 0; t < T; t++) {
                const uint8_t *x = xq + (t * nb + b) * xb;
                const int8_t *q = (const int8_t *)(x + xs);
                int32_t sumi = 0;
                for (int j = 0; j < 32; j++) sumi += v[j] * q[j];
                const float sx = act == ACT_Q8_1 ? half_float(load16(x + 2)) : 0.0f;
                y[t * ldy + r] += dw * half_float(load16(x)) * (float)sumi + mw * sx;
            }
        }
    }
}

static inline float float_at(int64_t f, const void *p, int64_t k) {
    if (f == F32) return ((const float *)p)[k];
    if (f == F16) return half_float(((const uint16_t *)p)[k]);
    return bits_float((uint32_t)((const uint16_t *)p)[k] << 16);
}

static void floats_scalar(int64_t f, int64_t act, int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows,
                          const uint8_t *xq, int64_t T, float *y, int64_t ldy) {
    const int64_t x_bytes = act == ACT_F32 ? 4 * n : 2 * n;
    float chunk[256];
    for (int64_t r = 0; r < rows; r++) {
        for (int64_t t = 0; t < T; t++) y[t * ldy + r] = 0.0f;
        for (int64_t k0 = 0; k0 < n; k0 += 256) {
            const int64_t len = n - k0 < 256 ? n - k0 : 256;
            for (int64_t k = 0; k < len; k++) chunk[k] = float_at(f, w + r * row_bytes, k0 + k);
            for (int64_t t = 0; t < T; t++) {
                float sum = 0.0f;
                for (int64_t k = 0; k < len; k++) sum += chunk[k] * float_at(act, xq + t * x_bytes, k0 + k);
                y[t * ldy + r] += sum;
            }
        }
    }
}

#if defined(PATH_AVX512) || defined(PATH_AVX2)
/* ---- SIMD paths: activations unpacked once per call, per token [nbp int8 quants [32] | nbp float d | nbp float s]
 * (nbp: the blocks rounded up to a pair; the pad block is all zeros, so an odd last block reads as a pair) ---- */

typedef struct { const int8_t *q; const float *d, *s; const int32_t *c; const float *dx; } act_view;
#define SCRATCH_BYTES 32768
#if defined(PATH_AVX512)
#define ACT_BLOCK_BYTES 104  /* quants, two floats, and the pair terms: c and dx, 8 lanes of each per block */
#else
#define ACT_BLOCK_BYTES 40   /* quants and two floats */
#endif

/* `bias`: the offset o of the weight format's unsigned quants (AVX-512: each block pair's -o * sums of four
 * activation quants, c, and its scales as lanes [d0 x8 | d1 x8], dx, are formed here once, not once per row) */
static void unpack_blocks(int64_t act, int bias, const uint8_t *xq, int64_t nb, int64_t nbp, int64_t T, uint8_t *xs,
                          act_view *view) {
    const int64_t xb = act == ACT_Q8_1 ? 36 : 34, at = act == ACT_Q8_1 ? 4 : 2;
    for (int64_t t = 0; t < T; t++) {
        int8_t *q = (int8_t *)(xs + t * nbp * ACT_BLOCK_BYTES);
        float *d = (float *)(q + nbp * 32), *s = d + nbp;
        int32_t *c = (int32_t *)(s + nbp);
        float *dx = (float *)(c + 8 * nbp);
        view[t] = (act_view){q, d, s, c, dx};
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *x = xq + (t * nb + b) * xb;
            memcpy(q + 32 * b, x + at, 32);
            d[b] = half_float(load16(x));
            s[b] = act == ACT_Q8_1 ? half_float(load16(x + 2)) : 0.0f;
        }
        if (nb < nbp) memset(q + 32 * nb, 0, 32), d[nb] = s[nb] = 0.0f;
#if defined(PATH_AVX512)
        for (int64_t b = 0; b < nbp; b++)  /* block b's 8 lanes of its pair's c and dx */
            for (int i = 0; i < 8; i++) {
                const int8_t *four = q + 32 * b + 4 * i;
                c[8 * b + i] = -bias * (four[0] + four[1] + four[2] + four[3]);
                dx[8 * b + i] = d[b];
            }
#else
        (void)bias, (void)c, (void)dx;
#endif
    }
}
#endif

#if defined(PATH_AVX512)
/* nibble sources for a block pair: bytes quants_at + j % 16 (+ block_bytes for the second 32), low nibbles in
 * 16-byte groups 0 and 2, high ones (shifted down 4 within 16-bit words) in groups 1 and 3 */
static const uint8_t PAIR_J[64] __attribute__((aligned(64))) = {
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15,
    0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
#if !defined(__GFNI__)
static const uint16_t PAIR_SHIFT[32] __attribute__((aligned(64))) = {
    0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4};
#endif

/* two blocks at p (one when single: the second reads as zeros) -> u8 quants [64], d [d0 x8 | d1 x8], m alike */
INLINE void decode_pair(const int f, const int single, const uint8_t *p, __m512i *u, __m512 *d, __m512 *m) {
    const int bb = block_bytes(f);
    if (f == Q8_0) {
        const __m256i lo = _mm256_loadu_si256((const __m256i *)(p + 2));
        const __m256i hi = single ? _mm256_setzero_si256() : _mm256_loadu_si256((const __m256i *)(p + 36));
        *u = _mm512_xor_si512(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1), _mm512_set1_epi8((char)0x80));
        const __m128i d0 = _mm_set1_epi16((short)load16(p)), d1 = _mm_set1_epi16(single ? 0 : (short)load16(p + 34));
        *d = _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(d0), d1, 1));
        return;
    }
    const __m512i v = _mm512_maskz_loadu_epi8(single ? (1ull << bb) - 1 : (1ull << 2 * bb) - 1, p);
    const __m512i second = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi8((char)bb), 1);
    const __m512i at = _mm512_add_epi8(_mm512_add_epi8(_mm512_load_si512(PAIR_J), second),
                                       _mm512_set1_epi8((char)quants_at(f)));
#if defined(__GFNI__) /* one affine map per 8 bytes over GF(2): x & 15 (low nibbles) or x >> 4 (high ones) */
    const __m512i nibble = _mm512_set_epi64(0x1020408000000000, 0x1020408000000000, 0x0102040800000000, 0x0102040800000000,
                                            0x1020408000000000, 0x1020408000000000, 0x0102040800000000, 0x0102040800000000);
    __m512i q = _mm512_gf2p8affine_epi64_epi8(_mm512_permutexvar_epi8(at, v), nibble, 0);
#else
    __m512i q = _mm512_and_si512(_mm512_srlv_epi16(_mm512_permutexvar_epi8(at, v), _mm512_load_si512(PAIR_SHIFT)),
                                 _mm512_set1_epi8(0x0f));
#endif
    if (f == Q5_0 || f == Q5_1) {
        const uint64_t h = load32(p + high_bits_at(f)) | (single ? 0 : (uint64_t)load32(p + bb + high_bits_at(f)) << 32);
        q = _mm512_mask_add_epi8(q, _cvtu64_mask64(h), q, _mm512_set1_epi8(16));
    }
    if (looked_up(f)) {
        const __m128i kv = _mm_add_epi8(_mm_loadu_si128((const __m128i *)kvalues_of(f)), _mm_set1_epi8((char)0x80));
        q = _mm512_shuffle_epi8(_mm512_broadcast_i32x4(kv), q);
    }
    *u = q;
    if (f == MXFP4) {  /* [d0 x8 | d1 x8] from the two scale bytes */
        const __m512 d0 = _mm512_set1_ps(e8m0_half(p[0]));
        *d = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(d0), _mm256_castps_pd(_mm256_set1_ps(single ? 0.0f : e8m0_half(p[bb]))), 1));
        return;
    }
    /* words [d0 x8, d1 x8, m0 x8, m1 x8]: d at word 0 of each block, m at word 1 */
    const __m512i words = _mm512_set_epi16(bb / 2 + 1, bb / 2 + 1, bb / 2 + 1, bb / 2 + 1, bb / 2 + 1, bb / 2 + 1,
                                           bb / 2 + 1, bb / 2 + 1, 1, 1, 1, 1, 1, 1, 1, 1, bb / 2, bb / 2, bb / 2,
                                           bb / 2, bb / 2, bb / 2, bb / 2, bb / 2, 0, 0, 0, 0, 0, 0, 0, 0);
    const __m512i dm = _mm512_permutexvar_epi16(words, v);
    *d = _mm512_cvtph_ps(_mm512_castsi512_si256(dm));
    if (has_min(f)) *m = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(dm, 1));
}

INLINE int bias(int f) { return f == Q4_0 ? 8 : f == Q5_0 ? 16 : f == Q8_0 || looked_up(f) ? 128 : 0; }

/* two floats at p in lanes 0 and 1 */
INLINE __m512 two_floats(const float *p) { return _mm512_castps128_ps512(_mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)p))); }

/* one block pair (b, b + 1) of R rows x TT tokens into acc */
INLINE void pair_step(const int f, const int R, const int TT, const int single, const uint8_t *w, int64_t row_bytes,
                      const act_view *x, int64_t b, __m512 acc[ACC_ROWS][TILE_TOKENS], const int own_prefetch) {
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512i xq[TILE_TOKENS], c[TILE_TOKENS];
    __m512 dx[TILE_TOKENS], sx[TILE_TOKENS];
    for (int t = 0; t < TT; t++) { /* per token block: shared by the R rows */
        xq[t] = _mm512_loadu_si512(x[t].q + 32 * b);
        c[t] = bias(f) ? _mm512_loadu_si512(x[t].c + 8 * b) : _mm512_setzero_si512();  /* -o * x's sums of four */
        dx[t] = _mm512_loadu_ps(x[t].dx + 8 * b);  /* [d0 x8 | d1 x8] */
        if (has_min(f)) sx[t] = _mm512_maskz_permutexvar_ps(0x0101, halves, two_floats(x[t].s + b));  /* s0, s1 in lanes 0, 8 */
    }
    for (int r = 0; r < R; r++) {
        __m512i u;
        __m512 dw, mw = _mm512_setzero_ps();
        decode_pair(f, single, w + r * row_bytes + b * block_bytes(f), &u, &dw, &mw);
        /* one token: each row a stream (cpu_stream.h); more: the next tile's rows, at this offset. A tile's short
         * rows are streams the hardware prefetcher would have to find anew each tile (and a masked load that
         * misses stalls); one line per pair, two for Q8_0 */
        if (own_prefetch && TT == 1) {
            stream_prefetch(w + r * row_bytes + b * block_bytes(f), 2 * block_bytes(f));
        } else if (own_prefetch) {
            _mm_prefetch((const char *)(w + (R + r) * row_bytes + b * block_bytes(f)), _MM_HINT_T0);
            if (2 * block_bytes(f) > 64) _mm_prefetch((const char *)(w + (R + r) * row_bytes + b * block_bytes(f) + 64), _MM_HINT_T0);
        }
        for (int t = 0; t < TT; t++) {
            const __m512 i = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(c[t], u, xq[t]));
            acc[r][t] = _mm512_fmadd_ps(i, _mm512_mul_ps(dw, dx[t]), acc[r][t]);
            if (has_min(f)) acc[r][t] = _mm512_fmadd_ps(mw, sx[t], acc[r][t]);
        }
    }
}

INLINE void tile_blocks(const int f, const int R, const int TT, const uint8_t *w, int64_t row_bytes, const act_view *x,
                        int64_t nb, float *y, int64_t ldy) {
    __m512 acc[ACC_ROWS][TILE_TOKENS];  /* fixed sizes (R, TT are constants once inlined): registers, not a VLA */
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
    for (int64_t b = 0; b + 2 <= nb; b += 2) pair_step(f, R, TT, 0, w, row_bytes, x, b, acc, 1);
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
    if (nb & 1) { /* the odd last block, apart: sharing acc with the loop would keep acc in memory */
        __m512 last[ACC_ROWS][TILE_TOKENS];
        for (int r = 0; r < R; r++)
            for (int t = 0; t < TT; t++) last[r][t] = _mm512_setzero_ps();
        pair_step(f, R, TT, 1, w, row_bytes, x, nb - 1, last, 1);
        for (int r = 0; r < R; r++)
            for (int t = 0; t < TT; t++) y[t * ldy + r] += _mm512_reduce_add_ps(last[r][t]);
    }
}

/* 16 weights from k (the first `live` of them when live < 16) as float32 */
INLINE __m512 float_weights(const int f, const void *row, int64_t k, const int tail, __mmask16 live) {
    if (f == F32) return tail ? _mm512_maskz_loadu_ps(live, (const float *)row + k) : _mm512_loadu_ps((const float *)row + k);
    const __m256i h = tail ? _mm256_maskz_loadu_epi16(live, (const uint16_t *)row + k)
                           : _mm256_loadu_si256((const __m256i *)((const uint16_t *)row + k));
    if (f == F16) return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* a0 + a1 + a2 + a3 as (a0 + a1) + (a2 + a3), pinned: the build lets the compiler reassociate float sums, which it
 * then does differently where one row or four are summed (floats_lone's four rows must give each row's lone-row bits) */
INLINE __m512 add4_pinned(__m512 a0, __m512 a1, __m512 a2, __m512 a3) {
    __m512 s01 = _mm512_add_ps(a0, a1), s23 = _mm512_add_ps(a2, a3);
    __asm__("" : "+v"(s01), "+v"(s23));
    return _mm512_add_ps(s01, s23);
}

/* The float tiles' accumulators [row][token]: zeroed; summed into y */
INLINE void floats_clear(const int R, const int TT, __m512 acc[FLOAT_ROWS][FLOAT_TOKENS]) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm512_setzero_ps();
}

INLINE void floats_store(const int R, const int TT, __m512 acc[FLOAT_ROWS][FLOAT_TOKENS], float *y, int64_t ldy) {
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) y[t * ldy + r] = _mm512_reduce_add_ps(acc[r][t]);
}

/* R (1, 4 or 8) rows `stride` bytes apart at one token, each a lone row: two accumulators (k in 32s), the masked
 * tail into the first (2 x R independent FMA chains; one row's two, where leftover rows go alone, still outrun
 * memory); prefetched: each row a software-prefetched stream (cpu_stream.h), else plain loads, the hardware
 * prefetchers alone (eight_streams). A row's value depends on neither R nor prefetched: tile_floats' lone row is
 * R = 1, four_streams' tile R = 4, eight_streams' R = 8. */
INLINE void floats_lone(const int f, const int R, const int prefetched, const uint8_t *w, int64_t stride, const float *x,
                        int64_t n, float *y) {
    const int size = f == F32 ? 4 : 2;
    __m512 acc[8][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        for (int r = 0; r < R; r++) {
            if (prefetched) stream_prefetch(w + r * stride + k * size, 32 * size);
            for (int j = 0; j < 2; j++)
                acc[r][j] = _mm512_fmadd_ps(float_weights(f, w + r * stride, k + 16 * j, 0, 0), _mm512_loadu_ps(x + k + 16 * j), acc[r][j]);
        }
    for (; k < n; k += 16) {
        const __mmask16 live = n - k >= 16 ? 0xffff : (__mmask16)((1u << (n - k)) - 1);
        for (int r = 0; r < R; r++)
            acc[r][0] = _mm512_fmadd_ps(float_weights(f, w + r * stride, k, 1, live), _mm512_maskz_loadu_ps(live, x + k), acc[r][0]);
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[r][0], acc[r][1]));
}

/* R rows x TT tokens: an accumulator each, or a lone row and token (floats_lone), which reads x as it is. Every
 * other tile reads x packed (floats_packed:
 * [n16 / 16][TT][16], zeros past n), its TT vectors of a step loaded once into registers and held there by an
 * empty asm (else GCC folds each load into every row's FMA: 28 loads a step where 10 do, and this core issues
 * about one 64-byte load a cycle: F32 [1024, 2048] at T = 64, 1 thread, 50 -> 79 GMAC/s). The same FMAs on the
 * same values in the same order as x unpacked: the same bits. */
INLINE void tile_floats(const int f, const int R, const int TT, const uint8_t *w, int64_t row_bytes, const float *x,
                        int64_t n, float *y, int64_t ldy) {
    if (R * TT == 1) {
        floats_lone(f, 1, 1, w, row_bytes, x, n, y);
        return;
    }
    __m512 acc[FLOAT_ROWS][FLOAT_TOKENS];
    floats_clear(R, TT, acc);
    int64_t k = 0;
    const float *xp = x;
    for (; k + 16 <= n; k += 16, xp += TT * 16) {
        __m512 xv[FLOAT_TOKENS];
        for (int t = 0; t < TT; t++) {
            xv[t] = _mm512_load_ps(xp + 16 * t);
            __asm__("" : "+v"(xv[t]));  /* in a register, not folded into the FMAs below */
        }
        for (int r = 0; r < R; r++) {
            const __m512 wv = float_weights(f, w + r * row_bytes, k, 0, 0);
            for (int t = 0; t < TT; t++) acc[r][t] = _mm512_fmadd_ps(wv, xv[t], acc[r][t]);
        }
    }
    if (k < n) {  /* the last n % 16: x's zeros beside the masked weights */
        const __mmask16 live = (__mmask16)((1u << (n - k)) - 1);
        for (int r = 0; r < R; r++) {
            const __m512 wv = float_weights(f, w + r * row_bytes, k, 1, live);
            for (int t = 0; t < TT; t++) acc[r][t] = _mm512_fmadd_ps(wv, _mm512_load_ps(xp + 16 * t), acc[r][t]);
        }
    }
    floats_store(R, TT, acc, y, ldy);
}

#if defined(__AVX512BF16__)
#define PATH_BF16_PAIRS 1
/* R (1 or 4) rows `stride` bytes apart at one token, each a lone row: four accumulators in 128-value steps, the
 * masked rest into the first, the four added pairwise; a row's value does not depend on R */
INLINE void bf16_lone(const int R, const uint8_t *w, int64_t stride, const uint16_t *x, int64_t n, float *y) {
    __m512 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm512_setzero_ps();
    int64_t k = 0;
    for (; k + 128 <= n; k += 128)
        for (int j = 0; j < 4; j++)
            for (int r = 0; r < R; r++) {
                const int64_t at = k + 32 * j;
                stream_prefetch(w + r * stride + at * 2, 64);
                acc[r][j] = _mm512_dpbf16_ps(acc[r][j], (__m512bh)_mm512_loadu_si512((const uint16_t *)(w + r * stride) + at),
                                             (__m512bh)_mm512_loadu_si512(x + at));
            }
    for (; k < n; k += 32) {
        const __mmask32 live = n - k >= 32 ? 0xffffffffu : (__mmask32)((1u << (n - k)) - 1);
        for (int r = 0; r < R; r++)
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)_mm512_maskz_loadu_epi16(live, (const uint16_t *)(w + r * stride) + k),
                                         (__m512bh)_mm512_maskz_loadu_epi16(live, x + k));
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(add4_pinned(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
}

/* BF16 weights times BF16 activations (a GGUF's BF16 matrices, as llama.cpp takes them) by vdpbf16ps: 32 values a
 * step, the products of bf16 pairs exact in float32 and added pair by pair into float32 accumulators (the
 * instruction treats subnormal bf16 inputs and outputs as zero, as llama.cpp's same instruction does). An
 * accumulator per (row, token), four for a lone row and token (bf16_lone); the tail masked. */
INLINE void tile_bf16(const int f, const int R, const int TT, const uint8_t *w, int64_t row_bytes, const uint16_t *x,
                      int64_t n, float *y, int64_t ldy) {
    (void)f;
    if (R * TT == 1) {
        bf16_lone(1, w, row_bytes, x, n, y);
        return;
    }
    __m512 acc[FLOAT_ROWS][FLOAT_TOKENS];
    floats_clear(R, TT, acc);
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_loadu_si512((const uint16_t *)(w + r * row_bytes) + k);
            if (R > 1) _mm_prefetch((const char *)(w + (R + r) * row_bytes) + k * 2, _MM_HINT_T0);
            else stream_prefetch(w + k * 2, 64);
            for (int t = 0; t < TT; t++) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, (__m512bh)_mm512_loadu_si512(x + t * n + k));
        }
    if (k < n) {
        const __mmask32 live = (__mmask32)((1u << (n - k)) - 1);
        for (int r = 0; r < R; r++) {
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(live, (const uint16_t *)(w + r * row_bytes) + k);
            for (int t = 0; t < TT; t++)
                acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv, (__m512bh)_mm512_maskz_loadu_epi16(live, x + t * n + k));
        }
    }
    floats_store(R, TT, acc, y, ldy);
}

#endif

/* ---- T >= WIDE_FROM: sixteen weight rows on a vector's lanes ---------------------------------------------
 * cpu_dotk.c's prefill tiles for the 32-value block formats. 16 rows' block pairs are decoded once (decode_pair:
 * unsigned bytes u = q + o) and transposed into a tile whose dword k holds values 4k..4k+3 of all 16 rows; per
 * token and block, 8 vpdpbusd with a broadcast of the token's 4 quants at that place start from -o * the block's
 * sum of quants and give the 16 rows' exact integer dot products, which take d_w * d_x (and m_w * s_x) in
 * float32 as the row loop's pair_step does, block after block. Each weight block is decoded once per 64 tokens,
 * not once per 4. Numerics: the same integer products and per-block float32 terms as the row loop; only the
 * order they are added in differs (block order here, lanes and a tree there): within float32 rounding. */
enum { WIDE_ROWS = 16, WIDE_TOKENS = 8, WIDE_CHUNK = 64, WIDE_FROM = 8 };

typedef struct {
    __m512i q[16];       /* dword k < 8: values 4k..4k+3 of block b's 16 rows; 8 + k: block b + 1's */
    __m512 d[2], m[2];   /* the rows' d and m (has_min) of blocks b and b + 1 */
} wide_tile;

/* rows' block pairs at w (rr < 16 rows; the others zero) -> the tile; single: the pair is one block */
INLINE void wide_fill(const int f, const int single, const uint8_t *w, int64_t row_bytes, int64_t rr, wide_tile *t) {
    __m512i v[16];
    uint16_t dh[2][16] = {{0}}, mh[2][16] = {{0}};
    float de[2][16] = {{0}};  /* MXFP4's d */
    const int bb = block_bytes(f);
    for (int64_t r = 0; r < 16; r++) {
        if (r >= rr) { v[r] = _mm512_setzero_si512(); continue; }
        const uint8_t *p = w + r * row_bytes;
        __m512 d, m;
        decode_pair(f, single, p, &v[r], &d, &m);
        for (int h = 0; h < 2 - single; h++) {
            if (f == MXFP4) de[h][r] = e8m0_half(p[h * bb]);
            else dh[h][r] = load16(p + h * bb);
            if (has_min(f)) mh[h][r] = load16(p + h * bb + 2);
        }
    }
    transpose16(v);
    for (int k = 0; k < 16; k++) t->q[k] = v[k];
    for (int h = 0; h < 2; h++) {
        t->d[h] = f == MXFP4 ? _mm512_loadu_ps(de[h]) : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)dh[h]));
        t->m[h] = has_min(f) ? _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)mh[h])) : _mm512_setzero_ps();
    }
}

typedef struct { int32_t c; float d, s, pad; } wide_act;  /* a token block's -o * sum of quants, d, s (Q8_1) */

/* The tiles' view of T tokens' activation blocks (Q8_0 / Q8_1 as llama.cpp writes them, xb bytes a block, nb
 * blocks a token): per block its d, s and -o * the sum of its quants (o: the weight format's offset). */
static void wide_prep(int64_t act, int o, const uint8_t *xq, int64_t nb, int64_t T, wide_act *out) {
    const int64_t xb = act == ACT_Q8_1 ? 36 : 34, at = act == ACT_Q8_1 ? 4 : 2;
    for (int64_t i = 0; i < T * nb; i++) {
        const uint8_t *x = xq + i * xb;
        /* the quants + 128 as unsigned bytes, summed in four 64-bit lanes by psadbw against zero */
        const __m256i u = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(x + at)), _mm256_set1_epi8((char)0x80));
        const __m256i sad = _mm256_sad_epu8(u, _mm256_setzero_si256());
        const __m128i two = _mm_add_epi64(_mm256_castsi256_si128(sad), _mm256_extracti128_si256(sad, 1));
        const int32_t sum = (int32_t)(_mm_cvtsi128_si64(two) + _mm_extract_epi64(two, 1)) - 32 * 128;
        out[i] = (wide_act){-o * sum, half_float(load16(x)), act == ACT_Q8_1 ? half_float(load16(x + 2)) : 0.0f, 0.0f};
    }
}

/* acc[j] (token j < tn's 16 row sums) += blocks b (and b + 1 unless single) of the tile times token j's: its
 * quants of block b at q + j * xrow, xb bytes a block; its blocks' wide_act at meta + j * nb */
INLINE void wide_tokens(const int f, const int tn, const int single, const wide_tile *t, const uint8_t *q, int64_t xrow,
                        int xb, const wide_act *meta, int64_t nb, __m512 *acc) {
    for (int h = 0; h < 2 - single; h++) {
        __m512i a[WIDE_TOKENS];
        for (int j = 0; j < tn; j++) a[j] = _mm512_set1_epi32(meta[j * nb + h].c);
        for (int k = 0; k < 8; k++)
            for (int j = 0; j < tn; j++) a[j] = dpbusd_bcast(a[j], t->q[8 * h + k], q + j * xrow + h * xb + 4 * k);
        for (int j = 0; j < tn; j++) {
            acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(a[j]), _mm512_mul_ps(t->d[h], _mm512_set1_ps(meta[j * nb + h].d)), acc[j]);
            if (has_min(f)) acc[j] = _mm512_fmadd_ps(t->m[h], _mm512_set1_ps(meta[j * nb + h].s), acc[j]);
        }
    }
}

#define WIDE_PASS(tn) wide_tokens(f, tn, single, &tile, x0 + (t0 + t) * xrow, xrow, xb, meta + (t0 + t) * nb + b, nb, acc + t)
/* xq: T tokens' activations as llama.cpp writes them (act: Q8_0 or Q8_1); meta: wide_prep's view of them */
INLINE void blocks_wide(const int f, int64_t act, int64_t nb, const uint8_t *w, int64_t row_bytes, int64_t rows,
                        const uint8_t *xq, const wide_act *meta, int64_t T, float *y, int64_t ldy) {
    const int xb = act == ACT_Q8_1 ? 36 : 34;
    const int64_t xrow = nb * xb;
    __m512 acc[WIDE_CHUNK];
    wide_tile tile;
    for (int64_t r0 = 0; r0 < rows; r0 += WIDE_ROWS) {
        const int64_t rr = rows - r0 < WIDE_ROWS ? rows - r0 : WIDE_ROWS;
        const __mmask16 keep = (__mmask16)((1u << rr) - 1u);
        for (int64_t t0 = 0; t0 < T; t0 += WIDE_CHUNK) {
            const int64_t tc = T - t0 < WIDE_CHUNK ? T - t0 : WIDE_CHUNK;
            for (int64_t t = 0; t < tc; t++) acc[t] = _mm512_setzero_ps();
            for (int64_t b = 0; b < nb; b += 2) {
                const int single = b + 1 == nb;
                const uint8_t *x0 = xq + b * xb + (act == ACT_Q8_1 ? 4 : 2);
                wide_fill(f, single, w + r0 * row_bytes + b * block_bytes(f), row_bytes, rr, &tile);
                int64_t t = 0;
                for (; t + WIDE_TOKENS <= tc; t += WIDE_TOKENS) WIDE_PASS(WIDE_TOKENS);
                switch (tc - t) {  /* the tail, each length its own specialised call */
                case 7: WIDE_PASS(7); break;
                case 6: WIDE_PASS(6); break;
                case 5: WIDE_PASS(5); break;
                case 4: WIDE_PASS(4); break;
                case 3: WIDE_PASS(3); break;
                case 2: WIDE_PASS(2); break;
                case 1: WIDE_PASS(1); break;
                }
            }
            for (int64_t t = 0; t < tc; t++) _mm512_mask_storeu_ps(y + (t0 + t) * ldy + r0, keep, acc[t]);
        }
    }
}
#undef WIDE_PASS
#endif /* PATH_AVX512 */

#if defined(PATH_AVX2)
/* from + u . s in int32 lanes of four bytes (u unsigned, s signed; maddubs cannot saturate on the values here) */
#if defined(__AVXVNNI__)
#define DOT_FROM(from, u, s) _mm256_dpbusd_avx_epi32(from, u, s)
#elif defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define DOT_FROM(from, u, s) _mm256_dpbusd_epi32(from, u, s)
#else
#define DOT_FROM(from, u, s) _mm256_add_epi32(from, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)))
#endif

INLINE float sum8(__m256 v) {
    const __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)));
}

/* The bias o the AVX2 path leaves in a format's quants (then takes o * x's sums off once per token block): Q4_0 / Q5_0
 * stay unsigned, 0..15 / 0..31; Q8_0, IQ4_NL and MXFP4 (to +-127, where maddubs would saturate) take ggml's sign trick. */
INLINE int bias(int f) { return f == Q4_0 ? 8 : f == Q5_0 ? 16 : 0; }
INLINE int signed_quants(int f) { return f == Q8_0 || looked_up(f); }

/* one block -> 32 quants: *u the unsigned bytes to multiply (q, or |w| for signed_quants), *s w itself (its signs) */
INLINE void decode_block256(const int f, const uint8_t *p, __m256i *u, __m256i *s, float *d, float *m) {
    *d = block_d(f, p);
    *m = has_min(f) ? half_float(load16(p + 2)) : 0.0f;
    __m256i q;
    if (f == Q8_0) {
        q = _mm256_loadu_si256((const __m256i *)(p + 2));
    } else {
        const __m128i t = _mm_loadu_si128((const __m128i *)(p + quants_at(f)));
        q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(t, 4), t), _mm256_set1_epi8(0x0f));
    }
    if (f == Q5_0 || f == Q5_1) { /* ggml's bytes_from_bits_32: 0xff where the block's 5th bit is set */
        const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)load32(p + high_bits_at(f))),
            _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
        const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                               _mm256_set1_epi64x(-1));
        q = _mm256_or_si256(q, _mm256_and_si256(bits, _mm256_set1_epi8(0x10)));
    }
    if (looked_up(f)) q = _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues_of(f))), q);
    *s = q;
    *u = signed_quants(f) ? _mm256_sign_epi8(q, q) : q;
}

INLINE void tile_blocks(const int f, const int R, const int TT, const uint8_t *w, int64_t row_bytes, const act_view *x,
                        int64_t nb, float *y, int64_t ldy) {
    __m256 acc[ACC_ROWS][TILE_TOKENS];
    float mins[ACC_ROWS][TILE_TOKENS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps(), mins[r][t] = 0.0f;
    for (int64_t b = 0; b < nb; b++) {
        __m256i xq[TILE_TOKENS], c[TILE_TOKENS];
        __m256 dx[TILE_TOKENS];
        for (int t = 0; t < TT; t++) { /* per token block: shared by the R rows */
            xq[t] = _mm256_loadu_si256((const __m256i *)(x[t].q + 32 * b));
            dx[t] = _mm256_broadcast_ss(x[t].d + b);
            c[t] = _mm256_setzero_si256();
            if (bias(f)) c[t] = _mm256_sub_epi32(c[t], DOT_FROM(c[t], _mm256_set1_epi8((char)bias(f)), xq[t]));
        }
        for (int r = 0; r < R; r++) {
            __m256i u, s;
            float dw, mw;
            decode_block256(f, w + r * row_bytes + b * block_bytes(f), &u, &s, &dw, &mw);
            if (b & 1 || block_bytes(f) > 32) _mm_prefetch((const char *)(w + (R + r) * row_bytes + b * block_bytes(f)), _MM_HINT_T0);
            const __m256 dwv = _mm256_set1_ps(dw);
            for (int t = 0; t < TT; t++) {
                const __m256i i = DOT_FROM(c[t], u, signed_quants(f) ? _mm256_sign_epi8(xq[t], s) : xq[t]);
                acc[r][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_mul_ps(dwv, dx[t]), acc[r][t]);
                if (has_min(f)) mins[r][t] += mw * x[t].s[b];
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) y[t * ldy + r] = sum8(acc[r][t]) + mins[r][t];
}

/* Q8_0 at one token (AVX2). A block: |w| times x with w's signs, maddubs + madd to int32, one fma by d_w d_x. Rows
 * go in tiles of four (the token's block loaded once for them; four_streams: one row from each quarter), each row
 * a stream (cpu_stream.h). Tiles of four adjacent rows with one prefetch 2048 bytes past the tile against the
 * one-row loop before them: rows of 512 values 12-16 -> 17-19 GB/s a core from DRAM on a Zen 3, 23 -> 28 on two
 * (in L3 one core 21.5 -> 26.5; rows of 2048 values 14-20 -> 17-19 from DRAM, 24 -> 27.5 in L3). Each row's lanes
 * accumulate and reduce (sum8) as tile_blocks' do: the same bits as the T > 1 tiles. */
INLINE __m256 q8_0_block(const uint8_t *p, __m256i xq, float dx, __m256 acc) {
    const __m256i q = _mm256_loadu_si256((const __m256i *)(p + 2));
    const __m256i i = DOT_FROM(_mm256_setzero_si256(), _mm256_sign_epi8(q, q), _mm256_sign_epi8(xq, q));
    return _mm256_fmadd_ps(_mm256_cvtepi32_ps(i), _mm256_set1_ps(half_float(load16(p)) * dx), acc);
}

/* R (1 or 4) rows `stride` bytes apart */
INLINE void q8_0_rows(const int R, const uint8_t *w, int64_t stride, const act_view *x, int64_t nb, float *y) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t b = 0; b < nb; b++) {
        const __m256i xq = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        const float dx = x->d[b];
        for (int r = 0; r < R; r++) {
            stream_prefetch(w + r * stride + 34 * b, 34);
            a[r] = q8_0_block(w + r * stride + 34 * b, xq, dx, a[r]);
        }
    }
    for (int r = 0; r < R; r++) y[r] = sum8(a[r]);
}

/* as the AVX-512 add4_pinned */
INLINE __m256 add4_pinned(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    __m256 s01 = _mm256_add_ps(a0, a1), s23 = _mm256_add_ps(a2, a3);
    __asm__("" : "+x"(s01), "+x"(s23));
    return _mm256_add_ps(s01, s23);
}

INLINE __m256 float_weights(const int f, const void *row, int64_t k) {
    if (f == F32) return _mm256_loadu_ps((const float *)row + k);
    const __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)row + k));
    if (f == F16) return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* R (1 or 4) rows `stride` bytes apart at one token, each a lone row: four accumulators (k in 32s), the last 8s
 * into the first, the rest in scalar, each row a stream (cpu_stream.h; AVX2 always `prefetched`); a row's value
 * does not depend on R */
INLINE void floats_lone(const int f, const int R, const int prefetched, const uint8_t *w, int64_t stride, const float *x,
                        int64_t n, float *y) {
    (void)prefetched;
    const int size = f == F32 ? 4 : 2;
    __m256 acc[4][4];
    for (int r = 0; r < R; r++)
        for (int j = 0; j < 4; j++) acc[r][j] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 32 <= n; k += 32)
        for (int r = 0; r < R; r++) {
            stream_prefetch(w + r * stride + k * size, 32 * size);
            for (int j = 0; j < 4; j++)
                acc[r][j] = _mm256_fmadd_ps(float_weights(f, w + r * stride, k + 8 * j), _mm256_loadu_ps(x + k + 8 * j), acc[r][j]);
        }
    const int64_t k8 = k;
    for (int r = 0; r < R; r++) {
        for (k = k8; k + 8 <= n; k += 8) acc[r][0] = _mm256_fmadd_ps(float_weights(f, w + r * stride, k), _mm256_loadu_ps(x + k), acc[r][0]);
        float sum = sum8(add4_pinned(acc[r][0], acc[r][1], acc[r][2], acc[r][3]));
        for (int64_t j = k; j < n; j++) sum += float_at(f, w + r * stride, j) * x[j];
        y[r] = sum;
    }
}

/* R rows x TT tokens: an accumulator each, the next tile's rows prefetched when R > 1 (as the AVX-512 tile), the
 * last n % 8 in scalar; or a lone row and token (floats_lone) */
INLINE void tile_floats(const int f, const int R, const int TT, const uint8_t *w, int64_t row_bytes, const float *x,
                        int64_t n, float *y, int64_t ldy) {
    if (R * TT == 1) {
        floats_lone(f, 1, 1, w, row_bytes, x, n, y);
        return;
    }
    const int size = f == F32 ? 4 : 2;
    __m256 acc[FLOAT_ROWS][FLOAT_TOKENS];
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) acc[r][t] = _mm256_setzero_ps();
    int64_t k = 0;
    for (; k + 8 <= n; k += 8)
        for (int r = 0; r < R; r++) {
            const __m256 wv = float_weights(f, w + r * row_bytes, k);
            if (R > 1 && (k & (size == 4 ? 8 : 24)) == 0) _mm_prefetch((const char *)(w + (R + r) * row_bytes) + k * size, _MM_HINT_T0);
            for (int t = 0; t < TT; t++) acc[r][t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + t * n + k), acc[r][t]);
        }
    for (int r = 0; r < R; r++)
        for (int t = 0; t < TT; t++) {
            float sum = sum8(acc[r][t]);
            for (int64_t j = k; j < n; j++) sum += float_at(f, w + r * row_bytes, j) * x[t * n + j];
            y[t * ldy + r] = sum;
        }
}
#endif /* PATH_AVX2 */

#if defined(PATH_AVX512)
INLINE void q8_0_rows(const int R, const uint8_t *w, int64_t stride, const act_view *x, int64_t nb, float *y) {
    tile_blocks(Q8_0, R, 1, w, stride, x, nb, y, 1);
}
#endif

#if defined(PATH_AVX512) || defined(PATH_AVX2)
/* One token as four streams (cpu_dotk.c's four_streams): a tile's four rows are row j of each quarter of the call's
 * rows (row stride: a quarter), their values put back in place; the rows that the last, shorter quarter lacks, one
 * at a time. `four` computes each of its rows as `one` does (the same operations in the same order), so a row's
 * value is the same either way. Q8_0: the tile of four rows (AVX-512: tile_blocks, the same bits as one row);
 * before, four adjacent rows a tile, which on a Zen 4 (one core, from DRAM) beat one row at a time for rows of 512
 * and 1024 values (19.0 -> 22.2, 21.5 -> 24.3 GB/s) and lost for 2048 (23.9 -> 22.0), so AVX-512 took them up to
 * 1024 values only. The float formats: floats_lone, BF16 weights with BF16 activations bf16_lone, whose R = 4 and
 * R = 1 are four rows and one. */
typedef struct { const act_view *xv; int64_t nb; const float *x; const uint16_t *xb; int64_t n; } one_token;
typedef void (*rows_fn)(const one_token *t, const uint8_t *w, int64_t stride, float *ys);  /* a tile of S rows */
typedef float (*one_row_fn)(const one_token *t, const uint8_t *w);

/* The call's rows in S parts, row j of each part read together (`tile`: S rows `stride` apart), their values put
 * back in place; the rows that the last, shorter part lacks, one at a time (`one`) */
INLINE void row_streams(const int S, const uint8_t *w, int64_t row_bytes, int64_t rows, const one_token *t, rows_fn tile,
                        one_row_fn one, float *y) {
    const int64_t part = (rows + S - 1) / S;
    int64_t j = 0;
    for (; (S - 1) * part + j < rows; j++) {
        float ys[8];
        tile(t, w + j * row_bytes, part * row_bytes, ys);
        for (int s = 0; s < S; s++) y[s * part + j] = ys[s];
    }
    for (int s = 0; s < S - 1; s++)
        for (int64_t r = s * part + j; r < (s + 1) * part && r < rows; r++) y[r] = one(t, w + r * row_bytes);
}

static void four_streams(const uint8_t *w, int64_t row_bytes, int64_t rows, const one_token *t, rows_fn four,
                         one_row_fn one, float *y) {
    row_streams(4, w, row_bytes, rows, t, four, one, y);
}

#if defined(PATH_AVX512)
/* One token as eight plain streams: four_streams' way with eighths of the call's rows and no software prefetch,
 * where that reads faster (dot32_set_streams). Eight streams the hardware prefetchers alone follow read faster on
 * some hosts than four prefetched ones, on others not (cpu_kernels.c's read probes; docs/kernels.md): on the
 * Intel Ice Lake host, 2 threads from DRAM, 10 rounds toggled in one process (2026-12-07), the lane's F32 calls
 * 23.0 -> 25.7 GB/s (median), BF16 23.5 -> 26.0, beside reads of 27.7-30.5; Q8_0 26.1 either way, so the
 * block formats keep four_streams. Float rows only: their decoding is a load and an FMA, and each row's value
 * is the same either way (floats_lone), so the choice is one of speed alone. */
static void eight_streams(const uint8_t *w, int64_t row_bytes, int64_t rows, const one_token *t, rows_fn eight,
                          one_row_fn one, float *y) {
    row_streams(8, w, row_bytes, rows, t, eight, one, y);
}
#endif

static void q8_0_four(const one_token *t, const uint8_t *w, int64_t stride, float *y4) { q8_0_rows(4, w, stride, t->xv, t->nb, y4); }
static float q8_0_one(const one_token *t, const uint8_t *w) {
    float y;
    q8_0_rows(1, w, 0, t->xv, t->nb, &y);
    return y;
}

/* the float formats' tile of R rows and lone row, per format (f a constant in each): four and one as prefetched
 * streams, and on AVX-512 eight and one as plain streams */
#define FLOAT_ROW_FNS(F, TILE, ONE, R, PREFETCHED)                                                                     \
    static void TILE##_##F(const one_token *t, const uint8_t *w, int64_t stride, float *ys) {                          \
        floats_lone(F, R, PREFETCHED, w, stride, t->x, t->n, ys);                                                      \
    }                                                                                                                  \
    static float ONE##_##F(const one_token *t, const uint8_t *w) {                                                     \
        float y;                                                                                                       \
        floats_lone(F, 1, PREFETCHED, w, 0, t->x, t->n, &y);                                                           \
        return y;                                                                                                      \
    }
FLOAT_ROW_FNS(F32, floats_four, floats_one, 4, 1)
FLOAT_ROW_FNS(F16, floats_four, floats_one, 4, 1)
FLOAT_ROW_FNS(BF16, floats_four, floats_one, 4, 1)
#if defined(PATH_AVX512)
FLOAT_ROW_FNS(F32, floats_eight, floats_plain, 8, 0)
FLOAT_ROW_FNS(F16, floats_eight, floats_plain, 8, 0)
FLOAT_ROW_FNS(BF16, floats_eight, floats_plain, 8, 0)
#endif
#undef FLOAT_ROW_FNS
#if defined(PATH_BF16_PAIRS)
static void bf16_four_rows(const one_token *t, const uint8_t *w, int64_t stride, float *y4) { bf16_lone(4, w, stride, t->xb, t->n, y4); }
static float bf16_one_row(const one_token *t, const uint8_t *w) {
    float y;
    bf16_lone(1, w, 0, t->xb, t->n, &y);
    return y;
}
#endif
#endif

#if defined(PATH_AVX512) || defined(PATH_AVX2)
/* Rows in tiles of ROWS (the last few one at a time), each over every token in tiles of up to TTMAX. At T = 1 a tile
 * is ROWS1 rows: one where decoding is cheap next to the bytes (Q8_0, the float formats: one sequential stream,
 * what the prefetchers like best), ROWS_AT_ONE_TOKEN where it is not (the token's work shared by the rows). */
#define TOKEN_TILES(tile, f, R, TTMAX, r, x, extent) /* TTMAX <= 6: every tail length its own specialised call */   \
    for (int64_t t = 0; t < T; t += TTMAX) {                                                                           \
        const int64_t tt = T - t < TTMAX ? T - t : TTMAX;                                                              \
        const uint8_t *wr = w + (r) * row_bytes;                                                                       \
        float *yr = y + t * ldy + (r);                                                                                 \
        switch (tt) {                                                                                                  \
        case 6: tile(f, R, 6 <= TTMAX ? 6 : 1, wr, row_bytes, x(t), extent, yr, ldy); break;                           \
        case 5: tile(f, R, 5 <= TTMAX ? 5 : 1, wr, row_bytes, x(t), extent, yr, ldy); break;                           \
        case 4: tile(f, R, 4 <= TTMAX ? 4 : 1, wr, row_bytes, x(t), extent, yr, ldy); break;                           \
        case 3: tile(f, R, 3 <= TTMAX ? 3 : 1, wr, row_bytes, x(t), extent, yr, ldy); break;                           \
        case 2: tile(f, R, 2 <= TTMAX ? 2 : 1, wr, row_bytes, x(t), extent, yr, ldy); break;                           \
        default: tile(f, R, 1, wr, row_bytes, x(t), extent, yr, ldy); break;                                           \
        }                                                                                                              \
    }
#define TILES(tile, f, ROWS, ROWS1, TTMAX, x, extent)                                                                  \
    do {                                                                                                               \
        int64_t r = 0;                                                                                                 \
        if (T == 1)                                                                                                    \
            for (; r + ROWS1 <= rows; r += ROWS1) tile(f, ROWS1, 1, w + r * row_bytes, row_bytes, x(0), extent, y + r, ldy); \
        else                                                                                                           \
            for (; r + ROWS <= rows; r += ROWS) { TOKEN_TILES(tile, f, ROWS, TTMAX, r, x, extent) }                    \
        for (; r < rows; r++) { TOKEN_TILES(tile, f, 1, TTMAX, r, x, extent) }                                         \
    } while (0)

INLINE void blocks_simd(const int f, int64_t nb, const uint8_t *w, int64_t row_bytes, int64_t rows, const act_view *xv,
                        int64_t T, float *y, int64_t ldy) {
#define AT(t) (xv + (t))
    if (f == Q8_0 && T == 1) {
        const one_token t = {xv, nb, NULL, NULL, 0};
        four_streams(w, row_bytes, rows, &t, q8_0_four, q8_0_one, y);
        return;
    }
    TILES(tile_blocks, f, TILE_ROWS, (f == Q8_0 ? 1 : ROWS_AT_ONE_TOKEN), TILE_TOKENS, AT, nb);
#undef AT
}

/* The float tiles over x's T rows, `stride` floats apart (a packed token tile of x when stride is n16, below) */
INLINE void floats_tiles(const int f, int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const float *x,
                         int64_t stride, int64_t T, float *y, int64_t ldy) {
    if (T == 1) {
        const one_token t = {NULL, 0, x, NULL, n};
#if defined(PATH_AVX512)
        if (plain_streams) {
            if (f == F32) eight_streams(w, row_bytes, rows, &t, floats_eight_F32, floats_plain_F32, y);
            else if (f == F16) eight_streams(w, row_bytes, rows, &t, floats_eight_F16, floats_plain_F16, y);
            else eight_streams(w, row_bytes, rows, &t, floats_eight_BF16, floats_plain_BF16, y);
            return;
        }
#endif
        if (f == F32) four_streams(w, row_bytes, rows, &t, floats_four_F32, floats_one_F32, y);
        else if (f == F16) four_streams(w, row_bytes, rows, &t, floats_four_F16, floats_one_F16, y);
        else four_streams(w, row_bytes, rows, &t, floats_four_BF16, floats_one_BF16, y);
        return;
    }
#define AT(t) (x + (t) * stride)
    TILES(tile_floats, f, FLOAT_ROWS, 1, FLOAT_TOKENS, AT, n);
#undef AT
}

#if defined(PATH_AVX512)
enum { FLOAT_CHUNK_BYTES = 262144 };  /* packed activations a chunk: with a granule's rows, within L2 */

/* x [T, n] -> packed: token tile j (FLOAT_TOKENS tokens, the last fewer) at j * FLOAT_TOKENS * n16, as [n16 / 16]
 * [its tokens][16], zeros past n */
INLINE void floats_pack(const float *x, int64_t n, int64_t n16, int64_t T, float *packed) {
    for (int64_t t0 = 0; t0 < T; t0 += FLOAT_TOKENS) {
        const int64_t tt = T - t0 < FLOAT_TOKENS ? T - t0 : FLOAT_TOKENS;
        float *p = packed + t0 * n16;
        for (int64_t k = 0; k < n16; k += 16) {
            const __mmask16 live = n - k >= 16 ? 0xffff : (__mmask16)((1u << (n - k)) - 1);
            for (int64_t j = 0; j < tt; j++, p += 16) _mm512_store_ps(p, _mm512_maskz_loadu_ps(live, x + (t0 + j) * n + k));
        }
    }
}
#endif

#if defined(PATH_AVX512)
/* ---- F32 weights at T >= OUTER_FROM (AVX-512): outer products, no horizontal sums -------------------------------
 * The float tiles dot a row with a token along k, end every (row, token) with a horizontal sum and read the packed
 * activations from L2 again for every 4 rows: on [768, 768] at T = 43 about half this core's FMA rate (torch's
 * sgemm: 1.1-1.5x theirs). Here a tile of up to 48 tokens is packed k-major ([n][48]: value k of its tokens side
 * by side, by 16 x 16 transposes), and 8 rows x 3 token vectors keep 24 accumulators: per k, 3 vector loads, each
 * row's weight broadcast from memory, 24 FMAs, and the rows of the next tile prefetched a line per 16 k. Each
 * (row, token) adds its products in k order in float32 within chunks of OUTER_CHUNK values, then the chunks' sums in
 * order (the tiles: 16 lanes, then a tree; one running sum over all n read noticeably rounder on 2048-long rows), so
 * the two agree within float32 rounding; the order depends on n only, not on T, the tile or the thread count. */
enum { OUTER_ROWS = 8, OUTER_VECS = 3, OUTER_TOKENS = 16 * OUTER_VECS, OUTER_FROM = 16, OUTER_CHUNK = 128 };

/* tokens x [tt, n] (tt <= 16 * tv) -> packed [n][OUTER_TOKENS], vectors 0..tv-1 of each k, zeros past tt */
INLINE void outer_pack(const float *x, int64_t n, int64_t tt, int64_t tv, float *packed) {
    for (int64_t k = 0; k < n; k += 16) {
        const int64_t kk = n - k < 16 ? n - k : 16;
        const __mmask16 live = (__mmask16)((1u << kk) - 1);
        for (int64_t v = 0; v < tv; v++) {
            __m512i m[16];
            for (int64_t j = 0; j < 16; j++)
                m[j] = 16 * v + j < tt ? _mm512_castps_si512(_mm512_maskz_loadu_ps(live, x + (16 * v + j) * n + k)) : _mm512_setzero_si512();
            transpose16(m);  /* m[c]: value k + c of tokens 16v .. 16v + 15 */
            for (int64_t c = 0; c < kk; c++) _mm512_store_si512((__m512i *)(packed + (k + c) * OUTER_TOKENS + 16 * v), m[c]);
        }
    }
}

/* R rows (stride floats apart) x TV token vectors of packed: y[t * ldy + r] for the tile's tt tokens */
INLINE void outer_tile(const int R, const int TV, const float *w, int64_t stride, const float *packed, int64_t n, int64_t tt,
                       float *y, int64_t ldy) {
    __m512 total[OUTER_ROWS][OUTER_VECS];  /* the chunks' sums */
    for (int r = 0; r < R; r++)
        for (int v = 0; v < TV; v++) total[r][v] = _mm512_setzero_ps();
    for (int64_t c0 = 0; c0 < n; c0 += OUTER_CHUNK) {
        __m512 acc[OUTER_ROWS][OUTER_VECS];
        for (int r = 0; r < R; r++)
            for (int v = 0; v < TV; v++) acc[r][v] = _mm512_setzero_ps();
        const int64_t c1 = n - c0 < OUTER_CHUNK ? n : c0 + OUTER_CHUNK;
        for (int64_t k0 = c0; k0 < c1; k0 += 16) {
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(w + (R + r) * stride + k0), _MM_HINT_T0);
            const int64_t end = c1 - k0 < 16 ? c1 : k0 + 16;
            for (int64_t k = k0; k < end; k++) {
                const float *p = packed + k * OUTER_TOKENS;
                __m512 xv[OUTER_VECS];
                for (int v = 0; v < TV; v++) xv[v] = _mm512_load_ps(p + 16 * v);
                for (int r = 0; r < R; r++) {
                    const __m512 wv = _mm512_set1_ps(w[r * stride + k]);
                    for (int v = 0; v < TV; v++) acc[r][v] = _mm512_fmadd_ps(wv, xv[v], acc[r][v]);
                }
            }
        }
        for (int r = 0; r < R; r++)
            for (int v = 0; v < TV; v++) total[r][v] = _mm512_add_ps(total[r][v], acc[r][v]);
    }
    for (int r = 0; r < R; r++)
        for (int v = 0; v < TV; v++) {
            float out[16] __attribute__((aligned(64)));
            _mm512_store_ps(out, total[r][v]);
            for (int j = 0; j < 16 && 16 * v + j < tt; j++) y[(16 * v + j) * ldy + r] = out[j];
        }
}

/* -> 1, or 0 when the packed activations' memory would not come */
static int floats_outer(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const float *x, int64_t T, float *y,
                        int64_t ldy) {
    float *packed = aligned_alloc(64, (size_t)n * OUTER_TOKENS * sizeof(float));
    if (packed == NULL) return 0;
    const float *wf = (const float *)w;
    const int64_t stride = row_bytes / 4;
    for (int64_t t0 = 0; t0 < T; t0 += OUTER_TOKENS) {
        const int64_t tt = T - t0 < OUTER_TOKENS ? T - t0 : OUTER_TOKENS, tv = (tt + 15) / 16;
        outer_pack(x + t0 * n, n, tt, tv, packed);
        float *yt = y + t0 * ldy;
#define OUTER_ROWS_OF(TV)                                                                                              \
    do {                                                                                                               \
        int64_t r = 0;                                                                                                 \
        for (; r + OUTER_ROWS <= rows; r += OUTER_ROWS) outer_tile(OUTER_ROWS, TV, wf + r * stride, stride, packed, n, tt, yt + r, ldy); \
        for (; r < rows; r++) outer_tile(1, TV, wf + r * stride, stride, packed, n, tt, yt + r, ldy);                  \
    } while (0)
        if (tv == 3) OUTER_ROWS_OF(3);
        else if (tv == 2) OUTER_ROWS_OF(2);
        else OUTER_ROWS_OF(1);
#undef OUTER_ROWS_OF
    }
    free(packed);
    return 1;
}
#endif

/* -> 1, or 0 when the packed activations' memory would not come. T > 1 on AVX-512: tokens in chunks of about
 * FLOAT_CHUNK_BYTES of packed activations, each packed once for all the rows. */
INLINE int floats_simd(const int f, int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const float *x,
                       int64_t T, float *y, int64_t ldy) {
#if defined(PATH_AVX512)
    if (f == F32 && T >= OUTER_FROM && floats_outer(n, w, row_bytes, rows, x, T, y, ldy)) return 1;
    if (T > 1) {
        const int64_t n16 = (n + 15) & ~(int64_t)15, fit = FLOAT_CHUNK_BYTES / (n16 * 4) / FLOAT_TOKENS * FLOAT_TOKENS;
        const int64_t chunk = fit < FLOAT_TOKENS ? FLOAT_TOKENS : fit > T ? T : fit;
        float *packed = aligned_alloc(64, (size_t)(chunk * n16) * sizeof(float));
        if (packed == NULL) return 0;
        for (int64_t c0 = 0; c0 < T; c0 += chunk) {
            const int64_t tc = T - c0 < chunk ? T - c0 : chunk;
            floats_pack(x + c0 * n, n, n16, tc, packed);
            floats_tiles(f, n, w, row_bytes, rows, packed, n16, tc, y + c0 * ldy, ldy);
        }
        free(packed);
        return 1;
    }
#endif
    floats_tiles(f, n, w, row_bytes, rows, x, n, T, y, ldy);
    return 1;
}

#if defined(PATH_BF16_PAIRS)
INLINE void bf16_simd(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const uint16_t *x, int64_t T, float *y,
                      int64_t ldy) {
    if (T == 1) {
        const one_token t = {NULL, 0, NULL, x, n};
        four_streams(w, row_bytes, rows, &t, bf16_four_rows, bf16_one_row, y);
        return;
    }
#define AT(t) (x + (t) * n)
    TILES(tile_bf16, BF16, FLOAT_ROWS, 1, TILE_TOKENS, AT, n);  /* 4 tokens: 6 measured no faster here */
#undef AT
}
#endif

/* Tokens per chunk: as many whole token tiles as keep `per_token` bytes of activations each within ~24 KB (at least
 * one tile); all T when T is one tile or less (decode). */
static inline int64_t chunk_tokens(int64_t per_token, int64_t T) {
    const int64_t tiles = 24576 / (per_token > 0 ? per_token : 1) / TILE_TOKENS;
    return T <= TILE_TOKENS ? T : (tiles > 0 ? tiles : 1) * TILE_TOKENS;
}

#if defined(PATH_AVX512)
/* The 16-row tiles, on the activations as they are; a function of its own (inlined into dot_simd, the six tile
 * loops cost the float formats' loops there 20% of F32 prefill). -> 1, or 0 when out of memory. */
__attribute__((noinline)) static int dot_wide(int64_t f, int64_t act, int64_t n, const uint8_t *w, int64_t row_bytes,
                                              int64_t rows, const uint8_t *xq, int64_t T, float *y, int64_t ldy) {
    const int64_t nb = n / 32;
    wide_act *meta = aligned_alloc(64, (size_t)(T * nb) * sizeof(wide_act));
    if (meta == NULL) return 0;
    wide_prep(act, bias((int)f), xq, nb, T, meta);
    switch (f) {
    case Q4_0: blocks_wide(Q4_0, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    case Q4_1: blocks_wide(Q4_1, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    case Q5_0: blocks_wide(Q5_0, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    case Q5_1: blocks_wide(Q5_1, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    case Q8_0: blocks_wide(Q8_0, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    case IQ4_NL: blocks_wide(IQ4_NL, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    case MXFP4: blocks_wide(MXFP4, act, nb, w, row_bytes, rows, xq, meta, T, y, ldy); break;
    }
    free(meta);
    return 1;
}
#endif

/* -> 1 if done here, 0 if the scratch would not come (the caller runs the scalar path) */
static int dot_simd(int64_t f, int64_t act, int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows,
                    const uint8_t *xq, int64_t T, float *y, int64_t ldy) {
#if defined(PATH_BF16_PAIRS)
    if (f == BF16 && act == ACT_BF16) {  /* the activations as they are: no scratch */
        bf16_simd(n, w, row_bytes, rows, (const uint16_t *)xq, T, y, ldy);
        return 1;
    }
#endif
    const int blocks = f != F32 && f != F16 && f != BF16;
#if defined(PATH_AVX512)
    if (blocks && T >= WIDE_FROM) return dot_wide(f, act, n, w, row_bytes, rows, xq, T, y, ldy);
#endif
    unsigned char stack[SCRATCH_BYTES] __attribute__((aligned(64)));
    const int64_t nb = n / 32, nbp = (nb + 1) & ~(int64_t)1;
    const int64_t bytes = blocks ? T * (nbp * ACT_BLOCK_BYTES + (int64_t)sizeof(act_view)) : act == ACT_F32 ? 0 : T * n * 4;
    uint8_t *scratch = bytes <= SCRATCH_BYTES ? stack : aligned_alloc(64, ((size_t)bytes + 63) & ~(size_t)63);
    if (scratch == NULL) return 0;
    if (blocks) {
        act_view *xv = (act_view *)(scratch + T * nbp * ACT_BLOCK_BYTES);
#if defined(PATH_AVX512)
        unpack_blocks(act, bias((int)f), xq, nb, nbp, T, scratch, xv);
#else
        unpack_blocks(act, 0, xq, nb, nbp, T, scratch, xv);
#endif
        /* tokens in chunks whose unpacked activations stay in L1 (~24 KB) while each row tile passes over them, beside
         * cpu_kernels.c's 32-row granules (Q8_0 [1024, 2048] at T = 256, 1 thread, interleaved x3: 60-63 GMAC/s
         * without the chunks, 68-69 with; Q4_0 at T = 64 97-99 without, 92-93 with). A chunk is a whole number of
         * token tiles, so every (row, token) runs the same operations as without. */
        const int64_t chunk = chunk_tokens(nbp * ACT_BLOCK_BYTES, T);
        for (int64_t t0 = 0; t0 < T; t0 += chunk) {
            const int64_t tc = T - t0 < chunk ? T - t0 : chunk;
            const act_view *xc = xv + t0;
            float *yc = y + t0 * ldy;
            switch (f) {
            case Q4_0: blocks_simd(Q4_0, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            case Q4_1: blocks_simd(Q4_1, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            case Q5_0: blocks_simd(Q5_0, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            case Q5_1: blocks_simd(Q5_1, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            case Q8_0: blocks_simd(Q8_0, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            case IQ4_NL: blocks_simd(IQ4_NL, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            case MXFP4: blocks_simd(MXFP4, nb, w, row_bytes, rows, xc, tc, yc, ldy); break;
            }
        }
    } else {
        const float *x = (const float *)xq;
        if (act != ACT_F32) {
            float *xf = (float *)scratch;
            for (int64_t i = 0; i < T * n; i++) xf[i] = float_at(act, xq, i);
            x = xf;
        }
        int done = 0;
        switch (f) {
        case F32: done = floats_simd(F32, n, w, row_bytes, rows, x, T, y, ldy); break;
        case F16: done = floats_simd(F16, n, w, row_bytes, rows, x, T, y, ldy); break;
        case BF16: done = floats_simd(BF16, n, w, row_bytes, rows, x, T, y, ldy); break;
        }
        if (!done) {
            if (scratch != stack) free(scratch);
            return 0;
        }
    }
    if (scratch != stack) free(scratch);
    return 1;
}
#endif

void dot32_dot(int64_t wtype, int64_t act, int64_t n, const void *w, int64_t row_bytes, int64_t rows, const void *xq,
               int64_t T, float *y, int64_t ldy) {
    if (rows <= 0 || T <= 0) return;
#if defined(PATH_AVX512) || defined(PATH_AVX2)
    if (dot_simd(wtype, act, n, w, row_bytes, rows, xq, T, y, ldy)) return;
#endif
    if (wtype == F32 || wtype == F16 || wtype == BF16) floats_scalar(wtype, act, n, w, row_bytes, rows, xq, T, y, ldy);
    else blocks_scalar((int)wtype, act, n / 32, w, row_bytes, rows, xq, T, y, ldy);
}

/* which SIMD path this build took: 2 AVX-512, 1 AVX2, 0 scalar (for tests and status lines) */
int64_t dot32_path(void) {
#if defined(PATH_AVX512)
    return 2;
#elif defined(PATH_AVX2)
    return 1;
#else
    return 0;
#endif
}
