/* moetier native CPU kernels: SwiGLU experts and a linear layer on a thread pool (cpu_pool.h); the decode router
 * (cpu_router.h), the delta rule of linear attention (cpu_deltanet.h), GLM-5.3's hyper-connection weights
 * (cpu_hyper.h) and the decode step (cpu_step.h), which uses the first two, are included at the end.
 *
 *   out[t] = sum over the experts e serving token t of w_e[t] * down_e @ (silu(gate_e @ x[t]) * (up_e @ x[t]))
 *
 * Each matrix is held in its stored format (GGML type, moetier.model.formats), anywhere in memory; the caller
 * passes addresses, so experts are read in place. Its dot products are computed by the family registered for
 * its type (moe_dot_register; the interface is cpu_dot.h): activations converted once per row to the format
 * that family's dot product takes (llama.cpp's vec_dot_type, or float32 for F16 / BF16 weights when the
 * expert's record asks for float32 activations), then the family's dot over weight rows. The fallback family
 * here takes float32 activations for every format: a float32 matrix read in place, any other a row at a time
 * dequantized by cpu_formats.c (gguf's values bit for bit) and dotted by the same `dot`, so with the fallback
 * a float32 expert gives the bits moetier's decode gave before the families (4 vector accumulators per row).
 *
 * Work is cut into granules (cpu_pool.h runs them on every pool thread): activation rows to convert; row
 * ranges of each expert's gate_up (all its tokens at once, each weight row read once for them); the SwiGLU
 * and its conversion for down, by whichever thread finishes the expert's last gate_up range; row ranges of
 * each down; then each token's gate-weighted sum, over its experts in the caller's order. The cut depends on
 * the shapes only, and every output value is written by one granule from the same inputs, so the result is
 * the same bits for any thread count, any timing (tests/test_native_pool.py).
 *
 * Built once per machine by moetier/native.py (cc -O3 -march=native, reassociation allowed so the dot products
 * vectorize); called through ctypes, which releases the GIL. moe_decode_init must be called once, and a dot
 * family registered for every type, before any call; the Python wrappers check every argument.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_dot.h"
#include "cpu_pool.h"
#include "cpu_stream.h"

/* 8 floats in one vector register (GCC/Clang vector extensions: AVX on x86-64, NEON pairs on arm64) */
typedef float v8f __attribute__((vector_size(32)));

static inline v8f load8(const float *p) {
    v8f v;
    memcpy(&v, p, sizeof v);  /* an unaligned load */
    return v;
}

static inline float sum8(v8f v) {
    return ((v[0] + v[4]) + (v[1] + v[5])) + ((v[2] + v[6]) + (v[3] + v[7]));
}

static inline void store8(float *p, v8f v) { memcpy(p, &v, sizeof v); }

/* e^x for x <= 0 in 8 lanes (clamped at -87.3: about 1e-38): 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 in two
 * parts (Cody-Waite), p Cephes' degree-6 polynomial for e^r: within about 2 ulp of expf */
static inline v8f exp8(v8f x) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8f low = {-87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f, -87.3f};
    const v8i below = x < low;  /* lanes of -1 where x < low */
    x = (v8f)((below & (v8i)low) | (~below & (v8i)x));
    const v8i whole = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, v8i);  /* x <= 0: rounds to nearest */
    const v8f n = __builtin_convertvector(whole, v8f);
    const v8f r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8f p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.f;
    const v8i bits = (whole + 127) << 23;
    v8f scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* w . x over cols: 4 vector accumulators (independent FMA chains), then the tail columns.
 * Not inlined: the float32 rows read in place and the dequantized rows run the very same code. */
__attribute__((noinline)) static float dot(const float *restrict w, const float *restrict x, int64_t cols) {
    const int64_t wide = cols & ~(int64_t)31, eights = cols & ~(int64_t)7;
    v8f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    int64_t c = 0;
    for (; c < wide; c += 32) {
        a0 += load8(w + c) * load8(x + c);
        a1 += load8(w + c + 8) * load8(x + c + 8);
        a2 += load8(w + c + 16) * load8(x + c + 16);
        a3 += load8(w + c + 24) * load8(x + c + 24);
    }
    for (; c < eights; c += 8) a0 += load8(w + c) * load8(x + c);
    float s = sum8((a0 + a1) + (a2 + a3));
    for (; c < cols; c++) s += w[c] * x[c];
    return s;
}

/* y[r] = W[r, :] . x for r in [0, rows): row after row, so W streams from memory in address order. */
static void gemv(const float *restrict W, const float *restrict x, float *restrict y, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) y[r] = dot(W + r * cols, x, cols);
}

/* ---------------------------------------------------------------------------------------------------------
 * Dot-product families: a table by weight type, and the fallback every type starts with.
 * ------------------------------------------------------------------------------------------------------- */
enum { TYPE_F32 = 0, TYPES = 128 };  /* above every type id of moetier.model.formats (IQ3_XXS_T 118, IQ3_S_T 121) */

typedef struct { act_type_fn act_type; quantize_fn quantize; dot_fn dot; } dot_entry;
static dot_entry dots[TYPES];

