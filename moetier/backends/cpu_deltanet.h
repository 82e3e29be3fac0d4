/* The gated delta rule's decode step for Qwen3-Next's linear-attention layers (and KDA's, GLM-5.3's, at the end), on
 * the pool.
 *
 * Per value head, with the head's state S [dk, dv] updated in place:
 *
 *   S <- S * exp(g);  u = S^T k;  delta = beta (v - u);  S <- S + k delta^T;  o = S^T q
 *
 * in two passes over S (the first decays it and sums u, the second adds the rank-one update and sums o), so the
 * state -- 64 KB a head at dk = dv = 128 -- is read from memory once a token, where torch's five elementwise
 * passes and their temporaries read and wrote it ~8 times (1.25 ms a layer against 24 us for one read, measured).
 * The sums over dk run in row order, each of dv lanes accumulating on its own: the same products as
 * moetier.engine.deltanet._recurrent_step, summed in another order (float32 rounding apart).
 *
 * One job runs it, the token mixer (deltanet_mix_held: the decode step's, cpu_step.h, and the per-layer path's,
 * moe_deltanet_mix): a granule per key head does all of what deltanet_layer computes between the in- and
 * out-projections for its channels -- the causal conv step continuing the conv state, silu, the L2 norms, beta
 * and g, the rule for each of its value heads, the gated RMSNorm -- so a linear-attention layer hands the pool one
 * job between its two products. Each granule writes only its own heads' channels, state and outputs: the same bits
 * for any thread count. Included by
 * cpu_kernels.c (v8f, load8, store8, exp8, pool_run).
 */

/* One value head: S [dk, dv] updated in place, o [dv] = S^T q after it (see the top of this file). dv <= 512.
 * The decay: e for every row (Gated DeltaNet), or e_rows[i] for row i when e_rows is given (KDA's per channel). */
