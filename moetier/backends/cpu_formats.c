/* moetier stored-format rows: one row of an expert matrix, in its GGML format, to float32.
 *
 * Guarantee: every value is bit for bit what gguf.quants.dequantize (the
 * gguf package's numpy code, the reference) gives for the same bytes: each
 * format repeats that code's float32 operations in its order, and this file
 * is built with STRICT_FLAGS (moetier/native.py: no reassociation, no fused
 * multiply-add), so the compiler keeps them. Integer unpacking may differ in
 * form; it is exact either way. float16 fields convert as numpy converts
 * them (subnormals exact, NaN payloads kept, signalling ones unquieted).
 * Blocks are little-endian, as GGML writes them (the host must be too).
 *
 * The IQ lookup tables (grids, sign patterns, kvalues) are not spelled out
 * here: moetier/backends/iq_tables.py takes them from the gguf package and
 * hands them over once (format_tables) before any row is read (MXFP4's 16
 * values are: the tests compare every format with the package, bit for
 * bit). Inputs are checked by the Python wrappers; nothing here validates a
 * type or a size.
 * cpu_kernels.c's decode calls dequantize_row through a pointer.
 */
#include <stdint.h>
#include <string.h>

#include "cpu_iq3_t.h"

enum {
    F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11, Q4_K = 12,
    Q5_K = 13, Q6_K = 14, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19, IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22,
    IQ4_XS = 23, IQ1_M = 29, BF16 = 30, MXFP4 = 39,
    IQ3_XXS_T = 118, IQ3_S_T = 121,  /* moetier's resident IQ3_XXS and IQ3_S (cpu_iq3_t.h), not GGML types */
    TYPES = 122,
};

/* (values per block, bytes per block) by GGML type id; {0, 0}: not a format read here.
 * cpu_kernels.py refuses this library if any entry differs from moetier.model.formats. */
static const int64_t GEOMETRY[TYPES][2] = {
    [F32] = {1, 4}, [F16] = {1, 2}, [BF16] = {1, 2}, [Q4_0] = {32, 18}, [Q4_1] = {32, 20}, [Q5_0] = {32, 22},
    [Q5_1] = {32, 24}, [Q8_0] = {32, 34}, [Q2_K] = {256, 84}, [Q3_K] = {256, 110}, [Q4_K] = {256, 144},
    [Q5_K] = {256, 176}, [Q6_K] = {256, 210}, [IQ2_XXS] = {256, 66}, [IQ2_XS] = {256, 74}, [IQ3_XXS] = {256, 98},
    [IQ4_NL] = {32, 18}, [IQ3_S] = {256, 110}, [IQ2_S] = {256, 82}, [IQ4_XS] = {256, 136}, [IQ1_S] = {256, 50},
    [IQ1_M] = {256, 56}, [MXFP4] = {32, 17}, [IQ3_XXS_T] = {256, 98}, [IQ3_S_T] = {256, 110},
};

/* -> 1 and the type's block geometry, or 0 for a type this file does not read */
int64_t format_geometry(int64_t type, int64_t *block, int64_t *block_bytes) {
    if (type < 0 || type >= TYPES || GEOMETRY[type][0] == 0) return 0;
    *block = GEOMETRY[type][0];
    *block_bytes = GEOMETRY[type][1];
    return 1;
}

static uint8_t grid_iq3_xxs[256][4], grid_iq3_s[512][4], ksigns[128];
static uint8_t grid_iq2_xxs[256][8], grid_iq2_xs[512][8], grid_iq2_s[1024][8];
static int8_t kvalues[16], grid_iq1[2048][8];

/* The IQ tables, from the gguf package: IQ3_XXS's grid [256, 4] and IQ3_S's [512, 4] (values 1..62,
 * as bytes), IQ2_XXS's 128 sign patterns (bit i set: value i of 8 is negated), IQ4_NL's 16 kvalues, and the
 * IQ2 grids: IQ2_XXS's [256, 8], IQ2_XS's [512, 8], IQ2_S's [1024, 8] (values 8, 25, 43), and IQ1_S's (and
 * IQ1_M's) [2048, 8] (values -1, 0, 1). */