/* cpu_formats.c's row dequantizer (one row of `cols` values of `type` -> dst; returns the next row) and its
 * block geometry, which gives the bytes of a row */
typedef const uint8_t *(*row_fn)(int64_t type, const uint8_t *src, float *dst, int64_t cols);
typedef int64_t (*geometry_fn)(int64_t type, int64_t *block, int64_t *block_bytes);
static row_fn dequantize_row;
static int64_t block_values[TYPES], block_bytes[TYPES];

/* Once, before any call: the formats library's row dequantizer and block geometry (cpu_formats.c, built apart
 * with strict IEEE flags so its values are gguf's bit for bit). */
void moe_decode_init(void *row, void *geometry) {
    dequantize_row = (row_fn)row;
    for (int64_t t = 0; t < TYPES; t++)
        if (!((geometry_fn)geometry)(t, &block_values[t], &block_bytes[t])) block_values[t] = 1, block_bytes[t] = 0;
}

static inline int64_t row_bytes(int64_t type, int64_t cols) { return cols / block_values[type] * block_bytes[type]; }

/* Weight type `wtype` computes with these three functions (cpu_dot.h) from now on; -> 0, or -1 for a bad type. */
int64_t moe_dot_register(int64_t wtype, void *act_type, void *quantize, void *dot_product) {
    if (wtype < 0 || wtype >= TYPES) return -1;
    dots[wtype] = (dot_entry){(act_type_fn)act_type, (quantize_fn)quantize, (dot_fn)dot_product};
    return 0;
}

/* The activation format weight type `wtype` is multiplied with, as registered (-1: none registered). */
int64_t moe_act_type(int64_t wtype, int64_t float_acts) {
    return wtype >= 0 && wtype < TYPES && dots[wtype].act_type ? dots[wtype].act_type(wtype, float_acts) : -1;
}

int64_t fallback_act_type(int64_t wtype, int64_t float_acts) {
    (void)wtype, (void)float_acts;
    return ACT_F32;
}

void fallback_quantize(int64_t act_type, const float *x, void *xq, int64_t n) {
    (void)act_type;
    memcpy(xq, x, (size_t)n * sizeof(float));
}

enum { ROW_ON_STACK = 16384 };  /* floats of a dequantized row kept on the stack; longer rows take the heap */

void fallback_dot(int64_t wtype, int64_t act_type, int64_t n, const void *w, int64_t row_stride, int64_t rows,
                  const void *xq, int64_t T, float *y, int64_t ldy) {
    (void)act_type;
    const float *x = xq;
    const uint8_t *at = w;
    if (wtype == TYPE_F32) {
        for (int64_t r = 0; r < rows; r++, at += row_stride)
            for (int64_t t = 0; t < T; t++) y[t * ldy + r] = dot((const float *)at, x + t * n, n);
        return;
    }
    float stack[ROW_ON_STACK], *row = n <= ROW_ON_STACK ? stack : malloc((size_t)n * sizeof(float));
    for (int64_t r = 0; r < rows; r++, at += row_stride) {
        if (row) dequantize_row(wtype, at, row, n);
        for (int64_t t = 0; t < T; t++) y[t * ldy + r] = row ? dot(row, x + t * n, n) : NAN;  /* NaN: out of memory */
    }
    if (row != stack) free(row);
}

/* ---------------------------------------------------------------------------------------------------------
 * Jobs: experts over tokens (decode: one token) and a linear layer, cut into granules.
 * ------------------------------------------------------------------------------------------------------- */
/* record word 4: flags in its low 32 bits; with FLAG_CLAMP, its high 32 bits are the float SwiGLU limit */
enum { FLAG_FLOAT_ACTS = 1, FLAG_CLAMP = 2 };

/* The SwiGLU clamp of a record: gate <= limit, up within [-limit, limit] (GLM-5.3's); 0 for none. */
static inline float record_limit(const int64_t *r) {
    if (!(r[4] & FLAG_CLAMP)) return 0.f;
    const uint32_t bits = (uint32_t)((uint64_t)r[4] >> 32);
    float limit;
    memcpy(&limit, &bits, sizeof limit);
    return limit;
}

typedef struct {
    const uint8_t *w;  /* rows of `cols` values of `type`, row_bytes apart */
    const dot_entry *fn;
    int64_t type, act, row_bytes, act_bytes;  /* act_bytes: one activation row of the columns, in format act */
} matrix;

static matrix matrix_of(int64_t address, int64_t type, int64_t float_acts, int64_t cols) {
    matrix m = {(const uint8_t *)(intptr_t)address, &dots[type], type, 0, row_bytes(type, cols), 0};
    m.act = m.fn->act_type(type, float_acts);
    m.act_bytes = act_row_bytes(m.act, cols);
    return m;
}

typedef struct {  /* activation rows converted once for the matrices that read them */
    int64_t act, n, act_bytes;
    quantize_fn quantize;
    const int64_t *rows;  /* [n] rows of x it converts; NULL: rows 0..n-1 */
    uint8_t *xq;          /* [n, act_bytes] */
    int64_t left;         /* its granules not yet finished */
} act_unit;

