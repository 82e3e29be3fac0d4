/* GLM-5.3's latent attention for one decoded token (included once, by cpu_kernels.c, before cpu_step.h, whose step
 * runs it): moetier/engine/mla.py's latent_layer for T = 1 in its absorbed form (kv_b folded into q and into the
 * output), in the same order of operations, float32:
 *
 *   [q_a | kv_a (| wk | head logits | pool-gate logits)] = in(x) (+ bias)
 *   q_r = rms_norm(q_a) q_norm; latent = rms_norm(kv_a) kv_norm -> the layer's latent cache at `position`;
 *   with an indexer: LayerNorm(wk) k_norm + k_bias and the gate logits -> its index cache at `position`;
 *   [q (| qi)] = [q_b; wq_b](q_r);
 *   with an indexer: each complete pool's key is, per channel, the softmax over its slots of (gate logits +
 *     pool_bias) weighting the slots' keys; a pool's score sum_h (head_logit_h Hi^-1/2) relu(qi_h . key di^-1/2);
 *     the token attends to the min(topk / pool, complete) best pools; a "shared" layer keeps the previous
 *     layer's positions; then (select_tail) the incomplete pool it sits in;
 *   per head h: qk = q_h W_k[h] [r]; softmax over the chosen positions p of qk . latent_p dn^-1/2 (none chosen:
 *     zeros, as mla.py's nan_to_num); ctx = sum_p w_p latent_p; o_h = W_v[h] ctx [dv]; out = o(o) (+ bias).
 *
 * The pools are chosen as top_k does (ties to the lower pool), except where the k-th best score ties an unchosen
 * pool's (ReLU's exact zeros make that common in random models): torch.topk breaks such ties its own way, so
 * the choice goes to the caller's `choose` (the Python side runs torch.topk over the same scores), and the
 * selection is the Python path's. Heads are granules of one pool job; the rest runs on the calling thread.
 * Nothing here validates (moetier/engine/native_step.py checks every shape). */

typedef int64_t (*choose_fn)(const float *scores, int64_t n, int64_t k, int64_t *picks);  /* -> 0, or -1 */

typedef struct {  /* the latent-attention geometry of a model */
    int64_t q_rank, r, dn, dv, H;             /* r: the kv latent's rank */
    int64_t Hi, di, pool, topk, select_tail;  /* the indexer */
} latent_shape;

typedef struct {  /* one latent-attention layer (moetier.engine.mla.LatentWeights) */
    linear_part in[5];                     /* rows q_rank + r (+ 2 di + Hi); consecutive same-format parts merged */
    int64_t in_parts;                      /* 0: not a latent-attention layer */
    const float *in_bias;                  /* [rows], or NULL */
    const float *q_norm, *kv_norm;         /* [q_rank], [r] */
    linear_part up[2];                     /* q_b: H dn rows of q_rank; the indexer's wq_b: Hi di rows */
    const float *kv_weight;                /* [H, dn + dv, r] */
    linear_part out;                       /* D rows of H dv */
    const float *out_bias;                 /* [D], or NULL */
    const float *k_norm, *k_bias;          /* [di] each: the indexer key's LayerNorm; NULL: a shared layer */
    const float *pool_bias;                /* [pool, di] */
} step_latent;

typedef struct {
    const float *q, *kv_weight, *latents;  /* [H, dn], [H, dn + dv, r], [P, r] */
    const int64_t *picked;                 /* [n] positions, ascending */
    int64_t n, dn, dv, r;
    float scale;
    float *work, *out;                     /* work: 2 r + n floats per head; out [H, dv] */
} latent_job;

