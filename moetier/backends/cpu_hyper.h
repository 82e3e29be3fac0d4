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