static void deltanet_head(float *S, const float *q, const float *k, const float *v, float e, const float *e_rows,
                          float beta, float *o, int64_t dk, int64_t dv) {
    float u[512], delta[512];  /* dv <= 512: the Python side refuses wider heads */
    for (int64_t j = 0; j < dv; j++) u[j] = o[j] = 0.f;
    const int64_t wide = dv & ~(int64_t)7;
    for (int64_t i = 0; i < dk; i++) {
        float *row = S + i * dv;
        const float ki = k[i], ei = e_rows ? e_rows[i] : e;
        int64_t j = 0;
        for (; j < wide; j += 8) {
            const v8f s = load8(row + j) * ei;
            store8(row + j, s);
            store8(u + j, load8(u + j) + s * ki);
        }
        for (; j < dv; j++) {
            row[j] *= ei;
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

/* x * sigmoid(x) for 8 lanes, from e^-|x| (exp8's domain): 1 / (1 + e) for x >= 0, e / (1 + e) below */
static inline v8f silu8(v8f x) {
    typedef int32_t v8i __attribute__((vector_size(32)));
    const v8i negative = x < 0.f;
    const v8f e = exp8((v8f)((negative & (v8i)x) | (~negative & (v8i)-x))), sum = 1.f + e;  /* e^-|x|, 1 + e^-|x| */
    return x * (v8f)((negative & (v8i)(e / sum)) | (~negative & (v8i)(1.f / sum)));
}

/* x[0 .. n) = silu(x), every value by silu8's lanes (a tail through a padded copy) */
static void silu_row(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) store8(x + i, silu8(load8(x + i)));
    if (i < n) {
        float tail[8] = {0};
        memcpy(tail, x + i, (size_t)(n - i) * sizeof(float));
        store8(tail, silu8(load8(tail)));
        memcpy(x + i, tail, (size_t)(n - i) * sizeof(float));
    }
}

/* channels [0, n) of the conv: y = sum_j w[j] window[j] over the K-1 earlier inputs (state [n, K-1]) and this
 * one (x), the state shifted to end with x; y replaces x, silu'd */
static void conv_step(float *x, float *state, const float *w, int64_t n, int64_t K) {
    for (int64_t c = 0; c < n; c++) {
        float *s = state + c * (K - 1);
        const float *wc = w + c * K, now = x[c];
        float y = 0.f;
        for (int64_t j = 0; j < K - 1; j++) y += s[j] * wc[j];
        y += now * wc[K - 1];
        for (int64_t j = 0; j + 1 < K - 1; j++) s[j] = s[j + 1];
        if (K > 1) s[K - 2] = now;
        x[c] = y;
    }
    silu_row(x, n);
}

/* x[0 .. n) *= 1 / sqrt(sum x^2 + 1e-6) (transformers' l2norm), then *= scale when scale != 1 */
static void l2_normalise(float *x, int64_t n, float scale) {
    float squares = 0.f;
    for (int64_t i = 0; i < n; i++) squares += x[i] * x[i];
    const float r = 1.f / sqrtf(squares + 1e-6f);
    for (int64_t i = 0; i < n; i++) x[i] *= r;
    if (scale != 1.f)
        for (int64_t i = 0; i < n; i++) x[i] *= scale;
}

/* softplus as torch computes it (beta 1, threshold 20) */
static inline float softplus(float x) { return x > 20.f ? x : log1pf(expf(x)); }

static inline float sigmoidf(float x) { return 1.f / (1.f + expf(-x)); }

/* o[0 .. n) = o / rms(o) * norm * gate: the gated RMSNorm (rms = sqrt(mean o^2 + eps)) */
static void gated_rms(float *o, const float *norm, const float *gate, int64_t n, float eps) {
    float squares = 0.f;
    for (int64_t i = 0; i < n; i++) squares += o[i] * o[i];
    const float rms = 1.f / sqrtf(squares / (float)n + eps);
    for (int64_t i = 0; i < n; i++) o[i] = o[i] * rms * norm[i] * gate[i];
}

typedef struct {  /* a linear-attention layer's token mixer for one token, between its two projections */
    float *mixed;              /* [C] the in-projection's q|k|v channels, replaced by the conv's silu outputs */
    const float *z, *ba;       /* [Hv dv] the output gate, [Hk, 2, r] b|a, from the same projection */
    float *conv_state;         /* [C, K-1] */
    float *state;              /* [Hv, dk, dv] */
    const float *conv;         /* [C, K] */
    const float *dt_bias, *decay_rate, *norm;  /* [Hv], [Hv] (-exp(A_log)), [dv] */
    float *out;                /* [Hv, dv]: RMSNorm(o) * norm * silu(z) */
    int64_t Hk, Hv, dk, dv, K;
    float eps, q_scale;        /* the gated norm's epsilon, dk^-1/2 */
} deltanet_mix;

static void deltanet_mix_granule(void *job, int64_t head) {  /* key head `head` and its r value heads */
    const deltanet_mix *a = job;
    const int64_t dk = a->dk, dv = a->dv, r = a->Hv / a->Hk, K = a->K;
    const int64_t qc = head * dk, kc = a->Hk * dk + head * dk, vc = 2 * a->Hk * dk + head * r * dv;  /* first channels */
    float *q = a->mixed + qc, *k = a->mixed + kc, *v = a->mixed + vc;
    conv_step(q, a->conv_state + qc * (K - 1), a->conv + qc * K, dk, K);
    conv_step(k, a->conv_state + kc * (K - 1), a->conv + kc * K, dk, K);
    conv_step(v, a->conv_state + vc * (K - 1), a->conv + vc * K, r * dv, K);
    l2_normalise(q, dk, a->q_scale);
    l2_normalise(k, dk, 1.f);
    for (int64_t j = 0; j < r; j++) {
        const int64_t h = head * r + j;
        const float b = a->ba[head * 2 * r + j], alpha = a->ba[head * 2 * r + r + j];
        const float beta = 1.f / (1.f + expf(-b)), g = a->decay_rate[h] * softplus(alpha + a->dt_bias[h]);
        float *o = a->out + h * dv, z[512];
        deltanet_head(a->state + h * dk * dv, q, k, v + j * dv, expf(g), NULL, beta, o, dk, dv);
        memcpy(z, a->z + h * dv, (size_t)dv * sizeof(float));
        silu_row(z, dv);
        gated_rms(o, a->norm, z, dv, a->eps);  /* o / rms(o) * norm * silu(z) */
    }
}

/* The token mixer on the pool (see deltanet_mix). The caller holds pool->call. */
static void deltanet_mix_held(moe_pool *pool, const deltanet_mix *a) {
    int64_t heads = a->Hk;
    pool_run(pool, deltanet_mix_granule, (void *)a, 1, &heads);
}

/* One token's mixer for the per-layer path (moetier.engine.deltanet): `projected` [C + Hv dv + 2 Hv] is the layer's
 * in-projection (q|k|v, z, b|a), its first C values overwritten; states updated in place; out [Hv dv]. -> 0. */
int64_t moe_deltanet_mix(moe_pool *pool, float *projected, float *conv_state, float *state, const float *conv,
                         const float *dt_bias, const float *decay_rate, const float *norm, int64_t Hk, int64_t Hv,
                         int64_t dk, int64_t dv, int64_t K, double eps, float *out) {
    const int64_t C = 2 * Hk * dk + Hv * dv;
    const deltanet_mix a = {projected, projected + C, projected + C + Hv * dv, conv_state, state, conv, dt_bias,
                            decay_rate, norm, out, Hk, Hv, dk, dv, K, (float)eps, (float)pow((double)dk, -0.5)};
    pthread_mutex_lock(&pool->call);
    deltanet_mix_held(pool, &a);
    pthread_mutex_unlock(&pool->call);
    return 0;
}

/* ---- KDA (GLM-5.3): the same rule with a decay per key channel -------------------------------------------
 * One token of moetier.engine.kda.kda_layer between its projections, a granule per head (H heads of d, keys and
 * values alike): the conv step and silu over the head's q, k and v channels, the L2 norms (q then times d^-1/2),
 * beta = sigmoid(b), per channel g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (or -exp(A_log)
 * softplus(f + dt_bias) without a bound), the rule with S's row i decayed by exp(g_i), then
 * RMSNorm(o) * norm * sigmoid(gate). The forget gate's and output gate's up-projections (f, gate) stay the
 * caller's: they are stored matrices. */
typedef struct {
    float *mixed;                        /* [3 H d] q|k|v, replaced by the conv's silu outputs */
    const float *b, *forget, *gate;      /* [H] beta's logits; [H d] f_b's output; [H d] g_b's output */
    float *conv_state, *state;           /* [3 H d, K-1], [H, d, d] */
    const float *conv, *dt_bias, *decay_rate, *norm;  /* [3 H d, K], [H d], [H] exp(A_log), [d] */
    float *out;                          /* [H d] */
    int64_t H, d, K, bounded;
    float lower_bound, eps, q_scale;
    int64_t T;                           /* tokens: mixed, b, forget, gate and out hold T rows */
} kda_mix;

/* Head h of token t (the job's rows t: mixed, b, forget, gate and out are T rows, each its width apart) */
static void kda_token(const kda_mix *a, int64_t h, int64_t t) {
    const int64_t d = a->d, K = a->K, width = a->H * d;
    float *mixed = a->mixed + t * 3 * width;
    const float *forget = a->forget + t * width, *gates = a->gate + t * width;
    for (int64_t part = 0; part < 3; part++) {  /* q, k, v */
        const int64_t c = part * width + h * d;
        conv_step(mixed + c, a->conv_state + c * (K - 1), a->conv + c * K, d, K);
    }
    float *q = mixed + h * d, *k = mixed + width + h * d, *v = mixed + 2 * width + h * d;
    l2_normalise(q, d, a->q_scale);
    l2_normalise(k, d, 1.f);
    float e[512], gate[512];
    const float rate = a->decay_rate[h];
    for (int64_t i = 0; i < d; i++) {
        const float f = forget[h * d + i] + a->dt_bias[h * d + i];
        e[i] = expf(a->bounded ? a->lower_bound * sigmoidf(rate * f) : -rate * softplus(f));
        gate[i] = sigmoidf(gates[h * d + i]);
    }
    float *o = a->out + t * width + h * d;
    deltanet_head(a->state + h * d * d, q, k, v, 0.f, e, sigmoidf(a->b[t * a->H + h]), o, d, d);
    gated_rms(o, a->norm, gate, d, a->eps);
}

/* a granule: one head through the job's T tokens in order (a head's channels, conv and delta-rule states are its
 * own) */
static void kda_mix_granule(void *job, int64_t h) {
    const kda_mix *a = job;
    for (int64_t t = 0; t < a->T; t++) kda_token(a, h, t);
}

/* The job for T tokens of H heads of d (lower_bound NaN: the softplus gate) */
static kda_mix kda_job(float *mixed, const float *b, const float *forget, const float *gate, float *conv_state,
                       float *state, const float *conv, const float *dt_bias, const float *decay_rate, const float *norm,
                       float *out, int64_t H, int64_t d, int64_t K, double lower_bound, double eps, int64_t T) {
    return (kda_mix){mixed, b, forget, gate, conv_state, state, conv, dt_bias, decay_rate, norm, out, H, d, K,
                     !isnan(lower_bound), isnan(lower_bound) ? 0.f : (float)lower_bound, (float)eps,
                     (float)pow((double)d, -0.5), T};  /* as torch scales by a Python float */
}

/* The caller holds pool->call. */
static void kda_mix_held(moe_pool *pool, const kda_mix *a) {
    int64_t heads = a->H;
    pool_run(pool, kda_mix_granule, (void *)a, 1, &heads);
}

/* T KDA tokens' mixer for the per-layer path, in order (decode: T = 1; prefill: the recurrence token by token,
 * a head's d x d state in L1, instead of the chunked form torch runs): mixed [T, 3 H d] (overwritten), b [T, H],
 * forget and gate [T, H d], states updated in place, out [T, H d]. lower_bound: NaN for the softplus gate. -> 0. */
int64_t moe_kda_mix(moe_pool *pool, float *mixed, const float *b, const float *forget, const float *gate, float *conv_state,
                    float *state, const float *conv, const float *dt_bias, const float *decay_rate, const float *norm,
                    int64_t H, int64_t d, int64_t K, double lower_bound, double eps, int64_t T, float *out) {
    const kda_mix a = kda_job(mixed, b, forget, gate, conv_state, state, conv, dt_bias, decay_rate, norm, out, H, d, K,
                              lower_bound, eps, T);
    pthread_mutex_lock(&pool->call);
    kda_mix_held(pool, &a);
    pthread_mutex_unlock(&pool->call);
    return 0;
}
