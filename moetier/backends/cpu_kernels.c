/* moetier native decode kernel: one token through k SwiGLU experts, each matrix in its stored format.
 *
 *   out[D] = sum_j scale[j] * down_j @ (silu(gate_j @ x) * (up_j @ x))
 *
 * gate_up_j is [2I, D] (gate rows, then up rows) and down_j is [D, I], both
 * row-major and contiguous, anywhere in memory, each in any GGML format of
 * moetier.model.formats: the caller passes their addresses and types, so
 * experts are read in place, each byte once. A float32 matrix is read as it
 * lies; any other has each row turned to float32 in a row of scratch (that
 * fits L1) by cpu_formats.c's dequantize_row, bit for bit gguf's values, and
 * dotted with the same code: so a stored format's result is bit for bit what
 * this kernel computes on the matrices dequantized to float32, which is the
 * float32 math up to summation order (against float64 on gguf's values,
 * tests/test_native_formats.py saw 1.2e-7..3e-7 of the output's scale). Decode is
 * bound by those bytes: each matrix is read row after row, in address order,
 * one sequential stream the hardware prefetchers follow (8 rows interleaved
 * read half as fast on a Zen 3 VM), each row's dot product over four vector
 * accumulators. One call per layer's group replaces ~5 framework ops per expert.
 * Also here: the native CPU lane (threads that never take the GIL) and the
 * decode router (gate, scores, top-k and weights in one call; float32 gate).
 *
 * Built once per machine by moetier/native.py (cc -O3 -march=native,
 * with reassociation allowed so the dot products vectorize); called through
 * ctypes, which releases the GIL. moe_decode_init must be called once first.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

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

/* y[r] = W[r, :] . x for r in [0, rows): row after row, so W streams from memory in address order
 * (one sequential stream is what the hardware prefetchers follow best). */
static void gemv(const float *restrict W, const float *restrict x, float *restrict y, int64_t rows, int64_t cols) {
    for (int64_t r = 0; r < rows; r++) y[r] = dot(W + r * cols, x, cols);
}

enum { TYPE_F32 = 0 };  /* GGML type ids; every other format goes through dequantize_row */

/* cpu_formats.c's row dequantizer: one row of `cols` values of GGML type `type` -> dst; returns the next row */
typedef const uint8_t *(*row_fn)(int64_t type, const uint8_t *src, float *dst, int64_t cols);
static row_fn dequantize_row;

/* Once, before any decode: the row dequantizer of the formats library (cpu_formats.c, built apart with
 * strict IEEE flags so its values are gguf's bit for bit). */
void moe_decode_init(void *row) { dequantize_row = (row_fn)row; }

/* Scratch floats moe_decode needs for widths D and I: gate_up [2I], hidden [I], y [D], one row [max(D, I)]. */
int64_t moe_scratch_floats(int64_t D, int64_t I) { return 3 * I + D + (D > I ? D : I); }

/* y[rows] = W x, W [rows, cols] in GGML type `type` at address W; row: scratch of cols floats */
static void matvec(const void *W, int64_t type, const float *x, float *y, int64_t rows, int64_t cols, float *row) {
    if (type == TYPE_F32) {
        gemv(W, x, y, rows, cols);
        return;
    }
    const uint8_t *w = W;
    for (int64_t r = 0; r < rows; r++) {
        w = dequantize_row(type, w, row, cols);
        y[r] = dot(row, x, cols);
    }
}

/* out[D] = sum over j = first, first + stride, ... < k of scale[j] * ffn_j(x), summed in that order.
 * experts: 4k int64s, (gate_up address, down address, gate_up type, down type) per expert;
 * scratch: moe_scratch_floats(D, I) floats. */
