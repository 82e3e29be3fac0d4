/* moetier native decode kernel: one token through k SwiGLU experts, float32.
 *
 *   out[D] = sum_j scale[j] * down_j @ (silu(gate_j @ x) * (up_j @ x))
 *
 * gate_up_j is [2I, D] (gate rows, then up rows) and down_j is [D, I], both
 * row-major and contiguous, anywhere in memory: the caller passes their
 * addresses, so experts are read in place, each byte once. Decode is bound by
 * those bytes; the kernel streams 8 rows per pass so x is read from L1 once per
 * 8 rows and the loads of 8 independent dot products keep the memory pipe full.
 * One call per layer's group replaces ~5 framework ops per expert.
 *
 * Built once per machine by moetier/backends/native.py (cc -O3 -march=native,
 * with reassociation allowed so the dot products vectorize); called through
 * ctypes, which releases the GIL, so lanes run it in parallel threads.
 */
#include <math.h>
#include <stdint.h>

#define ROWS 8

/* y[r] = W[r, :] . x for r in [0, rows) */
static void gemv(const float *restrict W, const float *restrict x, float *restrict y, int64_t rows, int64_t cols) {
    int64_t r = 0;
    for (; r + ROWS <= rows; r += ROWS) {
        const float *w = W + r * cols;
        float s[ROWS] = {0};
        for (int64_t c = 0; c < cols; c++) {
            const float xc = x[c];
            for (int q = 0; q < ROWS; q++) s[q] += w[q * cols + c] * xc;
        }
        for (int q = 0; q < ROWS; q++) y[r + q] = s[q];
    }
    for (; r < rows; r++) {
        const float *w = W + r * cols;
        float s = 0.f;
        for (int64_t c = 0; c < cols; c++) s += w[c] * x[c];
        y[r] = s;
    }
}

/* experts: 2k addresses, gate_up_0, down_0, gate_up_1, down_1, ...
 * scratch: 3I + D floats the call may overwrite. out: D floats, overwritten. */
void moe_decode_f32(const float *x, int64_t D, int64_t I, int64_t k, const int64_t *experts,
                    const float *scale, float *out, float *scratch) {
    float *gate_up = scratch, *hidden = scratch + 2 * I, *y = scratch + 3 * I;
    for (int64_t d = 0; d < D; d++) out[d] = 0.f;
    for (int64_t j = 0; j < k; j++) {
        gemv((const float *)(intptr_t)experts[2 * j], x, gate_up, 2 * I, D);
        for (int64_t i = 0; i < I; i++) {
            const float g = gate_up[i];
            hidden[i] = g / (1.f + expf(-g)) * gate_up[I + i];
        }
        gemv((const float *)(intptr_t)experts[2 * j + 1], hidden, y, D, I);
        const float s = scale[j];
        for (int64_t d = 0; d < D; d++) out[d] += s * y[d];
    }
}