void format_tables(const uint8_t *iq3_xxs, const uint8_t *iq3_s, const uint8_t *signs, const int8_t *kv,
                   const uint8_t *iq2_xxs, const uint8_t *iq2_xs, const uint8_t *iq2_s, const int8_t *iq1) {
    memcpy(grid_iq3_xxs, iq3_xxs, sizeof grid_iq3_xxs);
    memcpy(grid_iq3_s, iq3_s, sizeof grid_iq3_s);
    memcpy(ksigns, signs, sizeof ksigns);
    memcpy(kvalues, kv, sizeof kvalues);
    memcpy(grid_iq2_xxs, iq2_xxs, sizeof grid_iq2_xxs);
    memcpy(grid_iq2_xs, iq2_xs, sizeof grid_iq2_xs);
    memcpy(grid_iq2_s, iq2_s, sizeof grid_iq2_s);
    memcpy(grid_iq1, iq1, sizeof grid_iq1);
}

static inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

/* float16 bits -> float32, exactly, as numpy converts (npy_halfbits_to_floatbits). Branch-free, so a row
 * of them vectorizes: normal numbers rebias the exponent; inf and NaN keep their payload; zeros and
 * subnormals are 2^-14 * (1 + m / 1024) - 2^-14 = m * 2^-24, an exact subtraction. */
static inline float half_float(uint16_t h) {
    const uint32_t shifted = (uint32_t)(h & 0x7fffu) << 13, exponent = shifted & 0x0f800000u;
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t normal = shifted + (112u << 23), special = shifted + (224u << 23);
    const uint32_t small = float_bits(bits_float(shifted + (113u << 23)) - 0x1p-14f);
    return bits_float(sign | (exponent == 0x0f800000u ? special : exponent == 0 ? small : normal));
}

static inline float f16_at(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return half_float(h);
}

static inline uint32_t u32_at(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* ---- one block of each format -> y[block]; the arithmetic of its gguf.quants dequantize_blocks ----
 * Loops run over runs of values that share a scale and a bit position, so they vectorize; a sign is a
 * factor of +-1 picked without a branch (a branch on a random bit mispredicts half the time). */

static void block_q4_0(const uint8_t *restrict b, float *restrict y) {  /* d * (q - 8) */
    const float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) y[j] = d * (float)((qs[j] & 15) - 8);
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((qs[j] >> 4) - 8);
}

static void block_q4_1(const uint8_t *restrict b, float *restrict y) {  /* d * q + m */
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) y[j] = d * (float)(qs[j] & 15) + m;
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)(qs[j] >> 4) + m;
}

static void block_q5_0(const uint8_t *restrict b, float *restrict y) {  /* d * (q - 16), q's fifth bit from qh */
    const float d = f16_at(b);
    const uint32_t qh = u32_at(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) y[j] = d * (float)((int)((qs[j] & 15) | ((qh >> j) & 1) << 4) - 16);
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((int)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) - 16);
}

static void block_q5_1(const uint8_t *restrict b, float *restrict y) {  /* d * q + m */
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) y[j] = d * (float)((qs[j] & 15) | ((qh >> j) & 1) << 4) + m;
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)((qs[j] >> 4) | ((qh >> (j + 16)) & 1) << 4) + m;
}

static void block_q8_0(const uint8_t *restrict b, float *restrict y) {  /* q * d */
    const float d = f16_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++) y[j] = (float)qs[j] * d;
}

/* Q2_K and Q3_K's 2-bit values: value h * 128 + s * 32 + l is bits 2s of byte h * 32 + l, in 16 groups of 16 */
static void block_q2_k(const uint8_t *restrict b, float *restrict y) {  /* (d * sc) * q - dmin * m */
    const uint8_t *scales = b, *qs = b + 16;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                const int group = 8 * h + 2 * s + half, at = 32 * h + 16 * half;
                const float dl = d * (float)(scales[group] & 15), ml = dmin * (float)(scales[group] >> 4);
                float *out = y + 16 * group;
                for (int l = 0; l < 16; l++) out[l] = dl * (float)((qs[at + l] >> (2 * s)) & 3) - ml;
            }
}