static void latent_granule(void *job, int64_t h) {
    const latent_job *a = job;
    const int64_t r = a->r, n = a->n;
    float *qk = a->work + h * (2 * r + n), *s = qk + r, *ctx = s + n, *o = a->out + h * a->dv;
    const float *Wk = a->kv_weight + h * (a->dn + a->dv) * r, *Wv = Wk + a->dn * r, *q = a->q + h * a->dn;
    if (!n) {
        for (int64_t j = 0; j < a->dv; j++) o[j] = 0.f;
        return;
    }
    for (int64_t i = 0; i < r; i++) qk[i] = 0.f;
    for (int64_t c = 0; c < a->dn; c++)
        for (int64_t i = 0; i < r; i++) qk[i] += q[c] * Wk[c * r + i];
    float top = -INFINITY, total = 0.f;
    for (int64_t j = 0; j < n; j++) {
        s[j] = dot(qk, a->latents + a->picked[j] * r, r) * a->scale;
        top = s[j] > top ? s[j] : top;
    }
    for (int64_t j = 0; j < n; j++) total += (s[j] = expf(s[j] - top));
    for (int64_t i = 0; i < r; i++) ctx[i] = 0.f;
    for (int64_t j = 0; j < n; j++) {
        const float w = s[j] / total, *latent = a->latents + a->picked[j] * r;
        for (int64_t i = 0; i < r; i++) ctx[i] += w * latent[i];
    }
    for (int64_t j = 0; j < a->dv; j++) o[j] = dot(Wv + j * r, ctx, r);
}

static void layer_norm_row(const float *x, const float *w, const float *b, float *y, int64_t n, float eps) {
    float mean = 0.f, var = 0.f;
    for (int64_t i = 0; i < n; i++) mean += x[i];
    mean /= (float)n;
    for (int64_t i = 0; i < n; i++) var += (x[i] - mean) * (x[i] - mean);
    const float r = 1.f / sqrtf(var / (float)n + eps);
    for (int64_t i = 0; i < n; i++) y[i] = (x[i] - mean) * r * w[i] + b[i];
}

/* The pools the token chooses (an indexer layer): their first positions into `starts`, -> how many, or -1 when
 * `choose` failed. index: [P, 2 di] every position's key | gate logits; qi [Hi, di]; head [Hi]; work: complete
 * (di + 1) floats. */
static int64_t choose_pools(const latent_shape *s, const step_latent *L, const float *index, int64_t P, const float *qi,
                            const float *head, float *work, choose_fn choose, int64_t *starts) {
    const int64_t di = s->di, pool = s->pool, complete = P / pool;
    const int64_t k = s->topk / pool < complete ? s->topk / pool : complete;
    if (k <= 0) return 0;
    float *key = work, *scores = work + di;  /* one pool's key at a time, then every pool's score */
    /* the scales as torch applies a Python float's */
    const float key_scale = (float)pow((double)di, -0.5), head_scale = (float)pow((double)s->Hi, -0.5);
    for (int64_t p = 0; p < complete; p++) {
        const float *rows = index + p * pool * 2 * di;
        for (int64_t c = 0; c < di; c++) {  /* per channel: softmax over the slots of gate + bias, weighting keys */
            float e[pool], top = -INFINITY, total = 0.f, sum = 0.f;
            for (int64_t j = 0; j < pool; j++) {
                e[j] = rows[j * 2 * di + di + c] + L->pool_bias[j * di + c];
                top = e[j] > top ? e[j] : top;
            }
            for (int64_t j = 0; j < pool; j++) total += (e[j] = expf(e[j] - top));
            for (int64_t j = 0; j < pool; j++) sum += e[j] / total * rows[j * 2 * di + c];
            key[c] = sum;
        }
        float score = 0.f;
        for (int64_t h = 0; h < s->Hi; h++) {
            const float relu = dot(qi + h * di, key, di) * key_scale;
            score += head[h] * head_scale * (relu > 0.f ? relu : 0.f);
        }
        scores[p] = score;
    }
    top_k(scores, complete, k, starts);
    const float last = scores[starts[k - 1]];
    int64_t tied = 0;
    for (int64_t p = 0; p < complete && !tied; p++) {
        if (scores[p] != last) continue;
        tied = 1;
        for (int64_t j = 0; j < k; j++) tied &= starts[j] != p;
    }
    if (tied && choose(scores, complete, k, starts)) return -1;
    for (int64_t j = 0; j < k; j++) starts[j] *= pool;
    return k;
}

