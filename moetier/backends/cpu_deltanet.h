/* The gated delta rule's decode step for Qwen3-Next's linear-attention layers, on the pool.
 *
 * Per value head (a granule each), with the head's state S [dk, dv] updated in place:
 *
 *   S <- S * exp(g);  u = S^T k;  delta = beta (v - u);  S <- S + k delta^T;  o = S^T q
 *
 * in two passes over S (the first decays it and sums u, the second adds the rank-one update and sums o), so the
 * state -- 64 KB a head at dk = dv = 128 -- is read from memory once a token, where torch's five elementwise
 * passes and their temporaries read and wrote it ~8 times (1.25 ms a layer against 24 us for one read, measured).
 * q and k come L2-normalised (q scaled by dk^-1/2) and repeated to the value heads. The sums over dk run in row
 * order, each of dv lanes accumulating on its own: the same products as moetier.engine.deltanet._recurrent_step,
 * summed in another order (float32 rounding apart). Included by cpu_kernels.c (v8f, load8, store8, pool_run).
 */

typedef struct {
    float *state;           /* [H, dk, dv] */
    const float *q, *k;     /* [H, dk] */
    const float *v;         /* [H, dv] */
    const float *decay;     /* [H]: g, the log of the step's decay */
    const float *beta;      /* [H] */
    float *out;             /* [H, dv] */
    int64_t dk, dv;
} deltanet_job;

static void deltanet_granule(void *job, int64_t head) {
    const deltanet_job *a = job;
    const int64_t dk = a->dk, dv = a->dv;
    float *S = a->state + head * dk * dv, *o = a->out + head * dv;
    const float *q = a->q + head * dk, *k = a->k + head * dk, *v = a->v + head * dv;
    const float e = expf(a->decay[head]), beta = a->beta[head];
    float u[512], delta[512];  /* dv <= 512: the Python side refuses wider heads */
    for (int64_t j = 0; j < dv; j++) u[j] = o[j] = 0.f;
    const int64_t wide = dv & ~(int64_t)7;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i];
        int64_t j = 0;
        for (; j < wide; j += 8) {
            const v8f s = load8(row + j) * e;
            store8(row + j, s);
            store8(u + j, load8(u + j) + s * ki);
        }
        for (; j < dv; j++) {
            row[j] *= e;
            u[j] += row[j] * ki;
        }
    }
    for (int64_t j = 0; j < dv; j++) delta[j] = (v[j] - u[j]) * beta;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], qi = q[i];
        int64_t j = 0;
        for (; j < wide; j += 8) {
            const v8f s = load8(row + j) + ki * load8(delta + j);
            store8(row + j, s);
            store8(o + j, load8(o + j) + s * qi);
        }
        for (; j < dv; j++) {
            row[j] += ki * delta[j];
            o[j] += row[j] * qi;
        }
    }
}

/* One token's delta-rule step over H value heads (see the top of this file). -> 0. */
int64_t moe_deltanet_step(moe_pool *pool, float *state, const float *q, const float *k, const float *v,
                          const float *decay, const float *beta, int64_t H, int64_t dk, int64_t dv, float *out) {
    deltanet_job a = {state, q, k, v, decay, beta, out, dk, dv};
    pthread_mutex_lock(&pool->call);
    pool_run(pool, deltanet_granule, &a, 1, &H);
    pthread_mutex_unlock(&pool->call);
    return 0;
}