static void block_q3_k(const uint8_t *restrict b, float *restrict y) {  /* (d * (sc - 32)) * q, q in -4..3 */
    const uint8_t *hmask = b, *qs = b + 32, *scales = b + 96;
    const float d = f16_at(b + 108);
    for (int h = 0; h < 2; h++)
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                const int group = 8 * h + 2 * s + half, at = 32 * h + 16 * half, bit = 4 * h + s;
                const int low = group < 8 ? scales[group] & 15 : scales[group - 8] >> 4;
                const int high = (scales[8 + group % 4] >> (2 * (group / 4))) & 3;
                const float dl = d * (float)((low | high << 4) - 32);
                float *out = y + 16 * group;
                for (int l = 0; l < 16; l++) {  /* a clear mask bit subtracts 4 */
                    const int q = ((qs[at + l] >> (2 * s)) & 3) - ((((hmask[16 * half + l] >> bit) & 1) ^ 1) << 2);
                    out[l] = dl * (float)q;
                }
            }
}

/* Q4_K and Q5_K's 6-bit scales and mins of their 8 groups of 32, unpacked from 12 bytes */
static void scale_min_k(const uint8_t *s, int *sc, int *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 2) & 0x30);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 2) & 0x30);
    }
}

static void block_q4_k(const uint8_t *restrict b, float *restrict y) {  /* 8 groups of 32: (d * sc) * q - dmin * m */
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *qs = b + 16;
    int sc[8], mn[8];
    scale_min_k(b + 4, sc, mn);
    for (int j = 0; j < 8; j++) {  /* group j: nibble j % 2 of bytes (j / 2) * 32 .. + 32 */
        const float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
        const uint8_t *q = qs + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) y[32 * j + l] = dj * (float)((q[l] >> shift) & 15) - mj;
    }
}

static void block_q5_k(const uint8_t *restrict b, float *restrict y) {  /* Q4_K with a fifth bit per value from qh */
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *qh = b + 16, *qs = b + 48;
    int sc[8], mn[8];
    scale_min_k(b + 4, sc, mn);
    for (int j = 0; j < 8; j++) {
        const float dj = d * (float)sc[j], mj = dmin * (float)mn[j];
        const uint8_t *q = qs + (j / 2) * 32;
        const int shift = 4 * (j % 2);
        for (int l = 0; l < 32; l++) y[32 * j + l] = dj * (float)(((q[l] >> shift) & 15) | ((qh[l] >> j) & 1) << 4) - mj;
    }
}

static void block_q6_k(const uint8_t *restrict b, float *restrict y) {  /* 16 groups of 16: (d * sc) * (q - 32) */
    const int8_t *scales = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    for (int h = 0; h < 2; h++) {  /* half h: value 32 s + l (s < 4) is nibble s / 2 of ql[32 (s % 2) + l], bits 2s of qh[l] */
        const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
        for (int s = 0; s < 4; s++)
            for (int half = 0; half < 2; half++) {
                const int group = 8 * h + 2 * s + half, at = 16 * half;
                const float dl = d * (float)scales[group];
                const uint8_t *low = ql + 32 * (s % 2) + at;
                float *out = y + 16 * group;
                for (int l = 0; l < 16; l++)
                    out[l] = dl * (float)((((low[l] >> (4 * (s / 2))) & 15) | ((qh[at + l] >> (2 * s)) & 3) << 4) - 32);
            }
    }
}