/* One token's latent-attention layer: out [D] for x [D] at `position`; its latent (and index row) land in the
 * caches latents [capacity, r] and index [capacity, 2 di]. picked [position + 1] / *count: the positions attended,
 * ascending -- an indexer layer's choice, which a shared layer that follows reuses. scratch: latent_scratch(s)
 * floats; heads: H dv floats. -> 0, -2 when out of memory, -3 when `choose` failed. The caller holds pool->call. */
static int64_t latent_layer_held(moe_pool *pool, const latent_shape *s, const step_latent *L, const float *x, int64_t D,
                                 int64_t float_acts, float eps, int64_t position, float *latents, float *index,
                                 int64_t *picked, int64_t *count, choose_fn choose, float *scratch, float *heads,
                                 float *out) {
    const int64_t indexed = L->k_norm != NULL, di = s->di, P = position + 1, r = s->r;
    const int64_t rows = s->q_rank + r + (indexed ? 2 * di + s->Hi : 0);
    float *proj = scratch, *q_r = proj + rows, *up = q_r + s->q_rank;
    int64_t status = linear_held(pool, x, 1, D, L->in, L->in_parts, float_acts, proj);
    if (status) return status;
    if (L->in_bias)
        for (int64_t i = 0; i < rows; i++) proj[i] += L->in_bias[i];
    rms_norm_row(proj, L->q_norm, q_r, s->q_rank, eps);
    rms_norm_row(proj + s->q_rank, L->kv_norm, latents + position * r, r, eps);
    const float *head_logits = proj + s->q_rank + r + di;
    if (indexed) {
        float *row = index + position * 2 * di;
        layer_norm_row(proj + s->q_rank + r, L->k_norm, L->k_bias, row, di, 1e-6f);  /* mla.py's INDEX_NORM_EPS */
        memcpy(row + di, head_logits + s->Hi, (size_t)di * sizeof(float));
    }
    if ((status = linear_held(pool, q_r, 1, s->q_rank, L->up, indexed ? 2 : 1, float_acts, up))) return status;
    const int64_t complete = P / s->pool, n_max = P;
    float *work = pool_arena(pool, sizeof(float) * (size_t)(complete * (di + 1) + s->H * (2 * r + n_max)) + 64);
    if (!work) return -2;
    if (indexed) {
        int64_t starts[s->topk / s->pool + 1];
        const int64_t chosen = choose_pools(s, L, index, P, up + s->H * s->dn, head_logits, work, choose, starts);
        if (chosen < 0) return -3;
        for (int64_t i = 1; i < chosen; i++)  /* pools in position order */
            for (int64_t j = i; j > 0 && starts[j] < starts[j - 1]; j--) {
                const int64_t t = starts[j];
                starts[j] = starts[j - 1], starts[j - 1] = t;
            }
        *count = 0;
        for (int64_t j = 0; j < chosen; j++)
            for (int64_t p = starts[j]; p < starts[j] + s->pool; p++) picked[(*count)++] = p;
    }
    int64_t n = *count;  /* the chosen pools' positions (this layer's or, shared, the previous layer's) */
    if (s->select_tail && s->pool > 1)
        for (int64_t p = complete * s->pool; p < P; p++) picked[n++] = p;
    latent_job job = {up, L->kv_weight, latents, picked, n, s->dn, s->dv, r, (float)pow((double)s->dn, -0.5), work,
                       heads};
    int64_t granules = s->H;
    pool_run(pool, latent_granule, &job, 1, &granules);
    if ((status = linear_held(pool, heads, 1, s->H * s->dv, &L->out, 1, float_acts, out))) return status;
    if (L->out_bias)
        for (int64_t i = 0; i < D; i++) out[i] += L->out_bias[i];
    return 0;
}

/* Floats of scratch latent_layer_held takes (beside its arena and heads). */
static int64_t latent_scratch(const latent_shape *s) {
    return 2 * s->q_rank + s->r + 2 * s->di + s->Hi + s->H * s->dn + s->Hi * s->di;
}