typedef struct {  /* one expert and the tokens it serves */
    matrix up, down;        /* gate_up [2I, D], down [D, I] */
    int64_t n, unit;        /* tokens; the act_unit gate_up reads */
    const float *weights;   /* [n] gate weights */
    float *h;               /* [n, 2I]: gate_up's outputs, then the SwiGLU in each row's first I */
    uint8_t *hq;            /* [n, down.act_bytes] */
    float *y;               /* [n, D] */
    int64_t up_left;        /* gate_up granules not yet finished */
    int64_t hidden_pending; /* 1 until hq is written */
    float limit;            /* the SwiGLU clamp (record_limit); 0: none */
} moe_group;

enum { G_QUANT, G_UP, G_DOWN, G_SUM, G_LINEAR };
typedef struct { int64_t kind, index, from, to; } granule;

typedef struct {
    const float *x;  /* [T, D] */
    float *out;      /* [T, D]; a linear layer's [T, rows] */
    int64_t T, D, I, G;
    act_unit *units;
    moe_group *groups;
    granule *granules;
    int64_t down_left;  /* down granules not yet finished */
    int64_t *sum_start, *sum_group, *sum_pos;  /* token t's experts: (group, its row there) at [sum_start[t], sum_start[t+1]) */
    matrix *parts;      /* a linear layer's row parts, each [its rows, D], read with units[part] */
    int64_t *part_row;  /* [parts] the first output column of each part */
    int64_t rows;       /* a linear layer's output columns: all its parts' rows */
    int64_t grain;      /* one token's granule bytes (one_token_grain) */
} moe_job;

/* Rows of a matrix per granule: `grain` bytes of weights at one token (one_token_grain), ~64 KiB for 2 to 8
 * tokens, less for more (a granule's work is weight bytes times tokens), never under 32 at one token or 64 at
 * more. One token reads a granule's rows as four streams (cpu_dotk.c four_streams), each a quarter of it, which
 * the prefetchers find anew at every granule: 64 KiB granules made streams of 16 KiB (Q4_K from DRAM, 2 threads,
 * C harness: 25.0-25.4 -> 28.9-29.1 GB/s at 256 KiB, 29.4 at 512; Q6_K 26.2 -> 29.3). More tokens: a granule
 * reads all its tokens' activations for each of its row tiles, so few rows and many tokens stream activations from
 * L2 or beyond (Q8_0 [1024, 2048] at T = 256, 1 thread: 4 rows a granule 30 GMAC/s, 32 rows 63), and each dot
 * call first unpacks or packs its tokens' activations, once per granule (the `wide` F32 and Q8_0 prefill, 2
 * threads: 32 -> 64 rows 5-10% faster). At more tokens a function of the shapes only. */
enum { GRANULE_ROWS_MIN = 32, GRANULE_ROWS_MIN_TOKENS = 64 };
static int64_t granule_rows(int64_t row_bytes, int64_t tokens, int64_t grain) {
    const int64_t target = tokens == 1 ? grain : (int64_t)65536 * 8 / (tokens > 8 ? tokens : 8);
    const int64_t least = tokens > 1 ? GRANULE_ROWS_MIN_TOKENS : GRANULE_ROWS_MIN;
    const int64_t r = (target + row_bytes - 1) / row_bytes;
    return r < least ? least : (r + 3) & ~(int64_t)3;
}

/* A one-token job's granule bytes: its weight bytes over GRAINS_A_THREAD per pool thread, within [GRAIN_MIN,
 * GRAIN_MAX]. Each granule start costs its four streams' first bytes from DRAM while the core waits (the
 * prefetch burst was 80% of four_streams' samples, 6.7% of a lane call's; perf, IQ3_S), so granules as big as
 * the threads leave room for: the lane's IQ3_S calls (8 experts, 16 MB) 21.0-21.3 -> 21.7-22.2 GB/s with 1 MiB
 * granules, Q4_K 29.2-30.2 -> 30.8-31.0, `deep` IQ3_S decode 81.0-84.5 -> 83.6-87.1 tok/s (2 threads, Intel
 * host, alternated); F32 `wide`, Q4_K_M and Q8_0 `deep` within noise. A many-core host keeps ~4 granules a
 * thread (256 KiB, as before, where they would be fewer). The cut then depends on the thread count, the bits do
 * not: at one token each row's sum is its blocks in order into its own accumulator, whatever granule it is in
 * (tested with cuts that differ by thread count). */
enum { GRAINS_A_THREAD = 4, GRAIN_MIN = 262144, GRAIN_MAX = 1048576 };
static int64_t one_token_grain(const moe_pool *pool, int64_t weight_bytes) {
    const int64_t grain = weight_bytes / (GRAINS_A_THREAD * pool_threads(pool));
    return grain < GRAIN_MIN ? GRAIN_MIN : grain > GRAIN_MAX ? GRAIN_MAX : grain;
}

enum { QUANT_ROWS = 16, SUM_ROWS = 4 };