static void block_iq3_xxs(const uint8_t *restrict b, float *restrict y) {  /* 8 groups of 32: ((d * (0.5 + s) * 0.5) * grid) * sign */
    const float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int ib = 0; ib < 8; ib++) {
        const uint32_t aux = u32_at(b + 66 + 4 * ib);  /* 4 bits of scale, four 7-bit sign indices */
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.5f;
        for (int g = 0; g < 4; g++) {  /* 8 values: two grid rows of 4, the signs of one pattern */
            const uint8_t signs = ksigns[(aux >> (7 * g)) & 127];
            const uint8_t *grid0 = grid_iq3_xxs[qs[8 * ib + 2 * g]], *grid1 = grid_iq3_xxs[qs[8 * ib + 2 * g + 1]];
            float *out = y + 32 * ib + 8 * g;
            for (int i = 0; i < 4; i++) out[i] = db * (float)grid0[i] * (float)(1 - 2 * ((signs >> i) & 1));
            for (int i = 0; i < 4; i++) out[4 + i] = db * (float)grid1[i] * (float)(1 - 2 * ((signs >> (4 + i)) & 1));
        }
    }
}

static void block_iq3_s(const uint8_t *restrict b, float *restrict y) {  /* 8 groups of 32: ((d * (1 + 2 sc)) * grid) * sign */
    const float d = f16_at(b);
    const uint8_t *qs = b + 2, *qh = b + 66, *signs = b + 74, *scales = b + 106;
    for (int ib = 0; ib < 8; ib++) {
        const float db = d * (float)(1 + 2 * ((scales[ib / 2] >> (4 * (ib % 2))) & 15));
        for (int k = 0; k < 8; k++) {  /* grid row i (4 values): 8 bits of index from qs, the ninth from qh */
            const int i = 8 * ib + k, sign = signs[i / 2] >> (4 * (i % 2));
            const uint8_t *grid = grid_iq3_s[qs[i] | ((qh[ib] >> k) & 1) << 8];
            float *out = y + 4 * i;
            for (int c = 0; c < 4; c++) out[c] = db * (float)grid[c] * ((sign >> c) & 1 ? -1.f : 1.f);
        }
    }
}

/* The IQ2 formats: 32 grid rows of 8 values, each with a byte of signs (bit i set: value i negated), and a
 * 4-bit scale s per 16 or 32 values: ((d * (0.5 + s)) * 0.25) * grid * sign; iq2_rows writes one row. */
static inline void iq2_rows(float db, const uint8_t *grid, uint8_t signs, float *out) {
    for (int i = 0; i < 8; i++) out[i] = db * (float)grid[i] * ((signs >> i) & 1 ? -1.f : 1.f);
}

static void block_iq2_xxs(const uint8_t *restrict b, float *restrict y) {  /* 8 groups of 32: 4 index bytes, a u32 of signs and scale */
    const float d = f16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        const uint8_t *g = b + 2 + 8 * ib;
        const uint32_t aux = u32_at(g + 4);  /* four 7-bit sign indices, 4 bits of scale */
        const float db = d * (0.5f + (float)(aux >> 28)) * 0.25f;
        for (int k = 0; k < 4; k++) iq2_rows(db, grid_iq2_xxs[g[k]], ksigns[(aux >> (7 * k)) & 127], y + 32 * ib + 8 * k);
    }
}

static void block_iq2_xs(const uint8_t *restrict b, float *restrict y) {  /* 16 groups of 16: u16 9-bit index | 7-bit signs */
    const float d = f16_at(b);
    for (int group = 0; group < 16; group++) {
        const float db = d * (0.5f + (float)((b[66 + group / 2] >> (4 * (group % 2))) & 15)) * 0.25f;
        for (int k = 2 * group; k < 2 * group + 2; k++) {
            const uint16_t q = (uint16_t)(b[2 + 2 * k] | b[3 + 2 * k] << 8);
            iq2_rows(db, grid_iq2_xs[q & 511], ksigns[q >> 9], y + 8 * k);
        }
    }
}