static void decode_strided(const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts, const float *scale,
                           int64_t first, int64_t stride, float *out, float *scratch) {
    float *gate_up = scratch, *hidden = scratch + 2 * I, *y = scratch + 3 * I, *row = scratch + 3 * I + D;
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t j = first; j < k; j += stride) {
        const int64_t *e = experts + 4 * j;
        matvec((const void *)(intptr_t)e[0], e[2], x, gate_up, 2 * I, D, row);
        for (int64_t i = 0; i < I; i++) {
            const float g = gate_up[i];
            hidden[i] = g / (1.f + expf(-g)) * gate_up[I + i];
        }
        matvec((const void *)(intptr_t)e[1], e[3], hidden, y, D, I, row);
        const float s = scale[j];
        for (int64_t d = 0; d < D; d++) out[d] += s * y[d];
    }
}

/* every expert, in order. experts: 4k int64s (see decode_strided); out: D floats, overwritten;
 * scratch: moe_scratch_floats(D, I) floats. */
void moe_decode(const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                const float *scale, float *out, float *scratch) {
    decode_strided(x, D, I, k, experts, scale, 0, 1, out, scratch);
}

/* ---------------------------------------------------------------------------
 * The native CPU lane: decode calls queued to threads that never touch Python.
 *
 * A lane owns `threads` pthreads and LANE_SLOTS job slots. lane_submit copies a
 * call (x, the experts' addresses and types, their scales) into a free slot and returns
 * its ticket at once (with all slots queued, once one is done); the threads split the call's experts into `parts`
 * (expert j goes to part j % parts, each part summed in order into its own
 * row) and the thread that finishes the last part adds the rows in part order,
 * so the result does not depend on which thread ran what. lane_collect waits
 * for a ticket (the GIL is released by ctypes meanwhile), copies the result
 * out and frees the slot; lane_release frees a slot whose caller went away
 * (now if done, else when done). The slot owns copies of everything but the
 * expert weights, which the caller keeps alive until lane_close returns.
 * Threads waiting for work, and lane_collect waiting for a result, poll for
 * spin_s before they sleep on a condition variable: decode hands work over
 * every layer, and a sleeping thread's wake-up costs tens of microseconds on
 * a virtual CPU.
 * ------------------------------------------------------------------------- */
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

#define LANE_SLOTS 16
#define LANE_THREADS_MAX 64

enum { SLOT_FREE, SLOT_QUEUED, SLOT_DONE };

typedef struct {
    int64_t state;
    int released;
    int64_t ticket, D, I, k, parts, claimed, finished;
    double done_s;                     /* CLOCK_MONOTONIC seconds when the last part finished */
    float *x;                          /* [D] */
    int64_t *experts;                  /* [4k]: per expert gate_up, down addresses and types */
    float *scale;                      /* [k] */
    float *rows;                       /* [parts, D] partial sums; row 0 ends as the total */
    float *scratch;                    /* [parts, moe_scratch_floats(D, I)] */
    int64_t cap_x, cap_experts, cap_scale, cap_rows, cap_scratch;
} lane_slot;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    lane_slot slots[LANE_SLOTS];
    int64_t next_ticket;               /* also read without the lock by spinning threads */
    int stop, threads;
    double spin_s;                     /* how long a thread polls before it sleeps on a condition */
    pthread_t tid[LANE_THREADS_MAX];
} moe_lane;

static double monotonic_s(void);

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Poll *word (read without the lock) until it differs from `seen` or spin_s passes: a hand-off that
 * lands within the spin costs no futex sleep and wake, which on a virtual CPU take tens of us. */
static void spin_while_equal(const int64_t *word, int64_t seen, double spin_s) {
    if (spin_s <= 0) return;
    const double until = monotonic_s() + spin_s;
    while (__atomic_load_n(word, __ATOMIC_ACQUIRE) == seen && monotonic_s() < until)
        cpu_relax();
}

