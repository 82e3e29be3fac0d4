/* The dotk family (cpu_dot.h): Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S
 * and IQ4_XS weight rows dotted with activations in Q8_K, as llama.cpp's ggml_vec_dot_<fmt>_q8_K computes them.
 *
 * dotk_quantize writes Q8_K (float d, int8 qs[256], int16 bsums[16] per 256 values) byte for byte as
 * quantize_row_q8_K_ref: the first value of largest magnitude sets iscale = -127 / it, q = round-half-even of
 * the float32 product iscale * x (a separate multiply, never fused), capped at 127, d = 1 / iscale.
 *
 * dotk_dot, numerics: per 256-value block, integer dot products of weight quants and activation quants, exact
 * in int32, each 16- or 32-value group's sum times its integer scale; then times d_w * d_x in float32, minus
 * dmin_w * d_x * sum(min * bsum) for the formats with mins (Q2_K, Q4_K, Q5_K). Every format is decoded to one
 * shape (the struct wblock): 256 unsigned quants u < 128 with w = u - offset, 16 group scales, the offset's
 * share (offset * scale * bsum, an integer: Q3_K 4, Q6_K 32, IQ3_XXS 64, IQ3_S 16) taken off through the
 * bsums, so every product is a u8 x s8 pair (maddubs) that cannot saturate. IQ4_XS, the IQ1 and IQ2 formats, and with
 * AVX-512 IQ3_XXS and IQ3_S, keep signed values (|w| <= 127) and move their signs onto the activations (|q| <= 127
 * in Q8_K). Only the float sums' order differs from llama.cpp's (vector lanes, blocks in turn): float32 rounding.
 * IQ3_XXS's factor 0.25 and the IQ1 and IQ2 formats' 0.125 are folded into d (exact).
 *
 * Loops: each weight block is decoded once and applied to all T activation rows. T = 1 (decode's gemv, memory bound):
 * row by row, block by block, streamed (cpu_stream.h), 16 rows' sums folded at once; every format has its own gemv
 * with AVX-512 (Q2_K, Q3_K, Q5_K, Q6_K, IQ1, IQ2, IQ4_XS: with VNNI), which reads the quant bytes as they lie (all
 * but Q6_K's against the activations reordered to match: see "Q4_K at T = 1", "Q2_K and Q3_K at T = 1", "IQ3_S at
 * T = 1", "IQ2_XXS at T = 1", "IQ1_S and IQ1_M at T = 1"; IQ4_XS's there takes
 * its kvalues unsigned, + 128, and the offset's share through the sub-block sums). T > 1 (prefill): the activation blocks
 * are first copied so their quants sit on 64-byte lines (a Q8_K block is 292 bytes: every load would split a line),
 * then 4 rows at a time walk the blocks, so one block column of activations (T x 320 bytes, T <= 64 per pass) stays in
 * L1 for every row and token. With AVX-512 VNNI, T >= 8 (>= 4 for the IQ formats) takes 16-row tiles instead: the rows
 * on a vector's lanes, one vpdpbusd per token and 4 values (see "T > 1 with AVX-512 VNNI" below); with AVX2, from 12 to
 * 64 tokens by format, Q2_K..Q5_K and IQ3_S take 16-row tiles on two vectors' lanes, one vpmaddubsw per token and 4
 * values of 8 rows (see "T > 1 with AVX2"). No threads here: callers split rows.
 *
 * SIMD paths, chosen at build time (-march=native): AVX-512 F/BW/VL/VBMI on 64-value vectors (vpdpwssd with VNNI); the
 * IQ3 grids are looked up in registers (vpermi2b on nibble codes of the grids' 8 levels, vpermb on quarters of the
 * grids in the one-token gemvs: gathers cost 30+ cycles on Zen 4 / 5). AVX2 + FMA on 32-value vectors (maddubs / madd,
 * as ggml's x86 code; IQ3 grid rows by scalar loads), which machines with AVX-512 but no VBMI also take. A portable
 * scalar path elsewhere.
 *
 * Resident layouts: IQ3_XXS_T and IQ3_S_T (cpu_iq3_t.h) are the two IQ3 formats with their sign bits transposed,
 * which the one-token AVX-512 loops read as masks; dotk_repack converts, dotk_resident_type says which a host
 * holds; every other loop decodes a block put back.
 *
 * Tables: the IQ1, IQ2 and IQ3 grids and IQ4_NL's kvalues come from the gguf package through dotk_tables; until
 * it is called the IQ formats are not offered (act_type -1). The IQ1 and IQ2 formats' grid rows (8 values) are
 * looked up by scalar loads, a row at a time, but for the IQ2 grids with AVX-512 (16-bit codes in registers); their
 * one-token loops (AVX-512 VNNI, AVX2) are their own. IQ3_XXS's sign patterns follow a rule
 * (7 bits and a parity bit), which dotk_tables checks against the package's table.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cpu_dot.h"
#include "cpu_vnni.h"
#include "cpu_stream.h"
#include "cpu_iq3_t.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__)
#define DOTK_AVX512 1
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__)
#define DOTK_AVX2 1
#include <immintrin.h>
#endif

enum { Q2_K = 10, Q3_K = 11, Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
       IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, IQ1_M = 29, IQ3_XXS_T = 118, IQ3_S_T = 121 };
enum { QK = 256, Q8K_BYTES = 292 };  /* Q8_K block: d at 0, qs at 4, bsums at 260 */
/* Q8_K blocks copied for many tokens: qs on a 64-byte boundary (no load splits a cache line), bsums, d, and
 * (AVX2) the 8 sub-block sums (int16) */
enum { PACKED_QS = 0, PACKED_BSUMS = 256, PACKED_D = 288, PACKED_SUMS8 = 304, PACKED_BYTES = 320 };
enum { HAS_OFF = 1, HAS_MIN = 2, SIGNED = 4 };  /* what a format's decoded block carries */
/* the row tiles' scale (min) pairs a row's block has against a token's sums: span 4 (values per 16), its 16
 * bsums, 8 pairs; span 8 (per 32), its 8 sub-block sums, 4 */
#define PAIRS(span) (32 / (span))
enum { OFFSET_XXS = 64, OFFSET_S = 16 };  /* IQ3_XXS and IQ3_S values as unsigned: offset + sign * grid value */
/* The IQ3 formats' decoded form: with AVX-512 the grid values' magnitudes and signs (SIGNED: one vpshufb a vector
 * where offset +- value took two, and no offset's share); elsewhere offset + sign * value (HAS_OFF) */
#if defined(DOTK_AVX512)
#define IQ3_KIND SIGNED
#else
#define IQ3_KIND HAS_OFF
#endif

static uint32_t grid_xxs[256], grid_s[512];  /* 4 values (bytes) per entry */
static uint64_t grid2_xxs[256], grid2_xs[512], grid2_s[1024];  /* the IQ2 grids: 8 values (bytes) per entry */
static uint64_t grid1[2048];  /* the IQ1 grid: 8 values g of -1, 0, 1 (int8) per entry */
static uint64_t grid1_up[2048] __attribute__((aligned(64)));  /* g + 1 (0, 1, 2) for the one-token loops */

/* The IQ2 grids as 16-bit codes for in-register lookups (AVX-512): value i of an entry is level (code >> 2i) & 3 of
 * levels2 (their three values 8, 25, 43); codes_ok: every IQ2 grid has that form */
static uint16_t code2_xxs[256] __attribute__((aligned(64))), code2_xs[512] __attribute__((aligned(64)));
static uint16_t code2_s[1024] __attribute__((aligned(64)));
static uint8_t levels2[16] __attribute__((aligned(16)));
static int codes_ok;
static int8_t kvalues[16];
static int tables_ready;
/* The grids again for in-register lookups (AVX-512): each value is one of 8 levels (gguf's grids: IQ3_XXS 4..62,
 * IQ3_S 1..15 odd), so an entry is 4 level numbers, kept as two bytes in two planes: [0][e] holds values 0 and 1
 * of entry e (low, high nibble), [1][e] values 2 and 3; levels_*[k] is level k's value. */
static uint8_t code_xxs[2][256] __attribute__((aligned(64))), code_s[2][512] __attribute__((aligned(64)));
static uint8_t levels_xxs[16], levels_s[16];  /* each grid's distinct values, ascending */
/* IQ3_S's grid for its one-token loop (AVX-512 with GFNI): its levels are 2c + 1 (c = 0..7, odd_levels_s), so an
 * entry is 12 bits of codes: s3_low[e] holds c0 | c1 << 3 | (c2 & 3) << 6, and s3_high a nibble c2 >> 2 | c3 << 1
 * for entry e (low nibble of byte e) and entry 256 + e (high nibble): 768 bytes, 12 vpermb a block, where two
 * planes of the values as nibbles took 16. */
static uint8_t s3_low[512] __attribute__((aligned(64))), s3_high[256] __attribute__((aligned(64)));
static int odd_levels_s;
/* IQ3_XXS's grid for its one-token loop with GFNI: planes as code_xxs's, each nibble a code c whose value is an
 * affine map over GF(2) of it, half the level = A c ^ XXS_AFFINE_BASE, one vgf2p8affineqb a vector where a level
 * number took a vpshufb on Intel's busiest port (gguf's levels 4, 12, .., 52, 62 halved, 2, 6, .., 26, 31, take all
 * 4 bits: 31 ^ 2 is 4 + 8 + 16 + 1). affine_xxs[0] and [1]: the matrices that map a byte's low and high nibble;
 * affine_xxs_ok: every level is even and has a code. */
enum { XXS_AFFINE_BASE = 2 };
static uint8_t gf_xxs[2][256] __attribute__((aligned(64)));
static uint64_t affine_xxs[2];
static int affine_xxs_ok;
static uint8_t sign_table[128] __attribute__((aligned(64)));  /* IQ3_XXS's sign patterns, from their rule */
static uint64_t sign_ones[128];  /* the same patterns as 8 bytes of +1 / -1 (ggml's keven_signs_q2xs) */

static inline uint16_t u16_at(const uint8_t *p) { uint16_t v; memcpy(&v, p, 2); return v; }
static inline uint32_t u32_at(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static inline uint64_t u64_at(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }
static inline float f32_at(const uint8_t *p) { float v; memcpy(&v, p, 4); return v; }

static inline float f16_at(const uint8_t *p) {
    const uint16_t h = u16_at(p);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, em = h & 0x7fffu;
    uint32_t bits;
    if (em >= 0x7c00u) bits = sign | 0x7f800000u | (em & 0x3ffu) << 13;  /* inf, NaN */
    else if (em >= 0x0400u) bits = sign | ((em << 13) + (112u << 23));
    else { const float f = (float)em * 0x1p-24f; memcpy(&bits, &f, 4); bits |= sign; }  /* zero, subnormal: exact */
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* IQ3_XXS's sign pattern of 8 values from its 7-bit index: the index, and bit 7 set when its parity is odd */
static inline uint8_t sign_pattern(unsigned i) { return (uint8_t)(i | (unsigned)(__builtin_popcount(i) & 1) << 7); }

/* grid [entries][4] -> its distinct values (ascending) in levels and each entry's 4 level numbers as nibbles in
 * two planes; 0 if the grid has more than 8 distinct values (a level must keep a nibble's top bit clear: the
 * expansion shifts codes without masking them) */
static int level_codes(const uint8_t *grid, int entries, uint8_t levels[16], uint8_t *codes) {
    int seen[256] = {0}, count = 0;
    for (int i = 0; i < 4 * entries; i++) seen[grid[i]] = 1;
    memset(levels, 0, 16);
    for (int v = 0; v < 256; v++)
        if (seen[v]) {
            if (count == 8) return 0;
            levels[count] = (uint8_t)v;
            seen[v] = count++;
        }
    for (int e = 0; e < entries; e++)
        for (int plane = 0; plane < 2; plane++)
            codes[plane * entries + e] = (uint8_t)(seen[grid[4 * e + 2 * plane]] | seen[grid[4 * e + 2 * plane + 1]] << 4);
    return 1;
}

/* the value of code c under the basis: XXS_AFFINE_BASE ^ the basis vectors of c's set bits */
static unsigned affine_value(const uint8_t *basis, int dims, unsigned c) {
    unsigned v = XXS_AFFINE_BASE;
    for (int t = 0; t < dims; t++) v ^= c >> t & 1 ? basis[t] : 0;
    return v;
}

/* levels[0..7] as codes (code[k]: level k's) under one affine map value = A c ^ XXS_AFFINE_BASE of a nibble c;
 * A as gf2p8affineqb's matrices for a byte's low and high nibble (row i of A, the bits feeding output bit i, is
 * byte 7 - i) -> 0 if the levels need more than 4 dimensions */
static int affine_codes(const uint8_t levels[8], uint8_t code[8], uint64_t matrix[2]) {
    uint8_t basis[4];
    int dims = 0;
    for (int k = 0; k < 8; k++) {
        int c = 0;
        while (c < 1 << dims && affine_value(basis, dims, (unsigned)c) != levels[k]) c++;
        if (c == 1 << dims) {  /* not yet spanned: its offset from the base joins the basis */
            if (dims == 4) return 0;
            basis[dims++] = (uint8_t)(levels[k] ^ XXS_AFFINE_BASE);
            c = 1 << (dims - 1);
        }
        code[k] = (uint8_t)c;
    }
    matrix[0] = matrix[1] = 0;
    for (int i = 0; i < 8; i++) {
        unsigned row = 0;
        for (int t = 0; t < dims; t++) row |= (unsigned)(basis[t] >> i & 1) << t;
        matrix[0] |= (uint64_t)row << 8 * (7 - i);
        matrix[1] |= (uint64_t)(row << 4) << 8 * (7 - i);
    }
    return 1;
}

/* levels2: the distinct values of an IQ2 grid [entries][8], ascending -> 0 if it has more than 3 */
static int grid_levels(const uint8_t *grid, int entries) {
    int count = 0, seen[256] = {0};
    for (int i = 0; i < 8 * entries; i++) seen[grid[i]] = 1;
    memset(levels2, 0, sizeof levels2);
    for (int v = 0; v < 256; v++)
        if (seen[v]) {
            if (count == 3) return 0;
            levels2[count++] = (uint8_t)v;
        }
    return 1;
}

/* an IQ2 grid [entries][8] -> codes (levels2's level of each value, 2 bits each); 0 if a value is not one of
 * levels2's */
static int grid_codes(const uint8_t *grid, int entries, uint16_t *codes) {
    for (int e = 0; e < entries; e++) {
        codes[e] = 0;
        for (int i = 0; i < 8; i++) {
            int level = 0;
            while (level < 3 && levels2[level] != grid[8 * e + i]) level++;
            if (level == 3) return 0;
            codes[e] |= (uint16_t)(level << 2 * i);
        }
    }
    return 1;
}

/* -> 0, or why the IQ formats stay off: 1 when the package's sign table is not the parity rule this file
 * computes, 2 when an IQ3 grid has a value over its offset (the unsigned form offset +- value must stay in 0..127)
 * or more than 8 distinct values, an IQ2 grid a value outside 1..127 (a magnitude vpmaddubsw takes, never 0: the
 * AVX2 loop moves the signs with vpsignb), or the IQ1 grid one outside -1..1. grids: IQ3_XXS [256][4] and IQ3_S
 * [512][4] bytes; signs: IQ2_XXS's 128 patterns; kv: IQ4_NL's 16 kvalues; IQ2_XXS [256][8], IQ2_XS [512][8], IQ2_S
 * [1024][8] bytes; IQ1_S's (and IQ1_M's) [2048][8] int8. */
int64_t dotk_tables(const uint8_t *iq3_xxs, const uint8_t *iq3_s, const uint8_t *signs, const int8_t *kv,
                    const uint8_t *iq2_xxs, const uint8_t *iq2_xs, const uint8_t *iq2_s, const int8_t *iq1) {
    for (unsigned i = 0; i < 128; i++)
        if (signs[i] != sign_pattern(i)) return 1;
    for (int i = 0; i < 4 * 512; i++)
        if ((i < 4 * 256 && iq3_xxs[i] > OFFSET_XXS) || iq3_s[i] > OFFSET_S) return 2;
    for (int i = 0; i < 8 * 1024; i++)
        if ((i < 8 * 256 && (iq2_xxs[i] - 1u) > 126u) || (i < 8 * 512 && (iq2_xs[i] - 1u) > 126u) || (iq2_s[i] - 1u) > 126u)
            return 2;
    for (int i = 0; i < 8 * 2048; i++)
        if (iq1[i] < -1 || iq1[i] > 1) return 2;
    if (!level_codes(iq3_xxs, 256, levels_xxs, code_xxs[0]) || !level_codes(iq3_s, 512, levels_s, code_s[0])) return 2;
    uint8_t code[8], half[8];  /* the loop dots half of each level (halved exactly: every level even) */
    int even = 1;
    for (int k = 0; k < 8; k++) half[k] = levels_xxs[k] / 2, even &= !(levels_xxs[k] & 1);
    affine_xxs_ok = even && affine_codes(half, code, affine_xxs);
    for (int e = 0; e < 256 && affine_xxs_ok; e++)
        for (int plane = 0; plane < 2; plane++)
            gf_xxs[plane][e] = (uint8_t)(code[code_xxs[plane][e] & 15] | code[code_xxs[plane][e] >> 4] << 4);
    odd_levels_s = 1;
    for (int k = 0; k < 8; k++) odd_levels_s &= levels_s[k] == 2 * k + 1;
    memset(s3_high, 0, sizeof s3_high);
    for (int e = 0; e < 512; e++) {
        const unsigned c0 = code_s[0][e] & 15, c1 = code_s[0][e] >> 4, c2 = code_s[1][e] & 15, c3 = code_s[1][e] >> 4;
        s3_low[e] = (uint8_t)(c0 | c1 << 3 | (c2 & 3) << 6);
        s3_high[e % 256] |= (uint8_t)((c2 >> 2 | c3 << 1) << 4 * (e / 256));  /* entry e + 256: the high nibble */
    }
    memcpy(grid_xxs, iq3_xxs, sizeof grid_xxs);
    memcpy(grid_s, iq3_s, sizeof grid_s);
    memcpy(kvalues, kv, sizeof kvalues);
    memcpy(grid2_xxs, iq2_xxs, sizeof grid2_xxs);
    memcpy(grid2_xs, iq2_xs, sizeof grid2_xs);
    memcpy(grid2_s, iq2_s, sizeof grid2_s);
    memcpy(grid1, iq1, sizeof grid1);
    for (int e = 0; e < 2048; e++) {
        grid1_up[e] = 0;
        for (int j = 0; j < 8; j++) grid1_up[e] |= (uint64_t)(uint8_t)((int8_t)(grid1[e] >> 8 * j) + 1) << 8 * j;
    }
    codes_ok = grid_levels(iq2_xxs, 256) && grid_codes(iq2_xxs, 256, code2_xxs) && grid_codes(iq2_xs, 512, code2_xs)
               && grid_codes(iq2_s, 1024, code2_s);
    for (unsigned i = 0; i < 128; i++) {
        sign_table[i] = sign_pattern(i);
        sign_ones[i] = 0;
        for (int j = 0; j < 8; j++) sign_ones[i] |= (uint64_t)(sign_table[i] >> j & 1 ? 0xff : 0x01) << 8 * j;
    }
    tables_ready = 1;
    return 0;
}

int64_t dotk_act_type(int64_t wtype, int64_t float_acts) {
    (void)float_acts;  /* these formats dot with Q8_K only */
    switch (wtype) {
    case Q2_K: case Q3_K: case Q4_K: case Q5_K: case Q6_K: return ACT_Q8_K;
    case IQ1_S: case IQ1_M: case IQ2_XXS: case IQ2_XS: case IQ2_S: case IQ3_XXS: case IQ3_S: case IQ4_XS: case IQ3_XXS_T:
    case IQ3_S_T:
        return tables_ready ? ACT_Q8_K : -1;
    default: return -1;
    }
}

/* ---- activations: quantize_row_q8_K_ref ------------------------------------------------------- */

static void quantize_block(const float *x, uint8_t *out) {
    float amax = 0.f, top = 0.f;
    int8_t q[QK];
#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 m = _mm256_setzero_ps();
    for (int j = 0; j < QK; j += 8) m = _mm256_max_ps(m, _mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    h = _mm_max_ss(h, _mm_movehdup_ps(h));
    amax = _mm_cvtss_f32(h);
    for (int j = 0; j < QK && amax != 0.f; j += 8) {  /* the first value of that magnitude, as ggml's strict > keeps */
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), abs_mask),
                                                         _mm256_set1_ps(amax), _CMP_EQ_OQ));
        if (hit) { top = x[j + __builtin_ctz((unsigned)hit)]; break; }
    }
#else
    for (int j = 0; j < QK; j++) {
        const float ax = x[j] < 0 ? -x[j] : x[j];
        if (ax > amax) { amax = ax; top = x[j]; }
    }
#endif
    if (amax == 0.f) {
        memset(out, 0, Q8K_BYTES);
        return;
    }
    const float iscale = -127.f / top;
#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
    const __m256 vs = _mm256_set1_ps(iscale);
    const __m256i cap = _mm256_set1_epi32(127);
    for (int j = 0; j < QK; j += 32) {  /* cvtps rounds half to even, as ggml's 1.5 * 2^23 trick does */
        __m256i v[4];
        for (int k = 0; k < 4; k++)
            v[k] = _mm256_min_epi32(_mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + j + 8 * k), vs)), cap);
        const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
        _mm256_storeu_si256((__m256i *)(q + j), _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    }
#else
    for (int j = 0; j < QK; j++) {
        const long v = __builtin_lrintf(iscale * x[j]);  /* round half to even (the default rounding mode) */
        q[j] = (int8_t)(v < 127 ? v : 127);
    }
#endif
    int16_t bsums[16];
    for (int g = 0; g < 16; g++) {
        int s = 0;
        for (int l = 0; l < 16; l++) s += q[16 * g + l];
        bsums[g] = (int16_t)s;
    }
    const float d = 1.f / iscale;
    memcpy(out, &d, 4);
    memcpy(out + 4, q, QK);
    memcpy(out + 260, bsums, 32);
}

void dotk_quantize(int64_t act_type, const float *x, void *xq, int64_t n) {
    if (act_type != ACT_Q8_K) return;  /* the wrappers ask only for the format act_type names */
    for (int64_t i = 0; i < n / QK; i++) quantize_block(x + QK * i, (uint8_t *)xq + Q8K_BYTES * i);
}

/* ---- packed scales, shared by the paths --------------------------------------------------------- */

/* Q4_K / Q5_K: 12 bytes -> 8 six-bit scales (sc[0..7]) and 8 mins (sc[8..15]) */
static inline void scales_mins_k(const uint8_t *p, uint8_t out[16]) {
    const uint32_t a0 = u32_at(p), a1 = u32_at(p + 4), a2 = u32_at(p + 8);
    const uint32_t w[4] = {a0 & 0x3f3f3f3fu, (a2 & 0x0f0f0f0fu) | ((a0 >> 2) & 0x30303030u),
                           a1 & 0x3f3f3f3fu, ((a2 >> 4) & 0x0f0f0f0fu) | ((a1 >> 2) & 0x30303030u)};
    memcpy(out, w, 16);
}

/* Q3_K: 12 bytes -> 16 six-bit scales (still biased by 32): low 4 bits in bytes 0..7, high 2 in bytes 8..11 */
static inline void scales_q3k(const uint8_t *p, uint8_t out[16]) {
    const uint32_t a0 = u32_at(p), a1 = u32_at(p + 4), h = u32_at(p + 8), m4 = 0x0f0f0f0fu, m2 = 0x03030303u;
    const uint32_t w[4] = {(a0 & m4) | (h & m2) << 4, (a1 & m4) | ((h >> 2) & m2) << 4,
                           ((a0 >> 4) & m4) | ((h >> 4) & m2) << 4, ((a1 >> 4) & m4) | ((h >> 6) & m2) << 4};
    memcpy(out, w, 16);
}

/* IQ3_S / IQ4_XS: the 8 four-bit fields of 4 bytes, in order, one per byte */
static inline uint64_t nibbles8(uint32_t v) {
    uint64_t x = v;
    x = (x | x << 16) & 0x0000ffff0000ffffull;
    x = (x | x << 8) & 0x00ff00ff00ff00ffull;
    return (x | x << 4) & 0x0f0f0f0f0f0f0f0full;
}

/* IQ4_XS: the 8 two-bit fields of 16 bits, in order, one per byte */
static inline uint64_t crumbs8(uint16_t v) {
    uint64_t x = v;
    x = (x | x << 24) & 0x000000ff000000ffull;
    x = (x | x << 12) & 0x000f000f000f000full;
    return (x | x << 6) & 0x0303030303030303ull;
}

#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
static inline __m256i load256(const uint8_t *p) { return _mm256_loadu_si256((const __m256i *)p); }

static inline __m256i dup8_16(__m128i v8, int mins) {  /* 8 bytes (at byte 8 * mins) -> 16 uint16, each twice */
    const __m128i pick = _mm_add_epi8(_mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7), _mm_set1_epi8((char)(8 * mins)));
    return _mm256_cvtepu8_epi16(_mm_shuffle_epi8(v8, pick));
}

/* a Q8_K block's 8 sub-block sums (pairs of its bsums; |sum| <= 32 * 127: int16) */
static inline __m128i sub_block_sums8(const uint8_t *xb) {
    return _mm_hadd_epi16(_mm_loadu_si128((const __m128i *)(xb + 260)), _mm_loadu_si128((const __m128i *)(xb + 276)));
}

/* bytes 0..7: the 8 sub-block scales; 8..15: the 8 mins (scales_mins_k in one xmm) */
static inline __m128i q4k_scales_mins(const uint8_t *b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 4));  /* dwords a0, a1, a2 (and 4 quant bytes) */
    __m128i lo = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0));    /* a0, a2, a1, a2 >> 4: the low bits */
    lo = _mm_and_si128(_mm_srlv_epi32(lo, _mm_setr_epi32(0, 0, 0, 4)), _mm_setr_epi32(0x3f3f3f3f, 0x0f0f0f0f, 0x3f3f3f3f, 0x0f0f0f0f));
    const __m128i hi = _mm_and_si128(_mm_srli_epi32(_mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)), 2),
                                     _mm_setr_epi32(0, 0x30303030, 0, 0x30303030));  /* a0 >> 2, a1 >> 2: bits 4, 5 */
    return _mm_or_si128(lo, hi);
}

/* group g's two 16-value scales across a vector's int16 (group 2g's in the low lane, 2g + 1's in the high) from a
 * block's 16 (int16 h: group h) */
static inline __attribute__((always_inline)) __m256i group_scales(__m256i sc, int g) {
    const __m256i pick = _mm256_add_epi8(_mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3, 2, 3),
                                         _mm256_set1_epi8((char)(4 * (g % 4))));
    return _mm256_shuffle_epi8(g < 4 ? _mm256_permute2x128_si256(sc, sc, 0x00) : _mm256_permute2x128_si256(sc, sc, 0x11), pick);
}

/* Q3_K: the 16 scales - 32 as int16 (scales_q3k in registers: its stores read back as a vector stalled on store
 * forwarding), from the 12 bytes at b + 96 (read as the 16 at b + 92: inside the block) */
static inline __m256i q3k_scales16(const uint8_t *b) {
    const __m128i v = _mm_loadu_si128((const __m128i *)(b + 92));  /* dwords: quant bytes, a0, a1, h */
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 1)), h = _mm_shuffle_epi32(v, _MM_SHUFFLE(3, 3, 3, 3));
    const __m128i low = _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 4, 4)), _mm_set1_epi8(15));
    const __m128i high = _mm_slli_epi32(_mm_and_si128(_mm_srlv_epi32(h, _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3)), 4);
    return _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_or_si128(low, high), _mm_set1_epi8(32)));
}
#endif

/* ---- the IQ2 and IQ1 formats: 32 grid rows of 8 values a block, 16 scales ------------------------------------
 * llama.cpp's ggml_vec_dot_iq2_{xxs,xs,s}_q8_K: per block d_w * d_x * sum over 16 (or 32) values of (2s + 1) * the
 * integer dot of grid values carrying their signs with the activation quants, all times 0.125 (folded into d, exact).
 * ggml_vec_dot_iq1_{s,m}_q8_K: d_w * d_x * (sum (2s + 1) * grid . q + 0.125 * sum (2s + 1) * delta * (sum of q)),
 * grid values -1, 0, 1 and delta +-1 per row (IQ1_S: per 32 values): the same as (d_w / 8) * d_x * sum (2s + 1) *
 * (8 grid + delta) . q, whose values 8 g + delta (+-1, +-7, +-9) are whole, and whose float32 product rounds as
 * llama.cpp's (scaling by 8 is exact). Each format's bytes are read into one shape, which each path turns into its
 * SIGNED wblock (grid_wblock). */