static void block_iq2_s(const uint8_t *restrict b, float *restrict y) {  /* 16 groups of 16: 10-bit indices, sign bytes */
    const float d = f16_at(b);
    const uint8_t *qs = b + 2, *signs = b + 34, *qh = b + 66, *scales = b + 74;
    for (int group = 0; group < 16; group++) {
        const float db = d * (0.5f + (float)((scales[group / 2] >> (4 * (group % 2))) & 15)) * 0.25f;
        for (int k = 2 * group; k < 2 * group + 2; k++)
            iq2_rows(db, grid_iq2_s[qs[k] | ((qh[k / 4] >> (2 * (k % 4))) & 3) << 8], signs[k], y + 8 * k);
    }
}

/* The IQ1 formats: 32 rows of 8 grid values (-1, 0, 1) plus the row's delta (+-0.125), each 16 or 32 values
 * scaled by d * (2s + 1): dl * (grid + delta) */
static inline void iq1_row(float dl, const int8_t *grid, float delta, float *out) {
    for (int i = 0; i < 8; i++) out[i] = dl * ((float)grid[i] + delta);
}

static void block_iq1_s(const uint8_t *restrict b, float *restrict y) {  /* 8 groups of 32: a uint16 of high bits each */
    const float d = f16_at(b);
    for (int ib = 0; ib < 8; ib++) {
        const unsigned qh = (unsigned)(b[34 + 2 * ib] | b[35 + 2 * ib] << 8);
        const float dl = d * (float)(2 * ((qh >> 12) & 7) + 1), delta = qh & 0x8000u ? -0.125f : 0.125f;
        for (int l = 0; l < 4; l++)
            iq1_row(dl, grid_iq1[b[2 + 4 * ib + l] | ((qh >> (3 * l)) & 7) << 8], delta, y + 32 * ib + 8 * l);
    }
}

static void block_iq1_m(const uint8_t *restrict b, float *restrict y) {  /* 16 groups of 16; d in the scales' top nibbles */
    uint16_t sc[4];
    for (int j = 0; j < 4; j++) sc[j] = (uint16_t)(b[48 + 2 * j] | b[49 + 2 * j] << 8);
    const uint16_t dbits = (uint16_t)((sc[0] >> 12) | ((sc[1] >> 8) & 0x00f0) | ((sc[2] >> 4) & 0x0f00) | (sc[3] & 0xf000));
    const float d = f16_at((const uint8_t *)&dbits);
    for (int group = 0; group < 16; group++) {
        const float dl = d * (float)(2 * ((sc[group / 4] >> (3 * (group % 4))) & 7) + 1);
        for (int k = 2 * group; k < 2 * group + 2; k++) {  /* row k: a nibble of qh, three index bits and delta's sign */
            const unsigned nib = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
            iq1_row(dl, grid_iq1[b[k] | (nib & 7) << 8], nib & 8 ? -0.125f : 0.125f, y + 8 * k);
        }
    }
}

/* MXFP4: an E8M0 scale byte e, taken as 2^(e - 128) (ggml_e8m0_to_fp32_half), times the doubled E2M1 values */
static void block_mxfp4(const uint8_t *restrict b, float *restrict y) {
    static const int8_t kv[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    const float d = bits_float(b[0] < 2 ? 0x00200000u << b[0] : (uint32_t)(b[0] - 1) << 23);
    for (int j = 0; j < 16; j++) y[j] = d * (float)kv[b[1 + j] & 15];
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)kv[b[1 + j] >> 4];
}

static void block_iq4_nl(const uint8_t *restrict b, float *restrict y) {  /* d * kvalue */
    const float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) y[j] = d * (float)kvalues[qs[j] & 15];
    for (int j = 0; j < 16; j++) y[j + 16] = d * (float)kvalues[qs[j] >> 4];
}