static double monotonic_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void *lane_main(void *arg) {
    moe_lane *lane = arg;
    pthread_mutex_lock(&lane->mu);
    for (;;) {
        lane_slot *s = NULL;  /* the oldest queued call with a part left to claim */
        for (int i = 0; i < LANE_SLOTS; i++) {
            lane_slot *c = &lane->slots[i];
            if (c->state == SLOT_QUEUED && c->claimed < c->parts && (!s || c->ticket < s->ticket)) s = c;
        }
        if (!s) {
            if (lane->stop) break;
            const int64_t seen = lane->next_ticket;
            pthread_mutex_unlock(&lane->mu);
            spin_while_equal(&lane->next_ticket, seen, lane->spin_s);
            pthread_mutex_lock(&lane->mu);
            if (lane->next_ticket == seen && !lane->stop) pthread_cond_wait(&lane->work, &lane->mu);
            continue;
        }
        const int64_t part = s->claimed++;
        pthread_mutex_unlock(&lane->mu);
        decode_strided(s->x, s->D, s->I, s->k, s->experts, s->scale, part, s->parts,  /* experts part, part + parts, ... */
                       s->rows + part * s->D, s->scratch + part * moe_scratch_floats(s->D, s->I));
        pthread_mutex_lock(&lane->mu);
        if (++s->finished < s->parts) continue;
        pthread_mutex_unlock(&lane->mu);  /* the last part: every other row is written */
        for (int64_t p = 1; p < s->parts; p++)
            for (int64_t d = 0; d < s->D; d++) s->rows[d] += s->rows[p * s->D + d];
        const double done_s = monotonic_s();
        pthread_mutex_lock(&lane->mu);
        s->done_s = done_s;
        __atomic_store_n(&s->state, s->released ? SLOT_FREE : SLOT_DONE, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&lane->done);
    }
    pthread_mutex_unlock(&lane->mu);
    return NULL;
}

static int grow(void **buffer, int64_t *cap, int64_t need, size_t item) {
    if (need <= *cap) return 0;
    void *bigger = realloc(*buffer, (size_t)need * item);
    if (!bigger) return -1;
    *buffer = bigger;
    *cap = need;
    return 0;
}

moe_lane *lane_open(int64_t threads, double spin_s) {
    if (threads < 1 || threads > LANE_THREADS_MAX) return NULL;
    moe_lane *lane = calloc(1, sizeof(moe_lane));
    if (!lane) return NULL;
    lane->spin_s = spin_s;
    pthread_mutex_init(&lane->mu, NULL);
    pthread_cond_init(&lane->work, NULL);
    pthread_cond_init(&lane->done, NULL);
    for (int64_t t = 0; t < threads; t++) {
        if (pthread_create(&lane->tid[t], NULL, lane_main, lane) != 0) break;
        lane->threads++;
    }
    return lane;
}

int64_t lane_threads(const moe_lane *lane) { return lane->threads; }

/* Queue one call (experts: 4k int64s, as moe_decode's); returns its ticket. With every slot taken it waits
 * for a queued call to finish; -1 when all are done but uncollected, -2 when out of memory. */
