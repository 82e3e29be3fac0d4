/* GLM-5.3's hyper-connection weights (included once, by cpu_kernels.c): what moetier/engine/hyper.py's
 * Streams.enter computes from its projection, for T tokens of n streams, in transformers' order of operations:
 *
 *   pre  = sigmoid(mix_pre * scale[0] + base_pre) + eps                       [T, n]
 *   post = 2 sigmoid(mix_post * scale[1] + base_post)                          [T, n]
 *   comb = softmax_rows(mix_comb * scale[2] + base_comb) + eps, then Sinkhorn-Knopp: the columns divided by
 *          their sums + eps, then iters - 1 times the rows, then the columns   [T, n, n]
 *
 * float32, expf where torch has its own exp and sums in index order: within float32 rounding of the torch ops.
 * In torch a decoded token's weights were some 120 operations on 16 floats (the Sinkhorn loop's 19 rounds), a
 * third of a GLM-5.3 token's time on the per-layer path; here they are one call. */
#include <math.h>

/* sigmoidf: cpu_deltanet.h's, included before this file */

void moe_hyper_weights(const float *mix, const float *base, const float *scale, int64_t T, int64_t n, int64_t iters,
                       float eps, float *pre, float *post, float *comb) {
    const int64_t width = (2 + n) * n;
    for (int64_t t = 0; t < T; t++) {
        const float *m = mix + t * width;
        float *c = comb + t * n * n;
        for (int64_t i = 0; i < n; i++) {
            pre[t * n + i] = sigmoidf(m[i] * scale[0] + base[i]) + eps;
            post[t * n + i] = 2.f * sigmoidf(m[n + i] * scale[1] + base[n + i]);
        }
        for (int64_t r = 0; r < n; r++) {  /* each row's softmax */
            float *row = c + r * n, top = -INFINITY, total = 0.f;
            for (int64_t j = 0; j < n; j++) {
                row[j] = m[2 * n + r * n + j] * scale[2] + base[2 * n + r * n + j];
                top = row[j] > top ? row[j] : top;
            }
            for (int64_t j = 0; j < n; j++) total += (row[j] = expf(row[j] - top));
            for (int64_t j = 0; j < n; j++) row[j] = row[j] / total + eps;
        }
        for (int64_t it = 0; it < iters; it++) {
            if (it > 0)
                for (int64_t r = 0; r < n; r++) {
                    float s = 0.f;
                    for (int64_t j = 0; j < n; j++) s += c[r * n + j];
                    for (int64_t j = 0; j < n; j++) c[r * n + j] /= s + eps;
                }
            for (int64_t j = 0; j < n; j++) {
                float s = 0.f;
                for (int64_t r = 0; r < n; r++) s += c[r * n + j];
                for (int64_t r = 0; r < n; r++) c[r * n + j] /= s + eps;
            }
        }
    }
}

/* ---- one token's streams in the decode step (cpu_step.h) ---------------------------------------------------- */
typedef struct {  /* one block's hyper-connection (moetier.engine.hyper.HyperWeights) */
    linear_part fn;                 /* (2 + n) n rows of n D float32 values */
    const float *base, *scale;      /* [(2 + n) n], [3] */
} step_hyper;

/* The block input x [D] from the streams h [n, D] (Streams.enter for one token): flat = h / rms(h) over its n D
 * values, mix = fn flat, the weights above; x = sum_i pre_i h_i, streams' post and comb kept in weights
 * [n + n + n n] for streams_leave. scratch: n D + (2 + n) n floats. -> 0, or -2 when out of memory. The caller
 * holds pool->call. */
static int64_t streams_enter(moe_pool *pool, const step_hyper *w, const float *h, int64_t n, int64_t D, int64_t iters,
                             float hc_eps, float rms_eps, float *scratch, float *weights, float *x) {
    const int64_t N = n * D;
    float *flat = scratch, *mix = scratch + N, *pre = weights, *post = weights + n, *comb = weights + 2 * n;
    float squares = 0.f;
    for (int64_t i = 0; i < N; i++) squares += h[i] * h[i];
    const float r = 1.f / sqrtf(squares / (float)N + rms_eps);
    for (int64_t i = 0; i < N; i++) flat[i] = h[i] * r;
    const int64_t status = linear_held(pool, flat, 1, N, &w->fn, 1, 0, mix);
    if (status) return status;
    moe_hyper_weights(mix, w->base, w->scale, 1, n, iters, hc_eps, pre, post, comb);
    for (int64_t i = 0; i < D; i++) {
        float s = 0.f;
        for (int64_t j = 0; j < n; j++) s += pre[j] * h[j * D + i];
        x[i] = s;
    }
    return 0;
}

/* The block's output y [D] into the streams h [n, D] (Streams.leave): h_m <- post_m y + sum_j comb[j, m] h_j, with
 * the weights streams_enter kept. scratch: n D floats. */
static void streams_leave(float *h, int64_t n, int64_t D, const float *weights, const float *y, float *scratch) {
    const float *post = weights + n, *comb = weights + 2 * n;
    memcpy(scratch, h, sizeof(float) * (size_t)(n * D));
    for (int64_t m = 0; m < n; m++)
        for (int64_t i = 0; i < D; i++) {
            float s = 0.f;
            for (int64_t j = 0; j < n; j++) s += comb[j * n + m] * scratch[j * D + i];
            h[m * D + i] = post[m] * y[i] + s;
        }
}