typedef struct {
    const uint64_t *grid; /* the format's rows: 8 magnitudes (IQ2) or values -1, 0, 1 (IQ1, int8) each */
    const uint16_t *codes; /* the same rows as codes (code2_*; IQ1: NULL, its 2048 rows are looked up as they are) */
    uint64_t neg[4];      /* bit j of word c: value 64c + j is negative (IQ2), its row's delta is -1 (IQ1) */
    uint64_t scales[2];   /* byte g: the 16 values g's 2s + 1 */
    float d;              /* 0.125 * the block's d */
} grid_fields;

/* a sub-block's 32-bit sign mask (bit k: value k negative) from its four 7-bit pattern indices: each field
 * to its byte, and bit 7 of each byte its parity */
static inline uint32_t signs_xxs1(uint32_t a) {
    uint32_t f = (a & 0x7fu) | ((a << 1) & 0x7f00u) | ((a << 2) & 0x7f0000u) | ((a << 3) & 0x7f000000u);
    uint32_t p = f ^ (f >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    return f | (p & 0x01010101u) << 7;
}

/* the sign patterns of four 7-bit indices in bits 9..15 of four uint16 (IQ2_XS): as signs_xxs1, a byte each */
static inline uint32_t signs_xs4(uint64_t q4) {
    uint64_t f = (q4 >> 9) & 0x007f007f007f007full, p = f ^ (f >> 4);
    p ^= p >> 2;
    p ^= p >> 1;
    f |= (p & 0x0001000100010001ull) << 7;
    f = (f | f >> 8) & 0x0000ffff0000ffffull;
    return (uint32_t)(f | f >> 16);
}

/* 16 four-bit scales s (8 bytes, low nibble first) -> the 16 bytes 2s + 1, as two words */
static inline void odd_scales(const uint8_t *p, uint64_t out[2]) {
    for (int h = 0; h < 2; h++) out[h] = nibbles8(u32_at(p + 4 * h)) << 1 | 0x0101010101010101ull;
}

/* Each word below is built in a register and stored once, and each format's row indices are read from the block as
 * the paths look the rows up (grid_wblock: indices_* with AVX-512, row_* elsewhere), not stored between: a chain of
 * read-modify-writes of a word through memory, or a load of narrower stores, stalls on store forwarding. One Zen 4
 * core from DRAM at one token (2048 columns), through memory as first written -> scalar as below -> the IQ2 grids'
 * codes in registers (grid_wblock; IQ2_XXS's signs and scales as IQ3_XXS's), llama.cpp's vec_dot beside (GB/s):
 * IQ2_XXS 2.3 -> 1.7 -> 3.2 (3.5), IQ2_XS 1.2 -> 2.4 -> 3.3-3.7 (4.1), IQ2_S 1.1 -> 3.3 -> 3.5-3.8 (4.5), IQ1_S 1.3
 * -> 1.7 (2.8), IQ1_M 0.9 -> 1.7 (3.1). What is left: the scalar work on the other formats' fields, IQ1's 32 grid
 * lookups and their inserts (vpgatherdq was no faster), and the decoded block's round trip through the wblock form.
 * The IQ1 and IQ2 formats have one-token loops of their own ("IQ2_XXS at T = 1" with AVX-512 VNNI, "IQ1_S, IQ1_M
 * and the IQ2 formats at T = 1" with AVX2 and AVX-512): this form is their T > 1 tiles' and the other paths'. */
static inline unsigned row_iq2xxs(const uint8_t *b, int k) { return b[2 + 8 * (k / 4) + k % 4]; }
static inline unsigned row_iq2xs(const uint8_t *b, int k) { return u16_at(b + 2 + 2 * k) & 511u; }
static inline unsigned row_iq2s(const uint8_t *b, int k) { return b[2 + k] | ((b[66 + k / 4] >> (2 * (k % 4))) & 3u) << 8; }
static inline unsigned row_iq1s(const uint8_t *b, int k) { return b[2 + k] | ((u16_at(b + 34 + 2 * (k / 4)) >> (3 * (k % 4))) & 7u) << 8; }
static inline unsigned row_iq1m(const uint8_t *b, int k) { return b[k] | ((b[32 + k / 2] >> (4 * (k % 2))) & 7u) << 8; }

/* 8 groups of 32: 4 index bytes, then a uint32 of four 7-bit sign pattern indices and the group's scale (bits 28..31) */
static inline void fields_iq2xxs(const uint8_t *b, grid_fields *f) {
    f->d = 0.125f * f16_at(b);
    f->grid = grid2_xxs, f->codes = code2_xxs;
    for (int c = 0; c < 4; c++)  /* word c: groups 2c, 2c + 1 */
        f->neg[c] = signs_xxs1(u32_at(b + 6 + 16 * c)) | (uint64_t)signs_xxs1(u32_at(b + 14 + 16 * c)) << 32;
    for (int h = 0; h < 2; h++) {
        uint64_t sc = 0;
        for (int i = 0; i < 4; i++) sc |= (uint64_t)(2 * (u32_at(b + 6 + 8 * (4 * h + i)) >> 28) + 1) * 0x0101u << 16 * i;
        f->scales[h] = sc;
    }
}

/* 32 uint16: a 9-bit grid index and a 7-bit sign pattern index; then 16 scales as nibbles */
static inline void fields_iq2xs(const uint8_t *b, grid_fields *f) {
    f->d = 0.125f * f16_at(b);
    f->grid = grid2_xs, f->codes = code2_xs;
    for (int c = 0; c < 4; c++) f->neg[c] = signs_xs4(u64_at(b + 2 + 16 * c)) | (uint64_t)signs_xs4(u64_at(b + 10 + 16 * c)) << 32;
    odd_scales(b + 66, f->scales);
}

/* 32 index bytes, 32 sign bytes, 8 bytes of the indices' two high bits, 16 scales as nibbles */
static inline void fields_iq2s(const uint8_t *b, grid_fields *f) {
    f->d = 0.125f * f16_at(b);
    f->grid = grid2_s, f->codes = code2_s;
    for (int c = 0; c < 4; c++) f->neg[c] = u64_at(b + 34 + 8 * c);
    odd_scales(b + 74, f->scales);
}

/* IQ1_M's float16 d, whose 4 nibbles are the tops of its 4 scale words (at 48) */
static inline float iq1m_d(const uint8_t *b) {
    const uint64_t sc = u64_at(b + 48);
    const uint16_t d = (uint16_t)((sc >> 12 & 0x000f) | (sc >> 24 & 0x00f0) | (sc >> 36 & 0x0f00) | (sc >> 48 & 0xf000));
    return f16_at((const uint8_t *)&d);
}

/* 8 groups of 32: 32 index bytes, then 8 uint16: three high index bits per row, the group's scale (bits 12..14)
 * and its delta's sign (bit 15) */
static inline void fields_iq1s(const uint8_t *b, grid_fields *f) {
    f->d = 0.125f * f16_at(b);
    f->grid = grid1, f->codes = NULL;
    for (int c = 0; c < 4; c++)  /* word c: groups 2c, 2c + 1, each all one delta */
        f->neg[c] = (u16_at(b + 34 + 4 * c) >> 15) * 0x00000000ffffffffull | (u16_at(b + 36 + 4 * c) >> 15) * 0xffffffff00000000ull;
    for (int h = 0; h < 2; h++) {
        uint64_t sc = 0;
        for (int i = 0; i < 4; i++) sc |= (uint64_t)(2 * ((u16_at(b + 34 + 2 * (4 * h + i)) >> 12) & 7) + 1) * 0x0101u << 16 * i;
        f->scales[h] = sc;
    }
}

/* 32 index bytes; 16 bytes, a nibble per row: three high index bits and the row's delta's sign; 4 uint16 of 4 three-
 * bit scales each (per 16 values), whose top nibbles are the block's float16 d */
static inline void fields_iq1m(const uint8_t *b, grid_fields *f) {
    f->d = 0.125f * iq1m_d(b);
    f->grid = grid1, f->codes = NULL;
    for (int h = 0; h < 2; h++) {
        uint64_t sc = 0;
        for (int g = 0; g < 8; g++) sc |= (uint64_t)(2 * ((u16_at(b + 48 + 2 * (2 * h + g / 4)) >> (3 * (g % 4))) & 7) + 1) << 8 * g;
        f->scales[h] = sc;
    }
    for (int c = 0; c < 4; c++) {
        uint64_t neg = 0;
        for (int j = 0; j < 8; j++) {
            const int k = 8 * c + j;
            const unsigned nib = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
            neg |= (uint64_t)(nib >> 3) * 0xff << 8 * j;
        }
        f->neg[c] = neg;
    }
}

#if defined(DOTK_AVX512)
/* ==== AVX-512: a block is 4 vectors of 64 values; vector c holds groups 4c..4c+3, one per 128-bit lane ==== */

typedef struct {
    __m512i q[4], sc[4];  /* quants (unsigned, or |w| when SIGNED); each group's int16 scale across its lane */
    __mmask64 neg[4];     /* SIGNED: the negative values */
    __m512i negoff;       /* HAS_OFF: -offset * scale per group (int16) in the low half, zeros above */
    __m256i mn;           /* HAS_MIN: each group's min (int16) */
    __m256i s16;          /* each group's scale (int16): the tiles' copy */
    __m512 dd;            /* d in lanes 0..7; lanes 8..15: -dmin (HAS_MIN), else d */
} wblock;
typedef __m512 acc_t;     /* HAS_MIN: lanes 8..15 gather the mins' share; the row's dot is the sum of all lanes */
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline float acc_sum(acc_t a) { return _mm512_reduce_add_ps(a); }
/* lane r: the sum of a[r]'s lanes, for 16 rows at once (30 shuffles, against ~4 a row for acc_sum) */
static inline __m512 sums16(const __m512 a[16]) {
    __m512 w[8], x[4], y[2];
    for (int r = 0; r < 8; r++) w[r] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * r], a[2 * r + 1]), _mm512_unpackhi_ps(a[2 * r], a[2 * r + 1]));
    for (int r = 0; r < 4; r++) {  /* 128-bit lane L of x[r]: rows 4r..4r+3, each its lane L's sum */
        const __m512d lo = _mm512_castps_pd(w[2 * r]), hi = _mm512_castps_pd(w[2 * r + 1]);
        x[r] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)), _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
    }
    for (int r = 0; r < 2; r++) y[r] = _mm512_add_ps(_mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0x88), _mm512_shuffle_f32x4(x[2 * r], x[2 * r + 1], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xdd));
}
/* y[r] = the sum of acc[r] for r < rr <= 16; acc[rr..15] may be anything */
static inline void acc_store(acc_t acc[16], int64_t rr, float *y) {
    for (int64_t r = rr; r < 16; r++) acc[r] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(y, (__mmask16)((1u << rr) - 1u), sums16(acc));
}

static inline __m512i iota16(void) {  /* int16 0, 1, .., 31 */
    return _mm512_set_epi32(0x001f001e, 0x001d001c, 0x001b001a, 0x00190018, 0x00170016, 0x00150014, 0x00130012,
                            0x00110010, 0x000f000e, 0x000d000c, 0x000b000a, 0x00090008, 0x00070006, 0x00050004,
                            0x00030002, 0x00010000);
}
static inline __m512i iota32(void) { return _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); }
static inline __m512i lane16(int c) {  /* int16 lanes: which of the 16 groups each lane of vector c belongs to */
    return _mm512_add_epi16(_mm512_srli_epi16(iota16(), 3), _mm512_set1_epi16((short)(4 * c)));
}

static inline __m512i iota8(void) {  /* bytes 0, 1, .., 63 */
    return _mm512_set_epi64(0x3f3e3d3c3b3a3938ll, 0x3736353433323130ll, 0x2f2e2d2c2b2a2928ll, 0x2726252423222120ll,
                            0x1f1e1d1c1b1a1918ll, 0x1716151413121110ll, 0x0f0e0d0c0b0a0908ll, 0x0706050403020100ll);
}

static inline void spread_scales(wblock *w, __m256i s16) {
    w->s16 = s16;
    for (int c = 0; c < 4; c++) w->sc[c] = _mm512_permutexvar_epi16(lane16(c), _mm512_castsi256_si512(s16));
}

static inline __m512i halves(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
static inline __m512i dup256(const uint8_t *p) { return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512i shifts16(int lo, int hi) { return halves(_mm256_set1_epi16((short)lo), _mm256_set1_epi16((short)hi)); }
static inline __m512i bits8(int lo, int hi) { return halves(_mm256_set1_epi8((char)lo), _mm256_set1_epi8((char)hi)); }
static inline __m512 d_dmin(float d, float dmin) {
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castps_pd(_mm512_set1_ps(d)), _mm256_castps_pd(_mm256_set1_ps(-dmin)), 1));
}
static inline __m512i neg_off(__m256i s16, int offset) {
    return _mm512_zextsi256_si512(_mm256_mullo_epi16(s16, _mm256_set1_epi16((short)-offset)));
}

/* Q4_K's and Q5_K's shared head: d, dmin and the 8 six-bit sub-block scales and mins */
static inline void scales_mins_head(const uint8_t *b, wblock *w) {
    uint8_t sm[16];
    scales_mins_k(b + 4, sm);
    const __m128i v = _mm_loadu_si128((const __m128i *)sm);
    w->dd = d_dmin(f16_at(b), f16_at(b + 2));
    spread_scales(w, dup8_16(v, 0));
    w->mn = dup8_16(v, 1);
}

static inline void decode_q4k(const uint8_t *b, wblock *w) {
    scales_mins_head(b, w);
    const __m512i sh = shifts16(0, 4), m4 = _mm512_set1_epi8(15);
    for (int c = 0; c < 4; c++) w->q[c] = _mm512_and_si512(_mm512_srlv_epi16(dup256(b + 16 + 32 * c), sh), m4);
}

static inline void decode_q5k(const uint8_t *b, wblock *w) {
    scales_mins_head(b, w);
    const __m512i sh = shifts16(0, 4), m4 = _mm512_set1_epi8(15), qh = dup256(b + 16), five = _mm512_set1_epi8(16);
    for (int c = 0; c < 4; c++) {
        const __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(dup256(b + 48 + 32 * c), sh), m4);
        w->q[c] = _mm512_mask_add_epi8(lo, _mm512_test_epi8_mask(qh, bits8(1 << (2 * c), 1 << (2 * c + 1))), lo, five);
    }
}

static inline void decode_q6k(const uint8_t *b, wblock *w) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    w->dd = _mm512_set1_ps(f16_at(b + 208));
    spread_scales(w, s16);
    w->negoff = neg_off(s16, 32);
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {  /* 64 low-nibble bytes serve two vectors; the 2 high bits of each from qh */
        const __m512i ql = _mm512_loadu_si512(b + 64 * h), qh = dup256(b + 128 + 32 * h);
        w->q[2 * h] = _mm512_or_si512(_mm512_and_si512(ql, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, shifts16(4, 2)), m30));
        w->q[2 * h + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ql, 4), m4),
                                          _mm512_and_si512(_mm512_srlv_epi16(qh, shifts16(0, 2)), m30));
    }
}

static inline void decode_q2k(const uint8_t *b, wblock *w) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b));
    w->dd = d_dmin(f16_at(b + 80), f16_at(b + 82));
    spread_scales(w, _mm256_and_si256(v, _mm256_set1_epi16(15)));
    w->mn = _mm256_srli_epi16(v, 4);
    const __m512i m3 = _mm512_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m512i qs = dup256(b + 16 + 32 * h);
        w->q[2 * h] = _mm512_and_si512(_mm512_srlv_epi16(qs, shifts16(0, 2)), m3);
        w->q[2 * h + 1] = _mm512_and_si512(_mm512_srlv_epi16(qs, shifts16(4, 6)), m3);
    }
}

static inline void decode_q3k(const uint8_t *b, wblock *w) {
    const __m256i s16 = q3k_scales16(b);
    w->dd = _mm512_set1_ps(f16_at(b + 108));
    spread_scales(w, s16);
    w->negoff = neg_off(s16, 4);
    const __m512i m3 = _mm512_set1_epi8(3), four = _mm512_set1_epi8(4), hm = dup256(b);
    for (int h = 0; h < 2; h++) {
        const __m512i qs = dup256(b + 32 + 32 * h);
        for (int j = 0; j < 2; j++) {  /* vector 2h + j: 2-bit fields 2j, 2j + 1; high bit 4h + 2j (+1) of hmask */
            const __m512i lo = _mm512_and_si512(_mm512_srlv_epi16(qs, shifts16(4 * j, 4 * j + 2)), m3);
            const __mmask64 high = _mm512_test_epi8_mask(hm, bits8(1 << (4 * h + 2 * j), 1 << (4 * h + 2 * j + 1)));
            w->q[2 * h + j] = _mm512_mask_add_epi8(lo, high, lo, four);
        }
    }
}

/* One code plane of 64 grid entries: vpermi2b looks up 128 entries at once (index bits 0..6); the results for
 * entries 128.. (bit 7) and 256.. (bit 8) are blended in. Gathers cost 30+ cycles each on Zen 4 / 5. */
static inline __m512i code_plane(const uint8_t *table, int entries, __m512i idx, __mmask64 bit7, __mmask64 bit8) {
    const __m512i *t = (const __m512i *)table;
    __m512i r = _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(t[0], idx, t[1]), _mm512_permutex2var_epi8(t[2], idx, t[3]));
    if (entries == 512) {
        const __m512i h = _mm512_mask_blend_epi8(bit7, _mm512_permutex2var_epi8(t[4], idx, t[5]), _mm512_permutex2var_epi8(t[6], idx, t[7]));
        r = _mm512_mask_blend_epi8(bit8, r, h);
    }
    return r;
}

/* The 64 grid entries of a block (qs: their index bytes; ninth: bit 8 of each index) -> its 4 vectors: the
 * values' magnitudes (the SIGNED form: the decoder sets the signs in w->neg, and they go onto the activations).
 * The two code planes are unpacked into 4 nibbles per entry within 128-bit lanes, which leaves lane L of the q-th result holding positions 16L + 4q .. 16L + 4q + 3; the entries are first permuted so
 * that position to be entry 16q + 4L + s: then result q is values 64q .. 64q + 63 in order. */
static inline void grid_values(wblock *w, const uint8_t *codes, int entries, const uint8_t levels[16], __m512i qs,
                               __mmask64 ninth) {
    static const uint8_t order[64] __attribute__((aligned(64))) = {
        0, 1, 2, 3, 16, 17, 18, 19, 32, 33, 34, 35, 48, 49, 50, 51, 4, 5, 6, 7, 20, 21, 22, 23, 36, 37, 38, 39, 52, 53, 54, 55,
        8, 9, 10, 11, 24, 25, 26, 27, 40, 41, 42, 43, 56, 57, 58, 59, 12, 13, 14, 15, 28, 29, 30, 31, 44, 45, 46, 47, 60, 61, 62, 63};
    const __m512i perm = _mm512_load_si512(order), idx = _mm512_permutexvar_epi8(perm, qs);
    const __mmask64 bit7 = _mm512_movepi8_mask(idx);
    const __mmask64 bit8 = entries == 512 ? _mm512_movepi8_mask(_mm512_permutexvar_epi8(perm, _mm512_movm_epi8(ninth))) : 0;
    const __m512i lo = code_plane(codes, entries, idx, bit7, bit8), hi = code_plane(codes + entries, entries, idx, bit7, bit8);
    const __m512i values = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)levels));
    for (int h = 0; h < 2; h++) {  /* levels < 8: vpshufb reads a nibble's level from its low 4 bits, top bit clear */
        const __m512i c = h ? _mm512_unpackhi_epi8(lo, hi) : _mm512_unpacklo_epi8(lo, hi), c4 = _mm512_srli_epi16(c, 4);
        w->q[2 * h] = _mm512_shuffle_epi8(values, _mm512_unpacklo_epi8(c, c4));
        w->q[2 * h + 1] = _mm512_shuffle_epi8(values, _mm512_unpackhi_epi8(c, c4));
    }
}

/* IQ3_XXS's and IQ2_XXS's 8 sign and scale words (each: four 7-bit sign pattern indices, the group's scale in bits
 * 28..31) -> w's 16 scales (2s + 1) and 256 sign bits */
static inline void xxs_words(__m256i a, wblock *w) {
    __m256i s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(a, 28), 1), _mm256_set1_epi32(1));
    s = _mm256_or_si256(s, _mm256_slli_epi32(s, 16));  /* 2 * scale + 1 in both int16 halves: 16 group scales */
    spread_scales(w, s);
    /* the 32 seven-bit fields, a byte each (vpmultishiftqb), through the 128 patterns (vpermi2b): 256 sign bits
     * in value order; vector c's mask is bit v % 8 of byte 8c + v / 8 of them, spread by vpermb */
    const __m256i fields = _mm256_multishift_epi64_epi8(_mm256_set1_epi64x(0x352e2720150e0700ll), a);
    const __m512i patterns = _mm512_permutex2var_epi8(_mm512_load_si512(sign_table), _mm512_castsi256_si512(fields),
                                                      _mm512_load_si512(sign_table + 64));
    const __m512i byte = _mm512_srli_epi16(_mm512_and_si512(iota8(), _mm512_set1_epi8(0x38)), 3);
    const __m512i bit = _mm512_set1_epi64((long long)0x8040201008040201ull);
    for (int c = 0; c < 4; c++)
        w->neg[c] = _mm512_test_epi8_mask(_mm512_permutexvar_epi8(_mm512_add_epi8(byte, _mm512_set1_epi8((char)(8 * c))), patterns), bit);
}

static inline void decode_iq3xxs(const uint8_t *b, wblock *w) {
    w->dd = _mm512_set1_ps(0.25f * f16_at(b));
    xxs_words(_mm256_loadu_si256((const __m256i *)(b + 66)), w);
    grid_values(w, code_xxs[0], 256, levels_xxs, _mm512_loadu_si512(b + 2), 0);
}

/* an IQ3 block with 8 scales as nibbles (IQ3_S, IQ3_XXS_T, each 2s + 1), d_w * d_scale, its 256 signs in value
 * order (natural[c]: values 64c .. 64c + 63) and its grid's codes */
static inline void decode_iq3_nibbles(const uint8_t *b, uint32_t scales, float d_scale, const uint64_t natural[4],
                                      const uint8_t *codes, int entries, const uint8_t *levels, uint64_t ninth, wblock *w) {
    const __m128i sc = _mm_cvtsi64_si128((long long)nibbles8(scales));
    __m256i s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc));
    s16 = _mm256_add_epi16(_mm256_slli_epi16(s16, 1), _mm256_set1_epi16(1));
    w->dd = _mm512_set1_ps(d_scale * f16_at(b));
    spread_scales(w, s16);
    for (int c = 0; c < 4; c++) w->neg[c] = natural[c];  /* a bit per value */
    grid_values(w, codes, entries, levels, _mm512_loadu_si512(b + 2), ninth);
}

static inline void decode_iq3s(const uint8_t *b, wblock *w) {
    uint64_t natural[4];
    memcpy(natural, b + IQ3S_SIGNS_AT, IQ3S_SIGN_BYTES);
    decode_iq3_nibbles(b, u32_at(b + 106), 1.f, natural, code_s[0], 512, levels_s, u64_at(b + 66), w);
}

/* IQ3_S_T and IQ3_XXS_T without a copy in the file's layout: their signs put back in value order (cpu_iq3_t.h)
 * (through an IQ3_XXS copy, its 32 sign fields and then their patterns, IQ3_XXS_T at T = 2 ran at half IQ3_XXS's
 * rate) */
static inline void decode_iq3s_t(const uint8_t *b, wblock *w) {
    uint64_t natural[4];
    iq3s_t_signs(b, (uint8_t *)natural);
    decode_iq3_nibbles(b, u32_at(b + 106), 1.f, natural, code_s[0], 512, levels_s, u64_at(b + 66), w);
}

static inline void decode_iq3xxs_t(const uint8_t *b, wblock *w) {
    uint64_t natural[4];
    iq3xxs_t_signs(b, (uint8_t *)natural);
    decode_iq3_nibbles(b, u32_at(b + IQ3XXS_SCALES_AT), 0.25f, natural, code_xxs[0], 256, levels_xxs, 0, w);
}

static inline void decode_iq4xs(const uint8_t *b, wblock *w) {
    const uint64_t sc = nibbles8(u32_at(b + 4)) | crumbs8(u16_at(b + 2)) << 4;
    const __m128i s8 = _mm_sub_epi8(_mm_cvtsi64_si128((long long)sc), _mm_set1_epi8(32));
    w->dd = _mm512_set1_ps(f16_at(b));
    spread_scales(w, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8)));
    const __m512i kv = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)kvalues)), m4 = _mm512_set1_epi8(15);
    const long long f = 0x0004000400040004ll;  /* int16 shift counts: 4 in 128-bit lanes 1 and 3 */
    const __m512i sh = _mm512_set_epi64(f, f, 0, 0, f, f, 0, 0);
    for (int c = 0; c < 4; c++) {  /* 32 bytes: lanes = low nibbles of 0..15, high of 0..15, low of 16..31, high */
        const __m512i v = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 8 + 32 * c)));
        const __m512i nib = _mm512_and_si512(_mm512_srlv_epi16(_mm512_shuffle_i64x2(v, v, 0x50), sh), m4);
        const __m512i k = _mm512_shuffle_epi8(kv, nib);
        w->neg[c] = _mm512_movepi8_mask(k);
        w->q[c] = _mm512_abs_epi8(k);
    }
}

/* The 32 row indices of an IQ1 / IQ2 block as uint16 lanes, computed in registers: the low 8 bits from 32 bytes
 * (index_low), bits 8.. from `fields16` (uint16 lanes; index k: lane k / per, shifted right by bits * (k % per),
 * masked: index_high) */
static inline __m512i index_low(const uint8_t *p) { return _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)p)); }
static inline __m512i index_high(__m512i fields16, int per, int bits, unsigned mask) {
    __m512i lane = _mm512_srli_epi16(_mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14,
                                                      13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), per == 4 ? 2 : 1);
    const __m512i k = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16, 15, 14, 13, 12, 11, 10,
                                       9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i shift = _mm512_mullo_epi16(_mm512_and_si512(k, _mm512_set1_epi16((short)(per - 1))), _mm512_set1_epi16((short)bits));
    const __m512i v = _mm512_srlv_epi16(_mm512_permutexvar_epi16(lane, fields16), shift);
    return _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16((short)mask)), 8);
}
static inline __m512i indices_iq2xxs(const uint8_t *b) {  /* bytes 8 (k / 4) + k % 4 of the 64 after d */
    const __m512i pick = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                         0, 0, 59, 58, 57, 56, 51, 50, 49, 48, 43, 42, 41, 40, 35, 34, 33, 32, 27, 26, 25, 24, 19,
                                         18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    return _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi8(pick, _mm512_loadu_si512(b + 2))));
}
static inline __m512i indices_iq2xs(const uint8_t *b) { return _mm512_and_si512(_mm512_loadu_si512(b + 2), _mm512_set1_epi16(511)); }
static inline __m512i indices_iq2s(const uint8_t *b) {
    return _mm512_or_si512(index_low(b + 2), index_high(_mm512_cvtepu8_epi16(_mm256_castsi128_si256(_mm_loadl_epi64((const __m128i *)(b + 66)))), 4, 2, 3));
}
static inline __m512i indices_iq1s(const uint8_t *b) {
    return _mm512_or_si512(index_low(b + 2), index_high(_mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(b + 34))), 4, 3, 7));
}
static inline __m512i indices_iq1m(const uint8_t *b) {
    return _mm512_or_si512(index_low(b), index_high(_mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 32)))), 2, 4, 7));
}

/* 32 uint16 lanes of idx (< entries) -> table[idx] each: a vpermi2w per 64 entries, then blends by the index's
 * bits 6.. (a tree) */