int64_t lane_submit(moe_lane *lane, const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                    const float *scale, int64_t parts) {
    if (parts > k) parts = k;
    if (parts < 1) parts = 1;
    pthread_mutex_lock(&lane->mu);
    lane_slot *s = NULL;
    for (;;) {  /* a free slot; while none, wait for a queued call to finish (none queued: give up) */
        int queued = 0;
        for (int i = 0; i < LANE_SLOTS && !s; i++) {
            if (lane->slots[i].state == SLOT_FREE) s = &lane->slots[i];
            queued |= lane->slots[i].state == SLOT_QUEUED;
        }
        if (s || !queued) break;
        pthread_cond_wait(&lane->done, &lane->mu);
    }
    int64_t ticket = -1;
    if (s) {
        ticket = -2;
        if (!grow((void **)&s->x, &s->cap_x, D, sizeof(float)) &&
            !grow((void **)&s->experts, &s->cap_experts, 4 * k, sizeof(int64_t)) &&
            !grow((void **)&s->scale, &s->cap_scale, k, sizeof(float)) &&
            !grow((void **)&s->rows, &s->cap_rows, parts * D, sizeof(float)) &&
            !grow((void **)&s->scratch, &s->cap_scratch, parts * moe_scratch_floats(D, I), sizeof(float))) {
            memcpy(s->x, x, (size_t)D * sizeof(float));
            memcpy(s->experts, experts, (size_t)(4 * k) * sizeof(int64_t));
            memcpy(s->scale, scale, (size_t)k * sizeof(float));
            s->D = D, s->I = I, s->k = k, s->parts = parts, s->claimed = 0, s->finished = 0, s->released = 0;
            s->ticket = ticket = lane->next_ticket;
            s->state = SLOT_QUEUED;
            __atomic_store_n(&lane->next_ticket, ticket + 1, __ATOMIC_RELEASE);
            if (parts > 1) pthread_cond_broadcast(&lane->work);
            else pthread_cond_signal(&lane->work);
        }
    }
    pthread_mutex_unlock(&lane->mu);
    return ticket;
}

static lane_slot *slot_of(moe_lane *lane, int64_t ticket) {
    lane_slot *s = &lane->slots[0];
    for (int i = 0; i < LANE_SLOTS; i++, s++)
        if (s->state != SLOT_FREE && s->ticket == ticket) return s;
    return NULL;
}

/* Wait for a ticket, copy its [D] result to out and the time it finished to *done_s; free its slot.
 * Returns 0, or -1 for a ticket that is not pending (already collected or released, or never given). */
int64_t lane_collect(moe_lane *lane, int64_t ticket, float *out, double *done_s) {
    pthread_mutex_lock(&lane->mu);
    lane_slot *s = slot_of(lane, ticket);
    if (!s || s->released) {
        pthread_mutex_unlock(&lane->mu);
        return -1;
    }
    if (s->state != SLOT_DONE) {  /* poll a while, then sleep */
        pthread_mutex_unlock(&lane->mu);
        spin_while_equal(&s->state, SLOT_QUEUED, lane->spin_s);
        pthread_mutex_lock(&lane->mu);
    }
    while (s->state != SLOT_DONE) pthread_cond_wait(&lane->done, &lane->mu);
    memcpy(out, s->rows, (size_t)s->D * sizeof(float));
    *done_s = s->done_s;
    s->state = SLOT_FREE;
    pthread_mutex_unlock(&lane->mu);
    return 0;
}

/* The caller will not collect this ticket: free its slot now if done, else when it is. */
void lane_release(moe_lane *lane, int64_t ticket) {
    pthread_mutex_lock(&lane->mu);
    lane_slot *s = slot_of(lane, ticket);
    if (s) {
        if (s->state == SLOT_DONE) s->state = SLOT_FREE;
        else s->released = 1;
    }
    pthread_mutex_unlock(&lane->mu);
}

/* Finish queued calls, stop the threads, free everything. */
void lane_close(moe_lane *lane) {
    pthread_mutex_lock(&lane->mu);
    lane->stop = 1;
    pthread_cond_broadcast(&lane->work);
    pthread_mutex_unlock(&lane->mu);
    for (int t = 0; t < lane->threads; t++) pthread_join(lane->tid[t], NULL);
    for (int i = 0; i < LANE_SLOTS; i++) {
        lane_slot *s = &lane->slots[i];
        free(s->x), free(s->experts), free(s->scale), free(s->rows), free(s->scratch);
    }
    pthread_cond_destroy(&lane->work);
    pthread_cond_destroy(&lane->done);
    pthread_mutex_destroy(&lane->mu);
    free(lane);
}

/* ---------------------------------------------------------------------------
 * The decode router: one token's gate logits, scores, top-k picks and weights
 * in one call, the arithmetic of moetier/engine/router.py (float32; the gate's
 * dot products in this file's order). Picks come in descending order of their
 * selection score, ties to the lower expert id.
 * ------------------------------------------------------------------------- */

