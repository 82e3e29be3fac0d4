/* IQ3_S_T and IQ3_XXS_T: IQ3_S and IQ3_XXS with each block's sign bits transposed, moetier's resident layouts of
 * the two where the one-token AVX-512 loops read them (cpu_dotk.c dotk_resident_type; never in a file). Both
 * formats' values come in groups of 4 (a grid entry each, 64 a block); bit 4p + j of a block's natural signs is
 * the sign of value j of group p. The one-token loops dot 4 vectors, vector j holding value j of every group, so
 * a vector's mask is bit j of each nibble of those 256 bits; transposed, it is one qword loaded with a kmovq.
 *
 * IQ3_S (110 bytes) keeps its natural signs at bytes 74..105. IQ3_S_T keeps everything else where IQ3_S does and
 * its signs as 4 little-endian qwords, bit p of qword j that same sign: replacing a vpermq and 4 vpshufbitqmb a
 * block (C harness, one thread from L2, 2048-value rows: 13.5 -> 15.1 GB/s; two threads from DRAM, 1 MiB
 * granules: 23.2-24.6 -> 25.6-26.1).
 *
 * IQ3_XXS (98 bytes: d, 64 grid indices, 8 u32) spends 7 bits on each 8 values' signs (the 8th makes their
 * count of minus signs even) and a u32's top 4 bits on its 32 values' scale: 8 x (4 x 7 + 4) bits at bytes
 * 66..97. IQ3_XXS_T keeps d and the indices and puts there the masks of vectors 0, 1 and 2 (qwords at 66, 74,
 * 82), vector 3's signs of the even groups (bit g = group 2g, a u32 at 90: the odd groups' are each the parity of
 * the other 7 of their 8, iq3xxs_fourth_mask) and the 8 scales as nibbles (a u32 at 94, nibble k = sub-block
 * k), the same 224 + 32 bits. That replaces a vpmultishiftqb, a vpermi2b, a vpermq, 4 vpshufbitqmb and a vpermd
 * a block with 4 kmovq and a few scalar instructions (C harness, 2048-value rows, IQ3_XXS before both changes
 * against IQ3_XXS_T with the GFNI magnitudes of cpu_dotk.c: one thread from L2 11.7-12.1 -> 15.6-15.9 GB/s, two
 * threads from DRAM, 1 MiB granules, 21.5-22.3 -> 27.4-28.6; IQ3_XXS with the magnitudes alone 12.2-12.5 and
 * 22.8-24.2).
 *
 * Every other reader (the row loops, the tiles, cpu_formats.c's rows) puts a block back first (*_block_back). */
#ifndef CPU_IQ3_T_H
#define CPU_IQ3_T_H

#include <stdint.h>
#include <string.h>
#if defined(__BMI2__)
#include <immintrin.h>
#endif

enum { IQ3S_SIGNS_AT = 74, IQ3S_SIGN_BYTES = 32, IQ3S_BYTES = 110 };
enum { IQ3XXS_SIGNS_AT = 66, IQ3XXS_LAST_AT = 90, IQ3XXS_SCALES_AT = 94, IQ3XXS_BYTES = 98 };
#define IQ3_EVEN_BITS 0x5555555555555555ull

/* the bits of x under mask, packed low (pext), and back (pdep) */
static inline uint64_t bits_gather(uint64_t x, uint64_t mask) {
#if defined(__BMI2__)
    return _pext_u64(x, mask);
#else
    uint64_t r = 0;
    for (int i = 0; mask; mask &= mask - 1, i++) r |= (x >> __builtin_ctzll(mask) & 1) << i;
    return r;
#endif
}

static inline uint64_t bits_scatter(uint64_t x, uint64_t mask) {
#if defined(__BMI2__)
    return _pdep_u64(x, mask);
#else
    uint64_t r = 0;
    for (int i = 0; mask; mask &= mask - 1, i++) r |= (x >> i & 1) << __builtin_ctzll(mask);
    return r;
#endif
}

/* 32 natural sign bytes -> the 4 transposed qwords (qword k of the natural bits: groups 16k .. 16k + 15) */
static inline void iq3_signs_transposed(const uint8_t *in, uint64_t t[4]) {
    t[0] = t[1] = t[2] = t[3] = 0;
    for (int k = 0; k < 4; k++) {
        uint64_t o;
        memcpy(&o, in + 8 * k, 8);
        for (int j = 0; j < 4; j++) t[j] |= bits_gather(o, 0x1111111111111111ull << j) << 16 * k;
    }
}

/* the 4 transposed qwords -> 32 natural sign bytes */
static inline void iq3_signs_back(const uint64_t t[4], uint8_t *out) {
    for (int k = 0; k < 4; k++) {
        uint64_t o = 0;
        for (int j = 0; j < 4; j++) o |= bits_scatter(t[j] >> 16 * k & 0xffff, 0x1111111111111111ull << j);
        memcpy(out + 8 * k, &o, 8);
    }
}