static inline __attribute__((always_inline)) __m512i lookup16(const uint16_t *table, const int entries, __m512i idx) {
    const __m512i *t = (const __m512i *)table;
    __m512i r[32];
    int parts = entries / 64;
    for (int p = 0; p < parts; p++) r[p] = _mm512_permutex2var_epi16(t[2 * p], idx, t[2 * p + 1]);
    for (int bit = 6; parts > 1; bit++) {
        const __mmask32 high = _mm512_test_epi16_mask(idx, _mm512_set1_epi16((short)(1 << bit)));
        parts /= 2;
        for (int p = 0; p < parts; p++) r[p] = _mm512_mask_blend_epi16(high, r[2 * p], r[2 * p + 1]);
    }
    return r[0];
}

/* 32 rows' IQ2 codes (uint16 lanes) -> w's magnitudes: each code's 8 levels picked by vpmultishiftqb, looked up in
 * levels2 */
static inline void code_magnitudes(__m512i codes, wblock *w) {
    const __m512i levels = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i *)levels2));
    for (int c = 0; c < 4; c++) {
        const __m512i code64 = _mm512_cvtepu16_epi64(_mm512_extracti32x4_epi32(codes, c));  /* row 8c + j in qword j */
        const __m512i level = _mm512_and_si512(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x0e0c0a0806040200ll), code64),
                                               _mm512_set1_epi8(3));
        w->q[c] = _mm512_shuffle_epi8(levels, level);
    }
}

/* an IQ1 or IQ2 block (b), its fields (grid_fields, above) and its row indices (rows) -> the SIGNED form; ternary
 * (IQ1): the values 8 g + delta, from g's byte (0xff, 0, 1: its low nibble picks) in one of two tables by delta */
static inline __attribute__((always_inline)) void grid_wblock(const uint8_t *b, const grid_fields *f, __m512i (*rows)(const uint8_t *),
                                                              wblock *w, const int ternary, const int entries) {
    w->dd = _mm512_set1_ps(f->d);
    spread_scales(w, _mm256_cvtepu8_epi16(_mm_set_epi64x((long long)f->scales[1], (long long)f->scales[0])));
    if (codes_ok && entries <= 1024) {  /* the rows' codes looked up in registers (IQ1's 2048 entries: 32 lookups and
                                          * 31 blends, slower than the scalar loads below: 1.7 -> 0.6-0.9 GB/s a Zen 4
                                          * core) */
        code_magnitudes(lookup16(f->codes, entries, rows(b)), w);
        for (int c = 0; c < 4; c++) w->neg[c] = f->neg[c];
        return;
    }
    uint16_t r16[32] __attribute__((aligned(64)));  /* one store, read back a lane at a time */
    _mm512_store_si512(r16, rows(b));
    const uint64_t *g = f->grid;
    for (int c = 0; c < 4; c++) {
        const uint16_t *r = r16 + 8 * c;
        const __m512i v = _mm512_set_epi64((long long)g[r[7]], (long long)g[r[6]], (long long)g[r[5]], (long long)g[r[4]],
                                           (long long)g[r[3]], (long long)g[r[2]], (long long)g[r[1]], (long long)g[r[0]]);
        if (ternary) {
            const __m512i nib = _mm512_and_si512(v, _mm512_set1_epi8(15));
            const __m512i plus = _mm512_broadcast_i32x4(_mm_setr_epi8(1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -7));
            const __m512i minus = _mm512_broadcast_i32x4(_mm_setr_epi8(-1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -9));
            const __m512i x = _mm512_mask_blend_epi8(f->neg[c], _mm512_shuffle_epi8(plus, nib), _mm512_shuffle_epi8(minus, nib));
            w->q[c] = _mm512_abs_epi8(x);
            w->neg[c] = _mm512_movepi8_mask(x);
        } else {
            w->q[c] = v;
            w->neg[c] = f->neg[c];
        }
    }
}

static inline __m512i dot_pairs(__m512i acc, __m512i p16, __m512i sc) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, p16, sc);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(p16, sc));
#endif
}

/* acc += this block times one activation block x (Q8_K) */
static inline __attribute__((always_inline)) acc_t apply_block(const wblock *w, const uint8_t *x, acc_t acc, int kind, int packed) {
    const int qs_at = packed ? PACKED_QS : 4, bs_at = packed ? PACKED_BSUMS : 260, d_at = packed ? PACKED_D : 0;
    __m512i p[4];
    for (int c = 0; c < 4; c++) {
        __m512i a = _mm512_loadu_si512(x + qs_at + 64 * c);
        if (kind & SIGNED) a = _mm512_mask_sub_epi8(a, w->neg[c], _mm512_setzero_si512(), a);
        p[c] = _mm512_maddubs_epi16(w->q[c], a);
    }
    /* two short chains, not one of four: the tokens' iterations overlap */
    __m512i s = _mm512_add_epi32(dot_pairs(_mm512_madd_epi16(p[0], w->sc[0]), p[2], w->sc[2]),
                                 dot_pairs(_mm512_madd_epi16(p[1], w->sc[1]), p[3], w->sc[3]));
    const __m256i bsums = _mm256_loadu_si256((const __m256i *)(x + bs_at));
    if (kind & HAS_OFF) s = dot_pairs(s, _mm512_zextsi256_si512(bsums), w->negoff);
    if (kind & HAS_MIN) {  /* the 16 lanes folded to 8, the mins' 8 sums beside them: one convert, one fma */
        const __m256i s8 = _mm256_add_epi32(_mm512_castsi512_si256(s), _mm512_extracti64x4_epi64(s, 1));
        s = _mm512_inserti64x4(_mm512_castsi256_si512(s8), _mm256_madd_epi16(bsums, w->mn), 1);
    }
    return _mm512_fmadd_ps(_mm512_mul_ps(w->dd, _mm512_set1_ps(f32_at(x + d_at))), _mm512_cvtepi32_ps(s), acc);
}

#elif defined(DOTK_AVX2)
/* ==== AVX2: a block is 8 vectors of 32 values; vector c holds groups 2c (low lane) and 2c + 1 (high lane) ==== */

typedef struct {
    __m256i q[8], sc[8];  /* quants (unsigned, or |w| when SIGNED); each group's int16 scale across its lane */
    __m256i sg[8];        /* SIGNED: the signed values (never 0), whose signs go onto the activations */
    __m256i off, mn;      /* per group: offset * scale, and min (int16), against the bsums */
    __m256i s16;          /* the 16 group scales (int16), for the row tiles */
    float d, dmin;
} wblock;
typedef __m256 acc_t;
static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }
static inline float acc_sum(acc_t a) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}
static inline void acc_store(acc_t acc[16], int64_t rr, float *y) { for (int64_t r = 0; r < rr; r++) y[r] = acc_sum(acc[r]); }

static inline void spread_scales(wblock *w, __m256i s16) {
    w->s16 = s16;
    for (int c = 0; c < 8; c++) w->sc[c] = group_scales(s16, c);  /* group 2c across the low lane, 2c + 1 the high */
}

/* bit `from` of each byte moved to bit `to` (all other bits cleared) */
static inline __m256i move_bit(__m256i v, int from, int to) {
    const __m256i b = _mm256_and_si256(v, _mm256_set1_epi8((char)(1 << from)));
    return from < to ? _mm256_slli_epi16(b, to - from) : from > to ? _mm256_srli_epi16(b, from - to) : b;
}

/* Q4_K's and Q5_K's shared head: d, dmin and the 8 six-bit sub-block scales and mins */
static inline void scales_mins_head(const uint8_t *b, wblock *w) {
    uint8_t sm[16];
    scales_mins_k(b + 4, sm);
    const __m128i v = _mm_loadu_si128((const __m128i *)sm);
    w->d = f16_at(b), w->dmin = f16_at(b + 2);
    spread_scales(w, dup8_16(v, 0));
    w->mn = dup8_16(v, 1);
}

static inline void decode_q4k(const uint8_t *b, wblock *w) {
    scales_mins_head(b, w);
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int j = 0; j < 4; j++) {
        const __m256i qs = load256(b + 16 + 32 * j);
        w->q[2 * j] = _mm256_and_si256(qs, m4);
        w->q[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m4);
    }
}

static inline void decode_q5k(const uint8_t *b, wblock *w) {
    scales_mins_head(b, w);
    const __m256i m4 = _mm256_set1_epi8(15), qh = load256(b + 16);
    for (int j = 0; j < 4; j++) {
        const __m256i qs = load256(b + 48 + 32 * j);
        w->q[2 * j] = _mm256_or_si256(_mm256_and_si256(qs, m4), move_bit(qh, 2 * j, 4));
        w->q[2 * j + 1] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 4), m4), move_bit(qh, 2 * j + 1, 4));
    }
}

static inline void decode_q6k(const uint8_t *b, wblock *w) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    w->d = f16_at(b + 208);
    spread_scales(w, s16);
    w->off = _mm256_slli_epi16(s16, 5);
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = load256(b + 64 * h), l1 = load256(b + 64 * h + 32), qh = load256(b + 128 + 32 * h);
        w->q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30));
        w->q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30));
        w->q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30));
        w->q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                          _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30));
    }
}

static inline void decode_q2k(const uint8_t *b, wblock *w) {
    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)b));
    w->d = f16_at(b + 80), w->dmin = f16_at(b + 82);
    spread_scales(w, _mm256_and_si256(v, _mm256_set1_epi16(15)));
    w->mn = _mm256_srli_epi16(v, 4);
    const __m256i m3 = _mm256_set1_epi8(3);
    for (int h = 0; h < 2; h++) {
        const __m256i qs = load256(b + 16 + 32 * h);
        w->q[4 * h + 0] = _mm256_and_si256(qs, m3);
        w->q[4 * h + 1] = _mm256_and_si256(_mm256_srli_epi16(qs, 2), m3);
        w->q[4 * h + 2] = _mm256_and_si256(_mm256_srli_epi16(qs, 4), m3);
        w->q[4 * h + 3] = _mm256_and_si256(_mm256_srli_epi16(qs, 6), m3);
    }
}

static inline void decode_q3k(const uint8_t *b, wblock *w) {
    const __m256i s16 = q3k_scales16(b);
    w->d = f16_at(b + 108);
    spread_scales(w, s16);
    w->off = _mm256_slli_epi16(s16, 2);
    const __m256i m3 = _mm256_set1_epi8(3), hm = load256(b);
    for (int h = 0; h < 2; h++) {
        const __m256i qs = load256(b + 32 + 32 * h);
        for (int s2 = 0; s2 < 4; s2++)
            w->q[4 * h + s2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(qs, 2 * s2), m3), move_bit(hm, 4 * h + s2, 2));
    }
}

/* a 32-bit mask (bit k: value k negative) -> 32 bytes, 0xff where negative */
static inline __m256i sign_bytes(uint32_t m) {
    const __m256i pick = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i bit = _mm256_set1_epi64x((long long)0x8040201008040201ull);
    return _mm256_cmpeq_epi8(_mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)m), pick), bit), bit);
}

/* 8 grid entries (32 values) by index: offset + value, offset - value where negative */
static inline __m256i signed_grid(const uint32_t *grid, const uint32_t idx[8], uint32_t neg, int offset) {
    /* scalar loads packed in registers: vpgatherdd costs 30+ cycles on Zen 4 / 5 (and is slowed on Intel by the
     * Downfall fix), a trip through memory stalls (8 narrow stores cannot forward to one wide load) */
    const __m256i g = _mm256_setr_epi32((int)grid[idx[0]], (int)grid[idx[1]], (int)grid[idx[2]], (int)grid[idx[3]],
                                        (int)grid[idx[4]], (int)grid[idx[5]], (int)grid[idx[6]], (int)grid[idx[7]]);
    const __m256i o = _mm256_set1_epi8((char)offset);
    return _mm256_blendv_epi8(_mm256_add_epi8(o, g), _mm256_sub_epi8(o, g), sign_bytes(neg));
}

static inline void decode_iq3xxs(const uint8_t *b, wblock *w) {
    const __m256i a = load256(b + 66);
    __m256i s = _mm256_add_epi32(_mm256_slli_epi32(_mm256_srli_epi32(a, 28), 1), _mm256_set1_epi32(1));
    s = _mm256_or_si256(s, _mm256_slli_epi32(s, 16));
    w->d = 0.25f * f16_at(b);
    spread_scales(w, s);
    w->off = _mm256_mullo_epi16(s, _mm256_set1_epi16(OFFSET_XXS));
    for (int c = 0; c < 8; c++) {
        uint32_t idx[8];
        for (int k = 0; k < 8; k++) idx[k] = b[2 + 8 * c + k];
        w->q[c] = signed_grid(grid_xxs, idx, signs_xxs1(u32_at(b + 66 + 4 * c)), OFFSET_XXS);
    }
}

static inline void decode_iq3s(const uint8_t *b, wblock *w) {
    const __m128i sc = _mm_cvtsi64_si128((long long)nibbles8(u32_at(b + 106)));
    __m256i s16 = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(sc, sc));
    s16 = _mm256_add_epi16(_mm256_slli_epi16(s16, 1), _mm256_set1_epi16(1));
    w->d = f16_at(b);
    spread_scales(w, s16);
    w->off = _mm256_mullo_epi16(s16, _mm256_set1_epi16(OFFSET_S));
    for (int c = 0; c < 8; c++) {
        uint32_t idx[8];
        const unsigned qh = b[66 + c];
        for (int k = 0; k < 8; k++) idx[k] = b[2 + 8 * c + k] | ((qh >> k) & 1u) << 8;
        w->q[c] = signed_grid(grid_s, idx, u32_at(b + 74 + 4 * c), OFFSET_S);
    }
}

static inline void decode_iq4xs(const uint8_t *b, wblock *w) {
    const uint64_t sc = nibbles8(u32_at(b + 4)) | crumbs8(u16_at(b + 2)) << 4;
    const __m128i s8 = _mm_sub_epi8(_mm_cvtsi64_si128((long long)sc), _mm_set1_epi8(32));
    w->d = f16_at(b);
    spread_scales(w, _mm256_cvtepi8_epi16(_mm_unpacklo_epi8(s8, s8)));
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues)), m4 = _mm256_set1_epi8(15);
    for (int c = 0; c < 8; c++) {  /* 16 bytes: low nibbles are values 0..15, high nibbles 16..31 */
        const __m128i v = _mm_loadu_si128((const __m128i *)(b + 8 + 16 * c));
        const __m256i k = _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(v, 4), v), m4));
        w->sg[c] = k;
        w->q[c] = _mm256_abs_epi8(k);
    }
}

/* an IQ1 or IQ2 block, its fields and row indices (grid_fields, above) -> the SIGNED form (ternary: as AVX-512's) */
static inline __attribute__((always_inline)) void grid_wblock(const uint8_t *b, const grid_fields *f, unsigned (*row)(const uint8_t *, int),
                                                              wblock *w, const int ternary, const int entries) {
    (void)entries;
    w->d = f->d;
    spread_scales(w, _mm256_cvtepu8_epi16(_mm_set_epi64x((long long)f->scales[1], (long long)f->scales[0])));
    const uint64_t *g = f->grid;
    for (int c = 0; c < 8; c++) {
        const int k = 4 * c;
        const __m256i v = _mm256_set_epi64x((long long)g[row(b, k + 3)], (long long)g[row(b, k + 2)], (long long)g[row(b, k + 1)],
                                            (long long)g[row(b, k)]);
        const __m256i neg = sign_bytes((uint32_t)(f->neg[c / 2] >> 32 * (c % 2)));
        if (ternary) {
            const __m256i nib = _mm256_and_si256(v, _mm256_set1_epi8(15));
            const __m256i plus = _mm256_broadcastsi128_si256(_mm_setr_epi8(1, 9, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -7));
            const __m256i minus = _mm256_broadcastsi128_si256(_mm_setr_epi8(-1, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, -9));
            const __m256i x = _mm256_blendv_epi8(_mm256_shuffle_epi8(plus, nib), _mm256_shuffle_epi8(minus, nib), neg);
            w->q[c] = _mm256_abs_epi8(x);
            w->sg[c] = x;
        } else {
            w->q[c] = v;
            w->sg[c] = _mm256_blendv_epi8(v, _mm256_sub_epi8(_mm256_setzero_si256(), v), neg);
        }
    }
}

/* a token's integer sum s of one block -> acc (the offset's and the mins' shares taken here) */
static inline __attribute__((always_inline)) acc_t finish_block(const wblock *w, const uint8_t *x, __m256i s, acc_t acc, int kind, int packed) {
    const int bs_at = packed ? PACKED_BSUMS : 260, d_at = packed ? PACKED_D : 0;
    const __m256i bsums = load256(x + bs_at);
    const __m256 dx = _mm256_set1_ps(f32_at(x + d_at));
    if (kind & HAS_OFF) s = _mm256_sub_epi32(s, _mm256_madd_epi16(bsums, w->off));
    if (kind & HAS_MIN) {
        const __m256 mins = _mm256_mul_ps(_mm256_set1_ps(w->dmin), _mm256_cvtepi32_ps(_mm256_madd_epi16(bsums, w->mn)));
        acc = _mm256_fmadd_ps(dx, _mm256_fmsub_ps(_mm256_set1_ps(w->d), _mm256_cvtepi32_ps(s), mins), acc);
    } else {
        acc = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(w->d), dx), _mm256_cvtepi32_ps(s), acc);
    }
    return acc;
}

static inline __attribute__((always_inline)) acc_t apply_block(const wblock *w, const uint8_t *x, acc_t acc, int kind, int packed) {
    const int qs_at = packed ? PACKED_QS : 4;
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        __m256i a = load256(x + qs_at + 32 * c);
        if (kind & SIGNED) a = _mm256_sign_epi8(a, w->sg[c]);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(w->q[c], a), w->sc[c]));
    }
    return finish_block(w, x, s, acc, kind, packed);
}

/* two tokens' blocks at once: the decoded block (which lives on the stack: AVX2 has 16 registers) read once for
 * both; each token's operations as apply_block's, so the same bits */
#define APPLY_PAIR 1
static inline __attribute__((always_inline)) void apply_pair(const wblock *w, const uint8_t *x0, const uint8_t *x1, acc_t *a0,
                                                             acc_t *a1, int kind, int packed) {
    const int qs_at = packed ? PACKED_QS : 4;
    __m256i s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {
        const __m256i q = w->q[c], sc = w->sc[c];
        __m256i a = load256(x0 + qs_at + 32 * c), b = load256(x1 + qs_at + 32 * c);
        if (kind & SIGNED) a = _mm256_sign_epi8(a, w->sg[c]), b = _mm256_sign_epi8(b, w->sg[c]);
        s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(q, a), sc));
        s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(q, b), sc));
    }
    *a0 = finish_block(w, x0, s0, *a0, kind, packed);
    *a1 = finish_block(w, x1, s1, *a1, kind, packed);
}

#else
/* ==== portable scalar: the decoded block in memory ==== */

typedef struct {
    uint8_t q[QK];      /* unsigned quants; SIGNED: int8 values */
    int32_t sc[16], off[16], mn[16];
    float d, dmin;
} wblock;
typedef float acc_t;
static inline acc_t acc_zero(void) { return 0.f; }
static inline float acc_sum(acc_t a) { return a; }
static inline void acc_store(acc_t acc[16], int64_t rr, float *y) { for (int64_t r = 0; r < rr; r++) y[r] = acc_sum(acc[r]); }

static inline void set_pairs(int32_t *dst, const uint8_t *v8) {  /* 8 sub-block values -> 16 groups */
    for (int g = 0; g < 16; g++) dst[g] = v8[g / 2];
}

/* Q4_K's and Q5_K's shared head: d, dmin and the 8 six-bit sub-block scales and mins */
static inline void scales_mins_head(const uint8_t *b, wblock *w) {
    uint8_t sm[16];
    scales_mins_k(b + 4, sm);
    w->d = f16_at(b), w->dmin = f16_at(b + 2);
    set_pairs(w->sc, sm);
    set_pairs(w->mn, sm + 8);
}

static inline void decode_q4k(const uint8_t *b, wblock *w) {
    scales_mins_head(b, w);
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++) w->q[32 * j + l] = (b[16 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15;
}

static inline void decode_q5k(const uint8_t *b, wblock *w) {
    scales_mins_head(b, w);
    for (int j = 0; j < 8; j++)
        for (int l = 0; l < 32; l++)
            w->q[32 * j + l] = (uint8_t)(((b[48 + 32 * (j / 2) + l] >> (4 * (j % 2))) & 15) | ((b[16 + l] >> j) & 1) << 4);
}

static inline void decode_q6k(const uint8_t *b, wblock *w) {
    w->d = f16_at(b + 208);
    for (int g = 0; g < 16; g++) w->sc[g] = (int8_t)b[192 + g], w->off[g] = 32 * w->sc[g];
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++)
                w->q[128 * h + 32 * s + l] = (uint8_t)(((b[64 * h + 32 * (s % 2) + l] >> (4 * (s / 2))) & 15) |
                                                       ((b[128 + 32 * h + l] >> (2 * s)) & 3) << 4);
}

static inline void decode_q2k(const uint8_t *b, wblock *w) {
    w->d = f16_at(b + 80), w->dmin = f16_at(b + 82);
    for (int g = 0; g < 16; g++) w->sc[g] = b[g] & 15, w->mn[g] = b[g] >> 4;
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++) w->q[128 * h + 32 * s + l] = (b[16 + 32 * h + l] >> (2 * s)) & 3;
}

static inline void decode_q3k(const uint8_t *b, wblock *w) {
    uint8_t s16[16];
    scales_q3k(b + 96, s16);
    w->d = f16_at(b + 108);
    for (int g = 0; g < 16; g++) w->sc[g] = (int32_t)s16[g] - 32, w->off[g] = 4 * w->sc[g];
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int l = 0; l < 32; l++)
                w->q[128 * h + 32 * s + l] = (uint8_t)(((b[32 + 32 * h + l] >> (2 * s)) & 3) | ((b[l] >> (4 * h + s)) & 1) << 2);
}

static inline void put_grid(uint8_t *q, uint32_t entry, unsigned neg4, int offset) {  /* 4 values of a grid row */
    for (int k = 0; k < 4; k++) {
        const int v = (entry >> (8 * k)) & 255;
        q[k] = (uint8_t)(neg4 >> k & 1 ? offset - v : offset + v);
    }
}

static inline void decode_iq3xxs(const uint8_t *b, wblock *w) {
    w->d = 0.25f * f16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t a = u32_at(b + 66 + 4 * ib);
        w->sc[2 * ib] = w->sc[2 * ib + 1] = 2 * (int32_t)(a >> 28) + 1;
        w->off[2 * ib] = w->off[2 * ib + 1] = OFFSET_XXS * w->sc[2 * ib];
        for (int k = 0; k < 4; k++) {
            const unsigned signs = sign_pattern((a >> (7 * k)) & 127);
            put_grid(w->q + 32 * ib + 8 * k, grid_xxs[b[2 + 8 * ib + 2 * k]], signs & 15, OFFSET_XXS);
            put_grid(w->q + 32 * ib + 8 * k + 4, grid_xxs[b[2 + 8 * ib + 2 * k + 1]], signs >> 4, OFFSET_XXS);
        }
    }
}

static inline void decode_iq3s(const uint8_t *b, wblock *w) {
    w->d = f16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        w->sc[2 * ib] = w->sc[2 * ib + 1] = 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 15) + 1;
        w->off[2 * ib] = w->off[2 * ib + 1] = OFFSET_S * w->sc[2 * ib];
    }
    for (int i = 0; i < 64; i++)
        put_grid(w->q + 4 * i, grid_s[b[2 + i] | ((b[66 + i / 8] >> (i % 8)) & 1) << 8], (b[74 + i / 2] >> (4 * (i % 2))) & 15, OFFSET_S);
}

static inline void decode_iq4xs(const uint8_t *b, wblock *w) {
    const uint64_t sc = nibbles8(u32_at(b + 4)) | crumbs8(u16_at(b + 2)) << 4;
    w->d = f16_at(b);
    for (int g = 0; g < 16; g++) w->sc[g] = (int32_t)((sc >> (8 * (g / 2))) & 63) - 32;
    for (int ib = 0; ib < 8; ib++)
        for (int l = 0; l < 16; l++) {
            w->q[32 * ib + l] = (uint8_t)kvalues[b[8 + 16 * ib + l] & 15];
            w->q[32 * ib + 16 + l] = (uint8_t)kvalues[b[8 + 16 * ib + l] >> 4];
        }
}

/* an IQ1 or IQ2 block, its fields and row indices (grid_fields, above) -> the SIGNED form: int8 values (ternary:
 * 8 g + delta) */
static inline void grid_wblock(const uint8_t *b, const grid_fields *f, unsigned (*row)(const uint8_t *, int), wblock *w,
                               const int ternary, const int entries) {
    (void)entries;
    w->d = f->d;
    for (int g = 0; g < 16; g++) w->sc[g] = (int32_t)(f->scales[g / 8] >> 8 * (g % 8) & 255);
    for (int v = 0; v < QK; v++) {
        const int m = (int)(f->grid[row(b, v / 8)] >> (8 * (v % 8)) & 255), neg = (int)(f->neg[v / 64] >> (v % 64) & 1);
        w->q[v] = (uint8_t)(int8_t)(ternary ? 8 * (int8_t)m + (neg ? -1 : 1) : neg ? -m : m);
    }
}

static inline __attribute__((always_inline)) acc_t apply_block(const wblock *w, const uint8_t *x, acc_t acc, int kind, int packed) {
    const int qs_at = packed ? PACKED_QS : 4, bs_at = packed ? PACKED_BSUMS : 260, d_at = packed ? PACKED_D : 0;
    const int8_t *a = (const int8_t *)(x + qs_at);
    int16_t bsums[16];
    memcpy(bsums, x + bs_at, 32);
    int32_t sum = 0, mins = 0;
    for (int g = 0; g < 16; g++) {
        int32_t s = 0;
        if (kind & SIGNED) for (int l = 0; l < 16; l++) s += (int8_t)w->q[16 * g + l] * a[16 * g + l];
        else for (int l = 0; l < 16; l++) s += w->q[16 * g + l] * a[16 * g + l];
        sum += w->sc[g] * s;
        if (kind & HAS_OFF) sum -= w->off[g] * bsums[g];
        if (kind & HAS_MIN) mins += w->mn[g] * bsums[g];
    }
    const float dx = f32_at(x + d_at);
    acc += (w->d * dx) * (float)sum;
    if (kind & HAS_MIN) acc -= (w->dmin * dx) * (float)mins;
    return acc;
}
#endif

/* ---- rows: each weight block decoded once, applied to up to TILE activation rows ----------------------- */
#if !defined(APPLY_PAIR) /* the other paths: a token at a time */
#define APPLY_PAIR 0
static inline void apply_pair(const wblock *w, const uint8_t *x0, const uint8_t *x1, acc_t *a0, acc_t *a1, int kind, int packed) {
    (void)w, (void)x0, (void)x1, (void)a0, (void)a1, (void)kind, (void)packed;
}
#endif


/* ---- one token: four streams -----------------------------------------------------------------------------
 * A gemv reads each weight byte once, so it runs at the rate the memory system streams rows to a core, and one
 * stream a thread (the rows in turn) leaves part of that rate unused: on the Intel development host, 2 threads
 * of the read probe read 24-25 GB/s as one prefetched stream each and 28-30 as four (cpu_kernels.c). So a call's
 * rows are cut in four quarters, and the format's `four` reads row j of each quarter together, block by block,
 * each row into its own sum (`one`: a row alone, where the last quarter is shorter); 16 rows' sums of a quarter
 * are folded at once. Where a format's decoding takes more registers than four rows leave, `four` reads its rows
 * two at a time (STREAMED's `together`): four at once lost (IQ3_S 19.4 -> 17.5 GB/s, Q5_K 17.3 -> 16.5), two
 * gained (C harness, 256 KiB granules: IQ3_S 17.5-18.3 -> 21.5, IQ3_XXS 18.4 -> 19.8-20.4); where even two
 * lost (AVX2: IQ3_S, the generic loop), no `four`: one stream, the rows in turn.
 * A row's sum is the same either way (its blocks in order into its own accumulator): the order of the rows
 * changes what is read when, not what is computed. Q4_K [1536, 2048] from DRAM, 2 threads in the pool's 64 KiB
 * granules, interleaved: 22.1 -> 24.0 GB/s (rows by quarters but each row alone: 22.3, no gain). `four` takes a
 * group's rows of all four quarters in one call (count <= 16, row r of quarter s from row[s] + r * row_bytes into
 * sum[s][r]), so its tables and constants are loaded once a group, not once a row: rows of 2 blocks (a 512-wide
 * down projection) were 10-16% slower a byte than rows of 8 (C harness from L1, n = 512: Q4_K 21.8 -> 25.4 GB/s,
 * IQ3_S 11.1 -> 12.0; `deep`'s IQ3_S decode 70-73.5 -> 74-76 tok/s). */