/* indices of the k largest of v[0..n) (entries equal to -INFINITY never picked before others), descending */
static void top_k(const float *v, int64_t n, int64_t k, int64_t *out) {
    int64_t have = 0;
    for (int64_t i = 0; i < n; i++) {
        if (have == k && !(v[i] > v[out[k - 1]])) continue;
        int64_t at = have < k ? have++ : k - 1;
        while (at > 0 && v[i] > v[out[at - 1]]) {
            out[at] = out[at - 1];
            at--;
        }
        out[at] = i;
    }
}

/* softmax routers: probs = softmax(logits); picks = top k of probs, or of logits + nudge when nudge
 * is given; weights = probs[picks], renormalised over the k when norm. scratch: E floats. */
void route_softmax_f32(const float *W, const float *x, int64_t E, int64_t D, int64_t k, const float *nudge, int64_t norm,
                       float *logits, float *probs, int64_t *picks, float *weights, float *scratch) {
    gemv(W, x, logits, E, D);
    float top = logits[0];
    for (int64_t e = 1; e < E; e++) top = logits[e] > top ? logits[e] : top;
    float total = 0.f;
    for (int64_t e = 0; e < E; e++) total += (probs[e] = expf(logits[e] - top));
    for (int64_t e = 0; e < E; e++) probs[e] /= total;
    if (nudge) {
        for (int64_t e = 0; e < E; e++) scratch[e] = logits[e] + nudge[e];
        top_k(scratch, E, k, picks);
    } else {
        top_k(probs, E, k, picks);
    }
    float sum = 0.f;
    for (int64_t j = 0; j < k; j++) sum += (weights[j] = probs[picks[j]]);
    if (norm)
        for (int64_t j = 0; j < k; j++) weights[j] /= sum;
}

/* sigmoid routers: scores = sigmoid(logits); choice = scores (+ correction) (+ nudge), limited to the
 * topk_group groups whose two best choices sum highest when n_group > 1; picks = top k of choice;
 * weights = scores[picks], renormalised (+1e-20) when norm, times scaling. scratch: E + n_group floats. */
void route_sigmoid_f32(const float *W, const float *x, int64_t E, int64_t D, int64_t k, const float *correction,
                       const float *nudge, int64_t n_group, int64_t topk_group, int64_t norm, float scaling,
                       float *logits, float *scores, int64_t *picks, float *weights, float *scratch) {
    gemv(W, x, logits, E, D);
    float *choice = scratch, *group_score = scratch + E;
    for (int64_t e = 0; e < E; e++) {
        scores[e] = 1.f / (1.f + expf(-logits[e]));
        float c = correction ? scores[e] + correction[e] : scores[e];
        choice[e] = nudge ? c + nudge[e] : c;
    }
    if (n_group > 1 && topk_group < n_group) {
        const int64_t per = E / n_group;
        int64_t best[2], keep[64];
        for (int64_t g = 0; g < n_group; g++) {
            const int64_t two = per < 2 ? per : 2;
            top_k(choice + g * per, per, two, best);
            group_score[g] = 0.f;
            for (int64_t j = 0; j < two; j++) group_score[g] += choice[g * per + best[j]];
        }
        top_k(group_score, n_group, topk_group, keep);
        for (int64_t g = 0; g < n_group; g++) {
            int kept = 0;
            for (int64_t j = 0; j < topk_group; j++) kept |= keep[j] == g;
            if (!kept)
                for (int64_t e = g * per; e < (g + 1) * per; e++) choice[e] = -INFINITY;
        }
    }
    top_k(choice, E, k, picks);
    float sum = 0.f;
    for (int64_t j = 0; j < k; j++) sum += (weights[j] = scores[picks[j]]);
    for (int64_t j = 0; j < k; j++) weights[j] = (norm ? weights[j] / (sum + 1e-20f) : weights[j]) * scaling;
}