/* an IQ3_S block as IQ3_S_T (110 bytes into out), and back */
static inline void iq3s_block_transposed(const uint8_t *b, uint8_t *out) {
    uint64_t t[4];
    memcpy(out, b, IQ3S_BYTES);
    iq3_signs_transposed(b + IQ3S_SIGNS_AT, t);
    memcpy(out + IQ3S_SIGNS_AT, t, IQ3S_SIGN_BYTES);
}

/* an IQ3_S_T block's 32 natural sign bytes (IQ3_S's) */
static inline void iq3s_t_signs(const uint8_t *b, uint8_t *natural) {
    uint64_t t[4];
    memcpy(t, b + IQ3S_SIGNS_AT, IQ3S_SIGN_BYTES);
    iq3_signs_back(t, natural);
}

static inline void iq3s_block_back(const uint8_t *b, uint8_t *out) {
    memcpy(out, b, IQ3S_BYTES);
    iq3s_t_signs(b, out + IQ3S_SIGNS_AT);
}

/* IQ3_XXS_T's mask of vector 3: its even groups' bits (packed, bit g = group 2g) in place, each odd group's the
 * parity of the other 7 signs of its 8 (groups 2g and 2g + 1: bit 2g of m0 ^ m1 ^ m2 ^ m3 and bit 2g + 1 of
 * m0 ^ m1 ^ m2) */
static inline uint64_t iq3xxs_fourth_mask(uint64_t m0, uint64_t m1, uint64_t m2, uint32_t even) {
    const uint64_t m3 = bits_scatter(even, IQ3_EVEN_BITS), odd = m0 ^ m1 ^ m2 ^ m3;
    return m3 | ((odd ^ odd >> 1) & IQ3_EVEN_BITS) << 1;
}

/* an IQ3_XXS block as IQ3_XXS_T (98 bytes into out), and back; 8 values' sign field f (7 bits) is the pattern
 * f | parity(f) << 7, bit t the sign of value t of the 8 */
static inline void iq3xxs_block_transposed(const uint8_t *b, uint8_t *out) {
    uint8_t natural[IQ3S_SIGN_BYTES];  /* byte g: the pattern of values 8g .. 8g + 7 (groups 2g, 2g + 1) */
    uint32_t scales = 0;
    for (int k = 0; k < 8; k++) {
        uint32_t aux;
        memcpy(&aux, b + IQ3XXS_SIGNS_AT + 4 * k, 4);
        for (int i = 0; i < 4; i++) {
            const unsigned f = aux >> 7 * i & 127;
            natural[4 * k + i] = (uint8_t)(f | (unsigned)(__builtin_popcount(f) & 1) << 7);
        }
        scales |= (aux >> 28) << 4 * k;
    }
    uint64_t t[4];
    iq3_signs_transposed(natural, t);
    const uint32_t even = (uint32_t)bits_gather(t[3], IQ3_EVEN_BITS);
    memcpy(out, b, IQ3XXS_SIGNS_AT);
    memcpy(out + IQ3XXS_SIGNS_AT, t, 24);
    memcpy(out + IQ3XXS_LAST_AT, &even, 4);
    memcpy(out + IQ3XXS_SCALES_AT, &scales, 4);
}

/* an IQ3_XXS_T block's 32 natural sign bytes (byte g: the pattern of values 8g .. 8g + 7, parity bit included) */
static inline void iq3xxs_t_signs(const uint8_t *b, uint8_t *natural) {
    uint64_t t[4];
    uint32_t even;
    memcpy(t, b + IQ3XXS_SIGNS_AT, 24);
    memcpy(&even, b + IQ3XXS_LAST_AT, 4);
    t[3] = iq3xxs_fourth_mask(t[0], t[1], t[2], even);
    iq3_signs_back(t, natural);
}

static inline void iq3xxs_block_back(const uint8_t *b, uint8_t *out) {
    uint8_t natural[IQ3S_SIGN_BYTES];
    uint32_t scales;
    iq3xxs_t_signs(b, natural);
    memcpy(&scales, b + IQ3XXS_SCALES_AT, 4);
    memcpy(out, b, IQ3XXS_SIGNS_AT);
    for (int k = 0; k < 8; k++) {
        uint32_t aux = (scales >> 4 * k & 15) << 28;
        for (int i = 0; i < 4; i++) aux |= (uint32_t)(natural[4 * k + i] & 127) << 7 * i;
        memcpy(out + IQ3XXS_SIGNS_AT + 4 * k, &aux, 4);
    }
}

#endif