typedef void (*four_rows_fn)(const uint8_t *const row[4], int64_t count, int64_t row_bytes, int64_t blocks,
                             const uint8_t *x, acc_t sum[4][16]);
typedef acc_t (*one_row_fn)(const uint8_t *row, int64_t blocks, const uint8_t *x);

static void four_streams(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const uint8_t *x, float *y,
                         four_rows_fn four, one_row_fn one) {
    const int64_t quarter = four != NULL ? (rows + 3) / 4 : rows, blocks = n / QK;  /* s: [s * quarter, (s + 1) * quarter) */
    /* each quarter's start (C harness, 256 KiB granules from DRAM: IQ3_S 1 thread 11.4 -> 11.9 GB/s, 2 threads
     * 23.1 -> 23.6, n = 512 21.2 -> 21.9; Q4_K within noise; `deep` IQ3_S decode, 3 rounds alternating, 768
     * tokens: 9.88 -> 9.63 s) */
    for (int s = 0; s < (four != NULL ? 4 : 1); s++) stream_start(w + s * quarter * row_bytes, quarter * row_bytes);
    for (int64_t j0 = 0; j0 < quarter; j0 += 16) {
        acc_t sums[4][16];
        int64_t rr[4];  /* rows of this group of 16 in each quarter: rr[0] >= rr[1] >= rr[2] >= rr[3] */
        for (int s = 0; s < 4; s++) {
            const int64_t end = (s + 1) * quarter < rows ? (s + 1) * quarter : rows, left = end - (s * quarter + j0);
            rr[s] = left < 0 ? 0 : left < 16 ? left : 16;
        }
        if (rr[3] > 0) {
            const uint8_t *const row[4] = {w + j0 * row_bytes, w + (quarter + j0) * row_bytes,
                                           w + (2 * quarter + j0) * row_bytes, w + (3 * quarter + j0) * row_bytes};
            four(row, rr[3], row_bytes, blocks, x, sums);
        }
        for (int64_t r = rr[3]; r < rr[0]; r++)
            for (int s = 0; s < 4 && r < rr[s]; s++) sums[s][r] = one(w + (s * quarter + j0 + r) * row_bytes, blocks, x);
        for (int s = 0; s < 4; s++)
            if (rr[s] > 0) acc_store(sums[s], rr[s], y + s * quarter + j0);
    }
}

/* name_one (and with STREAMED name_four: four_streams) from a format's block step: step(block, its activations,
 * &sum) adds one block into a sum_t (init: zero), finish(sum) gives the row's acc_t */
#define ONE_ROW(name, bytes, x_bytes, sum_t, init, step, finish)                                                      \
    static acc_t name##_one(const uint8_t *row, int64_t blocks, const uint8_t *x) {                                  \
        sum_t sum = init;                                                                                            \
        for (int64_t i = 0; i < blocks; i++) step(row + (bytes) * i, x + (x_bytes) * i, &sum);                       \
        return finish(sum);                                                                                          \
    }
#define STREAMED(name, together, bytes, x_bytes, sum_t, init, step, finish)                                           \
    ONE_ROW(name, bytes, x_bytes, sum_t, init, step, finish)                                                         \
    static void name##_four(const uint8_t *const row[4], int64_t count, int64_t row_bytes, int64_t blocks,           \
                            const uint8_t *x, acc_t out[4][16]) {                                                    \
        for (int64_t r = 0; r < count; r++) {                                                                        \
            for (int h = 0; h < 4; h += (together)) { /* `together` rows at a time: 4, or 2 where 4 spill registers */\
                sum_t sum[together];                                                                                 \
                for (int s = 0; s < (together); s++) sum[s] = init;                                                  \
                for (int64_t i = 0; i < blocks; i++)                                                                 \
                    for (int s = 0; s < (together); s++)                                                             \
                        step(row[h + s] + r * row_bytes + (bytes) * i, x + (x_bytes) * i, &sum[s]);                  \
                for (int s = 0; s < (together); s++) out[h + s][r] = finish(sum[s]);                                 \
            }                                                                                                        \
        }                                                                                                            \
    }

static inline acc_t as_is(acc_t a) { return a; }

/* AHEAD: bytes of each row prefetched ahead when rows are walked together (T > 1): the hardware prefetchers lose
 * 4 slow interleaved streams (seen: a 9.4 MB Q4_K matrix at T = 8, 4.1 ns a block and token without, 1.8 with) */
enum { TILE = 64, ROW_GROUP = 4, AHEAD = 1024 };

/* T activation rows (Q8_K) -> packed blocks, block-major: out[i][t] */
static void pack_tokens(const uint8_t *xq, int64_t T, int64_t blocks, uint8_t *out) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t i = 0; i < blocks; i++) {
            const uint8_t *x = xq + (t * blocks + i) * Q8K_BYTES;
            uint8_t *o = out + (i * T + t) * PACKED_BYTES;
            memcpy(o + PACKED_QS, x + 4, 256);
            memcpy(o + PACKED_BSUMS, x + 260, 32);
            memcpy(o + PACKED_D, x, 4);
#if defined(DOTK_AVX2)  /* for its tiles (AVX-512's read the tokens as they lie) */
            _mm_storeu_si128((__m128i *)(o + PACKED_SUMS8), sub_block_sums8(x));
#endif
        }
}

/* The row loop's one-token rows: two at a time with AVX-512 (Q5_K 16.3-17.1 -> 18.2-18.9 GB/s); one with AVX2,
 * whose 16 registers the decoded block fills (two at a time: Q3_K 12.1-13.4 -> 11.6, IQ4_XS 18.8 -> 19.0-19.8) */
#if defined(DOTK_AVX512)
#define ROWS_T1(name, bytes, step) STREAMED(name, 2, bytes, Q8K_BYTES, acc_t, acc_zero(), step, as_is)
#define ROWS_T1_FOUR(name) name##_four
#else
#define ROWS_T1(name, bytes, step) ONE_ROW(name, bytes, Q8K_BYTES, acc_t, acc_zero(), step, as_is)
#define ROWS_T1_FOUR(name) NULL
#endif

/* One token: four streams of rows, each row's blocks in turn (decode's gemv, memory-bound). Many: the tokens'
 * blocks packed, then ROW_GROUP rows at a time, block by block, so one block column of activations (tt x 320
 * bytes) stays in L1 while every row of the group and every token use it; each weight block is decoded once. */
#define ROWS(name, decode, block_bytes, kind)                                                                        \
    static inline __attribute__((always_inline)) void name##_step(const uint8_t *b, const uint8_t *x, acc_t *acc) { \
        wblock wb;                                                                                                   \
        stream_prefetch(b, (block_bytes));                                                                           \
        decode(b, &wb);                                                                                              \
        *acc = apply_block(&wb, x, *acc, kind, 0);                                                                   \
    }                                                                                                                \
    ROWS_T1(name##_t1, block_bytes, name##_step)                                                                     \
    static void name(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const uint8_t *xq, int64_t T,     \
                     float *y, int64_t ldy) {                                                                        \
        const int64_t blocks = n / QK, xrow = blocks * Q8K_BYTES;                                                    \
        uint8_t *packed = T > 1 ? aligned_alloc(64, (size_t)(TILE * blocks * PACKED_BYTES)) : NULL;                  \
        if (packed == NULL) {  /* one token (or no memory for the packed tokens): a token at a time */               \
            for (int64_t t = 0; t < T; t++)                                                                          \
                four_streams(n, w, row_bytes, rows, xq + t * xrow, y + t * ldy, ROWS_T1_FOUR(name##_t1), name##_t1_one); \
            return;                                                                                                  \
        }                                                                                                            \
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {                                                                   \
            const int64_t tt = T - t0 < TILE ? T - t0 : TILE;                                                        \
            pack_tokens(xq + t0 * xrow, tt, blocks, packed);                                                         \
            for (int64_t r0 = 0; r0 < rows; r0 += ROW_GROUP) {                                                       \
                const int64_t rr = rows - r0 < ROW_GROUP ? rows - r0 : ROW_GROUP;                                    \
                acc_t acc[ROW_GROUP][TILE];                                                                          \
                for (int64_t r = 0; r < rr; r++)                                                                     \
                    for (int64_t t = 0; t < tt; t++) acc[r][t] = acc_zero();                                         \
                for (int64_t i = 0; i < blocks; i++) {                                                               \
                    const uint8_t *column = packed + i * tt * PACKED_BYTES;                                          \
                    for (int64_t r = 0; r < rr; r++) {                                                               \
                        const uint8_t *block = w + (r0 + r) * row_bytes + (block_bytes) * i;                         \
                        for (int line = 0; line < (block_bytes); line += 64) __builtin_prefetch(block + AHEAD + line);\
                        wblock wb;                                                                                   \
                        decode(block, &wb);                                                                          \
                        int64_t t = 0;                                                                               \
                        if (APPLY_PAIR)                                                                              \
                            for (; t + 2 <= tt; t += 2)                                                              \
                                apply_pair(&wb, column + t * PACKED_BYTES, column + (t + 1) * PACKED_BYTES, &acc[r][t],  \
                                           &acc[r][t + 1], kind, 1);                                                 \
                        for (; t < tt; t++) acc[r][t] = apply_block(&wb, column + t * PACKED_BYTES, acc[r][t], kind, 1);\
                    }                                                                                                \
                }                                                                                                    \
                for (int64_t r = 0; r < rr; r++)                                                                     \
                    for (int64_t t = 0; t < tt; t++) y[(t0 + t) * ldy + r0 + r] = acc_sum(acc[r][t]);                \
            }                                                                                                        \
        }                                                                                                            \
        free(packed);                                                                                                \
    }

ROWS(rows_q2k, decode_q2k, 84, HAS_MIN)
ROWS(rows_q3k, decode_q3k, 110, HAS_OFF)
ROWS(rows_q4k, decode_q4k, 144, HAS_MIN)
ROWS(rows_q5k, decode_q5k, 176, HAS_MIN)
ROWS(rows_q6k, decode_q6k, 210, HAS_OFF)
ROWS(rows_iq3xxs, decode_iq3xxs, 98, IQ3_KIND)
ROWS(rows_iq3s, decode_iq3s, 110, IQ3_KIND)
/* IQ3_XXS_T and IQ3_S_T outside the one-token AVX-512 loops: each block decoded from a copy put back (cpu_iq3_t.h;
 * AVX-512's decoders above take them without one) */
#if !defined(DOTK_AVX512)
static inline void decode_iq3xxs_t(const uint8_t *b, wblock *w) {
    uint8_t block[IQ3XXS_BYTES];
    iq3xxs_block_back(b, block);
    decode_iq3xxs(block, w);
}
static inline void decode_iq3s_t(const uint8_t *b, wblock *w) {
    uint8_t block[IQ3S_BYTES];
    iq3s_block_back(b, block);
    decode_iq3s(block, w);
}
#endif
ROWS(rows_iq3xxst, decode_iq3xxs_t, 98, IQ3_KIND)
ROWS(rows_iq3st, decode_iq3s_t, 110, IQ3_KIND)
ROWS(rows_iq4xs, decode_iq4xs, 136, SIGNED)
#if defined(DOTK_AVX512)  /* the row indices a vector at a time (indices_*), elsewhere one at a time (row_*) */
#define ROW_INDICES(fmt) indices_##fmt
#else
#define ROW_INDICES(fmt) row_##fmt
#endif
#define GRID_DECODE(fmt, ternary, entries)                         \
    static inline void decode_##fmt(const uint8_t *b, wblock *w) { \
        grid_fields f;                                             \
        fields_##fmt(b, &f);                                       \
        grid_wblock(b, &f, ROW_INDICES(fmt), w, ternary, entries); \
    }
#if defined(DOTK_AVX512)  /* IQ2_XXS's signs and scales as IQ3_XXS's (its words are dwords 1, 3, .., 15 after d) */
static inline void decode_iq2xxs(const uint8_t *b, wblock *w) {
    if (!codes_ok) {
        grid_fields f;
        fields_iq2xxs(b, &f);
        grid_wblock(b, &f, ROW_INDICES(iq2xxs), w, 0, 256);
        return;
    }
    const __m512i groups = _mm512_loadu_si512(b + 2);
    w->dd = _mm512_set1_ps(0.125f * f16_at(b));
    xxs_words(_mm512_castsi512_si256(_mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1), groups)), w);
    code_magnitudes(lookup16(code2_xxs, 256, indices_iq2xxs(b)), w);
}
#else
GRID_DECODE(iq2xxs, 0, 256)
#endif
GRID_DECODE(iq2xs, 0, 512)
GRID_DECODE(iq2s, 0, 1024)
GRID_DECODE(iq1s, 1, 2048)
GRID_DECODE(iq1m, 1, 2048)
ROWS(rows_iq2xxs, decode_iq2xxs, 66, SIGNED)
ROWS(rows_iq2xs, decode_iq2xs, 74, SIGNED)
ROWS(rows_iq2s, decode_iq2s, 82, SIGNED)
ROWS(rows_iq1s, decode_iq1s, 50, SIGNED)
ROWS(rows_iq1m, decode_iq1m, 56, SIGNED)

#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
/* The one-token gemvs below that read the token's quants in an order of their own: order(x, blocks, out) writes
 * ORDERED_BYTES a block, on the stack up to ORDERED_ON_STACK blocks, else on the heap. -> 0 if out of memory (the
 * caller takes another loop). */
enum { ORDERED_BYTES = 448, ORDERED_ON_STACK = 64 };
typedef void (*order_fn)(const uint8_t *x, int64_t blocks, uint8_t *out);
static int ordered_one_token(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const uint8_t *xq, float *y,
                             order_fn order, four_rows_fn four, one_row_fn one) {
    const int64_t blocks = n / QK;
    uint8_t stack[ORDERED_ON_STACK * ORDERED_BYTES] __attribute__((aligned(64)));
    uint8_t *xp = blocks <= ORDERED_ON_STACK ? stack : aligned_alloc(64, (size_t)(blocks * ORDERED_BYTES));
    if (xp == NULL) return 0;
    order(xq, blocks, xp);
    four_streams(n, w, row_bytes, rows, xp, y, four, one);
    if (xp != stack) free(xp);
    return 1;
}
#endif

#if defined(DOTK_AVX512)
#define GF_HIGH_NIBBLE 0x1020408000000000ll  /* vgf2p8affineqb's matrix: bits 4-7 of a byte to bits 0-3 */
/* each byte's high nibble, as a byte: one affine map over GF(2) per 8 bytes where GFNI is (a shift and a mask
 * took two: 12.0-12.2 -> 12.4-12.5 GB/s) */
static inline __attribute__((always_inline)) __m512i high_nibbles(__m512i v) {
#if defined(__GFNI__)
    return _mm512_gf2p8affine_epi64_epi8(v, _mm512_set1_epi64(GF_HIGH_NIBBLE), 0);
#else
    return _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
#endif
}

/* ---- Q4_K at T = 1 with AVX-512: the weights' bytes as they lie, the activations reordered once per call -----
 * Decode's Q4_K gemv is compute-bound on a fast host (the generic loop above: ~25 cycles a block, most of them
 * shuffles that broadcast each 32 quant bytes to both halves of a vector and spread the scales). Here a block's
 * 128 quant bytes are two plain 64-byte loads: the low nibbles of bytes 0..63 are values 0..31 and 64..95 (sub-
 * blocks 0 and 2), their high nibbles 32..63 and 96..127 (1, 3), and bytes 64..127 the same for sub-blocks
 * 4..7. The token's Q8_K quants are copied once per call into that order (x_q4k), with the sum of each sub-
 * block's 32 quants (for the mins) and d. Per block: the six-bit scales and mins unpacked in one xmm, the mins'
 * dot against the sums in an xmm, and d * dx, dmin * dx as floats. With VNNI each vector's quants go through one
 * vpdpbusd (4 products a dword, |sum| <= 4 * 15 * 128 < 2^15) and two vectors' sums are packed to int16 (vpackssdw:
 * no saturation), so one vpdpwssd scales two vectors, their scales spread by one zero-masked vpermb: 6 multiplies
 * and 2 shuffles a block where vpmaddubsw, vpmaddwd / vpdpwssd and a vpermb a vector took 8 and 4 (C harness,
 * one Zen 4 core, 3 rounds alternated: 26.5 -> 29.6 GB/s from L3, 25.6 -> 28.5 from DRAM); without VNNI that way.
 * Numerics as the loop above (integer sums exact, then d_w * d_x and dmin_w * d_x in float32); the mins' share
 * is gathered in its own 4 lanes: float32 order only. */
enum { XQ4_QS = 0, XQ4_SUMS = 256, XQ4_D = 272, XQ4_BYTES = ORDERED_BYTES };

#if defined(__AVX512VNNI__)
/* two vectors of unsigned values u0, u1 (< 64) dotted with the 128 quant bytes at x (64 each) into s: each through
 * one vpdpbusd (4 products a dword: |sum| <= 4 * 63 * 128 < 2^15), the two packed to int16 (vpackssdw: nothing
 * saturates) and scaled by one vpdpwssd; sc: int16 w's scale, where w (of 32) holds dword 4 (w / 8) + w % 4 of u0
 * (w % 8 < 4) or of u1 (the K-quants' one-token steps: Q2_K .. Q6_K) */
static inline __attribute__((always_inline)) __m512i packed_pair(__m512i s, __m512i u0, __m512i u1, const uint8_t *x, __m512i sc) {
    const __m512i d0 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u0, _mm512_loadu_si512(x));
    const __m512i d1 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u1, _mm512_loadu_si512(x + 64));
    return _mm512_dpwssd_epi32(s, _mm512_packs_epi32(d0, d1), sc);
}
#endif

/* the 4 fp16 at p as floats: the conversion from memory, where a load into a register and a conversion from it took
 * one more uop on Intel's port 5 (asm: the compiler loads the 8 bytes into a register first) */
static inline __attribute__((always_inline)) __m128 f16x4_at(const uint8_t *p) {
    __m128 v;
    __asm__("vcvtph2ps %1, %0" : "=v"(v) : "m"(*(const uint64_t *)p));
    return v;
}

/* a block's leading fp16 scale (at p; 8 bytes read) times the float at x, in every lane */
static inline __attribute__((always_inline)) __m512 head_scale(const uint8_t *p, const uint8_t *x) {
    const float product = _mm_cvtss_f32(_mm_mul_ss(f16x4_at(p), _mm_load_ss((const float *)x)));
    __m512 v;
    __asm__("vbroadcastss %1, %0" : "=v"(v) : "m"(product));
    return v;
}

static void x_q4k(const uint8_t *x, int64_t blocks, uint8_t *out) {
    static const int from[8] = {0, 64, 32, 96, 128, 192, 160, 224};  /* the quants of each 32 bytes of out */
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *xb = x + Q8K_BYTES * i;
        uint8_t *o = out + XQ4_BYTES * i;
        for (int k = 0; k < 8; k++) _mm256_store_si256((__m256i *)(o + 32 * k), _mm256_loadu_si256((const __m256i *)(xb + 4 + from[k])));
        _mm_store_si128((__m128i *)(o + XQ4_SUMS), sub_block_sums8(xb));
        memcpy(o + XQ4_D, xb, 4);
    }
}

/* one block into a row's sum: the lanes of acc, the mins' share in mins (off the first 4 lanes at the end) */
typedef struct { __m512 acc; __m128 mins; } q4k_sum;
#define Q4K_ZERO ((q4k_sum){_mm512_setzero_ps(), _mm_setzero_ps()})
/* Q5_K (five = 1) the same way: its quant bytes at 48, the fifth bits (qh, 32 bytes at 16: bit 2j + 1 / 2j of byte l
 * for value 32j + l) broadcast to both halves of a vector and shifted per half to bit 4 (as Q6_K's high bits), each
 * vector's values (< 32: |sum| <= 4 * 31 * 128 < 2^15) one vpternlogd; with VNNI only (C harness, one Zen 4 core
 * from DRAM, alternated: the loop above 19.3 GB/s -> 26.6; Q4_K's 27.8 beside) */
static inline __attribute__((always_inline)) void q45k_step(const uint8_t *b, const uint8_t *x, q4k_sum *sum, const int five) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __mmask64 even = 0x5555555555555555ull;  /* int16 lanes: the scale byte, a zero above it */
    stream_prefetch(b, five ? 176 : 144);
    const __m128i sm = q4k_scales_mins(b);
    const __m512i sz = _mm512_castsi128_si512(sm);
    const __m512i lo = _mm512_loadu_si512(b + (five ? 48 : 16)), hi = _mm512_loadu_si512(b + (five ? 112 : 80));
    __m512i q[4] = {_mm512_and_si512(lo, m4), _mm512_and_si512(_mm512_srli_epi16(lo, 4), m4),
                    _mm512_and_si512(hi, m4), _mm512_and_si512(_mm512_srli_epi16(hi, 4), m4)};
    if (five) {  /* vector c's fifth bits: bits c / 2 * 4 + c % 2 (lower half) and + 2 (upper half) of qh */
        const __m512i qh = dup256(b + 16), bit4 = _mm512_set1_epi8(16);
        const __m512i up[4] = {_mm512_sllv_epi16(qh, shifts16(4, 2)), _mm512_sllv_epi16(qh, shifts16(3, 1)),
                               _mm512_srlv_epi16(qh, shifts16(0, 2)), _mm512_srlv_epi16(qh, shifts16(1, 3))};
        for (int c = 0; c < 4; c++) q[c] = _mm512_ternarylogic_epi32(q[c], up[c], bit4, 0xf8);  /* a | b & c */
    }
#if defined(__AVX512VNNI__)
    /* vectors 2h and 2h + 1 packed: int16 w of 128-bit lane L is int32 L * 4 + w % 4 of vector 2h + (w % 8) / 4,
     * whose sub-block is that vector's first (L < 2) or second: byte 2w of pick[h] (bits 3 and 5 of 2w) */
    const __m512i k = iota8();
    const __m512i base = _mm512_add_epi8(_mm512_and_si512(_mm512_srli_epi16(k, 4), _mm512_set1_epi8(2)),
                                         _mm512_and_si512(_mm512_srli_epi16(k, 3), _mm512_set1_epi8(1)));
    const __m512i pick[2] = {base, _mm512_add_epi8(base, _mm512_set1_epi8(4))};
    __m512i s = _mm512_setzero_si512();
    for (int h = 0; h < 2; h++)
        s = packed_pair(s, q[2 * h], q[2 * h + 1], x + XQ4_QS + 128 * h, _mm512_maskz_permutexvar_epi8(even, pick[h], sz));
#else
    const __m512i pick[4] = {bits8(0, 2), bits8(1, 3), bits8(4, 6), bits8(5, 7)};  /* vector c's sub-blocks */
    __m512i p[4], sc[4];
    for (int c = 0; c < 4; c++) {
        p[c] = _mm512_maddubs_epi16(q[c], _mm512_load_si512(x + XQ4_QS + 64 * c));
        sc[c] = _mm512_maskz_permutexvar_epi8(even, pick[c], sz);
    }
    const __m512i s = _mm512_add_epi32(dot_pairs(_mm512_madd_epi16(p[0], sc[0]), p[2], sc[2]),
                                       dot_pairs(_mm512_madd_epi16(p[1], sc[1]), p[3], sc[3]));
#endif
    const __m128i mdot = _mm_madd_epi16(_mm_unpackhi_epi8(sm, _mm_setzero_si128()), _mm_load_si128((const __m128i *)(x + XQ4_SUMS)));
    const __m128 dd = _mm_mul_ps(f16x4_at(b), _mm_set1_ps(f32_at(x + XQ4_D)));  /* d, dmin (lanes 0, 1) times dx */
    sum->acc = _mm512_fmadd_ps(_mm512_broadcastss_ps(dd), _mm512_cvtepi32_ps(s), sum->acc);
    sum->mins = _mm_fmadd_ps(_mm_permute_ps(dd, 0x55), _mm_cvtepi32_ps(mdot), sum->mins);
}
static inline __attribute__((always_inline)) void q4k_step(const uint8_t *b, const uint8_t *x, q4k_sum *sum) {
    q45k_step(b, x, sum, 0);
}
static inline __attribute__((always_inline)) void q5k_step(const uint8_t *b, const uint8_t *x, q4k_sum *sum) {
    q45k_step(b, x, sum, 1);
}
static inline __m512 q4k_finish(q4k_sum sum) { return _mm512_sub_ps(sum.acc, _mm512_zextps128_ps512(sum.mins)); }
STREAMED(q4k, 4, 144, XQ4_BYTES, q4k_sum, Q4K_ZERO, q4k_step, q4k_finish)
#if defined(__AVX512VNNI__)
STREAMED(q5k, 4, 176, XQ4_BYTES, q4k_sum, Q4K_ZERO, q5k_step, q4k_finish)
#endif

#if defined(__AVX512VNNI__)  /* the one-token loops of Q2_K, Q3_K and Q6_K below: with VNNI only */
/* ---- Q2_K and Q3_K at T = 1 with AVX-512 VNNI: the 2-bit fields where they lie -------------------------------
 * A block's 64 quant bytes are one load: byte p holds the 2-bit fields j = 0..3 of values 128 (p / 32) + 32j + p
 * % 32, so vector j (the fields j, shifted down and masked) is values 32j .. 32j + 31 and 128 + 32j .. + 31, each
 * 128-bit lane one group of 16 (8 (L / 2) + 2j + L % 2). Q3_K's third bits (hmask bit 4 (p / 32) + j of byte p %
 * 32), broadcast to both halves, are rotated to bit 2 per half (vprolvd) and or'ed in: values u = q + 4 hbit, w = u
 * - 4. The token's quants are copied once per call into that order (x_q23k), with the groups' sums (bsums) times
 * -4 (Q3_K's offset) and as they are (Q2_K's mins). Each vector through one vpdpbusd (|sum| <= 4 * 7 * 127), two
 * vectors' sums packed to int16 and scaled by one vpdpwssd (Q3_K's scales - 32, Q2_K's low nibbles); Q3_K's offset
 * one more vpdpwssd on the sums, Q2_K's mins (high nibbles) a madd in an xmm, times dmin d_x apart (as Q4_K's).
 * Numerics as the loop above: each block's integer sums exact, then times d_w d_x (dmin_w d_x) in float32 (C
 * harness, one Zen 4 core from DRAM, alternated: the loop above Q2_K 12.9 -> 16.1-16.6 GB/s, Q3_K 12.8 -> 16.0-16.3;
 * one, two or four rows at a time alike). */
enum { XQ23_QS = 0, XQ23_NEG4 = 256, XQ23_SUMS = 288, XQ23_D = 320 };

static void x_q23k(const uint8_t *x, int64_t blocks, uint8_t *out) {
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *xb = x + Q8K_BYTES * i;
        uint8_t *o = out + ORDERED_BYTES * i;
        for (int j = 0; j < 4; j++) {
            memcpy(o + XQ23_QS + 64 * j, xb + 4 + 32 * j, 32);
            memcpy(o + XQ23_QS + 64 * j + 32, xb + 4 + 128 + 32 * j, 32);
        }
        const __m256i sums = _mm256_loadu_si256((const __m256i *)(xb + 260));  /* |4 x sum| <= 4 * 16 * 127 < 2^15 */
        _mm256_storeu_si256((__m256i *)(o + XQ23_NEG4), _mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(sums, 2)));
        _mm256_storeu_si256((__m256i *)(o + XQ23_SUMS), sums);
        memcpy(o + XQ23_D, xb, 4);
    }
}