/* Granules of `step` rows over [0, total) (the last one shorter), appended to out from `at` (out NULL: only counted);
 * -> the next free index. Tapered, the last `step` rows are cut in TAPER pieces instead (multiples of 4 rows), so
 * a job's end waits on a quarter granule, not a whole one: whichever thread is last to claim, the other idles at
 * most that long. A one-token linear's granules are ~256 KiB (~20 us of IQ3_S a core): `deep`'s output projection
 * took 7 (one thread 4 of them) and its router 1, and the caller waited on the other thread 0.42 s over 768 decoded
 * tokens of `deep` IQ3_S; tapered (the last part of a one-token linear), 0.07 s, and decode 9.85 -> 9.73 s (3
 * rounds alternating). The cut stays a function of the shapes. */
enum { TAPER = 4 };
static int64_t add_granules_tapered(granule *out, int64_t at, int64_t kind, int64_t index, int64_t total, int64_t step,
                                    int taper) {
    const int64_t tail = !taper ? 0 : total < step ? total : step, head = total - tail;
    for (int64_t from = 0; from < head; from += step, at++)
        if (out) out[at] = (granule){kind, index, from, from + step < head ? from + step : head};
    const int64_t piece = tail ? (((tail + TAPER - 1) / TAPER + 3) & ~(int64_t)3) : 1;
    for (int64_t from = head; from < total; from += piece, at++)
        if (out) out[at] = (granule){kind, index, from, from + piece < total ? from + piece : total};
    return at;
}

static int64_t add_granules(granule *out, int64_t at, int64_t kind, int64_t index, int64_t total, int64_t step) {
    return add_granules_tapered(out, at, kind, index, total, step, 0);
}

static void swiglu(const moe_job *j, moe_group *e) {
    const int64_t I = j->I;
    const float limit = e->limit;
    for (int64_t t = 0; t < e->n; t++) {
        float *h = e->h + t * 2 * I;
        if (limit > 0.f)  /* as transformers clamps: gate.clamp(max=limit), up.clamp(-limit, limit) */
            for (int64_t i = 0; i < I; i++) {
                h[i] = h[i] > limit ? limit : h[i];
                h[I + i] = h[I + i] > limit ? limit : h[I + i] < -limit ? -limit : h[I + i];
            }
        for (int64_t i = 0; i < I; i++) {
            const float g = h[i];
            h[i] = g / (1.f + expf(-g)) * h[I + i];
        }
        e->down.fn->quantize(e->down.act, h, e->hq + t * e->down.act_bytes, I);
    }
}

static void run_granule(void *job, int64_t index) {
    moe_job *j = job;
    const granule *g = &j->granules[index];
    const int64_t from = g->from, rows = g->to - g->from;
    switch (g->kind) {
    case G_QUANT: {
        act_unit *u = &j->units[g->index];
        for (int64_t t = from; t < g->to; t++)
            u->quantize(u->act, j->x + (u->rows ? u->rows[t] : t) * j->D, u->xq + t * u->act_bytes, j->D);
        __atomic_fetch_sub(&u->left, 1, __ATOMIC_RELEASE);
        break;
    }
    case G_UP: {
        moe_group *e = &j->groups[g->index];
        const act_unit *u = &j->units[e->unit];
        await_zero(&u->left);
        const matrix *m = &e->up;
        m->fn->dot(m->type, m->act, j->D, m->w + from * m->row_bytes, m->row_bytes, rows, u->xq, e->n, e->h + from, 2 * j->I);
        if (__atomic_sub_fetch(&e->up_left, 1, __ATOMIC_ACQ_REL) == 0) {  /* the expert's last range: its hidden */
            swiglu(j, e);
            __atomic_store_n(&e->hidden_pending, 0, __ATOMIC_RELEASE);
        }
        break;
    }
    case G_DOWN: {
        moe_group *e = &j->groups[g->index];
        await_zero(&e->hidden_pending);
        const matrix *m = &e->down;
        m->fn->dot(m->type, m->act, j->I, m->w + from * m->row_bytes, m->row_bytes, rows, e->hq, e->n, e->y + from, j->D);
        __atomic_fetch_sub(&j->down_left, 1, __ATOMIC_RELEASE);
        break;
    }
    case G_SUM: {
        await_zero(&j->down_left);
        const int64_t D = j->D;
        for (int64_t t = from; t < g->to; t++) {
            float *out = j->out + t * D;
            for (int64_t d = 0; d < D; d++) out[d] = 0.f;
            for (int64_t p = j->sum_start[t]; p < j->sum_start[t + 1]; p++) {
                const moe_group *e = &j->groups[j->sum_group[p]];
                const float s = e->weights[j->sum_pos[p]], *y = e->y + j->sum_pos[p] * D;
                for (int64_t d = 0; d < D; d++) out[d] += s * y[d];
            }
        }
        break;
    }
    case G_LINEAR: {
        const act_unit *u = &j->units[g->index];
        await_zero(&u->left);
        const matrix *m = &j->parts[g->index];
        m->fn->dot(m->type, m->act, j->D, m->w + from * m->row_bytes, m->row_bytes, rows, u->xq, j->T,
                   j->out + j->part_row[g->index] + from, j->rows);
        break;
    }
    }
}

static inline size_t aligned(size_t bytes) { return (bytes + 63) & ~(size_t)63; }

static void *carve(uint8_t **at, size_t bytes) {
    void *p = *at;
    *at += aligned(bytes);
    return p;
}

static inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* one token's last expert's down rows are tapered (the job's end waits on a quarter granule) */
static inline int last_down_tapered(int64_t T, int64_t g, int64_t G) { return T == 1 && g == G - 1; }

/* Arena bytes moe_layout carves for this call (an upper bound: one token's experts may share activations). */
static size_t moe_bytes(int64_t T, int64_t D, int64_t I, int64_t G, const int64_t *records, const int64_t *offsets,
                        int64_t grain) {
    const int64_t pairs = offsets ? offsets[G] : G;
    size_t bytes = aligned(sizeof(moe_group) * (size_t)G) + aligned(sizeof(act_unit) * (size_t)G)
                   + 2 * aligned(sizeof(int64_t) * (size_t)(T + 1)) + 2 * aligned(sizeof(int64_t) * (size_t)pairs);
    int64_t granules = ceil_div(T, SUM_ROWS);
    for (int64_t g = 0; g < G; g++) {
        const int64_t *r = records + RECORD_WORDS * g, float_acts = r[4] & FLAG_FLOAT_ACTS;
        const matrix up = matrix_of(r[0], r[2], float_acts, D), down = matrix_of(r[1], r[3], float_acts, I);
        const int64_t n = offsets ? offsets[g + 1] - offsets[g] : 1;
        bytes += aligned((size_t)(n * up.act_bytes)) + aligned(sizeof(float) * (size_t)(n * 2 * I))
                 + aligned((size_t)(n * down.act_bytes)) + aligned(sizeof(float) * (size_t)(n * D));
        granules += ceil_div(n, QUANT_ROWS) + ceil_div(2 * I, granule_rows(up.row_bytes, n, grain))
                    + add_granules_tapered(NULL, 0, G_DOWN, g, D, granule_rows(down.row_bytes, n, grain), last_down_tapered(T, g, G));
    }
    return bytes + aligned(sizeof(granule) * (size_t)granules);
}

/* Lay the job out from `at` (moe_bytes of room); ends: where its 4 phases of granules end (conversions, gate_up
 * ranges, down ranges, sums). */
static void moe_layout(moe_job *j, uint8_t *at, const int64_t *records, const int64_t *offsets, const int64_t *rows,
                       const float *weights, int64_t ends[4]) {
    const int64_t T = j->T, D = j->D, I = j->I, G = j->G, pairs = offsets ? offsets[G] : G;
    j->groups = carve(&at, sizeof(moe_group) * (size_t)G);
    j->units = carve(&at, sizeof(act_unit) * (size_t)G);
    j->sum_start = carve(&at, sizeof(int64_t) * (size_t)(T + 1));
    j->sum_group = carve(&at, sizeof(int64_t) * (size_t)pairs);
    j->sum_pos = carve(&at, sizeof(int64_t) * (size_t)pairs);
    int64_t *cursor = carve(&at, sizeof(int64_t) * (size_t)(T + 1));  /* each token's next free pair */
    int64_t units = 0;
    for (int64_t g = 0; g < G; g++) {  /* the experts and the activation rows they read */
        moe_group *e = &j->groups[g];
        const int64_t *r = records + RECORD_WORDS * g, float_acts = r[4] & FLAG_FLOAT_ACTS;
        e->up = matrix_of(r[0], r[2], float_acts, D);
        e->down = matrix_of(r[1], r[3], float_acts, I);
        e->limit = record_limit(r);
        e->n = offsets ? offsets[g + 1] - offsets[g] : 1;
        e->weights = offsets ? weights + offsets[g] : weights + g;
        e->unit = units;
        if (T == 1 && e->n == 1)  /* one token: converted once per activation format, shared by its experts */
            for (int64_t u = 0; u < units; u++)
                if (j->units[u].n == 1 && j->units[u].act == e->up.act && j->units[u].quantize == e->up.fn->quantize) e->unit = u;
        if (e->unit == units) {
            uint8_t *xq = carve(&at, (size_t)(e->n * e->up.act_bytes));
            j->units[units++] = (act_unit){e->up.act, e->n, e->up.act_bytes, e->up.fn->quantize,
                                           offsets ? rows + offsets[g] : NULL, xq, 0};
        }
        e->h = carve(&at, sizeof(float) * (size_t)(e->n * 2 * I));
        e->hq = carve(&at, (size_t)(e->n * e->down.act_bytes));
        e->y = carve(&at, sizeof(float) * (size_t)(e->n * D));
        e->up_left = ceil_div(2 * I, granule_rows(e->up.row_bytes, e->n, j->grain));
        e->hidden_pending = 1;
    }
    /* granules in the order they are claimed: every one is claimed after those whose outputs it reads */
    granule *list = j->granules = (granule *)at;
    int64_t n = 0;
    for (int64_t u = 0; u < units; u++) {
        const int64_t before = n;
        n = add_granules(list, n, G_QUANT, u, j->units[u].n, QUANT_ROWS);
        j->units[u].left = n - before;
    }
    ends[0] = n;
    for (int64_t g = 0; g < G; g++)
        n = add_granules(list, n, G_UP, g, 2 * I, granule_rows(j->groups[g].up.row_bytes, j->groups[g].n, j->grain));
    ends[1] = n;
    for (int64_t g = 0; g < G; g++)
        n = add_granules_tapered(list, n, G_DOWN, g, D, granule_rows(j->groups[g].down.row_bytes, j->groups[g].n, j->grain),
                                 last_down_tapered(T, g, G));
    j->down_left = n - ends[1];
    ends[2] = n;
    ends[3] = add_granules(list, n, G_SUM, 0, T, SUM_ROWS);
    /* each token's (expert, row) pairs in expert order: a counting sort by token */
    for (int64_t t = 0; t <= T; t++) j->sum_start[t] = 0;
    for (int64_t p = 0; p < pairs; p++) j->sum_start[(offsets ? rows[p] : 0) + 1]++;
    for (int64_t t = 0; t < T; t++) j->sum_start[t + 1] += j->sum_start[t];
    for (int64_t t = 0; t < T; t++) cursor[t] = j->sum_start[t];
    for (int64_t g = 0, p = 0; g < G; g++)
        for (int64_t i = 0; i < j->groups[g].n; i++, p++) {
            const int64_t at_pair = cursor[offsets ? rows[p] : 0]++;
            j->sum_group[at_pair] = g, j->sum_pos[at_pair] = i;
        }
}

/* out [T, D] = for each token, the sum over the experts serving it (in group order) of its gate weight times the
 * expert's SwiGLU of its row of x [T, D] (zero for a token none serves). G groups: records [RECORD_WORDS G]
 * (gate_up, down addresses, their types, flags); group g serves the rows rows[offsets[g] .. offsets[g + 1]) of x
 * (each in [0, T), at least one) with weights[...] alike; offsets NULL: T = 1 and group g serves row 0 with weight
 * weights[g]. -> 0, or -2 when out of memory. The caller holds pool->call. */
static int64_t experts_held(moe_pool *pool, const float *x, int64_t T, int64_t D, int64_t I, int64_t G, const int64_t *records,
                            const int64_t *offsets, const int64_t *rows, const float *weights, float *out) {
    int64_t weight_bytes = 0;  /* gate_up [2I, D] and down [D, I] of each expert, as stored */
    for (const int64_t *r = records; r < records + RECORD_WORDS * G; r += RECORD_WORDS)
        weight_bytes += 2 * I * row_bytes(r[2], D) + D * row_bytes(r[3], I);
    const int64_t grain = one_token_grain(pool, weight_bytes);
    uint8_t *arena = pool_arena(pool, moe_bytes(T, D, I, G, records, offsets, grain));
    if (!arena) return -2;
    moe_job job = {.x = x, .out = out, .T = T, .D = D, .I = I, .G = G, .grain = grain};
    int64_t ends[4];
    moe_layout(&job, arena, records, offsets, rows, weights, ends);
    pool_run(pool, run_granule, &job, 4, ends);
    return 0;
}

int64_t moe_experts(moe_pool *pool, const float *x, int64_t T, int64_t D, int64_t I, int64_t G, const int64_t *records,
                    const int64_t *offsets, const int64_t *rows, const float *weights, float *out) {
    pthread_mutex_lock(&pool->call);
    const int64_t status = experts_held(pool, x, T, D, I, G, records, offsets, rows, weights, out);
    pthread_mutex_unlock(&pool->call);
    return status;
}

/* One token: out [D] = sum over j < k, in order, of scale[j] * ffn_j(x [D]); experts: RECORD_WORDS k int64s. */
int64_t moe_decode(moe_pool *pool, const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                   const float *scale, float *out) {
    return moe_experts(pool, x, 1, D, I, k, experts, NULL, NULL, scale, out);
}

typedef struct { int64_t address, type, rows; } linear_part;  /* rows of n values of `type` at address, as stored */

/* y [T, total rows] = x [T, n] W^T for W the row-stack of P parts (each its own format; part p's outputs are
 * columns from the sum of the rows before it); float_acts: F32 activations for F16 / BF16 weights. -> 0, or -2
 * when out of memory. The caller holds pool->call. */
static int64_t linear_held(moe_pool *pool, const float *x, int64_t T, int64_t n, const linear_part *parts, int64_t P,
                           int64_t float_acts, float *y) {
    moe_job job = {.x = x, .out = y, .T = T, .D = n};
    matrix m[P];
    int64_t granules = 0, weight_bytes = 0;
    size_t bytes = aligned(sizeof(act_unit) * (size_t)P) + aligned(sizeof(int64_t) * (size_t)P);
    for (int64_t p = 0; p < P; p++) {
        m[p] = matrix_of(parts[p].address, parts[p].type, float_acts, n);
        weight_bytes += parts[p].rows * m[p].row_bytes;
    }
    const int64_t grain = one_token_grain(pool, weight_bytes);
    for (int64_t p = 0; p < P; p++) {
        granules += ceil_div(T, QUANT_ROWS) + add_granules_tapered(NULL, 0, G_LINEAR, p, parts[p].rows,
                                                                    granule_rows(m[p].row_bytes, T, grain), T == 1 && p == P - 1);
        bytes += aligned((size_t)(T * m[p].act_bytes));
        job.rows += parts[p].rows;
    }
    uint8_t *at = pool_arena(pool, bytes + aligned(sizeof(granule) * (size_t)granules));
    if (!at) return -2;
    job.parts = m;
    job.units = carve(&at, sizeof(act_unit) * (size_t)P);
    job.part_row = carve(&at, sizeof(int64_t) * (size_t)P);
    for (int64_t p = 0, row = 0; p < P; row += parts[p].rows, p++) {
        uint8_t *xq = carve(&at, (size_t)(T * m[p].act_bytes));
        job.units[p] = (act_unit){m[p].act, T, m[p].act_bytes, m[p].fn->quantize, NULL, xq, ceil_div(T, QUANT_ROWS)};
        job.part_row[p] = row;
    }
    job.granules = (granule *)at;
    int64_t ends[2] = {0, 0};
    for (int64_t p = 0; p < P; p++) ends[0] = add_granules(job.granules, ends[0], G_QUANT, p, T, QUANT_ROWS);
    ends[1] = ends[0];
    for (int64_t p = 0; p < P; p++)
        ends[1] = add_granules_tapered(job.granules, ends[1], G_LINEAR, p, parts[p].rows, granule_rows(m[p].row_bytes, T, grain),
                                       T == 1 && p == P - 1);
    pool_run(pool, run_granule, &job, 2, ends);
    return 0;
}

/* y [T, rows] = x [T, n] W^T, W rows of n values of `wtype` at w, as stored (row_bytes apart); float_acts: F32
 * activations for F16 / BF16 weights. -> 0, or -2 when out of memory. */
int64_t moe_linear(moe_pool *pool, const float *x, int64_t T, int64_t n, const void *w, int64_t wtype, int64_t float_acts,
                   int64_t rows, float *y) {
    const linear_part part = {(int64_t)(intptr_t)w, wtype, rows};
    pthread_mutex_lock(&pool->call);
    const int64_t status = linear_held(pool, x, T, n, &part, 1, float_acts, y);
    pthread_mutex_unlock(&pool->call);
    return status;
}

/* The read probes (benchmarks' roofline): the sum of x [n] on every pool thread, a granule at a time, each granule
 * read as several streams (equal parts of it, in 256-byte steps) into eight vector accumulators, so loads, not adds,
 * bound it: a reduction reads each byte once and writes nothing. A roofline must be a bound, so the probes read as
 * fast as this machine lets a thread read, and which way is fastest differs between machines, so there are two:
 * - prefetched: four streams, each step also asking for its lines ahead (cpu_stream.h). On the Intel AMX
 *   development host (2 threads, 1 GiB, 2026-12-06) one plain stream a thread read 19-21 GB/s, one prefetched
 *   stream 22-25, four prefetched streams 28-30 (the kernels' float32 gemv, four rows a tile, read 28).
 * - plain: eight streams, no software prefetch, the hardware prefetchers alone. On the Intel Ice Lake host
 *   (2 threads, 1 GiB, 10 interleaved rounds, 2026-12-07) four prefetched streams read 23.8-25.3 GB/s (best),
 *   four plain 25.5-26.1, eight plain 26.8-27.9 (sixteen alike, thirty-two less), where the Q8_0 decode read
 *   26.8 and the prefetched probe was no bound.
 * Partial sums are added in granule order: the same value for any thread count. -> 0 (the sum in *sum), or -2
 * when out of memory. */
enum { READ_GRANULE = 1 << 18, READ_STEP = 64 };  /* floats: 1 MiB granules, 256-byte steps */
typedef struct { const float *x; int64_t n; double *partial; } read_job;

static inline __attribute__((always_inline)) void read_granule_streams(const read_job *r, int64_t g, const int streams,
                                                                       const int prefetch) {
    const int64_t from = g * READ_GRANULE, to = from + READ_GRANULE < r->n ? from + READ_GRANULE : r->n;
    const int64_t part = (to - from) / (streams * READ_STEP) * READ_STEP;  /* floats a stream reads */
    v8f acc[8] = {{0}};
    for (int64_t i = 0; i < part; i += READ_STEP)
        for (int s = 0; s < streams; s++) {
            const float *p = r->x + from + s * part + i;
            if (prefetch) stream_prefetch(p, READ_STEP * sizeof(float));
            for (int j = 0; j < 8; j++) acc[j] += load8(p + 8 * j);
        }
    float tail = 0.f;
    for (int64_t i = from + streams * part; i < to; i++) tail += r->x[i];
    for (int j = 1; j < 8; j++) acc[0] += acc[j];
    r->partial[g] = (double)sum8(acc[0]) + tail;
}

static void read_granule_prefetched(void *job, int64_t g) { read_granule_streams(job, g, 4, 1); }
static void read_granule_plain(void *job, int64_t g) { read_granule_streams(job, g, 8, 0); }

int64_t moe_read_sum(moe_pool *pool, const float *x, int64_t n, int64_t plain, double *sum) {
    const int64_t granules = ceil_div(n, READ_GRANULE);
    pthread_mutex_lock(&pool->call);
    double *partial = pool_arena(pool, sizeof(double) * (size_t)(granules ? granules : 1));
    if (partial) {
        read_job r = {x, n, partial};
        if (granules) pool_run(pool, plain ? read_granule_plain : read_granule_prefetched, &r, 1, &granules);
        *sum = 0.;
        for (int64_t g = 0; g < granules; g++) *sum += partial[g];
    }
    pthread_mutex_unlock(&pool->call);
    return partial ? 0 : -2;
}

/* Prefill's RMSNorm on every pool thread: rows [rows, n] -> y = x / rms(x) * w (w NULL: no weight), a granule of
 * RMS_ROWS rows. The squares are summed in 4 x 8 lanes, then the lanes in order (torch's F.rms_norm sums in its own
 * order: the two agree to float32 rounding); then x * (1 / rms) * w, as the reference multiplies. */
enum { RMS_ROWS = 4 };
typedef struct { const float *x, *w; float *y; int64_t rows, n; float eps; } rms_job;

static void rms_granule(void *job, int64_t g) {
    const rms_job *r = job;
    const int64_t to = (g + 1) * RMS_ROWS < r->rows ? (g + 1) * RMS_ROWS : r->rows, n = r->n;
    for (int64_t t = g * RMS_ROWS; t < to; t++) {
        const float *x = r->x + t * n;
        float *y = r->y + t * n;
        v8f acc[4] = {{0}};
        int64_t i = 0;
        for (; i + 32 <= n; i += 32)
            for (int j = 0; j < 4; j++) {
                const v8f v = load8(x + i + 8 * j);
                acc[j] += v * v;
            }
        float squares = sum8((acc[0] + acc[1]) + (acc[2] + acc[3]));
        for (; i < n; i++) squares += x[i] * x[i];
        const float k = 1.f / sqrtf(squares / (float)n + r->eps);
        if (r->w)
            for (i = 0; i < n; i++) y[i] = x[i] * k * r->w[i];
        else
            for (i = 0; i < n; i++) y[i] = x[i] * k;
    }
}

int64_t moe_rms_norm(moe_pool *pool, const float *x, const float *w, int64_t rows, int64_t n, double eps, float *y) {
    if (rows < 1 || n < 1) return -1;
    const int64_t granules = ceil_div(rows, RMS_ROWS);
    rms_job r = {x, w, y, rows, n, (float)eps};
    pthread_mutex_lock(&pool->call);
    pool_run(pool, rms_granule, &r, 1, &granules);
    pthread_mutex_unlock(&pool->call);
    return 0;
}

/* Prefill's rotary embedding on every pool thread, the heads' transpose fused: x [T, heads, d] (token stride
 * x_stride floats, heads d apart) at positions whose table rows are cos, sin [T, rd] -> out [heads, T, d], the first
 * rd dims of each head rotated (HF's rotate_half: x * cos + rotate_half(x) * sin), the rest copied; a granule is a
 * head and ROPE_TOKENS tokens. */
enum { ROPE_TOKENS = 32 };
typedef struct { const float *x, *cos, *sin; float *out; int64_t x_stride, heads, T, d, rd; } rope_job;

static void rope_granule(void *job, int64_t g) {
    const rope_job *r = job;
    const int64_t blocks = ceil_div(r->T, ROPE_TOKENS), head = g / blocks, t0 = (g % blocks) * ROPE_TOKENS;
    const int64_t t1 = t0 + ROPE_TOKENS < r->T ? t0 + ROPE_TOKENS : r->T, half = r->rd / 2, d = r->d;
    for (int64_t t = t0; t < t1; t++) {
        const float *x = r->x + t * r->x_stride + head * d, *c = r->cos + t * r->rd, *s = r->sin + t * r->rd;
        float *y = r->out + (head * r->T + t) * d;
        for (int64_t i = 0; i < half; i++) {
            y[i] = x[i] * c[i] + -x[i + half] * s[i];
            y[i + half] = x[i + half] * c[i + half] + x[i] * s[i + half];
        }
        for (int64_t i = r->rd; i < d; i++) y[i] = x[i];
    }
}

int64_t moe_rotary(moe_pool *pool, const float *x, int64_t x_stride, int64_t heads, int64_t T, int64_t d, const float *cos,
                   const float *sin, int64_t rd, float *out) {
    if (heads < 1 || T < 1 || d < 1 || rd < 0 || rd > d || rd % 2 || x_stride < heads * d) return -1;
    const int64_t granules = heads * ceil_div(T, ROPE_TOKENS);
    rope_job r = {x, cos, sin, out, x_stride, heads, T, d, rd};
    pthread_mutex_lock(&pool->call);
    pool_run(pool, rope_granule, &r, 1, &granules);
    pthread_mutex_unlock(&pool->call);
    return 0;
}

/* y = x / rms(x) (* w), n values (the trunk's RMSNorm: the decode step's and the latent attention's) */
static void rms_norm_row(const float *x, const float *w, float *y, int64_t n, float eps) {
    float squares = 0.f;
    for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
    const float r = 1.f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = w ? x[i] * r * w[i] : x[i] * r;
}

#include "cpu_router.h"
#include "cpu_deltanet.h"
#include "cpu_hyper.h"
#include "cpu_latent.h"
#include "cpu_step.h"
