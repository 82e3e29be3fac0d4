/* IQ3_S_T: IQ3_S with each block's 256 sign bits transposed, moetier's resident layout of IQ3_S where the
 * one-token AVX-512 loop reads it (cpu_dotk.c dotk_resident_type; never in a file).
 *
 * An IQ3_S block (110 bytes) keeps its signs at bytes 74..105, bit 4p + j the sign of value j of group p (p = 0..63,
 * 4 values a group). IQ3_S_T keeps everything else where IQ3_S does and its signs as 4 little-endian qwords, bit p
 * of qword j that same sign: a qword is the mask of one of the loop's 4 vectors (value j of each group), loaded
 * with one kmovq where IQ3_S's took a vpermq and a vpshufbitqmb each (C harness, one thread from L2, 2048-value
 * rows: 13.5 -> 15.1 GB/s; two threads from DRAM, 1 MiB granules: 23.2-24.6 -> 25.6-26.1). Every other reader
 * (the row loops, the tiles, cpu_formats.c's rows) puts the signs back first (iq3s_signs_back). */
#ifndef CPU_IQ3S_T_H
#define CPU_IQ3S_T_H

#include <stdint.h>
#include <string.h>
#if defined(__BMI2__)
#include <immintrin.h>
#endif

enum { IQ3S_SIGNS_AT = 74, IQ3S_SIGN_BYTES = 32 };

/* bits j, j + 4, .., j + 60 of x -> bits 0..15, and back */
static inline uint64_t nibble_bit_gather(uint64_t x, int j) {
#if defined(__BMI2__)
    return _pext_u64(x, 0x1111111111111111ull << j);
#else
    uint64_t r = 0;
    for (int i = 0; i < 16; i++) r |= (x >> (4 * i + j) & 1) << i;
    return r;
#endif
}

static inline uint64_t nibble_bit_scatter(uint64_t x, int j) {
#if defined(__BMI2__)
    return _pdep_u64(x, 0x1111111111111111ull << j);
#else
    uint64_t r = 0;
    for (int i = 0; i < 16; i++) r |= (x >> i & 1) << (4 * i + j);
    return r;
#endif
}

/* IQ3_S's 32 sign bytes -> IQ3_S_T's (qword k of IQ3_S: groups 16k .. 16k + 15) */
static inline void iq3s_signs_transposed(const uint8_t *in, uint8_t *out) {
    uint64_t t[4] = {0, 0, 0, 0};
    for (int k = 0; k < 4; k++) {
        uint64_t o;
        memcpy(&o, in + 8 * k, 8);
        for (int j = 0; j < 4; j++) t[j] |= nibble_bit_gather(o, j) << 16 * k;
    }
    memcpy(out, t, IQ3S_SIGN_BYTES);
}

/* IQ3_S_T's 32 sign bytes -> IQ3_S's */
static inline void iq3s_signs_back(const uint8_t *in, uint8_t *out) {
    uint64_t t[4];
    memcpy(t, in, IQ3S_SIGN_BYTES);
    for (int k = 0; k < 4; k++) {
        uint64_t o = 0;
        for (int j = 0; j < 4; j++) o |= nibble_bit_scatter(t[j] >> 16 * k & 0xffff, j);
        memcpy(out + 8 * k, &o, 8);
    }
}

/* an IQ3_S_T block as IQ3_S (110 bytes into out) */
static inline void iq3s_block_back(const uint8_t *b, uint8_t *out) {
    memcpy(out, b, 110);
    iq3s_signs_back(b + IQ3S_SIGNS_AT, out + IQ3S_SIGNS_AT);
}

#endif