/* the 4 vectors' values u (x_q23k's order) dotted into s, two at a time scaled by the groups' int16 scales s16 */
static inline __attribute__((always_inline)) __m512i q23k_dots(__m512i s, const __m512i u[4], const uint8_t *x, __m256i s16) {
    /* packed int16 w of 128-bit lane L: vector 2h + (w % 8) / 4, so group 8 (L / 2) + 2 (2h + (w % 8) / 4) + L % 2 */
    const __m512i w = iota16();
    const __m512i group = _mm512_add_epi16(_mm512_add_epi16(_mm512_slli_epi16(_mm512_srli_epi16(w, 4), 3),
                                                            _mm512_and_si512(_mm512_srli_epi16(w, 1), _mm512_set1_epi16(2))),
                                           _mm512_and_si512(_mm512_srli_epi16(w, 3), _mm512_set1_epi16(1)));
    for (int h = 0; h < 2; h++) {
        const __m512i pick = _mm512_add_epi16(group, _mm512_set1_epi16((short)(4 * h)));
        s = packed_pair(s, u[2 * h], u[2 * h + 1], x + XQ23_QS + 128 * h, _mm512_permutexvar_epi16(pick, _mm512_castsi256_si512(s16)));
    }
    return s;
}

/* the 2-bit fields of the 64 bytes at p: vector j's 0..3 */
static inline __attribute__((always_inline)) void q23k_fields(const uint8_t *p, __m512i u[4]) {
    const __m512i qs = _mm512_loadu_si512(p), m3 = _mm512_set1_epi8(3);
    for (int j = 0; j < 4; j++) u[j] = _mm512_and_si512(_mm512_srli_epi16(qs, 2 * j), m3);
}

static inline __attribute__((always_inline)) void q3k_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    stream_prefetch(b, 110);
    __m512i u[4];
    q23k_fields(b + 32, u);
    const __m512i hm = dup256(b), four = _mm512_set1_epi8(4);
    for (int j = 0; j < 4; j++) {  /* bit j (lower half) / 4 + j (upper) of each byte to bit 2: rotate by 2 - j, -2 - j */
        const __m512i by = _mm512_mask_set1_epi32(_mm512_set1_epi32((2 - j) & 31), 0xff00, (30 - j) & 31);
        u[j] = _mm512_ternarylogic_epi32(u[j], _mm512_rolv_epi32(hm, by), four, 0xf8);  /* a | b & c */
    }
    const __m256i s16 = q3k_scales16(b);
    __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(x + XQ23_NEG4))),
                                    _mm512_zextsi256_si512(s16));  /* the offset's share: -4 sc bsum */
    s = q23k_dots(s, u, x, s16);
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(f16_at(b + 108) * f32_at(x + XQ23_D)), _mm512_cvtepi32_ps(s), *acc);
}
STREAMED(q3k, 2, 110, ORDERED_BYTES, __m512, _mm512_setzero_ps(), q3k_step, as_is)

static inline __attribute__((always_inline)) void q2k_step(const uint8_t *b, const uint8_t *x, q4k_sum *sum) {
    stream_prefetch(b, 84);
    __m512i u[4];
    q23k_fields(b + 16, u);
    const __m128i sm = _mm_loadu_si128((const __m128i *)b);  /* low nibble: scale, high: min */
    const __m128i m4 = _mm_set1_epi8(15);
    const __m512i s = q23k_dots(_mm512_setzero_si512(), u, x, _mm256_cvtepu8_epi16(_mm_and_si128(sm, m4)));
    const __m256i mins = _mm256_madd_epi16(_mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(sm, 4), m4)),
                                           _mm256_loadu_si256((const __m256i *)(x + XQ23_SUMS)));
    const __m128i mdot = _mm_add_epi32(_mm256_castsi256_si128(mins), _mm256_extracti128_si256(mins, 1));
    const __m128 dd = _mm_mul_ps(f16x4_at(b + 80), _mm_set1_ps(f32_at(x + XQ23_D)));  /* d, dmin (lanes 0, 1) times dx */
    sum->acc = _mm512_fmadd_ps(_mm512_broadcastss_ps(dd), _mm512_cvtepi32_ps(s), sum->acc);
    sum->mins = _mm_fmadd_ps(_mm_permute_ps(dd, 0x55), _mm_cvtepi32_ps(mdot), sum->mins);
}
STREAMED(q2k, 2, 84, ORDERED_BYTES, q4k_sum, Q4K_ZERO, q2k_step, q4k_finish)

/* ---- Q6_K at T = 1 with AVX-512: the block streamed 64 values at a time, the activations as they lie -------
 * A half block's 64 low-bit bytes are one load: their low nibbles are values 0..63 of the half, their high
 * nibbles 64..127; the 32 high-bit bytes, broadcast to both halves of a vector, give each value its two bits
 * by one variable shift (by 4 / 2 for the low nibbles' halves, 0 / 2 right for the high ones'). So a vector is
 * 64 values in order, each 128-bit lane one group of 16; the offset 32's share is taken once a block through the
 * bsums. As Q4_K's (this loop runs with VNNI only): a vector's values through one vpdpbusd (|sum| <= 4 * 63 * 128
 * < 2^15), a half's two vectors packed to int16 and scaled by one vpdpwssd, their scales spread by one vpermw,
 * where a vpmaddubsw, a vpdpwssd and a vpermw a vector took 6 (C harness, one Zen 4 core: 32.3 -> 33.8 GB/s from
 * L3, 31.6 -> 32.5 from DRAM). Numerics as the loop above. (One core, a 110 MB matrix from DRAM: the loop above
 * read 14.6 GB/s where llama.cpp's AVX2 loop read 14.9.) */
static inline __attribute__((always_inline)) void q6k_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(15), m30 = _mm512_set1_epi8(0x30);
    const __m512i low_shift = shifts16(4, 2), high_shift = shifts16(0, 2);
    /* the half's two vectors packed (vpackssdw): int16 w (of 32) is dword 4 (w / 8) + w % 4 of vector (w % 8) / 4,
     * so of group 8h + 4 ((w % 8) / 4) + w / 8 (lane16(0): w / 8) */
    const __m512i group0 = _mm512_add_epi16(lane16(0), _mm512_and_si512(iota16(), _mm512_set1_epi16(4)));
    const __m512i group[2] = {group0, _mm512_add_epi16(group0, _mm512_set1_epi16(8))};
    stream_prefetch(b, 210);
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));
    const __m512i sc = _mm512_castsi256_si512(s16);
    __m512i s = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_zextsi256_si512(_mm256_loadu_si256((const __m256i *)(x + 260))),
                                    _mm512_zextsi256_si512(_mm256_sub_epi16(_mm256_setzero_si256(), _mm256_slli_epi16(s16, 5))));
    for (int h = 0; h < 2; h++) {
        const __m512i l = _mm512_loadu_si512(b + 64 * h), qh = dup256(b + 128 + 32 * h);
        const __m512i lo = _mm512_or_si512(_mm512_and_si512(l, m4), _mm512_and_si512(_mm512_sllv_epi16(qh, low_shift), m30));
        const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), m4),
                                           _mm512_and_si512(_mm512_srlv_epi16(qh, high_shift), m30));
        s = packed_pair(s, lo, hi, x + 4 + 128 * h, _mm512_permutexvar_epi16(group[h], sc));
    }
    *acc = _mm512_fmadd_ps(_mm512_set1_ps(f16_at(b + 208) * f32_at(x)), _mm512_cvtepi32_ps(s), *acc);
}
STREAMED(q6k, 4, 210, Q8K_BYTES, __m512, _mm512_setzero_ps(), q6k_step, as_is)
#endif

#if defined(__AVX512VNNI__)
/* ---- IQ4_XS at T = 1 with AVX-512 VNNI: the weights' bytes as they lie, the activations reordered -----------
 * As Q4_K's (x_iq4xs once per call): a block's 128 quant bytes are two
 * 64-byte loads, each byte's low nibble value j of its sub-block and high nibble value 16 + j, so each 128-bit
 * lane of the 4 nibble vectors is 16 values of one sub-block (vectors 0, 1: sub-blocks 0..3; 2, 3: 4..7). The
 * kvalues go in unsigned, kvalue + 128 (vpshufb), into vpdpbusd (no saturation: 4 products a lane), two vectors'
 * into one accumulator that starts at the offset's share, -128 x the lane's 8 quants (x_iq4xs puts it beside
 * them), and times their sub-blocks' scales - 32 (vpmulld). The scales come in lanes as they are used: each
 * lane's 6-bit field shifted and rotated into place from two broadcast words, a select, an arithmetic shift
 * (in place of a scalar unpacking, a vpmovsxbd and two vpermd, and of the offset's share in 4 lanes of its own,
 * Q4_K's mins: C harness, one thread from L2, 1 MiB calls, 22.1-22.5 -> 27.6-28.3 GB/s; two from DRAM
 * 28.9-31.6 -> 30.3-33.1, alternated). Every lane's integer sum is exact (|lane| <= 2 * 8 * 127 * 127 * 32 < 2^24,
 * so its float32 too); then times d_w * d_x in float32 (float32 order
 * only differs from the loop above). In place of a step over the activations as they lie, 64 values at a time,
 * that moved the kvalues' signs onto the activations (vptestnmb, a masked negation) and took the scales by
 * vpdpwssd after vpmaddubsw (Intel AMX host, C harness, [*, 2048] rows, interleaved): one thread from L1
 * 13.1-13.5 -> 16.1-16.4 GB/s, two threads from DRAM 22.5-24.9 -> 24.1-26.8 ([*, 768]: 22.2-24.1 -> 24.7-25.9).
 * That step had replaced the decoded-block loop: 16.4-16.9 -> 18.9-19.5 from L1, 26.3 -> 27.9-28.2 from DRAM. */
enum { XI4_QS = 0, XI4_BIAS = 256, XI4_D = 384, XI4_BYTES = ORDERED_BYTES };

static void x_iq4xs(const uint8_t *x, int64_t blocks, uint8_t *out) {
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *xb = x + Q8K_BYTES * i;
        uint8_t *o = out + XI4_BYTES * i;
        for (int c = 0; c < 4; c++)  /* vector c, lane L: quants 128 (c / 2) + 32 L + 16 (c % 2) .. + 15 */
            for (int L = 0; L < 4; L++)
                memcpy(o + XI4_QS + 64 * c + 16 * L, xb + 4 + 128 * (c / 2) + 32 * L + 16 * (c % 2), 16);
        const __m512i ones = _mm512_set1_epi8(1), zero = _mm512_setzero_si512();
        for (int pair = 0; pair < 2; pair++) {  /* int32 lane L of vectors 2 pair and 2 pair + 1: -128 x their 8 quants */
            const __m512i sum = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, ones, _mm512_load_si512(o + XI4_QS + 128 * pair)),
                                                    ones, _mm512_load_si512(o + XI4_QS + 128 * pair + 64));
            _mm512_store_si512(o + XI4_BIAS + 64 * pair, _mm512_sub_epi32(zero, _mm512_slli_epi32(sum, 7)));
        }
        memcpy(o + XI4_D, xb, 4);
    }
}

static inline __attribute__((always_inline)) void iq4xs_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    const __m512i m4 = _mm512_set1_epi8(15);
    const __m512i kvu = _mm512_broadcast_i32x4(_mm_xor_si128(_mm_loadu_si128((const __m128i *)kvalues), _mm_set1_epi8((char)0x80)));
    /* lane L's scale - 32, of sub-block L / 4 (vectors 0, 1) or 4 + L / 4 (2, 3), as a signed 6-bit field at bits
     * 26..31: its 2 high bits (crumb k of the u16 at 2, top bit flipped: sc - 32 = (crumb - 2) << 4 | nibble) by
     * a left shift to bits 30..31, its low 4 (nibble k of the u32 at 4) by a rotation to bits 26..29 */
    const __m512i to_crumb_lo = _mm512_set_epi32(24, 24, 24, 24, 26, 26, 26, 26, 28, 28, 28, 28, 30, 30, 30, 30);
    const __m512i to_crumb_hi = _mm512_set_epi32(16, 16, 16, 16, 18, 18, 18, 18, 20, 20, 20, 20, 22, 22, 22, 22);
    const __m512i to_nibble = _mm512_set_epi32(30, 30, 30, 30, 2, 2, 2, 2, 6, 6, 6, 6, 10, 10, 10, 10);
    const __m512i top2 = _mm512_set1_epi32((int)0xc0000000u);
    stream_prefetch(b, 136);
    const __m512i h = _mm512_xor_si512(_mm512_set1_epi32((int)u32_at(b + 2)), _mm512_set1_epi32(0xaaaa));
    const __m512i sc_lo = _mm512_srai_epi32(_mm512_ternarylogic_epi32(_mm512_sllv_epi32(h, to_crumb_lo),
                                                                      _mm512_rolv_epi32(h, to_nibble), top2, 0xe4), 26);  /* c ? a : b */
    const __m512i sc_hi = _mm512_srai_epi32(_mm512_ternarylogic_epi32(_mm512_sllv_epi32(h, to_crumb_hi),
                                                                      _mm512_rolv_epi32(_mm512_set1_epi32((int)u32_at(b + 4)), to_nibble), top2, 0xe4), 26);
    const __m512i lo = _mm512_loadu_si512(b + 8), hi = _mm512_loadu_si512(b + 72);
    const __m512i q[4] = {_mm512_and_si512(lo, m4), high_nibbles(lo), _mm512_and_si512(hi, m4), high_nibbles(hi)};
    __m512i v[2];
    for (int pair = 0; pair < 2; pair++)
        v[pair] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_load_si512(x + XI4_BIAS + 64 * pair), _mm512_shuffle_epi8(kvu, q[2 * pair]),
                                                          _mm512_load_si512(x + XI4_QS + 128 * pair)),
                                      _mm512_shuffle_epi8(kvu, q[2 * pair + 1]), _mm512_load_si512(x + XI4_QS + 128 * pair + 64));
    const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(v[0], sc_lo), _mm512_mullo_epi32(v[1], sc_hi));
    *acc = _mm512_fmadd_ps(head_scale(b, x + XI4_D), _mm512_cvtepi32_ps(s), *acc);
}
STREAMED(iq4xs, 4, 136, XI4_BYTES, __m512, _mm512_setzero_ps(), iq4xs_step, as_is)
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BITALG__) && defined(__GFNI__) && !defined(DOTK_IQ3_GENERIC)
#define IQ3_GEMV 1
/* ---- IQ3_S at T = 1 with AVX-512 VNNI, BITALG and GFNI: the grid's codes dotted as the lookup leaves them -----
 * The loop above looks up two code planes (8 vpermi2b, 2 cycles each on Intel's port 5), then spends as many
 * shuffles again putting each entry's 4 values in order (unpacks, a vpshufb to levels) and spreading the scales
 * (4 vpermw). Here an entry's 12 bits of level codes (s3_low, s3_high) are two lookups by vpermb on quarters of
 * a table (64 entries each), merged by masks of index bits 6 and 7: s3_low's 512 bytes blended by index bit 8,
 * s3_high's 256 (two entries a byte) its high nibble moved down where bit 8 is set; each of the block's 4 vectors
 * is then one or two vgf2p8affineqb (port 0), a value 2c + 1 an affine map of its code c: vector j is value j of
 * each of the 64 entries. So byte p of every vector belongs to entry p, and each int32 lane (4 entries) to one
 * 32-value sub-block, the same in all 4. The token's quants are copied once per call into that order (x_iq3s:
 * vector j, byte p = quant 4p + j), the signs' bits picked into it by vpshufbitqmb (IQ3_S_T: loaded as they lie);
 * 4 vpdpbusd (|w| x signed q) sum 16 products a lane (|sum| <= 16 * 15 * 127 < 2^15), one vpmaddwd times the
 * lane's scale 2s + 1. Numerics as the loop above: each block's integer sums exact in int32, then times d_w * d_x
 * in float32 (the lanes split a block's sum otherwise: float32 order only). The two planes of values as nibbles
 * this replaced (16 vpermb and two blends a block) ran 14.1-14.3 GB/s from L2 on one thread of the Intel host at
 * a slow hour, this 14.5-14.9 (C harness, IQ3_S_T, alternated twice); from DRAM on two threads within the noise
 * (22.1-23.8 against 21.7-24.7).
 * -DDOTK_IQ3_GENERIC builds the loop above instead (the A/B of docs/kernels.md). */
enum { XS_QS = 0, XS_D = 256, XS_HALF_D = 260, XS_BYTES = ORDERED_BYTES };  /* XS_HALF_D: d / 2 (IQ3_XXS's halves) */

static void x_iq3s(const uint8_t *x, int64_t blocks, uint8_t *out) {
    /* 64 bytes (16 quads) -> byte k of each quad, k = 0..3, 16 bytes each */
    const __m512i gather = _mm512_set_epi32(0x3f3b3733, 0x2f2b2723, 0x1f1b1713, 0x0f0b0703, 0x3e3a3632, 0x2e2a2622,
                                            0x1e1a1612, 0x0e0a0602, 0x3d393531, 0x2d292521, 0x1d191511, 0x0d090501,
                                            0x3c383430, 0x2c282420, 0x1c181410, 0x0c080400);
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *xb = x + Q8K_BYTES * i;
        uint8_t *o = out + XS_BYTES * i;
        for (int c = 0; c < 4; c++) {  /* quants 64c .. 64c + 63: quads 16c .. 16c + 15 */
            uint8_t t[64] __attribute__((aligned(64)));
            _mm512_store_si512(t, _mm512_permutexvar_epi8(gather, _mm512_loadu_si512(xb + 4 + 64 * c)));
            for (int k = 0; k < 4; k++) memcpy(o + XS_QS + 64 * k + 16 * c, t + 16 * k, 16);
        }
        memcpy(o + XS_D, xb, 4);
        const float half_d = 0.5f * f32_at(xb);
        memcpy(o + XS_HALF_D, &half_d, 4);
    }
}

/* the mask of the 64 bits at p, loaded as a mask (a load, where a kmovq from a general register takes port 5; asm:
 * where other code reads the same bits, IQ3_XXS_T's fourth mask, the compiler would share one general load) */
static inline __attribute__((always_inline)) __mmask64 mask_at(const uint8_t *p) {
    __mmask64 k;
    __asm__("kmovq %1, %0" : "=k"(k) : "m"(*(const uint64_t *)p));
    return k;
}

/* 256 table bytes p[0..3] (64 entries each) looked up by idx's low 8 bits. On Intel a vpermb per quarter, each
 * merged over the entries from its quarter on (masks idx >= 64, 128, 192: one instruction each, where two index-bit
 * masks and their or / and took five: C harness from L1, IQ3_S 12.0-12.2 -> 12.6-13.0 GB/s a core): a two-table
 * vpermt2b there is three uops, two on port 5. On AMD's Zen 4 and 5 a vpermt2b costs a vpermb (one a cycle, latency
 * 5) and a mask write is scarce (one a cycle for every kind): two vpermt2b blended by bit 7, half the shuffles and
 * one mask (C harness, one Zen 4 core, weights in L3, 3 rounds alternated: IQ3_S_T 12.7-12.9 -> 14.2-14.3 GB/s,
 * IQ3_XXS_T 14.2-14.3 -> 16.1-16.2; a tree of four independent vpermb and three blends, for latency: no gain). */
#if defined(__znver3__) || defined(__znver4__) || defined(__znver5__)  /* GCC 12 names Zen 4 znver3 */
static inline __attribute__((always_inline)) __m512i quarters256(const __m512i *p, __m512i idx) {
    return _mm512_mask_blend_epi8(_mm512_movepi8_mask(idx), _mm512_permutex2var_epi8(p[0], idx, p[1]),
                                  _mm512_permutex2var_epi8(p[2], idx, p[3]));
}
#else
static inline __attribute__((always_inline)) __m512i quarters256(const __m512i *p, __m512i idx) {
    const __m512i top2 = _mm512_set1_epi8((char)0xc0);
    const __mmask64 from1 = _mm512_test_epi8_mask(idx, top2), from2 = _mm512_movepi8_mask(idx),
                    from3 = _mm512_cmpge_epu8_mask(idx, top2);
    __m512i r = _mm512_permutexvar_epi8(idx, p[0]);
    r = _mm512_mask_permutexvar_epi8(r, from1, idx, p[1]);
    r = _mm512_mask_permutexvar_epi8(r, from2, idx, p[2]);
    return _mm512_mask_permutexvar_epi8(r, from3, idx, p[3]);
}
#endif

/* the bit indices vpshufbitqmb takes for vector j: byte p of it holds sign bit 4p + j (of a qword lane p / 8) */
static inline void sign_picks(__m512i pick[4]) {
    const __m512i quad = _mm512_and_si512(_mm512_slli_epi16(iota8(), 2), _mm512_set1_epi8(63));
    for (int j = 0; j < 4; j++) pick[j] = _mm512_add_epi8(quad, _mm512_set1_epi8((char)j));
}

/* the 4 vectors' magnitudes q dotted with the token's quants (x_iq3s's order) carrying the weights' signs (bit p
 * of negative[j]: byte p of vector j): each int32 lane of half[h] sums the 8 products of vectors 2h and 2h + 1
 * (2 vpdpbusd) */
static inline __attribute__((always_inline)) void signed_dot4(const __m512i q[4], const uint8_t *x,
                                                              const __mmask64 negative[4], __m512i half[2]) {
    const __m512i zero = _mm512_setzero_si512();
    __m512i a[4];
    for (int j = 0; j < 4; j++) {
        a[j] = _mm512_load_si512(x + XS_QS + 64 * j);
        a[j] = _mm512_mask_sub_epi8(a[j], negative[j], zero, a[j]);
    }
    for (int h = 0; h < 2; h++) half[h] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero, q[2 * h], a[2 * h]), q[2 * h + 1], a[2 * h + 1]);
}

/* vgf2p8affineqb matrices (output bit i takes the input bits set in byte 7 - i) for IQ3_S's values 2c + 1 (the
 * constant 1 is the instruction's): c0, c1 from bits 0-2 and 3-5 of s3_low's byte, c2 from its bits 6-7 and bit
 * 0 of s3_high's nibble, c3 from the nibble's bits 1-3, each into bits 1-3; and a byte's high nibble to its low */
#define S3_C0 0x0001020400000000ll
#define S3_C1 0x0008102000000000ll
#define S3_C2_LOW 0x0040800000000000ll
#define S3_C2_HIGH 0x0000000100000000ll
#define S3_C3 0x0002040800000000ll

/* one block into a row's sum (the lanes of acc); transposed: an IQ3_S_T block (its signs 4 masks as they lie) */
static inline __attribute__((always_inline)) void iq3s_any_step(const uint8_t *b, const uint8_t *x, __m512 *acc,
                                                                const int transposed) {
    const __m512i *low = (const __m512i *)s3_low, *high = (const __m512i *)s3_high;
    /* vector j, byte p: sign bit 4p + j, in qword p / 16 of the signs: the qwords doubled, so qword lane p / 8 */
    const __m512i twice = _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0);
    __m512i pick[4];
    sign_picks(pick);
    /* lane L: a right rotation by 4 * (L / 2) - 1 brings 2 * (nibble L / 2) to bits 1..4 */
    const __m512i nibble = _mm512_set_epi32(27, 27, 23, 23, 19, 19, 15, 15, 11, 11, 7, 7, 3, 3, 31, 31);
    stream_prefetch(b, 110);
    const __m512i idx = _mm512_loadu_si512(b + 2);
    const __mmask64 bit8 = mask_at(b + 66);
    const __m512i codes = _mm512_mask_blend_epi8(bit8, quarters256(low, idx), quarters256(low + 4, idx));
    const __m512i pair = quarters256(high, idx);  /* entry p's nibble low, entry 256 + p's high */
    const __m512i tops = _mm512_mask_gf2p8affine_epi64_epi8(pair, bit8, pair, _mm512_set1_epi64(GF_HIGH_NIBBLE), 0);
    const __m512i q[4] = {_mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64(S3_C0), 1),
                          _mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64(S3_C1), 1),
                          _mm512_xor_si512(_mm512_gf2p8affine_epi64_epi8(codes, _mm512_set1_epi64(S3_C2_LOW), 1),
                                           _mm512_gf2p8affine_epi64_epi8(tops, _mm512_set1_epi64(S3_C2_HIGH), 0)),
                          _mm512_gf2p8affine_epi64_epi8(tops, _mm512_set1_epi64(S3_C3), 1)};
    __mmask64 negative[4];
    if (transposed) {
        for (int j = 0; j < 4; j++) negative[j] = mask_at(b + IQ3S_SIGNS_AT + 8 * j);
    } else {
        const __m512i signs = _mm512_permutexvar_epi64(twice, _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(b + 74))));
        for (int j = 0; j < 4; j++) negative[j] = _mm512_bitshuffle_epi64_mask(signs, pick[j]);
    }
    __m512i half[2];
    signed_dot4(q, x, negative, half);
    /* 2s + 1 of lane L's sub-block L / 2, in the lane's low int16 (its high int16 zero) */
    const __m512i sc = _mm512_ternarylogic_epi32(_mm512_rorv_epi32(_mm512_set1_epi32((int)u32_at(b + 106)), nibble),
                                                 _mm512_set1_epi32(0x1e), _mm512_set1_epi32(1), 0xea);  /* a & b | c */
    const __m512i s = _mm512_madd_epi16(_mm512_add_epi32(half[0], half[1]), sc);
    *acc = _mm512_fmadd_ps(head_scale(b, x + XS_D), _mm512_cvtepi32_ps(s), *acc);
}
static inline __attribute__((always_inline)) void iq3s_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    iq3s_any_step(b, x, acc, 0);
}
static inline __attribute__((always_inline)) void iq3st_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    iq3s_any_step(b, x, acc, 1);
}
STREAMED(iq3s, 2, 110, XS_BYTES, __m512, _mm512_setzero_ps(), iq3s_step, as_is)
STREAMED(iq3st, 2, 110, XS_BYTES, __m512, _mm512_setzero_ps(), iq3st_step, as_is)

/* IQ3_XXS the same way: its 256 entries are 4 vpermb a plane, their nibbles the affine codes of its 8 levels
 * (gf_xxs; gguf's values 4..62), a vgf2p8affineqb a vector where a level number took a vpshufb (C harness,
 * IQ3_XXS_T, one thread from L2: 14.9-15.1 -> 15.4-16.2 GB/s, two from DRAM 24.0-25.7 -> 26.5-27.1). Its sign
 * fields through their 128 patterns as decode_iq3xxs reads them, or IQ3_XXS_T's masks as they lie (loaded as masks,
 * the fourth from the other three); its scales are each u32's top 4 bits, or IQ3_XXS_T's nibbles. The levels are
 * dotted halved (every level is even: d_x / 2 in the token's order, XS_HALF_D, makes up for it), so each half of a
 * lane's 16 products stays under 2^15 (8 * 31 * 127) and the scale is a vpmaddwd and a vpdpwssd where a vpaddd and
 * a vpmulld (two uops) took three. Those, the masks as loads (a kmovq from a register is a port-5 uop) and the
 * block's scale converted from memory (head_scale): C harness, IQ3_XXS_T, one thread from L2 on the Ice Lake host
 * (two processes at once, one a core, cores swapped) 13.5-13.9 -> 15.2-15.6 GB/s. One block into a row's sum;
 * transposed: an IQ3_XXS_T block (its masks as they lie, its scales as nibbles). */