static void block_iq4_xs(const uint8_t *restrict b, float *restrict y) {  /* 8 groups of 32: (d * (sc - 32)) * kvalue */
    const float d = f16_at(b);
    const uint16_t scales_h = (uint16_t)(b[2] | b[3] << 8);
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++) {
        const int sc = (((scales_l[ib / 2] >> (4 * (ib % 2))) & 15) | ((scales_h >> (2 * ib)) & 3) << 4) - 32;
        const float dl = d * (float)sc;
        const uint8_t *q = qs + 16 * ib;
        for (int l = 0; l < 16; l++) y[32 * ib + l] = dl * (float)kvalues[q[l] & 15];
        for (int l = 0; l < 16; l++) y[32 * ib + 16 + l] = dl * (float)kvalues[q[l] >> 4];
    }
}

/* ---- rows ----------------------------------------------------------------------------------- */

static void block_iq3_xxs_t(const uint8_t *restrict b, float *restrict y) {
    uint8_t block[IQ3XXS_BYTES];
    iq3xxs_block_back(b, block);
    block_iq3_xxs(block, y);
}

static void block_iq3_s_t(const uint8_t *restrict b, float *restrict y) {
    uint8_t block[IQ3S_BYTES];
    iq3s_block_back(b, block);
    block_iq3_s(block, y);
}

#define BLOCKS(fn, values, bytes) \
    for (int64_t n = cols / (values), i = 0; i < n; i++) fn(src + (bytes) * i, dst + (values) * i); \
    return src + (cols / (values)) * (bytes)

/* One row of `cols` values of GGML type `type` at src -> dst[cols]; returns the address of the next row. */
const uint8_t *dequantize_row(int64_t type, const uint8_t *src, float *dst, int64_t cols) {
    switch (type) {
    case F32:
        memcpy(dst, src, (size_t)cols * 4);
        return src + 4 * cols;
    case F16:
        for (int64_t c = 0; c < cols; c++) dst[c] = f16_at(src + 2 * c);
        return src + 2 * cols;
    case BF16:
        for (int64_t c = 0; c < cols; c++) dst[c] = bits_float((uint32_t)(src[2 * c] | src[2 * c + 1] << 8) << 16);
        return src + 2 * cols;
    case Q4_0: BLOCKS(block_q4_0, 32, 18);
    case Q4_1: BLOCKS(block_q4_1, 32, 20);
    case Q5_0: BLOCKS(block_q5_0, 32, 22);
    case Q5_1: BLOCKS(block_q5_1, 32, 24);
    case Q8_0: BLOCKS(block_q8_0, 32, 34);
    case Q2_K: BLOCKS(block_q2_k, 256, 84);
    case Q3_K: BLOCKS(block_q3_k, 256, 110);
    case Q4_K: BLOCKS(block_q4_k, 256, 144);
    case Q5_K: BLOCKS(block_q5_k, 256, 176);
    case Q6_K: BLOCKS(block_q6_k, 256, 210);
    case IQ2_XXS: BLOCKS(block_iq2_xxs, 256, 66);
    case IQ2_XS: BLOCKS(block_iq2_xs, 256, 74);
    case IQ2_S: BLOCKS(block_iq2_s, 256, 82);
    case IQ1_S: BLOCKS(block_iq1_s, 256, 50);
    case IQ1_M: BLOCKS(block_iq1_m, 256, 56);
    case IQ3_XXS: BLOCKS(block_iq3_xxs, 256, 98);
    case IQ4_NL: BLOCKS(block_iq4_nl, 32, 18);
    case MXFP4: BLOCKS(block_mxfp4, 32, 17);
    case IQ3_S: BLOCKS(block_iq3_s, 256, 110);
    case IQ3_XXS_T: BLOCKS(block_iq3_xxs_t, 256, 98);
    case IQ3_S_T: BLOCKS(block_iq3_s_t, 256, 110);
    case IQ4_XS: BLOCKS(block_iq4_xs, 256, 136);
    default:
        return src;  /* unreachable: the wrappers pass only types format_geometry knows */
    }
}

/* `rows` rows of `cols` values, one after the other from src -> dst[rows, cols] */
void dequantize_rows(int64_t type, const uint8_t *src, int64_t rows, int64_t cols, float *dst) {
    for (int64_t r = 0; r < rows; r++) src = dequantize_row(type, src, dst + r * cols, cols);
}
