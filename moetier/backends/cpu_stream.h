/* Software prefetch for a weight row read as one stream (decode's gemv, one token): the dot families' T = 1 loops
 * (cpu_dot32.c, cpu_dotk.c) call stream_prefetch once per block (or block pair, or vector step) they decode;
 * cpu_dotk.c's four_streams also calls stream_start once per stream, for the bytes before the first far request.
 *
 * Each call asks for the bytes STREAM_FAR ahead into L2 (prefetcht1) and the bytes STREAM_NEAR ahead into L1
 * (prefetcht0). The far request keeps enough lines in flight to cover DRAM's latency without taking one of L1's
 * few fill buffers for the whole trip; the near one moves them to L1 shortly before the loads, so the loads
 * rarely wait on L2 either. A pool granule is ~64 KiB of rows, a run the hardware prefetchers find anew each
 * time, so this matters most where a block's decoding is costly next to its bytes.
 *
 * Measured on the Intel Xeon (AMX) development host, 2 threads from DRAM, 1 GiB matrices cut in the pool's
 * 64 KiB granules, 11 interleaved rounds, GB/s with the read probe beside it (2026-12-06), against the former
 * prefetcht0 4096 bytes ahead: Q4_K 15.4-16.1 -> 19.7-20.3 (read 23-24), Q6_K 15.3-16.6 -> 18.7-19.1, Q8_0
 * 17.5 -> 19.5-19.9 (read 26.6), IQ3_S 13.9 -> 16.0, IQ3_XXS 14.1 -> 15.2, BF16 20.2 -> 26.4 (read 26.6), F32
 * 17.7 -> 19.1; far 2048 / 8192 / 16384 and near 256 / 512 / 1024 about alike, prefetcht1 alone +10-13%,
 * prefetchnta worse than none. Not measured on AMD Zen, where the hints' cache levels differ from Intel's (the
 * far request alone is the former prefetch there at worst). */
#ifndef MOETIER_CPU_STREAM_H
#define MOETIER_CPU_STREAM_H

enum { STREAM_FAR = 4096, STREAM_NEAR = 1024 };

/* the lines of [p, p + bytes) at STREAM_FAR ahead into L2 and at STREAM_NEAR ahead into L1; called for
 * consecutive pieces of a stream, whose starts are at most 64 bytes apart once the pieces' lines are added */
static inline __attribute__((always_inline)) void stream_prefetch(const void *p, const int bytes) {
    const char *c = (const char *)p;
    for (int line = 0; line < bytes; line += 64) {
        __builtin_prefetch(c + STREAM_FAR + line, 0, 2);
        __builtin_prefetch(c + STREAM_NEAR + line, 0, 3);
    }
}

/* a stream's first STREAM_FAR bytes (of its `bytes`) asked for at once: stream_prefetch runs that far ahead of the
 * loads, so without this a stream's start is read by demand misses */
static inline void stream_start(const void *p, const int64_t bytes) {
    const int64_t ahead = bytes < STREAM_FAR ? bytes : STREAM_FAR;
    for (int64_t line = 0; line < ahead; line += 64) __builtin_prefetch((const char *)p + line, 0, 2);
}

#endif