static inline __attribute__((always_inline)) void iq3xxs_any_step(const uint8_t *b, const uint8_t *x, __m512 *acc,
                                                                  const int transposed) {
    const __m512i *t = (const __m512i *)gf_xxs[0];  /* plane 0: t[0..3], plane 1: t[4..7] */
    stream_prefetch(b, 98);
    const __m512i idx = _mm512_loadu_si512(b + 2);
    const __m512i plane[2] = {quarters256(t, idx), quarters256(t + 4, idx)};
    const __m512i low = _mm512_set1_epi64((long long)affine_xxs[0]), high = _mm512_set1_epi64((long long)affine_xxs[1]);
    const __m512i q[4] = {_mm512_gf2p8affine_epi64_epi8(plane[0], low, XXS_AFFINE_BASE), _mm512_gf2p8affine_epi64_epi8(plane[0], high, XXS_AFFINE_BASE),
                          _mm512_gf2p8affine_epi64_epi8(plane[1], low, XXS_AFFINE_BASE), _mm512_gf2p8affine_epi64_epi8(plane[1], high, XXS_AFFINE_BASE)};
    __mmask64 negative[4];
    __m512i sc;  /* 2s + 1 of lane L's sub-block L / 2 */
    if (transposed) {
        for (int j = 0; j < 3; j++) negative[j] = mask_at(b + IQ3XXS_SIGNS_AT + 8 * j);
        negative[3] = _cvtu64_mask64(iq3xxs_fourth_mask(u64_at(b + IQ3XXS_SIGNS_AT), u64_at(b + IQ3XXS_SIGNS_AT + 8),
                                                        u64_at(b + IQ3XXS_SIGNS_AT + 16), u32_at(b + IQ3XXS_LAST_AT)));
        /* lane L: a right rotation by 4 * (L / 2) - 1 brings 2 * (nibble L / 2) to bits 1..4 */
        const __m512i nibble = _mm512_set_epi32(27, 27, 23, 23, 19, 19, 15, 15, 11, 11, 7, 7, 3, 3, 31, 31);
        sc = _mm512_rorv_epi32(_mm512_set1_epi32((int)u32_at(b + IQ3XXS_SCALES_AT)), nibble);
    } else {
        const __m512i twice = _mm512_set_epi64(3, 3, 2, 2, 1, 1, 0, 0), pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        __m512i pick[4];
        sign_picks(pick);
        const __m256i field_at = _mm256_set1_epi64x(0x352e2720150e0700ll);  /* the 7-bit sign fields of each u32 */
        const __m256i aux = _mm256_loadu_si256((const __m256i *)(b + 66));
        const __m512i patterns = _mm512_permutex2var_epi8(_mm512_load_si512(sign_table), _mm512_castsi256_si512(_mm256_multishift_epi64_epi8(field_at, aux)),
                                                          _mm512_load_si512(sign_table + 64));
        const __m512i signs = _mm512_permutexvar_epi64(twice, patterns);
        for (int j = 0; j < 4; j++) negative[j] = _mm512_bitshuffle_epi64_mask(signs, pick[j]);
        sc = _mm512_srli_epi32(_mm512_permutexvar_epi32(pairs, _mm512_castsi256_si512(aux)), 27);  /* top 4 bits, x 2 */
    }
    __m512i half[2];  /* each lane's 8 products of halved levels: |sum| <= 8 * 31 * 127 < 2^15 */
    signed_dot4(q, x, negative, half);
    sc = _mm512_ternarylogic_epi32(sc, _mm512_set1_epi32(0x1e), _mm512_set1_epi32(1), 0xea);  /* a & b | c */
    const __m512i s = _mm512_dpwssd_epi32(_mm512_madd_epi16(half[0], sc), half[1], sc);
    *acc = _mm512_fmadd_ps(head_scale(b, x + XS_HALF_D), _mm512_cvtepi32_ps(s), *acc);
}
static inline __attribute__((always_inline)) void iq3xxs_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    iq3xxs_any_step(b, x, acc, 0);
}
static inline __attribute__((always_inline)) void iq3xxst_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    iq3xxs_any_step(b, x, acc, 1);
}
STREAMED(iq3xxs, 2, 98, XS_BYTES, __m512, _mm512_setzero_ps(), iq3xxs_step, as_is)
STREAMED(iq3xxst, 2, 98, XS_BYTES, __m512, _mm512_setzero_ps(), iq3xxst_step, as_is)

/* ---- IQ2_XXS at T = 1 (with the IQ3 loops' instructions): the grid's 16-bit codes expanded where they lie -----
 * A block's 32 grid rows (8 values each) are looked up as 16-bit codes, 2 bits a value (lookup16: 4 vpermi2w, 3
 * blends). Vector m holds rows m, 4 + m, .., 28 + m, a row a qword: one vpmultishiftqb takes each value's code from
 * its row's (bits 16m + 2k of qword q, which holds rows 4q .. 4q + 3), one vpermb its level (levels2 repeated over
 * 64 entries: the neighbouring codes' bits above are ignored). So in every vector qword q is group q (rows 4q .. 4q
 * + 3, 32 values) and dwords 2q, 2q + 1 take its scale; the rows' sign patterns (IQ3_XXS's 128) as dwords of 4
 * bytes, dword q rows 4q .. 4q + 3, give each vector's signs by one vpshufbitqmb. The token's quants are copied once
 * per call into that order (x_iq2: vector m, qword q = quants 32q + 8m .. + 7, and d_x / 8), the signs put onto
 * them (a masked subtraction), 4 vpdpbusd sum each dword's 16 products (|sum| <= 16 * 43 * 127 < 2^17), one vpmulld
 * times the group's 2s + 1. IQ2_XS the same way, its 16-value scales two vpmulld (vectors 0, 1 are rows 4q, 4q + 1,
 * vectors 2, 3 rows 4q + 2, 4q + 3: the two halves of group q), its sign fields picked from their uint16 by one
 * vpmultishiftqb into the patterns. Numerics: each block's integer sums exact in int32, then times d_w * d_x / 8 in
 * float32 (float32 order only differs from the loop above). In place of the loop above, which decoded each block
 * into the shared form: one Zen 4 core from DRAM, 2048 columns, C harness, twice alternated, llama.cpp's vec_dot on
 * the same core beside (GB/s): IQ2_XXS 3.3 -> 7.3 (3.5), IQ2_XS 3.3 -> 6.4-6.5 (3.8-4.2). IQ2_S's 1024 rows are too
 * many to look up in registers at a gain (16 vpermi2w and 15 blends of their codes: 4.3-4.6): its loop (below,
 * with the IQ1 formats') loads them. */
enum { X2_QS = 0, X2_D = 384 };  /* in ORDERED_BYTES a block */

static void x_iq2(const uint8_t *x, int64_t blocks, uint8_t *out) {
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *xb = x + Q8K_BYTES * i;
        uint8_t *o = out + ORDERED_BYTES * i;
        for (int m = 0; m < 4; m++)
            for (int q = 0; q < 8; q++) memcpy(o + X2_QS + 64 * m + 8 * q, xb + 4 + 32 * q + 8 * m, 8);
        const float d8 = 0.125f * f32_at(xb);  /* IQ2's 1/8 folded in (exact) */
        memcpy(o + X2_D, &d8, 4);
    }
}

/* a block's 32 grid rows' codes (lookup16's uint16 lanes) -> the 4 vectors' magnitudes, x_iq2's order */
static inline __attribute__((always_inline)) void iq2_magnitudes(__m512i codes, __m512i q[4]) {
    const __m512i level = _mm512_permutexvar_epi32(_mm512_and_si512(_mm512_set1_epi32(0x03020100), _mm512_set1_epi32(0x03030303)),
                                                   _mm512_castsi128_si512(_mm_load_si128((const __m128i *)levels2)));
    for (int m = 0; m < 4; m++) {
        const long long at = 0x0e0c0a0806040200ll + 0x1010101010101010ll * m;  /* bits 16m + 2k, k = 0..7 */
        q[m] = _mm512_permutexvar_epi8(_mm512_multishift_epi64_epi8(_mm512_set1_epi64(at), codes), level);
    }
}

/* the 32 rows' signs, a byte a row, rows 4q .. 4q + 3 in bytes 0..3 of qword q -> each vector's negative values */
static inline __attribute__((always_inline)) void iq2_signs(__m512i rows4, __mmask64 negative[4]) {
    const __m512i bit = _mm512_and_si512(iota8(), _mm512_set1_epi8(7));
    for (int m = 0; m < 4; m++) negative[m] = _mm512_bitshuffle_epi64_mask(rows4, _mm512_add_epi8(bit, _mm512_set1_epi8((char)(8 * m))));
}

/* the 4 vectors' magnitudes dotted with the token's quants (x_iq2's order) carrying the signs, into acc: each dword
 * times sc[0] (IQ2_XXS: a scale per 32 values), or vectors 0, 1 times sc[0] and 2, 3 times sc[1] (rows 4q, 4q + 1
 * and 4q + 2, 4q + 3: a scale per 16 values) */
static inline __attribute__((always_inline)) __m512 iq2_dot(const __m512i q[4], const __mmask64 negative[4], const __m512i sc[2],
                                                             const int halves, const uint8_t *b, const uint8_t *x, __m512 acc) {
    __m512i s[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
    for (int m = 0; m < 4; m++) {
        const __m512i a = _mm512_load_si512(x + X2_QS + 64 * m);
        s[halves ? m / 2 : 0] = _mm512_dpbusd_epi32(s[halves ? m / 2 : 0], q[m], _mm512_mask_sub_epi8(a, negative[m], _mm512_setzero_si512(), a));
    }
    const __m512i t = halves ? _mm512_add_epi32(_mm512_mullo_epi32(s[0], sc[0]), _mm512_mullo_epi32(s[1], sc[1]))
                             : _mm512_mullo_epi32(s[0], sc[0]);
    return _mm512_fmadd_ps(head_scale(b, x + X2_D), _mm512_cvtepi32_ps(t), acc);
}

/* 2s + 1 of dword l of the sum: IQ2_XS's 8 scale bytes at p (two nibbles, rows 4q, 4q + 1 and 4q + 2, 4q + 3 of
 * byte q = l / 2) */
static inline __attribute__((always_inline)) void iq2_nibble_scales(const uint8_t *p, __m512i sc[2]) {
    const __m128i pairs = _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
    const __m512i v = _mm512_cvtepu8_epi32(_mm_shuffle_epi8(_mm_loadl_epi64((const __m128i *)p), pairs));
    const __m512i m = _mm512_set1_epi32(0x1e), one = _mm512_set1_epi32(1);
    sc[0] = _mm512_ternarylogic_epi32(_mm512_slli_epi32(v, 1), m, one, 0xea);  /* a & b | c */
    sc[1] = _mm512_ternarylogic_epi32(_mm512_srli_epi32(v, 3), m, one, 0xea);
}

/* IQ2_XXS: 8 groups of 4 index bytes and a sign and scale word (dwords 1, 3, .., 15 of the 64 bytes after d) */
static inline __attribute__((always_inline)) void iq2xxs_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    const __m512i index_at = _mm512_set_epi8(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                             0, 0, 59, 58, 57, 56, 51, 50, 49, 48, 43, 42, 41, 40, 35, 34, 33, 32, 27, 26, 25, 24, 19,
                                             18, 17, 16, 11, 10, 9, 8, 3, 2, 1, 0);
    stream_prefetch(b, 66);
    const __m512i groups = _mm512_loadu_si512(b + 2);
    __m512i q[4];
    iq2_magnitudes(lookup16(code2_xxs, 256, _mm512_cvtepu8_epi16(_mm512_castsi512_si256(_mm512_permutexvar_epi8(index_at, groups)))), q);
    /* the words' 32 seven-bit fields (vpmultishiftqb) through IQ3_XXS's 128 patterns */
    const __m512i words = _mm512_permutexvar_epi32(_mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 15, 13, 11, 9, 7, 5, 3, 1), groups);
    const __m256i fields = _mm256_multishift_epi64_epi8(_mm256_set1_epi64x(0x352e2720150e0700ll), _mm512_castsi512_si256(words));
    const __m512i patterns = _mm512_permutex2var_epi8(_mm512_load_si512(sign_table), _mm512_castsi256_si512(fields),
                                                      _mm512_load_si512(sign_table + 64));
    __mmask64 negative[4];
    iq2_signs(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(patterns)), negative);
    const __m512i pairs = _mm512_set_epi32(15, 15, 13, 13, 11, 11, 9, 9, 7, 7, 5, 5, 3, 3, 1, 1);  /* dword l: group l / 2's word */
    const __m512i sc[2] = {_mm512_ternarylogic_epi32(_mm512_srli_epi32(_mm512_permutexvar_epi32(pairs, groups), 27),
                                                     _mm512_set1_epi32(0x1e), _mm512_set1_epi32(1), 0xea), _mm512_setzero_si512()};
    *acc = iq2_dot(q, negative, sc, 0, b, x, *acc);
}

/* IQ2_XS: 32 uint16 (a 9-bit grid index, a 7-bit sign pattern index), 8 scale bytes */
static inline __attribute__((always_inline)) void iq2xs_step(const uint8_t *b, const uint8_t *x, __m512 *acc) {
    stream_prefetch(b, 74);
    const __m512i rows = _mm512_loadu_si512(b + 2);
    __m512i q[4];
    iq2_magnitudes(lookup16(code2_xs, 512, _mm512_and_si512(rows, _mm512_set1_epi16(511))), q);
    /* bytes 0..3 of qword q: the fields of rows 4q .. 4q + 3 (bits 9.. of each uint16), through the patterns */
    const __m512i fields = _mm512_multishift_epi64_epi8(_mm512_set1_epi64(0x3929190939291909ll), rows);
    __mmask64 negative[4];
    iq2_signs(_mm512_permutex2var_epi8(_mm512_load_si512(sign_table), fields, _mm512_load_si512(sign_table + 64)), negative);
    __m512i sc[2];
    iq2_nibble_scales(b + 66, sc);
    *acc = iq2_dot(q, negative, sc, 1, b, x, *acc);
}

STREAMED(iq2xxs, 1, 66, ORDERED_BYTES, __m512, _mm512_setzero_ps(), iq2xxs_step, as_is)
STREAMED(iq2xs, 1, 74, ORDERED_BYTES, __m512, _mm512_setzero_ps(), iq2xs_step, as_is)
#endif

#endif

#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
/* ---- IQ1_S, IQ1_M and the IQ2 formats at T = 1 with AVX2 (IQ1, IQ2_S with AVX-512 too): a vector a group ----
 * A 32-value group (4 grid rows of 8 values) a vector, in value order, against the token's Q8_K quants as they lie;
 * the group's rows by scalar loads (the grids of 1024 and 2048 rows are too big to look up in registers at a gain),
 * their indices formed four to a 64-bit word by two pdep where BMI2 has a fast one (not Zen 1 / 2); one vpmaddubsw
 * a group of magnitudes against the quants, one vpmaddwd by its scale(s), each block's scales unpacked once and
 * picked for a group by a shuffle. IQ2's signs go onto the quants (vpsignb by IQ2_XXS / IQ2_XS's +-1 patterns,
 * sign_ones; IQ2_S's sign bits as a mask with AVX-512, as bytes by a shuffle and a compare with AVX2). IQ1's values
 * g + delta (g of -1, 0, 1, delta +-1/8) are w (8 (g + 1) + c - k) / 8, k = 7 or 9 by the delta's sign, c a
 * constant: the rows' bytes 8 (g + 1) + c - k are unsigned, and c (2s + 1) times the quants' sum comes off once a
 * block through the Q8_K bsums (one vpmaddwd). IQ1_S: c = k (its delta is a group's): the rows g + 1 as grid1_up
 * holds them, the 8 in the group's scale 8 (2s + 1), the bsums' coefficient (2s + 1) k; IQ1_M: c = 9 (its delta is
 * a row's): the rows 8 (g + 1) + 9 - k (0..18: g + 1 shifted, 2 added where the delta bit is clear), coefficient
 * 9 (2s + 1). Numerics: each block's integer sum exact in int32 (|pair| <= 2 * 43 * 128, times 2s + 1 <= 31), then times
 * d_w d_x / 8 in float32 (float32 order only differs from the decoded-block loop). In place of loops that formed
 * the indices a row at a time, put IQ1's deltas through a second vpmaddubsw a group and broadcast each group's
 * scale from a general register, and, with AVX-512, of x_iq2-ordered loops for IQ1 and IQ2_S (their rows by
 * scalar loads from a store of their indices) -- one Zen 4 core from DRAM, 128 MB matrices, GB/s
 * (benchmarks/bench_kernels.py; llama.cpp's vec_dot, built for AVX2 only, beside): AVX2 build IQ1_S 2.3 -> 4.6
 * (2.9), IQ1_M 1.9 -> 3.7-3.9 (3.1), IQ2_S 3.7 -> 5.8 (4.6), IQ2_XS 3.1 -> 4.5 (4.2; it had kept the decoded-block
 * loop), IQ2_XXS unchanged 3.9 (3.5); AVX-512 build IQ1_S 3.2 -> 4.7, IQ1_M 3.3 -> 3.6, IQ2_S 5.0 -> 6.4. Without
 * the pdep (AVX2, -mno-bmi2) IQ1_S 3.2, IQ1_M 3.3. IQ2_XXS and IQ2_XS keep their AVX-512 loops (in-register
 * lookups: 7.4 and 6.3 there, these 3.8 and 4.2). */
static inline __m256i rows4(const uint64_t *t, unsigned r0, unsigned r1, unsigned r2, unsigned r3) {
    /* (4 broadcast loads and 3 blends, as ENTRIES8: IQ2_S 5.9 -> 5.5 GB/s, IQ1_S 4.5 -> 4.1 on Zen 4) */
    return _mm256_set_epi64x((long long)t[r3], (long long)t[r2], (long long)t[r1], (long long)t[r0]);
}
/* the table rows of 4 indices packed as 16-bit fields of ix */
static inline __m256i rows4_packed(const uint64_t *t, uint64_t ix) {
    return rows4(t, (unsigned)(ix & 0xffff), (unsigned)(ix >> 16 & 0xffff), (unsigned)(ix >> 32 & 0xffff), (unsigned)(ix >> 48));
}
#if defined(__BMI2__) && !defined(__znver1__) && !defined(__znver2__)  /* pdep is microcoded on Zen 1 / 2 */
#define FAST_PDEP 1
#endif
/* a group's 4 rows of table t: row l's index q[l] | the `span` bits at span * l of h above it (IQ1_S: span 3, h's
 * bits 12.. ignored; IQ1_M: span 4, its delta bits 3 + 4l cleared by the caller; IQ2_S: span 2) */
static inline __attribute__((always_inline)) __m256i grid_rows4(const uint64_t *t, const uint8_t *q, unsigned h, int span) {
    const unsigned field = (1u << span) - 1;
#if defined(FAST_PDEP)
    return rows4_packed(t, _pdep_u64(u32_at(q), 0x00ff00ff00ff00ffull) | _pdep_u64(h, field * 0x0100010001000100ull));
#else
    return rows4(t, q[0] | (h & field) << 8, q[1] | (h >> span & field) << 8, q[2] | (h >> 2 * span & field) << 8,
                 q[3] | (h >> 3 * span & field) << 8);
#endif
}
#define BLOCK_STEP(name, bytes)                                                                                    \
    static inline __attribute__((always_inline)) void name##_step(const uint8_t *b, const uint8_t *x, __m256 *acc) { \
        stream_prefetch(b, (bytes));                                                                             \
        name##_block(b, x, acc);                                                                                 \
    }

/* IQ1_S: 32 index bytes, then 8 uint16 (group g: three high index bits per row, its scale at bits 12..14, its
 * delta's sign at 15) */
static inline __attribute__((always_inline)) void iq1s_group_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const __m128i h = _mm_loadu_si128((const __m128i *)(b + 34));
    const __m128i sc = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(h, 11), _mm_set1_epi16(14)), _mm_set1_epi16(1));
    const __m128i k = _mm_add_epi16(_mm_set1_epi16(7), _mm_and_si128(_mm_srli_epi16(h, 14), _mm_set1_epi16(2)));
    const __m128i coef = _mm_mullo_epi16(sc, k);  /* (2s + 1) k of group g, for its two bsums */
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(load256(xb + 260),
                                 _mm256_set_m128i(_mm_unpackhi_epi16(coef, coef), _mm_unpacklo_epi16(coef, coef))));
    const __m256i sc8 = _mm256_broadcastsi128_si256(_mm_slli_epi16(sc, 3));  /* 8 (2s + 1), int16 g */
    __m256i pick = _mm256_set1_epi16(0x0100);
    for (int g = 0; g < 8; g++) {
        const __m256i v = grid_rows4(grid1_up, b + 2 + 4 * g, u16_at(b + 34 + 2 * g), 3);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v, load256(xb + 4 + 32 * g)), _mm256_shuffle_epi8(sc8, pick)));
        pick = _mm256_add_epi16(pick, _mm256_set1_epi16(0x0202));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * (0.125f * f32_at(xb))), _mm256_cvtepi32_ps(s), *acc);
}

/* IQ1_M: 32 index bytes; 16 bytes, a nibble per row (three high index bits, the delta's sign); 4 uint16 of 4 three-
 * bit scales each (a scale per 16 values: word w's field j is half 4w + j), whose top nibbles are the block's d */
static inline __attribute__((always_inline)) void iq1m_group_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const __m256i words = _mm256_shuffle_epi8(_mm256_set1_epi64x((long long)u64_at(b + 48)),
                                              _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2, 3, 4, 5, 4, 5, 4, 5, 4, 5, 6, 7, 6, 7, 6, 7, 6, 7));
    const __m256i field = _mm256_srli_epi16(_mm256_mullo_epi16(words, _mm256_setr_epi16(8192, 1024, 128, 16, 8192, 1024, 128, 16, 8192,
                                                                                         1024, 128, 16, 8192, 1024, 128, 16)), 13);
    const __m256i sc = _mm256_or_si256(_mm256_add_epi16(field, field), _mm256_set1_epi16(1));  /* 2s + 1, int16 = half */
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(load256(xb + 260), _mm256_add_epi16(_mm256_slli_epi16(sc, 3), sc)));
    const __m256i bit = _mm256_set_epi64x(0x8000800080008000ll, 0x0800080008000800ll, 0x0080008000800080ll, 0x0008000800080008ll);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const unsigned h = u16_at(b + 32 + 2 * g);
        const __m256i v = grid_rows4(grid1_up, b + 4 * g, h & 0x7777, 4);
        /* 9 - k: 2 by the rows whose delta bit is clear, 0 by the others */
        const __m256i c = _mm256_andnot_si256(_mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16((short)h), bit), bit), _mm256_set1_epi8(2));
        const __m256i p = _mm256_maddubs_epi16(_mm256_add_epi8(_mm256_slli_epi16(v, 3), c), load256(xb + 4 + 32 * g));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(p, group_scales(sc, g)));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(iq1m_d(b) * (0.125f * f32_at(xb))), _mm256_cvtepi32_ps(s), *acc);
}
BLOCK_STEP(iq1s_group, 50)
BLOCK_STEP(iq1m_group, 56)
#if defined(DOTK_AVX512)
static inline acc_t widened(__m256 a) { return _mm512_zextps256_ps512(a); }
#else
#define widened as_is
#endif
ONE_ROW(iq1s_group, 50, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq1s_group_step, widened)
ONE_ROW(iq1m_group, 56, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq1m_group_step, widened)

/* x with its bytes negated where `bits` has a one (bit j of byte k: byte 8k + j) */
static inline __attribute__((always_inline)) __m256i negated_where(__m256i x, uint32_t bits) {
#if defined(DOTK_AVX512)
    return _mm256_mask_sub_epi8(x, (__mmask32)bits, _mm256_setzero_si256(), x);
#else
    return _mm256_sign_epi8(x, _mm256_or_si256(sign_bytes(bits), _mm256_set1_epi8(1)));  /* -1 or 1 */
#endif
}

/* a block's 16 scales 2s + 1 (int16, half h of 16 values at h) from 8 bytes of two nibbles (half 2g low) */
static inline __m256i nibble_scales16(const uint8_t *p) {
    const __m128i raw = _mm_loadl_epi64((const __m128i *)p), m4 = _mm_set1_epi8(15);
    const __m256i sc = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(_mm_and_si128(raw, m4), _mm_and_si128(_mm_srli_epi16(raw, 4), m4)));
    return _mm256_or_si256(_mm256_add_epi16(sc, sc), _mm256_set1_epi16(1));
}

/* IQ2_S: 32 index bytes, 32 sign bytes, 8 bytes of the indices' two high bits, 8 scale bytes */
static inline __attribute__((always_inline)) void iq2s_group_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const __m256i sc = nibble_scales16(b + 74);
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const __m256i v = grid_rows4(grid2_s, b + 2 + 4 * g, b[66 + g], 2);
        const __m256i x = negated_where(load256(xb + 4 + 32 * g), u32_at(b + 34 + 4 * g));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v, x), group_scales(sc, g)));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * (0.125f * f32_at(xb))), _mm256_cvtepi32_ps(s), *acc);
}
BLOCK_STEP(iq2s_group, 82)
ONE_ROW(iq2s_group, 82, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq2s_group_step, widened)

/* IQ2_XXS: 8 groups of 4 index bytes and a word (4 seven-bit sign fields, the scale in bits 28..31) */
static inline __attribute__((always_inline)) void iq2xxs_group_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    __m256i s = _mm256_setzero_si256();
    /* the 8 words (dwords 1, 3, .., 15 after d): their top 4 bits -> 2s + 1, int16 g in both lanes (a shuffle a group
     * where a broadcast from a general register took two uops: 3.8-3.9 -> 4.2 GB/s, AVX2 build, one Zen 4 core) */
    const __m256i words = _mm256_permutevar8x32_epi32(load256(b + 2), _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
    const __m256i words2 = _mm256_permutevar8x32_epi32(load256(b + 34), _mm256_setr_epi32(1, 3, 5, 7, 1, 3, 5, 7));
    const __m256i top = _mm256_srli_epi32(_mm256_blend_epi32(words, words2, 0xf0), 28);
    const __m128i t16 = _mm_packs_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_or_si128(_mm_add_epi16(t16, t16), _mm_set1_epi16(1)));
    __m256i pick = _mm256_set1_epi16(0x0100);
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const uint8_t *q = b + 2 + 8 * g;
        const uint32_t aux = u32_at(q + 4);
        const __m256i sgn = rows4(sign_ones, aux & 127, aux >> 7 & 127, aux >> 14 & 127, aux >> 21 & 127);
        const __m256i x = _mm256_sign_epi8(load256(xb + 4 + 32 * g), sgn);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(rows4(grid2_xxs, q[0], q[1], q[2], q[3]), x), _mm256_shuffle_epi8(sc, pick)));
        pick = _mm256_add_epi16(pick, _mm256_set1_epi16(0x0202));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * (0.125f * f32_at(xb))), _mm256_cvtepi32_ps(s), *acc);
}

/* IQ2_XS: 32 uint16 (a 9-bit grid index, a 7-bit sign field), 8 scale bytes */
static inline __attribute__((always_inline)) void iq2xs_group_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const __m256i sc = nibble_scales16(b + 66);
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int g = 0; g < 8; g++) {
        const uint64_t w = u64_at(b + 2 + 8 * g), ix = w & 0x01ff01ff01ff01ffull;
        const __m256i v = rows4_packed(grid2_xs, ix);
        const __m256i sgn = rows4(sign_ones, (unsigned)(w >> 9 & 127), (unsigned)(w >> 25 & 127), (unsigned)(w >> 41 & 127), (unsigned)(w >> 57));
        const __m256i x = _mm256_sign_epi8(load256(xb + 4 + 32 * g), sgn);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(v, x), group_scales(sc, g)));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * (0.125f * f32_at(xb))), _mm256_cvtepi32_ps(s), *acc);
}
BLOCK_STEP(iq2xxs_group, 66)
BLOCK_STEP(iq2xs_group, 74)
ONE_ROW(iq2xxs_group, 66, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq2xxs_group_step, widened)
ONE_ROW(iq2xs_group, 74, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq2xs_group_step, widened)

#endif

#if defined(DOTK_AVX2)
/* ---- Q2_K .. Q6_K at T = 1 with AVX2: 32 values at a time, no decoded block --------------------------------
 * The loop above decodes a whole block (8 vectors of quants, 8 of scales, the offsets) before it dots it: more
 * than AVX2's 16 registers, so each block goes through the stack twice, and the scales are spread by two lane
 * permutes and eight shuffles. Here each 32 quant bytes are unpacked, dotted with the Q8_K block's quants as it
 * lies (a 32-value vector is one sub-block for Q4_K / Q5_K, groups 2c and 2c + 1 for Q6_K) and scaled at once,
 * the scales broadcast from one int16 vector by a shuffle each. Numerics as the loop above: each block's integer
 * sum exact, then times d_w * d_x in float32; Q4_K's and Q5_K's mins in their own 4 lanes (float32 order only),
 * Q6_K's offset 32 taken off through the bsums. */

/* shuffle controls: int16 k of a 128-bit lane across the lane */
static inline __m256i pick16(int k) { return _mm256_set1_epi16((short)(0x0101 * 2 * k + 0x0100)); }

