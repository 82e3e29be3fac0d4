/* AVX-512 VNNI helpers of the 16-row tiles (cpu_dotk.c's K-quant and IQ tiles, cpu_dot32.c's 32-value block
 * tiles): a vpdpbusd / vpdpwssd whose second operand is a dword broadcast from memory, and the 16 x 16 dword
 * transpose that puts 16 weight rows on a vector's lanes. Included by each family's file (static inline). */
#ifndef MOETIER_CPU_VNNI_H
#define MOETIER_CPU_VNNI_H
#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#include <stdint.h>

/* acc + the dot products of w's unsigned bytes with the 4 signed bytes at p, broadcast: vpdpbusd with its
 * broadcast operand (GCC keeps a separate vpbroadcastd and copies the accumulators around it) */
static inline __m512i dpbusd_bcast(__m512i acc, __m512i w, const uint8_t *p) {
    __asm__("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(w), "m"(*(const uint32_t *)p));
    return acc;
}

/* acc + the two int16 products of each dword of v with the int16 pair at p, broadcast (vpdpwssd) */
static inline __m512i dpwssd_bcast(__m512i acc, __m512i v, const uint8_t *p) {
    __asm__("vpdpwssd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(v), "m"(*(const uint32_t *)p));
    return acc;
}

/* 16 vectors of 16 dwords, rows in, columns out: out[c] lane r = in[r] lane c */
static inline void transpose16(__m512i v[16]) {
    __m512i t[16], x[16];
    for (int i = 0; i < 8; i++) {
        t[2 * i] = _mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]);
    }
    for (int q = 0; q < 4; q++) {  /* x[4q + j] lane l: column 4l + j of rows 4q..4q+3 */
        x[4 * q] = _mm512_unpacklo_epi64(t[4 * q], t[4 * q + 2]);
        x[4 * q + 1] = _mm512_unpackhi_epi64(t[4 * q], t[4 * q + 2]);
        x[4 * q + 2] = _mm512_unpacklo_epi64(t[4 * q + 1], t[4 * q + 3]);
        x[4 * q + 3] = _mm512_unpackhi_epi64(t[4 * q + 1], t[4 * q + 3]);
    }
    for (int j = 0; j < 4; j++) {  /* the 4 x 4 transpose of 128-bit lanes across the row quads */
        const __m512i a = _mm512_shuffle_i32x4(x[j], x[4 + j], 0x44), b = _mm512_shuffle_i32x4(x[j], x[4 + j], 0xee);
        const __m512i c = _mm512_shuffle_i32x4(x[8 + j], x[12 + j], 0x44), d = _mm512_shuffle_i32x4(x[8 + j], x[12 + j], 0xee);
        v[j] = _mm512_shuffle_i32x4(a, c, 0x88), v[4 + j] = _mm512_shuffle_i32x4(a, c, 0xdd);
        v[8 + j] = _mm512_shuffle_i32x4(b, d, 0x88), v[12 + j] = _mm512_shuffle_i32x4(b, d, 0xdd);
    }
}

#endif
#endif