/* Q4_K (high = 0) or Q5_K (high = 1): one block into acc (d * dx * sum) and mins (dmin * dx * the mins' dot) */
static inline __attribute__((always_inline)) void q45k_block(const uint8_t *b, const uint8_t *xb, int high, __m256 *acc, __m128 *mins) {
    const __m128i sm = q4k_scales_mins(b);
    const __m256i sc = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(sm));  /* the 8 scales, int16, both lanes */
    const __m128i mdot = _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_srli_si128(sm, 8)), sub_block_sums8(xb));
    const uint8_t *qs = b + (high ? 48 : 16), *x = xb + 4;
    const __m256i m4 = _mm256_set1_epi8(15);
    const __m256i qh = high ? _mm256_loadu_si256((const __m256i *)(b + 16)) : _mm256_setzero_si256();
    __m256i s = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {  /* 32 bytes: sub-block 2j in the low nibbles, 2j + 1 in the high ones */
        const __m256i q = _mm256_loadu_si256((const __m256i *)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (high) {
            lo = _mm256_or_si256(lo, move_bit(qh, 2 * j, 4));
            hi = _mm256_or_si256(hi, move_bit(qh, 2 * j + 1, 4));
        }
        const __m256i pl = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)(x + 64 * j)));
        const __m256i ph = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)(x + 64 * j + 32)));
        s = _mm256_add_epi32(s, _mm256_add_epi32(_mm256_madd_epi16(pl, _mm256_shuffle_epi8(sc, pick16(2 * j))),
                                                 _mm256_madd_epi16(ph, _mm256_shuffle_epi8(sc, pick16(2 * j + 1)))));
    }
    const __m128 dd = _mm_mul_ps(_mm_cvtph_ps(_mm_cvtsi32_si128((int)u32_at(b))), _mm_set1_ps(f32_at(xb)));  /* d, dmin times dx */
    *acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dd), _mm256_cvtepi32_ps(s), *acc);
    *mins = _mm_fmadd_ps(_mm_permute_ps(dd, 0x55), _mm_cvtepi32_ps(mdot), *mins);
}

/* the 8 table entries t[i[0..7]] (uint32_t) as one vector: 8 broadcast loads (load ports only) merged by 7
 * vpblendd (any vector ALU), where vmovd and 7 vpinsrd put 7 uops on the shuffle port (Intel's port 5). One Zen 4
 * core from DRAM, AVX2 build, alternated twice: IQ3_S 4.2 -> 4.4 GB/s, IQ3_XXS 4.2-4.3 -> 4.2; on Intel's client
 * cores, where that port binds these loops, not measured. */
#define ENTRIES8(t, i)                                                                                               \
    _mm256_blend_epi32(_mm256_blend_epi32(_mm256_blend_epi32(_mm256_set1_epi32((int)(t)[(i)[0]]), _mm256_set1_epi32((int)(t)[(i)[1]]), 0x02), \
                                          _mm256_blend_epi32(_mm256_set1_epi32((int)(t)[(i)[2]]), _mm256_set1_epi32((int)(t)[(i)[3]]), 0x08), 0x0c), \
                       _mm256_blend_epi32(_mm256_blend_epi32(_mm256_set1_epi32((int)(t)[(i)[4]]), _mm256_set1_epi32((int)(t)[(i)[5]]), 0x20), \
                                          _mm256_blend_epi32(_mm256_set1_epi32((int)(t)[(i)[6]]), _mm256_set1_epi32((int)(t)[(i)[7]]), 0x80), 0xc0), 0xf0)

/* Q6_K: one block into acc */
static inline __attribute__((always_inline)) void q6k_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const __m256i s16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(b + 192)));  /* 16 group scales */
    const __m256i m4 = _mm256_set1_epi8(15), m30 = _mm256_set1_epi8(0x30);
    /* the offset's share, 32 * scale * bsum per group, first (every product below is u8 x s8) */
    __m256i s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)(xb + 260)),
                                                                            _mm256_slli_epi16(s16, 5)));
    for (int h = 0; h < 2; h++) {
        const __m256i l0 = _mm256_loadu_si256((const __m256i *)(b + 64 * h)), l1 = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32));
        const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        const __m256i q[4] = {_mm256_or_si256(_mm256_and_si256(l0, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 4), m30)),
                              _mm256_or_si256(_mm256_and_si256(l1, m4), _mm256_and_si256(_mm256_slli_epi16(qh, 2), m30)),
                              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), _mm256_and_si256(qh, m30)),
                              _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                              _mm256_and_si256(_mm256_srli_epi16(qh, 2), m30))};
        for (int k = 0; k < 4; k++) {  /* vector c = 4h + k: group 2c in its low lane, 2c + 1 in its high lane */
            const int c = 4 * h + k;
            const __m256i p = _mm256_maddubs_epi16(q[k], _mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * c)));
            s = _mm256_add_epi32(s, _mm256_madd_epi16(p, group_scales(s16, c)));
        }
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b + 208) * f32_at(xb)), _mm256_cvtepi32_ps(s), *acc);
}

/* a block's 8 sub-block scales (int16) stored for each sub-block to broadcast its own: the asm statement keeps
 * the compiler from extracting them from the vector instead (2 uops each, one on the shuffle port) */
static inline __attribute__((always_inline)) void scales_in_memory(int16_t ls[8], __m128i s16) {
    _mm_store_si128((__m128i *)ls, s16);
    __asm__("" : "+m"(*(int16_t(*)[8])ls));
}

/* IQ3_S: one block into acc, the grid values' magnitudes (1..15) times the activations with the values' signs
 * (ggml's form, without the decoded block). The 9-bit grid indices are formed 16 at a time in a vector and
 * stored; the table is read by scalar loads of them. Tried and slower on Zen 5 (one core, a 3.6 MB matrix,
 * interleaved): the indices formed four to a 64-bit word in scalar code (3.7 -> 3.2 GB/s), stored and each
 * loaded back (3.3), entries paired in 64-bit registers before they enter the vector unit (3.2); vpgatherdd is
 * slower on Zen 4 / 5 than loads. On Intel the opposite: the indices read back by scalar loads (the compiler
 * otherwise extracts them from the vectors, 2 uops each, one on the shuffle port), with a block's 8 scales
 * widened once into an array: Intel AMX host, AVX2 build, C harness, [*, 2048] rows, one thread from L1 3.7 ->
 * 5.7 GB/s, two threads from DRAM 7.4 -> 11.0 (the scales alone: 4.1 from L1). So AMD targets keep the
 * extraction (not measured there since). Staging the 64 entries through memory instead of the inserts: 5.1 and
 * 9.9. */
#if !defined(__znver1__) && !defined(__znver2__) && !defined(__znver3__) && !defined(__znver4__)
#define INDICES_FROM_MEMORY 1
#endif
static inline __attribute__((always_inline)) void iq3s_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const __m256i one = _mm256_set1_epi8(1);
    const __m256i lane_bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, (short)32768);
    uint16_t idx[64] __attribute__((aligned(32)));
    int16_t ls[8] __attribute__((aligned(16)));  /* 2 s + 1 of each sub-block */
    for (int k = 0; k < 4; k++) {  /* entries 16k .. 16k + 15: index bit 8 from qh[2k], qh[2k + 1] */
        const __m256i lo = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(b + 2 + 16 * k)));
        const __m256i bits = _mm256_and_si256(_mm256_set1_epi16((short)u16_at(b + 66 + 2 * k)), lane_bit);
        const __m256i high = _mm256_and_si256(_mm256_cmpeq_epi16(bits, lane_bit), _mm256_set1_epi16(256));
        _mm256_store_si256((__m256i *)(idx + 16 * k), _mm256_or_si256(lo, high));
    }
    const __m128i w = _mm_cvtepu8_epi16(_mm_cvtsi64_si128((long long)nibbles8(u32_at(b + 106))));
    scales_in_memory(ls, _mm_add_epi16(_mm_add_epi16(w, w), _mm_set1_epi16(1)));
#if defined(INDICES_FROM_MEMORY)
    __asm__("" : "+m"(idx));  /* the compiler must read them back from memory */
#endif
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {  /* sub-block c: 32 values, entries 8c .. 8c + 7 */
        const uint16_t *i = idx + 8 * c;
        const __m256i gv = ENTRIES8(grid_s, i);
        const __m256i sign = _mm256_or_si256(sign_bytes(u32_at(b + 74 + 4 * c)), one);  /* -1 or 1 */
        const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * c)), sign);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(gv, x), _mm256_set1_epi16(ls[c])));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * f32_at(xb)), _mm256_cvtepi32_ps(s), *acc);
}

/* IQ3_XXS the same way: its 8-bit grid indices read from the block as they lie, each 8 values' signs one of
 * the 128 parity patterns as 8 bytes of +1 / -1 (sign_ones, ggml's form) picked by a 7-bit field of the
 * sub-block's u32, the scale its top 4 bits; times d_w / 4. In place of the decoded-block loop: Intel AMX host,
 * AVX2 build, C harness, [*, 2048] rows, one thread from L1 3.6-3.7 -> 5.1-5.2 GB/s, two threads from DRAM
 * 7.2-7.3 -> 10.0 (the patterns as bits expanded by sign_bytes: 3.9-4.0 and 7.7-7.9; the scales in scalar code
 * a sub-block: 4.6 and 9.0-9.1; IQ3_S's sign bits looked up like the patterns, in a 256-entry table, lost:
 * 5.6 -> 5.1 and 10.9 -> 10.0). */
static inline __attribute__((always_inline)) void iq3xxs_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    const uint8_t *q = b + 2;
    int16_t ls[8] __attribute__((aligned(16)));  /* 2 s + 1 of each sub-block: the top 4 bits of its u32 */
    const __m256i top = _mm256_srli_epi32(_mm256_loadu_si256((const __m256i *)(q + 64)), 28);
    const __m128i s4 = _mm_packs_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    scales_in_memory(ls, _mm_add_epi16(_mm_add_epi16(s4, s4), _mm_set1_epi16(1)));
    __m256i s = _mm256_setzero_si256();
    for (int c = 0; c < 8; c++) {  /* sub-block c: 32 values, entries 8c .. 8c + 7 */
        const uint8_t *i = q + 8 * c;
        const uint32_t aux = u32_at(q + 64 + 4 * c);
        const __m256i gv = ENTRIES8(grid_xxs, i);
        const __m256i sign = rows4(sign_ones, aux & 127, aux >> 7 & 127, aux >> 14 & 127, aux >> 21 & 127);
        const __m256i x = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xb + 4 + 32 * c)), sign);
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(gv, x), _mm256_set1_epi16(ls[c])));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(0.25f * f16_at(b) * f32_at(xb)), _mm256_cvtepi32_ps(s), *acc);
}

/* rows x one token through four_streams: a block step a format (each prefetching its block, cpu_stream.h) */
typedef struct { __m256 acc; __m128 mins; } q45k_sum;  /* the mins' share apart, off the first 4 lanes at the end */
#define Q45K_ZERO ((q45k_sum){_mm256_setzero_ps(), _mm_setzero_ps()})
static inline __m256 q45k_finish(q45k_sum sum) { return _mm256_sub_ps(sum.acc, _mm256_zextps128_ps256(sum.mins)); }
static inline __attribute__((always_inline)) void q4k_step(const uint8_t *b, const uint8_t *x, q45k_sum *sum) {
    stream_prefetch(b, 144);
    q45k_block(b, x, 0, &sum->acc, &sum->mins);
}
static inline __attribute__((always_inline)) void q5k_step(const uint8_t *b, const uint8_t *x, q45k_sum *sum) {
    stream_prefetch(b, 176);
    q45k_block(b, x, 1, &sum->acc, &sum->mins);
}
BLOCK_STEP(q6k, 210)
BLOCK_STEP(iq3s, 110)
static inline __attribute__((always_inline)) void iq3st_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    uint8_t block[IQ3S_BYTES];  /* IQ3_S_T: its IQ3_S copy, so its one-token bits are IQ3_S's */
    iq3s_block_back(b, block);
    iq3s_block(block, xb, acc);
}
BLOCK_STEP(iq3st, 110)
BLOCK_STEP(iq3xxs, 98)
static inline __attribute__((always_inline)) void iq3xxst_block(const uint8_t *b, const uint8_t *xb, __m256 *acc) {
    uint8_t block[IQ3XXS_BYTES];  /* IQ3_XXS_T: likewise */
    iq3xxs_block_back(b, block);
    iq3xxs_block(block, xb, acc);
}
BLOCK_STEP(iq3xxst, 98)

/* IQ4_XS with the token's quants reordered once per call (x_iq4xs_pairs): for sub-blocks 2p, 2p + 1 the 32 bytes
 * [x(2p) 0..15, x(2p + 1) 0..15], then [x(2p) 16..31, x(2p + 1) 16..31], so that two sub-blocks' 32 weight bytes are
 * one load whose low nibbles and high nibbles are one vector each, and the two sub-blocks' scales one shuffle
 * (group_scales); a kvalue's magnitude (vpabsb) times the quants with its sign (vpsignb), <= 2 * 127 * 127 a pair.
 * Numerics: each block's integer sum exact in int32, times d_w d_x in float32 (float32 order only differs from the
 * decoded-block loop). In place of a loop on the quants as they lie (a sub-block a vector: 16 bytes widened by
 * vinserti128, each scale broadcast), itself in place of the decoded-block loop (Intel AMX host, C harness, one
 * thread from L1 12.2-13.3 -> 15.7 GB/s, two from DRAM 19.6-19.8 -> 23.9-25.6): one Zen 4 core from DRAM, AVX2
 * build, GB/s, twice alternated, 12.9-13.3 -> 15.4-15.8 (llama.cpp's AVX2 vec_dot 12.1-12.3). */
enum { X4P_D = 256 };
static void x_iq4xs_pairs(const uint8_t *x, int64_t blocks, uint8_t *out) {
    for (int64_t i = 0; i < blocks; i++) {
        const uint8_t *xb = x + Q8K_BYTES * i + 4;
        uint8_t *o = out + ORDERED_BYTES * i;
        for (int p = 0; p < 4; p++)
            for (int h = 0; h < 2; h++) {
                memcpy(o + 64 * p + 32 * h, xb + 64 * p + 16 * h, 16);
                memcpy(o + 64 * p + 32 * h + 16, xb + 64 * p + 32 + 16 * h, 16);
            }
        memcpy(o + X4P_D, x + Q8K_BYTES * i, 4);
    }
}
static inline __attribute__((always_inline)) void iq4xs_pairs_step(const uint8_t *b, const uint8_t *x, __m256 *acc) {
    stream_prefetch(b, 136);
    const __m256i kv = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)kvalues)), m4 = _mm256_set1_epi8(15);
    const uint64_t sc8 = nibbles8(u32_at(b + 4)) | crumbs8(u16_at(b + 2)) << 4;
    /* int16 c: sub-block c's scale - 32 (group_scales(sc, p): 2p across the low lane, 2p + 1 the high) */
    const __m256i sc = _mm256_cvtepi8_epi16(_mm_sub_epi8(_mm_cvtsi64_si128((long long)sc8), _mm_set1_epi8(32)));
    __m256i s = _mm256_setzero_si256();
#pragma GCC unroll 4
    for (int p = 0; p < 4; p++) {
        const __m256i v = load256(b + 8 + 32 * p);
        const __m256i scale = group_scales(sc, p);
        for (int h = 0; h < 2; h++) {
            const __m256i k = _mm256_shuffle_epi8(kv, _mm256_and_si256(h ? _mm256_srli_epi16(v, 4) : v, m4));
            const __m256i xs = _mm256_sign_epi8(load256(x + 64 * p + 32 * h), k);
            s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(k), xs), scale));
        }
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b) * f32_at(x + X4P_D)), _mm256_cvtepi32_ps(s), *acc);
}
STREAMED(iq4xs_pairs, 4, 136, ORDERED_BYTES, __m256, _mm256_setzero_ps(), iq4xs_pairs_step, as_is)

/* Q3_K and Q2_K: one block into acc, 32 values (two 16-value groups: the low lane's and the high lane's) a vector,
 * their 2-bit fields where they lie (vector 4j + k: bits 2k of bytes 32j..), Q3_K's third bit c of each hmask byte
 * moved to bit 2 (values q + 4 h - 4: unsigned q + 4 h, the 4 (s - 32) times each group's sum taken off through the
 * bsums first), Q2_K's mins through the bsums (one vpmaddwd) into the same lanes times -dmin. Each vector one
 * vpmaddubsw (|pair| <= 2 * 7 * 128), one vpmaddwd by its groups' scales (picked from the block's 16 by a shuffle).
 * Numerics: each block's integer sums exact in int32, then times d_w d_x (and dmin d_x) in float32: float32 order
 * only differs from the decoded-block loop above. In place of that loop (one Zen 4 core from DRAM, 128 MB matrices,
 * benchmarks/bench_kernels.py, llama.cpp's vec_dot built for AVX2 beside): Q3_K 10.8 -> 13.2 GB/s (10.7), Q2_K
 * 13.0 -> 13.6 (10.4); two rows together in place of four: within the noise. */
static inline __attribute__((always_inline)) void q23k_block(const uint8_t *b, const uint8_t *xb, const int three, __m256 *acc) {
    const uint8_t *qs = b + (three ? 32 : 16);
    __m256i sc, s;
    if (three) {
        sc = q3k_scales16(b);  /* s - 32, int16 group g at g */
        s = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_madd_epi16(load256(xb + 260), _mm256_slli_epi16(sc, 2)));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)b);
        sc = _mm256_cvtepu8_epi16(_mm_and_si128(raw, _mm_set1_epi8(15)));
        const __m256i mins = _mm256_madd_epi16(load256(xb + 260), _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15))));
        *acc = _mm256_fnmadd_ps(_mm256_set1_ps(f16_at(b + 82) * f32_at(xb)), _mm256_cvtepi32_ps(mins), *acc);
        s = _mm256_setzero_si256();
    }
    const __m256i m3 = _mm256_set1_epi8(3), hm = three ? load256(b) : _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int c = 0; c < 8; c++) {
        const __m256i bits = load256(qs + 32 * (c / 4));
        __m256i q = _mm256_and_si256(_mm256_srli_epi16(bits, 2 * (c % 4)), m3);
        if (three) q = _mm256_or_si256(q, _mm256_and_si256(c >= 2 ? _mm256_srli_epi16(hm, c - 2) : _mm256_slli_epi16(hm, 2 - c), _mm256_set1_epi8(4)));
        s = _mm256_add_epi32(s, _mm256_madd_epi16(_mm256_maddubs_epi16(q, load256(xb + 4 + 32 * c)), group_scales(sc, c)));
    }
    *acc = _mm256_fmadd_ps(_mm256_set1_ps(f16_at(b + (three ? 108 : 80)) * f32_at(xb)), _mm256_cvtepi32_ps(s), *acc);
}
static inline __attribute__((always_inline)) void q3k_step(const uint8_t *b, const uint8_t *x, __m256 *acc) {
    stream_prefetch(b, 110);
    q23k_block(b, x, 1, acc);
}
static inline __attribute__((always_inline)) void q2k_step(const uint8_t *b, const uint8_t *x, __m256 *acc) {
    stream_prefetch(b, 84);
    q23k_block(b, x, 0, acc);
}
STREAMED(q3k, 4, 110, Q8K_BYTES, __m256, _mm256_setzero_ps(), q3k_step, as_is)
STREAMED(q2k, 4, 84, Q8K_BYTES, __m256, _mm256_setzero_ps(), q2k_step, as_is)
STREAMED(q4k, 4, 144, Q8K_BYTES, q45k_sum, Q45K_ZERO, q4k_step, q45k_finish)
STREAMED(q5k, 4, 176, Q8K_BYTES, q45k_sum, Q45K_ZERO, q5k_step, q45k_finish)
STREAMED(q6k, 4, 210, Q8K_BYTES, __m256, _mm256_setzero_ps(), q6k_step, as_is)
ONE_ROW(iq3s, 110, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq3s_step, as_is)
ONE_ROW(iq3st, 110, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq3st_step, as_is)
ONE_ROW(iq3xxs, 98, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq3xxs_step, as_is)
ONE_ROW(iq3xxst, 98, Q8K_BYTES, __m256, _mm256_setzero_ps(), iq3xxst_step, as_is)

#endif

#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
/* the one-token loops that read the token's Q8_K quants as they lie, where this build has them: 1 (its four, or
 * NULL, and one in *four, *one), or 0 (AVX-512: the ordered loops, else the row loop) */
static int one_token_as_is(int64_t wtype, four_rows_fn *four, one_row_fn *one) {
    switch (wtype) {
    case IQ1_S: *four = NULL, *one = iq1s_group_one; return 1;
    case IQ1_M: *four = NULL, *one = iq1m_group_one; return 1;
    case IQ2_XXS: *four = NULL, *one = iq2xxs_group_one; return 1;
    case IQ2_XS: *four = NULL, *one = iq2xs_group_one; return 1;
    case IQ2_S: *four = NULL, *one = iq2s_group_one; return 1;
#if defined(DOTK_AVX512) && defined(__AVX512VNNI__)
    case Q6_K: *four = q6k_four, *one = q6k_one; return 1;  /* as they lie: its loop has no order of its own */
#endif
#if defined(DOTK_AVX2)
    case Q4_K: *four = q4k_four, *one = q4k_one; return 1;
    case Q5_K: *four = q5k_four, *one = q5k_one; return 1;
    case Q6_K: *four = q6k_four, *one = q6k_one; return 1;
    case Q3_K: *four = q3k_four, *one = q3k_one; return 1;
    case Q2_K: *four = q2k_four, *one = q2k_one; return 1;
    case IQ3_S: *four = NULL, *one = iq3s_one; return 1;  /* its table loads: four rows lost (7.1 -> 5.9 GB/s), two (6.9 -> 6.5) */
    case IQ3_S_T: *four = NULL, *one = iq3st_one; return 1;
    case IQ3_XXS: *four = NULL, *one = iq3xxs_one; return 1;
    case IQ3_XXS_T: *four = NULL, *one = iq3xxst_one; return 1;
#endif
    default: return 0;
    }
}

/* the one-token loops that read the token's quants in an order of their own, where this build has them: 1 (that
 * order and the loops), else 0 */
static int one_token_ordered(int64_t wtype, order_fn *order, four_rows_fn *four, one_row_fn *one) {
    switch (wtype) {
#if defined(DOTK_AVX2)
    case IQ4_XS: *order = x_iq4xs_pairs, *four = iq4xs_pairs_four, *one = iq4xs_pairs_one; return 1;
#else
    case Q4_K: *order = x_q4k, *four = q4k_four, *one = q4k_one; return 1;
#endif
#if defined(__AVX512VNNI__)
    case Q5_K: *order = x_q4k, *four = q5k_four, *one = q5k_one; return 1;
    case Q3_K: *order = x_q23k, *four = q3k_four, *one = q3k_one; return 1;
    case Q2_K: *order = x_q23k, *four = q2k_four, *one = q2k_one; return 1;
    case IQ4_XS: *order = x_iq4xs, *four = iq4xs_four, *one = iq4xs_one; return 1;
#endif
#if defined(IQ3_GEMV)
    case IQ3_S: if (!odd_levels_s) return 0; *order = x_iq3s, *four = iq3s_four, *one = iq3s_one; return 1;
    case IQ3_S_T: if (!odd_levels_s) return 0; *order = x_iq3s, *four = iq3st_four, *one = iq3st_one; return 1;
    case IQ3_XXS: if (!affine_xxs_ok) return 0; *order = x_iq3s, *four = iq3xxs_four, *one = iq3xxs_one; return 1;
    case IQ3_XXS_T: if (!affine_xxs_ok) return 0; *order = x_iq3s, *four = iq3xxst_four, *one = iq3xxst_one; return 1;
    case IQ2_XXS: if (!codes_ok) return 0; *order = x_iq2, *four = iq2xxs_four, *one = iq2xxs_one; return 1;
    case IQ2_XS: if (!codes_ok) return 0; *order = x_iq2, *four = iq2xs_four, *one = iq2xs_one; return 1;
#endif
    default: return 0;
    }
}
#endif

#if defined(DOTK_AVX2)
/* ---- T > 1 with AVX2: sixteen weight rows on two vectors' lanes ----------------------------------------
 * The row loop above spends a token's 256 products on 8 vpmaddubsw and 8 vpmaddwd (the scales) plus a
 * horizontal fold per block. Here, as in the AVX-512 tiles below, the lanes are weight rows: 16 rows' blocks are
 * decoded once (the same decoders) and transposed so that dword k of tile vector q[k][h] holds values 4k..4k+3
 * of rows 8h..8h+7; a token's 4 activation bytes at k, broadcast, meet the 8 rows' 4 quants in one vpmaddubsw
 * (32 products). Its int16 pairs are summed over `chunk` dwords before one vpmaddwd applies the group's scale:
 * chunk * 2 * max(u) * 127 <= 32767 keeps every int16 sum exact (Q4_K 8 dwords, Q5_K / IQ3_S 4, Q2_K / Q3_K 4:
 * a group of 16; Q6_K's would be 2, and it was not faster than its row loop). Two tokens at a time, so each
 * tile load and each broadcast serves two products. The offset's share and the mins come per token through the
 * bsums (span 4) or the sub-block sums (span 8), as int16 pairs against each row's values. Numerics as the row loop's: per block and row the integer sum exact, then
 * d_w * d_x * it in float32, minus dmin_w * d_x * sum(min * bsum); only the float32 order differs (rows on
 * lanes, blocks in turn). Q6_K, IQ3_XXS (u up to 126: one dword a vpmaddwd, no gain) and IQ4_XS (signed values,
 * whose signs cannot go onto activations shared by 8 rows) keep the row loop. */
enum { TILE2_ROWS = 16 };

/* from how many tokens the tiles beat the row loop (its fill is spread over fewer tokens); measured on Zen 3, one
 * core, [512, 2048], interleaved: Q4_K / Q5_K / IQ3_S even at 8, 1.1x at 16, 1.3-1.45x at 64-256; Q2_K even at 16;
 * Q3_K 0.96x at 32, 1.23x at 64. Q6_K (a vpmaddwd every 2 dwords) was 0.95x at 64 and 256: it keeps the row loop. */
static inline int64_t tile2_from(int64_t wtype) { return wtype == Q3_K ? 64 : wtype == Q2_K ? 16 : 12; }

typedef struct {
    __m256i q[64][2];                 /* dword k: values 4k..4k+3; [h]: rows 8h..8h+7 (unsigned) */
    __m256i sc[16][2];                /* group g (16 values): each row's scale, int16 in both halves of its dword */
    __m256i offp[8][2], mnp[8][2];    /* pair p: each row's (offset * scale or min) of groups 2p, 2p + 1 (span 4) or
                                       * sub-blocks 2p, 2p + 1 (span 8), as an int16 pair against the sums */
    __m256 d[2], dmin[2];
} wtile2;

/* 8 vectors of 8 dwords, rows in, columns out: out[c] lane r = in[r] lane c */
static inline void transpose8(__m256i v[8]) {
    __m256i t[8], u[8];
    for (int i = 0; i < 4; i++) {
        t[2 * i] = _mm256_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int q = 0; q < 2; q++) {  /* u[4q + j] lane l (of 4): column j (low half) and j + 4 (high) of rows 4q + l */
        u[4 * q] = _mm256_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 1] = _mm256_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        u[4 * q + 2] = _mm256_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        u[4 * q + 3] = _mm256_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int j = 0; j < 4; j++) {
        v[j] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x20);
        v[j + 4] = _mm256_permute2x128_si256(u[j], u[4 + j], 0x31);
    }
}

/* rows[r] (r < rr <= 8): rows 8h + r's decoded blocks -> half h of the tile (lanes past rr: zeros) */
static inline void fill_half(wtile2 *t, const wblock *rows, int64_t rr, int h, int kind, int span) {
    __m256i v[8];
    for (int c = 0; c < 8; c++) {
        for (int64_t r = 0; r < 8; r++) v[r] = r < rr ? rows[r].q[c] : _mm256_setzero_si256();
        transpose8(v);
        for (int j = 0; j < 8; j++) t->q[8 * c + j][h] = v[j];
    }
    int16_t s16[8][16], off[8][16], mn[8][16];
    int32_t lanes[16][8], offp[8][8], mnp[8][8];
    float d[8], dmin[8];
    for (int64_t r = 0; r < 8; r++) {
        if (r < rr) {
            _mm256_storeu_si256((__m256i *)s16[r], rows[r].s16);
            if (kind & HAS_OFF) _mm256_storeu_si256((__m256i *)off[r], rows[r].off);
            if (kind & HAS_MIN) _mm256_storeu_si256((__m256i *)mn[r], rows[r].mn);
            d[r] = rows[r].d, dmin[r] = (kind & HAS_MIN) ? rows[r].dmin : 0.f;
        } else {
            memset(s16[r], 0, 32), memset(off[r], 0, 32), memset(mn[r], 0, 32);
            d[r] = dmin[r] = 0.f;
        }
        for (int g = 0; g < 16; g++) lanes[g][r] = (int32_t)((uint32_t)(uint16_t)s16[r][g] * 0x10001u);
        for (int p = 0; p < PAIRS(span); p++) {  /* span 8: each value comes twice (a sub-block's two groups) */
            const int a = span == 8 ? 4 * p : 2 * p, b = span == 8 ? 4 * p + 2 : 2 * p + 1;
            if (kind & HAS_OFF) offp[p][r] = (int32_t)((uint32_t)(uint16_t)off[r][a] | (uint32_t)(uint16_t)off[r][b] << 16);
            if (kind & HAS_MIN) mnp[p][r] = (int32_t)((uint32_t)(uint16_t)mn[r][a] | (uint32_t)(uint16_t)mn[r][b] << 16);
        }
    }
    for (int g = 0; g < 16; g++) t->sc[g][h] = _mm256_loadu_si256((const __m256i *)lanes[g]);
    for (int p = 0; p < PAIRS(span); p++) {
        if (kind & HAS_OFF) t->offp[p][h] = _mm256_loadu_si256((const __m256i *)offp[p]);
        if (kind & HAS_MIN) t->mnp[p][h] = _mm256_loadu_si256((const __m256i *)mnp[p]);
    }
    t->d[h] = _mm256_loadu_ps(d), t->dmin[h] = _mm256_loadu_ps(dmin);
}

static inline __m256i bcast32(const uint8_t *p) { return _mm256_set1_epi32((int)u32_at(p)); }

/* acc[2j + h] (rows 8h..8h+7's sums for token j < tn, tn 1 or 2) += the tile times token j's packed block at
 * x + j * PACKED_BYTES */
static inline __attribute__((always_inline)) void tile2_tokens(const wtile2 *t, const uint8_t *x, int tn, int kind, int span,
                                                               int chunk, __m256 *acc) {
    __m256i s[2][2];
    for (int j = 0; j < 2; j++) s[j][0] = s[j][1] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int k0 = 0; k0 < 64; k0 += chunk) {
        __m256i a[2][2];
        for (int j = 0; j < 2; j++) a[j][0] = a[j][1] = _mm256_setzero_si256();
        for (int k = k0; k < k0 + chunk; k++) {
            const __m256i w0 = t->q[k][0], w1 = t->q[k][1];
            for (int j = 0; j < 2; j++) {
                if (j >= tn) continue;
                const __m256i xb = bcast32(x + j * PACKED_BYTES + PACKED_QS + 4 * k);
                a[j][0] = _mm256_add_epi16(a[j][0], _mm256_maddubs_epi16(w0, xb));
                a[j][1] = _mm256_add_epi16(a[j][1], _mm256_maddubs_epi16(w1, xb));
                /* a chain per accumulator, in registers: unpinned, GCC builds all the products first and spills them */
                __asm__("" : "+x"(a[j][0]), "+x"(a[j][1]));
            }
        }
        for (int j = 0; j < 2; j++)
            for (int h = 0; h < 2; h++)
                if (j < tn) s[j][h] = _mm256_add_epi32(s[j][h], _mm256_madd_epi16(a[j][h], t->sc[k0 / 4][h]));
    }
    for (int j = 0; j < tn; j++) {
        const uint8_t *xj = x + j * PACKED_BYTES, *sums = xj + (span == 8 ? PACKED_SUMS8 : PACKED_BSUMS);
        const __m256 dx = _mm256_set1_ps(f32_at(xj + PACKED_D));
        for (int h = 0; h < 2; h++) {
            __m256i m = _mm256_setzero_si256();
            for (int p = 0; p < PAIRS(span); p++) {
                if (kind & HAS_OFF) s[j][h] = _mm256_sub_epi32(s[j][h], _mm256_madd_epi16(t->offp[p][h], bcast32(sums + 4 * p)));
                if (kind & HAS_MIN) m = _mm256_add_epi32(m, _mm256_madd_epi16(t->mnp[p][h], bcast32(sums + 4 * p)));
            }
            __m256 f = _mm256_mul_ps(_mm256_cvtepi32_ps(s[j][h]), _mm256_mul_ps(t->d[h], dx));
            if (kind & HAS_MIN) f = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(m), _mm256_mul_ps(t->dmin[h], dx), f);
            acc[2 * j + h] = _mm256_add_ps(acc[2 * j + h], f);
        }
    }
}

/* T > 1: TILE tokens at a time packed (pack_tokens), then 16 rows at a time; per block the rows decoded into the
 * tile once and every token pair's pass over it. packed: TILE * blocks packed blocks, acc: 2 * TILE vectors (the
 * caller's scratch) */
#define TILED2_ROWS(name, decode, block_bytes, kind, span, chunk)                                                  \
    static void name(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const uint8_t *xq, int64_t T,   \
                     float *y, int64_t ldy, uint8_t *packed, __m256 *acc) {                                        \
        const int64_t blocks = n / QK, xrow = blocks * Q8K_BYTES;                                                  \
        wtile2 tile;                                                                                               \
        wblock dec[8];                                                                                             \
        for (int64_t t0 = 0; t0 < T; t0 += TILE) {                                                                 \
            const int64_t tt = T - t0 < TILE ? T - t0 : TILE;                                                      \
            pack_tokens(xq + t0 * xrow, tt, blocks, packed);                                                       \
            for (int64_t r0 = 0; r0 < rows; r0 += TILE2_ROWS) {                                                    \
                const int64_t rr = rows - r0 < TILE2_ROWS ? rows - r0 : TILE2_ROWS;                                \
                for (int64_t t = 0; t < 2 * tt; t++) acc[t] = _mm256_setzero_ps();                                \
                for (int64_t i = 0; i < blocks; i++) {                                                             \
                    for (int h = 0; h < 2; h++) {                                                                  \
                        const int64_t hr = h == 0 ? (rr < 8 ? rr : 8) : (rr > 8 ? rr - 8 : 0);  /* rows in half h */\
                        for (int64_t r = 0; r < hr; r++) {                                                         \
                            const uint8_t *block = w + (r0 + 8 * h + r) * row_bytes + (block_bytes) * i;           \
                            for (int line = 0; line < (block_bytes); line += 64) __builtin_prefetch(block + AHEAD + line);\
                            decode(block, &dec[r]);                                                                \
                        }                                                                                          \
                        fill_half(&tile, dec, hr, h, kind, span);                                                  \
                    }                                                                                              \
                    const uint8_t *column = packed + i * tt * PACKED_BYTES;                                        \
                    int64_t t = 0;                                                                                 \
                    for (; t + 2 <= tt; t += 2) tile2_tokens(&tile, column + t * PACKED_BYTES, 2, kind, span, chunk, acc + 2 * t);\
                    if (t < tt) tile2_tokens(&tile, column + t * PACKED_BYTES, 1, kind, span, chunk, acc + 2 * t);\
                }                                                                                                  \
                for (int64_t t = 0; t < tt; t++)                                                                   \
                    for (int h = 0; h < 2 && 8 * h < rr; h++) {                                                    \
                        float out[8];                                                                              \
                        _mm256_storeu_ps(out, acc[2 * t + h]);                                                     \
                        memcpy(y + (t0 + t) * ldy + r0 + 8 * h, out, sizeof(float) * (size_t)(rr - 8 * h < 8 ? rr - 8 * h : 8));\
                    }                                                                                              \
            }                                                                                                      \
        }                                                                                                          \
    }

TILED2_ROWS(tiled2_q2k, decode_q2k, 84, HAS_MIN, 4, 4)
TILED2_ROWS(tiled2_q3k, decode_q3k, 110, HAS_OFF, 4, 4)
TILED2_ROWS(tiled2_q4k, decode_q4k, 144, HAS_MIN, 8, 8)
TILED2_ROWS(tiled2_q5k, decode_q5k, 176, HAS_MIN, 8, 4)
TILED2_ROWS(tiled2_iq3s, decode_iq3s, 110, HAS_OFF, 8, 4)
TILED2_ROWS(tiled2_iq3st, decode_iq3s_t, 110, HAS_OFF, 8, 4)
#endif


#if defined(DOTK_AVX512) && defined(__AVX512VNNI__)
#define DOTK_TILED 1
/* ---- T > 1 with AVX-512 VNNI: sixteen weight rows on a vector's lanes ------------------------------------
 * Prefill multiplies each weight block by many tokens. The loop above spends a token's 256 products on 4
 * vpmaddubsw, 4 vpmaddwd and a horizontal fold; here the lanes are 16 weight rows instead. 16 rows' blocks are
 * decoded once (the same decoders) and transposed into a tile whose dword k holds values 4k..4k+3 of all 16
 * rows, with each group's scales (and mins) across the rows; then one vpdpbusd multiplies a token's 4
 * activation bytes (a broadcast) by the 16 rows' 4 quants at that place: 64 products a instruction, no
 * horizontal sums, a group's scale applied once per 16 (or 32) values for all 16 rows (llama.cpp's tiled VNNI
 * kernel computes the same outer product with tokens on the lanes). Numerics as the gemv's: per group the
 * integer dot exact in int32, minus offset * bsum (the unsigned form's share; IQ4_XS held as w + 128), times the
 * group's integer scale, summed exactly over the block; then d_w * d_x * that sum in float32, minus
 * dmin_w * d_x * sum(min * bsum) for the formats with mins, added to the row's float32 sum block by block. Only
 * that float32 order differs from the gemv's (its lanes are values): the two agree to float32 rounding. */
enum { TILE_ROWS = 16, TILE_TOKENS = 8 };

typedef struct {
    __m512i q[64];            /* dword k: values 4k..4k+3 of the 16 rows (unsigned) */
    __m512i sc[16];           /* group g (16 values): the rows' scales (int32) */
    __m512i scp[8], mnp[8];   /* groups 2p, 2p + 1: the rows' scales, mins (HAS_MIN) as int16 pairs (span 8: sub-
                               * blocks 2p, 2p + 1, in [0..3]) */
    __m512 d, dmin;           /* the rows' d; dmin (HAS_MIN) */
} wtile;

/* dpbusd_bcast, dpwssd_bcast, transpose16: cpu_vnni.h */


/* A row's 16 group scales (or mins, int16) as the dwords of their pairs, against the bsums; span 8: each value comes
 * twice, so its even lanes are the 8 sub-blocks' (4 pairs), against the sub-block sums */
static inline __m512i group_pairs(__m256i v16, int span) {
    return span == 8 ? _mm512_zextsi128_si512(_mm256_cvtepi32_epi16(v16)) : _mm512_zextsi256_si512(v16);
}

/* rows[r] is row r's decoded block (r < rr; the others are zeros: they add nothing) -> the tile */
static inline void fill_tile(wtile *t, const wblock *rows, int64_t rr, int kind, int span) {
    __m512i v[16];
    float d[TILE_ROWS] = {0}, dmin[TILE_ROWS] = {0};
    for (int c = 0; c < 4; c++) {
        for (int64_t r = 0; r < TILE_ROWS; r++) {
            if (r >= rr) { v[r] = _mm512_setzero_si512(); continue; }
            __m512i q = rows[r].q[c];
            if (kind & SIGNED) {  /* |w| and its sign -> w + 128 */
                const __m512i h = _mm512_set1_epi8((char)128);
                q = _mm512_mask_sub_epi8(_mm512_add_epi8(h, q), rows[r].neg[c], h, q);
            }
            v[r] = q;
        }
        transpose16(v);
        for (int j = 0; j < 16; j++) t->q[16 * c + j] = v[j];
    }
    for (int64_t r = 0; r < TILE_ROWS; r++) v[r] = r < rr ? _mm512_cvtepi16_epi32(rows[r].s16) : _mm512_setzero_si512();
    transpose16(v);
    for (int g = 0; g < 16; g++) t->sc[g] = v[g];
    if (kind & (HAS_OFF | SIGNED)) {
        for (int64_t r = 0; r < TILE_ROWS; r++) v[r] = r < rr ? group_pairs(rows[r].s16, span) : _mm512_setzero_si512();
        transpose16(v);
        for (int p = 0; p < PAIRS(span); p++) t->scp[p] = v[p];
    }
    if (kind & HAS_MIN) {
        for (int64_t r = 0; r < TILE_ROWS; r++) v[r] = r < rr ? group_pairs(rows[r].mn, span) : _mm512_setzero_si512();
        transpose16(v);
        for (int p = 0; p < PAIRS(span); p++) t->mnp[p] = v[p];
    }
    for (int64_t r = 0; r < rr; r++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, rows[r].dd);
        d[r] = lanes[0], dmin[r] = -lanes[8];
    }
    t->d = _mm512_loadu_ps(d), t->dmin = _mm512_loadu_ps(dmin);
}

/* acc[j] (the 16 rows' sums for token j < tn) += the tile times token j's block (Q8_K at x + j * xrow).
 * span: dwords per scale group (4: 16 values; 8: 32, the formats whose scales come in 32s); shift: log2 of the
 * unsigned form's offset (HAS_OFF, SIGNED) */
static inline __attribute__((always_inline)) void tile_tokens(const wtile *t, const uint8_t *x, int64_t xrow, const uint8_t *m8,
                                                              int64_t m8row, int tn, int kind, int span, int shift, __m512 *acc) {
    __m512i s1[TILE_TOKENS], s2[TILE_TOKENS];
    for (int j = 0; j < TILE_TOKENS; j++) s1[j] = s2[j] = _mm512_setzero_si512();
    for (int g = 0; g < 64 / span; g++) {
        __m512i a[TILE_TOKENS];
        for (int j = 0; j < TILE_TOKENS; j++) a[j] = _mm512_setzero_si512();
        for (int k = span * g; k < span * (g + 1); k++) {
            const __m512i w = t->q[k];
            for (int j = 0; j < TILE_TOKENS; j++)
                if (j < tn) a[j] = dpbusd_bcast(a[j], w, x + j * xrow + 4 + 4 * k);
        }
        for (int j = 0; j < TILE_TOKENS; j++)
            if (j < tn) s1[j] = _mm512_add_epi32(s1[j], _mm512_mullo_epi32(a[j], t->sc[g * span / 4]));
    }
    for (int j = 0; j < TILE_TOKENS; j++) {
        if (j >= tn) continue;
        /* sum over groups of scale (or min) * bsum: the int16 pairs against the token's sums, a dword at a time;
         * span 8: its 8 sub-block sums at m8 (sums8), half the products; else its 16 bsums */
        const uint8_t *sums = span == 8 ? m8 + j * m8row : x + j * xrow + 260;
        if (kind & (HAS_OFF | SIGNED)) {
            __m512i c = _mm512_setzero_si512();
            for (int p = 0; p < PAIRS(span); p++) c = dpwssd_bcast(c, t->scp[p], sums + 4 * p);
            s1[j] = _mm512_sub_epi32(s1[j], _mm512_slli_epi32(c, shift));
        }
        if (kind & HAS_MIN)
            for (int p = 0; p < PAIRS(span); p++) s2[j] = dpwssd_bcast(s2[j], t->mnp[p], sums + 4 * p);
        const __m512 dx = _mm512_set1_ps(f32_at(x + j * xrow));
        __m512 f = _mm512_mul_ps(_mm512_cvtepi32_ps(s1[j]), _mm512_mul_ps(t->d, dx));
        if (kind & HAS_MIN) f = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(s2[j]), _mm512_mul_ps(t->dmin, dx), f);
        acc[j] = _mm512_add_ps(acc[j], f);
    }
}

/* blocks Q8_K blocks -> their 8 sub-block sums each, 16 bytes a block */
static void sub_block_sums(const uint8_t *xq, int64_t blocks, uint8_t *out) {
    for (int64_t b = 0; b < blocks; b++) _mm_storeu_si128((__m128i *)(out + 16 * b), sub_block_sums8(xq + b * Q8K_BYTES));
}

/* The token passes of one tile: TILE_TOKENS at a time, the tail as its own specialised call */
#define TILE_PASSES(kind, span, shift)                                                                             \
    for (int64_t t0 = 0; t0 < T; t0 += TILE_TOKENS) {                                                              \
        const int tn = T - t0 < TILE_TOKENS ? (int)(T - t0) : TILE_TOKENS;                                         \
        const uint8_t *x = xq + t0 * xrow + Q8K_BYTES * i, *m8 = sums8 + (t0 * blocks + i) * 16;                   \
        switch (tn) {                                                                                              \
        case 8: tile_tokens(&tile, x, xrow, m8, m8row, 8, kind, span, shift, acc + t0); break;                   \
        case 7: tile_tokens(&tile, x, xrow, m8, m8row, 7, kind, span, shift, acc + t0); break;                   \
        case 6: tile_tokens(&tile, x, xrow, m8, m8row, 6, kind, span, shift, acc + t0); break;                   \
        case 5: tile_tokens(&tile, x, xrow, m8, m8row, 5, kind, span, shift, acc + t0); break;                   \
        case 4: tile_tokens(&tile, x, xrow, m8, m8row, 4, kind, span, shift, acc + t0); break;                   \
        case 3: tile_tokens(&tile, x, xrow, m8, m8row, 3, kind, span, shift, acc + t0); break;                   \
        case 2: tile_tokens(&tile, x, xrow, m8, m8row, 2, kind, span, shift, acc + t0); break;                   \
        default: tile_tokens(&tile, x, xrow, m8, m8row, 1, kind, span, shift, acc + t0); break;                    \
        }                                                                                                          \
    }

/* T > 1: 16 rows at a time; per block the rows decoded into the tile once, then every token's pass over it.
 * acc: [T] vectors of the 16 rows' sums (T x 64 bytes, from the caller's scratch); sums8: [T][blocks] x 8 int16
 * (16 bytes a token and block), each 32-value sub-block's quant sum, filled here for the formats whose scales and mins
 * come per 32 values (span 8) */
#define TILED_ROWS(name, decode, block_bytes, kind, span, shift)                                                   \
    static void name(int64_t n, const uint8_t *w, int64_t row_bytes, int64_t rows, const uint8_t *xq, int64_t T,   \
                     float *y, int64_t ldy, __m512 *acc, uint8_t *sums8) {                                         \
        const int64_t blocks = n / QK, xrow = blocks * Q8K_BYTES, m8row = blocks * 16;                             \
        wtile tile;                                                                                                \
        wblock dec[TILE_ROWS];                                                                                     \
        if (span == 8) sub_block_sums(xq, T * blocks, sums8);                                                      \
        for (int64_t r0 = 0; r0 < rows; r0 += TILE_ROWS) {                                                         \
            const int64_t rr = rows - r0 < TILE_ROWS ? rows - r0 : TILE_ROWS;                                      \
            for (int64_t t = 0; t < T; t++) acc[t] = _mm512_setzero_ps();                                          \
            for (int64_t i = 0; i < blocks; i++) {                                                                 \
                for (int64_t r = 0; r < rr; r++) {                                                                 \
                    const uint8_t *block = w + (r0 + r) * row_bytes + (block_bytes) * i;                           \
                    for (int line = 0; line < (block_bytes); line += 64) __builtin_prefetch(block + AHEAD + line); \
                    decode(block, &dec[r]);                                                                        \
                }                                                                                                  \
                fill_tile(&tile, dec, rr, kind, span);                                                             \
                TILE_PASSES(kind, span, shift)                                                                     \
            }                                                                                                      \
            const __mmask16 keep = (__mmask16)((1u << rr) - 1u);                                                   \
            for (int64_t t = 0; t < T; t++) _mm512_mask_storeu_ps(y + t * ldy + r0, keep, acc[t]);                 \
        }                                                                                                          \
    }

TILED_ROWS(tiled_q2k, decode_q2k, 84, HAS_MIN, 4, 0)
TILED_ROWS(tiled_q3k, decode_q3k, 110, HAS_OFF, 4, 2)
TILED_ROWS(tiled_q4k, decode_q4k, 144, HAS_MIN, 8, 0)
TILED_ROWS(tiled_q5k, decode_q5k, 176, HAS_MIN, 8, 0)
TILED_ROWS(tiled_q6k, decode_q6k, 210, HAS_OFF, 4, 5)
TILED_ROWS(tiled_iq3xxs, decode_iq3xxs, 98, SIGNED, 8, 7)
TILED_ROWS(tiled_iq3xxst, decode_iq3xxs_t, 98, SIGNED, 8, 7)
TILED_ROWS(tiled_iq3s, decode_iq3s, 110, SIGNED, 8, 7)
TILED_ROWS(tiled_iq3st, decode_iq3s_t, 110, SIGNED, 8, 7)
TILED_ROWS(tiled_iq4xs, decode_iq4xs, 136, SIGNED, 8, 7)
TILED_ROWS(tiled_iq2xxs, decode_iq2xxs, 66, SIGNED, 8, 7)
TILED_ROWS(tiled_iq2xs, decode_iq2xs, 74, SIGNED, 4, 7)
TILED_ROWS(tiled_iq2s, decode_iq2s, 82, SIGNED, 4, 7)
TILED_ROWS(tiled_iq1s, decode_iq1s, 50, SIGNED, 8, 7)
TILED_ROWS(tiled_iq1m, decode_iq1m, 56, SIGNED, 4, 7)
#endif

void dotk_dot(int64_t wtype, int64_t act_type, int64_t n, const void *w, int64_t row_bytes, int64_t rows,
              const void *xq, int64_t T, float *y, int64_t ldy) {
    const uint8_t *wb = (const uint8_t *)w, *x = (const uint8_t *)xq;
    typedef void (*row_loop)(int64_t, const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t);
    row_loop loop = NULL;
#if defined(DOTK_TILED)
    typedef void (*tile_loop)(int64_t, const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t, __m512 *, uint8_t *);
    tile_loop tiles = NULL;
#define PICK(rows_fn, tiled_fn) (loop = rows_fn, tiles = tiled_fn)
#else
#define PICK(rows_fn, tiled_fn) (loop = rows_fn)
#endif
    if (act_type == ACT_Q8_K && dotk_act_type(wtype, 0) == ACT_Q8_K) {
        switch (wtype) {
        case Q2_K: PICK(rows_q2k, tiled_q2k); break;
        case Q3_K: PICK(rows_q3k, tiled_q3k); break;
        case Q4_K: PICK(rows_q4k, tiled_q4k); break;
        case Q5_K: PICK(rows_q5k, tiled_q5k); break;
        case Q6_K: PICK(rows_q6k, tiled_q6k); break;
        case IQ3_XXS: PICK(rows_iq3xxs, tiled_iq3xxs); break;
        case IQ3_XXS_T: PICK(rows_iq3xxst, tiled_iq3xxst); break;
        case IQ3_S: PICK(rows_iq3s, tiled_iq3s); break;
        case IQ3_S_T: PICK(rows_iq3st, tiled_iq3st); break;
        case IQ4_XS: PICK(rows_iq4xs, tiled_iq4xs); break;
        case IQ2_XXS: PICK(rows_iq2xxs, tiled_iq2xxs); break;
        case IQ2_XS: PICK(rows_iq2xs, tiled_iq2xs); break;
        case IQ2_S: PICK(rows_iq2s, tiled_iq2s); break;
        case IQ1_S: PICK(rows_iq1s, tiled_iq1s); break;
        case IQ1_M: PICK(rows_iq1m, tiled_iq1m); break;
        }
    }
#undef PICK
#if defined(DOTK_TILED)
    /* from how many tokens the tiles beat the row loop (its decoding is spread over fewer products): the IQ
     * formats' costlier decoding pays sooner (measured on Zen 5, 2048 columns) */
    const int64_t from = wtype == Q2_K || wtype == Q3_K || wtype == Q4_K || wtype == Q5_K || wtype == Q6_K ? 8 : 4;
    const size_t acc_bytes = (size_t)T * sizeof(__m512), sums_bytes = (size_t)(T * (n / QK) * 16 + 63) & ~(size_t)63;
    __m512 *acc = tiles != NULL && T >= from ? aligned_alloc(64, acc_bytes + sums_bytes) : NULL;
    if (acc != NULL) {  /* else (out of memory too) the row loop */
        tiles(n, wb, row_bytes, rows, x, T, y, ldy, acc, (uint8_t *)acc + acc_bytes);
        free(acc);
        return;
    }
#endif
#if defined(DOTK_AVX2)
    if (loop != NULL && T >= tile2_from(wtype)) {
        typedef void (*tile2_loop)(int64_t, const uint8_t *, int64_t, int64_t, const uint8_t *, int64_t, float *, int64_t,
                                   uint8_t *, __m256 *);
        const tile2_loop tiles2 = wtype == Q2_K ? tiled2_q2k : wtype == Q3_K ? tiled2_q3k : wtype == Q4_K ? tiled2_q4k
                                : wtype == Q5_K ? tiled2_q5k : wtype == IQ3_S ? tiled2_iq3s
                                : wtype == IQ3_S_T ? tiled2_iq3st : NULL;
        const size_t packed_bytes = (size_t)(TILE * (n / QK) * PACKED_BYTES);
        uint8_t *scratch = tiles2 != NULL ? aligned_alloc(64, packed_bytes + 2 * TILE * sizeof(__m256)) : NULL;
        if (scratch != NULL) {  /* else (out of memory too) the row loop */
            tiles2(n, wb, row_bytes, rows, x, T, y, ldy, scratch, (__m256 *)(scratch + packed_bytes));
            free(scratch);
            return;
        }
    }
#endif
#if defined(DOTK_AVX512) || defined(DOTK_AVX2)
    order_fn order;
    four_rows_fn four;
    one_row_fn one;
    if (loop != NULL && T == 1 && one_token_ordered(wtype, &order, &four, &one)
        && ordered_one_token(n, wb, row_bytes, rows, x, y, order, four, one))
        return;
    if (loop != NULL && T == 1 && one_token_as_is(wtype, &four, &one)) {
        four_streams(n, wb, row_bytes, rows, x, y, four, one);
        return;
    }
#endif
    if (loop != NULL) {
        loop(n, wb, row_bytes, rows, x, T, y, ldy);
        return;
    }
    for (int64_t t = 0; t < T; t++)  /* not this family's (the wrappers never ask): loudly wrong, never stale */
        for (int64_t r = 0; r < rows; r++) y[t * ldy + r] = __builtin_nanf("");
}

/* The layout this library reads a format in fastest where it is held in memory: IQ3_XXS_T and IQ3_S_T for IQ3_XXS
 * and IQ3_S where the one-token AVX-512 loops run (cpu_iq3_t.h), else the format itself. */
int64_t dotk_resident_type(int64_t wtype) {
#if defined(IQ3_GEMV)
    order_fn order;
    four_rows_fn four;
    one_row_fn one;
    const int64_t held = wtype == IQ3_XXS ? IQ3_XXS_T : wtype == IQ3_S ? IQ3_S_T : wtype;
    if (held != wtype && tables_ready && one_token_ordered(held, &order, &four, &one)) return held;
#endif
    return wtype;
}

/* `blocks` blocks from one layout of a format to another (IQ3_XXS <-> IQ3_XXS_T, IQ3_S <-> IQ3_S_T; the same type:
 * a copy) -> 0, or -1 for a pair this file does not convert (src and dst do not overlap) */
int64_t dotk_repack(int64_t from, int64_t to, const void *src, void *dst, int64_t blocks) {
    const uint8_t *in = (const uint8_t *)src;
    uint8_t *out = (uint8_t *)dst;
    const int xxs = (from == IQ3_XXS || from == IQ3_XXS_T) && (to == IQ3_XXS || to == IQ3_XXS_T);
    if (!xxs && !((from == IQ3_S || from == IQ3_S_T) && (to == IQ3_S || to == IQ3_S_T))) return -1;
    const int64_t bytes = xxs ? IQ3XXS_BYTES : IQ3S_BYTES;
    void (*convert)(const uint8_t *, uint8_t *) = from == to ? NULL
        : xxs ? (to == IQ3_XXS_T ? iq3xxs_block_transposed : iq3xxs_block_back)
        : (to == IQ3_S_T ? iq3s_block_transposed : iq3s_block_back);
    if (convert == NULL) memcpy(out, in, (size_t)(bytes * blocks));
    else
        for (int64_t i = 0; i < blocks; i++) convert(in + bytes * i, out + bytes * i);
    return 0;
}
