/* moetier's native decode step: one token through a run of decoder layers in one call (included once, by
 * cpu_kernels.c, whose jobs, dot families, router, delta rules, hyper-connections and latent attention it uses).
 *
 * For each layer, what moetier/engine/core.py computes for one token, in the same order, each block (the token
 * mixer, the MLP) between an input and an output of the residual: h itself and h += y, or with hyper-connections
 * (GLM-5.3, cpu_hyper.h) the streams h [n, D] collapsed into the block's input and y expanded back into them:
 *
 *   x = rms_norm(input, input_norm); then the token mixer, one of
 *     attention: [q k v] = qkv(x) (+ bias) (with an output gate, q's rows per head are d query rows then d gate
 *       rows); q, k per-head rms_norm * qk_norm; rotary on the first rotary_dim dims of q, k; k, v -> the KV cache
 *       at `position`; a = attention(q, keys [first, position], values) (* sigmoid(gate)); y = o(a) (+ bias);
 *     linear attention (Qwen3-Next's Gated DeltaNet, moetier/engine/deltanet.py): [q|k|v z b|a] = in(x); the
 *       conv step, silu, L2 norms, beta and g, the delta rule on the layer's state, the gated RMSNorm (one job of
 *       cpu_deltanet.h, a granule per key head); y = out(...);
 *     KDA (GLM-5.3's, moetier/engine/kda.py): [q|k|v b f_a g_a] = in(x); the gates' up-projections; the mixer (one
 *       job of cpu_deltanet.h); y = out(...);
 *     latent attention (GLM-5.3's, moetier/engine/mla.py) with its indexer: cpu_latent.h;
 *   x = rms_norm(input, post_norm); then a dense layer: y = mlp(x); a MoE layer: the router's logits (a float32
 *   linear), its picks and weights (pick_softmax / pick_sigmoid, nudged by the caller's bias row), and
 *   y = sum_j w_j expert_j(x) + shared(x), the shared part scaled by sigmoid(x . shared_gate) where the layer
 *   has one. Before the layers h may be a token's embedding row (dequantized by cpu_formats.c, as the engine's
 *   StoredEmbedding does; in every stream), after them the lm head's logits of rms_norm(h (the streams' mean),
 *   final_norm).
 *
 * Every matrix product is a job of cpu_kernels.c on the pool (the trunk's projections through their formats'
 * dot families, the experts through moe_layout's phases), each query head's attention a granule of one more
 * job; the per-head norms, rotary, the cache writes, the router's selection and the residual adds run on the
 * calling thread between jobs while the helpers poll. So one call hands the pool ~6 jobs per layer and Python
 * none. Every output value is computed by one thread from the same inputs, so the result is the same bits for
 * any thread count. Numerics against the Python path: the same products and formats, float32 sums in other
 * orders (the attention's dot products and softmax, the norms' sums, the router's logits, the conv taps, the
 * streams' projection) and exp8's e^x in the mixer's silu, so logits agree to float32 rounding
 * (tests/test_native_step.py, tests/test_glm5_next.py); the indexer's tied choices are torch's (cpu_latent.h). The Python
 * side (moetier/engine/native_step.py) checks every shape, format and pointer; nothing here validates.
 */

typedef struct {  /* the model's shape, for every layer of a call */
    int64_t D, H, G, d, rotary_dim;  /* hidden size, query heads, kv heads, head dim, leading dims that rotate */
    int64_t E, k, router;            /* routed experts, picks per token, router: 0 softmax, 1 sigmoid */
    int64_t norm_topk, n_group, topk_group, I;  /* I: a routed expert's width */
    int64_t float_acts;              /* the trunk's F16 / BF16 matrices take F32 activations */
    double eps, scaling;             /* rms_norm epsilon, routed_scaling_factor */
    const uint8_t *embed;            /* the embedding table: rows of D values of embed_type, as stored */
    int64_t embed_type;
    const float *final_norm;         /* [D] */
    linear_part head;                /* the lm head: V rows of D values */
    int64_t attention_gate;          /* attention layers' q rows per head: d query rows, then d gate rows */
    int64_t Hk, Hv, dk, dv, K;       /* linear attention: key / value heads, their dims, conv taps (0: none) */
    double lower_bound;              /* KDA's forget gate bound (NaN: the softplus gate) */
    int64_t streams, hc_iters;       /* hyper-connections: residual streams (0: a plain residual), Sinkhorn rounds */
    double hc_eps;
    latent_shape latent;             /* latent attention and its indexer (GLM-5.3) */
} step_model;

typedef struct {  /* a linear-attention layer's token mixer (moetier.engine.deltanet.DeltaNetWeights) */
    linear_part in[3];                          /* rows C + Hv dv + 2 Hv: q|k|v, z, b|a; same-format parts merged */
    int64_t in_parts;                           /* 0: an attention layer */
    const float *conv;                          /* [C, K] */
    const float *dt_bias, *decay_rate, *norm;   /* [Hv], [Hv] (-exp(A_log)), [dv] */
    linear_part out;                            /* D rows of Hv dv */
} step_deltanet;

typedef struct {  /* a KDA layer's token mixer (moetier.engine.kda.KdaWeights); H heads of d: Hk, dk */
    linear_part in[6];                          /* rows 3 H d + H + 2 d: q|k|v, b, f_a, g_a; same-format parts merged */
    int64_t in_parts;                           /* 0: not a KDA layer */
    linear_part forget_up, gate_up;             /* H d rows of d each */
    const float *conv, *dt_bias, *decay_rate, *norm;  /* [3 H d, K], [H d], [H] exp(A_log), [d] */
    linear_part out;                            /* D rows of H d */
} step_kda;

typedef struct {  /* one decoder layer: addresses of what the engine holds */
    const float *input_norm, *post_norm;  /* [D] */
    const float *qk_norm;                 /* [H + G, d], or NULL */
    linear_part qkv[3];                   /* rows (H + 2G) d in all: q, k, v, consecutive same-format parts merged */
    int64_t qkv_parts;
    const float *qkv_bias;                /* [(H + 2G) d], or NULL */
    linear_part o;                        /* D rows of H d */
    const float *o_bias;                  /* [D], or NULL */
    const float *router, *correction;     /* [E, D] float32, [E] or NULL; router NULL: a dense layer */
    const int64_t *experts;               /* [E, RECORD_WORDS]: every routed expert's record */
    const int64_t *mlp;                   /* a dense layer's MLP, a MoE layer's shared experts, or NULL: a record */
    int64_t mlp_I;                        /* its width */
    const float *shared_gate;             /* [D]: the shared experts' output * sigmoid(x . shared_gate), or NULL */
    step_deltanet deltanet;               /* a linear-attention layer's mixer (its qkv, o, qk_norm unused) */
    step_kda kda;                         /* a KDA layer's mixer (likewise) */
    step_latent latent;                   /* a latent-attention layer's (likewise) */
    step_hyper hyper_attn, hyper_ffn;     /* the streams' weights around the mixer and the MLP (model.streams > 0) */
} step_layer;

typedef struct {  /* one call */
    int64_t token;                        /* its id: h = its embedding row; -1: h holds the stream already */
    float *h;                             /* [D] the residual stream, updated in place */
    int64_t position, capacity, window;   /* the token's position, the caches' capacity, sliding window (0: none) */
    const float *cos, *sin;               /* [rotary_dim] the rotary table's row at position */
    float *const *keys, *const *values;   /* per layer of the call: [G, capacity, d] (NULL in linear layers) */
    const float *nudge;                   /* [MoE layers of the call, E] added to the selection scores, or NULL */
    float *logits, *probs, *weights;      /* per MoE layer of the call: [E], [E], [k]: its route */
    int64_t *picks;                       /* [MoE layers, k] */
    float *scratch;                       /* step_scratch(model) floats */
    float *out;                           /* [V] logits = head(rms_norm(h, final_norm)) after the layers, or NULL */
    float *const *conv_states;            /* per layer: [C, K-1] a linear layer's conv inputs, updated in place */
    float *const *recurrent_states;       /* per layer: [Hv, dk, dv] its delta-rule state, updated in place */
    float *const *latents, *const *index; /* per layer: a latent-attention layer's caches [capacity, r], [capacity, 2 di] */
    int64_t *picked;                      /* [position + 1]: the positions the last latent layer attended */
    choose_fn choose;                     /* the indexer's tied choices (cpu_latent.h) */
} step_call;

static inline int64_t most(int64_t a, int64_t b) { return a > b ? a : b; }

/* Floats of the token mixers' projections (an attention layer's q, gates, k, v; a Gated DeltaNet layer's q|k|v z b|a;
 * a KDA layer's q|k|v b f_a g_a and its gates' up-projections; a latent layer's) and of their outputs (the attention
 * heads', the delta rule's heads', the latent heads') */
static int64_t mix_rows(const step_model *m) {
    const int64_t attention = (m->H * (1 + m->attention_gate) + 2 * m->G) * m->d;
    const int64_t linear = 2 * m->Hk * m->dk + 2 * m->Hv * m->dv + 2 * m->Hv;
    const int64_t kda = 5 * m->Hk * m->dk + m->Hk + 2 * m->dk;
    return most(most(attention, linear), most(kda, latent_scratch(&m->latent)));
}

static int64_t mix_outputs(const step_model *m) {
    return most(most(m->H * m->d, m->Hv * m->dv), m->latent.H * m->latent.dv);
}

/* Floats of the streams' scratch: a copy of the streams [n D] and their projection, the weights, the block input */
static int64_t streams_scratch(const step_model *m) {
    const int64_t n = m->streams ? m->streams : 1;
    return n * m->D + 2 * (2 + n) * n + m->D;
}

/* Floats of scratch a call needs. */
int64_t step_scratch(const step_model *m) {
    return 5 * m->D + mix_rows(m) + mix_outputs(m) + m->attention_gate * m->H * m->d + m->E + 64 + streams_scratch(m);
}

/* the first rd of a head's d values rotated as RotaryTable.apply does (rotate_half), the rest kept */
static void rotate(float *x, const float *cos, const float *sin, int64_t rd) {
    const int64_t half = rd / 2;
    for (int64_t i = 0; i < half; i++) {
        const float a = x[i], b = x[i + half];
        x[i] = a * cos[i] - b * sin[i];
        x[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* Attention of T queries at positions start .. start + T - 1 (causal; a sliding window of `window` keys when
 * window > 0) over a layer's KV cache, grouped-query heads. A granule is one kv group's R = H / G query heads, a
 * block of ATTN_QUERIES queries and a range of key positions; it walks its range ATTN_CHUNK keys at a time, and a
 * chunk's keys and values (ATTN_CHUNK d floats each, in L1) serve all its queries and heads before the next is
 * read. Each (query, head) keeps a running max, sum of exponentials and weighted sum of values (the online
 * softmax): with one range the granule writes the output rows; with more, each range's (max, sum, row) goes to
 * `partial` and the caller merges them in range order. A query block has its range cut where the call has a
 * single block (decode), so that a few kv groups still give every thread work: ranges of at least ATTN_SPAN
 * positions, at most ATTN_RANGES of them. The cut is a function of the shapes, so the same bits for any thread
 * count. Before, each head was a granule reading its group's keys and values from L2 once per head, and a head's
 * output row (an array as long as the head) lived in memory: 16 heads, 2 groups, d = 128, one query, 2 threads,
 * through moe_attention (~6 us of it Python's): 20.7 / 41.0 / 120 us a call at 130 / 290 / 1000 positions, now
 * 15.1 / 28-30 / 77 (both loops then bound by their loads and multiply-adds: 16-wide vectors and a vector max
 * gained nothing). */
enum { ATTN_QUERIES = 16, ATTN_CHUNK = 32, ATTN_SPAN = 256, ATTN_RANGES = 16 };

typedef struct {
    const float *q, *keys, *values;  /* q [H, T, d]; the caches [G, capacity, d], positions < start + T written */
    float *out, *partial, *scratch;  /* out [T, H d]; partial [T, H, ranges, d + 2]; scratch: `room` floats a granule */
    int64_t H, G, d, capacity, T, start, window, blocks, ranges, base, span, room;  /* range r: base + [r, r + 1) span */
    float scale;
} attn_job;

/* s[j] = q . K[j] for 8 keys (rows d apart), d a multiple of 8 */
static inline void scores8(const float *q, const float *K, int64_t d, float *s) {
    v8f acc[8] = {{0}};
    for (int64_t c = 0; c < d; c += 8) {
        const v8f qc = load8(q + c);
        for (int j = 0; j < 8; j++) acc[j] += qc * load8(K + j * d + c);
    }
    for (int j = 0; j < 8; j++) s[j] = sum8(acc[j]);
}

/* one (query, head)'s state [m, l, row d] over keys K, values V [n, d] (n >= 1) of scores s (scratch: n floats) */
static void attn_update(float *state, const float *q, const float *K, const float *V, int64_t n, int64_t d, float scale,
                        float *s) {
    const int64_t wide = d % 8 ? 0 : n & ~(int64_t)7;
    int64_t p = 0;
    for (; p < wide; p += 8) scores8(q, K + p * d, d, s + p);
    for (; p < n; p++) s[p] = dot(q, K + p * d, d);
    float top = -INFINITY;
    for (p = 0; p < n; p++) top = (s[p] *= scale) > top ? s[p] : top;
    const float m = state[0] > top ? state[0] : top, keep = state[0] == -INFINITY ? 0.f : expf(state[0] - m);
    float total = 0.f;
    p = 0;
    if (n >= 8) {
        v8f sums = {0};
        for (; p + 8 <= n; p += 8) {
            const v8f e = exp8(load8(s + p) - m);
            store8(s + p, e);
            sums += e;
        }
        total = sum8(sums);
    }
    for (; p < n; p++) total += (s[p] = expf(s[p] - m));
    state[0] = m, state[1] = state[1] * keep + total;
    /* the row 64 values at a time in registers (a fixed count of accumulators: an array as long as the head kept
     * them in memory, a load and a store with every multiply-add), then 8 at a time, then one */
    float *row = state + 2;
    int64_t i = 0;
    for (; i + 64 <= d; i += 64) {
        v8f acc[8];
        for (int j = 0; j < 8; j++) acc[j] = keep * load8(row + i + 8 * j);
        for (p = 0; p < n; p++) {
            const float w = s[p], *v = V + p * d + i;
            for (int j = 0; j < 8; j++) acc[j] += w * load8(v + 8 * j);
        }
        for (int j = 0; j < 8; j++) store8(row + i + 8 * j, acc[j]);
    }
    for (; i + 8 <= d; i += 8) {
        v8f acc = keep * load8(row + i);
        for (p = 0; p < n; p++) acc += s[p] * load8(V + p * d + i);
        store8(row + i, acc);
    }
    for (; i < d; i++) {
        float acc = keep * row[i];
        for (p = 0; p < n; p++) acc += s[p] * V[p * d + i];
        row[i] = acc;
    }
}

static void attn_granule(void *job, int64_t granule) {
    const attn_job *a = job;
    const int64_t d = a->d, R = a->H / a->G, range = granule % a->ranges, block = granule / a->ranges % a->blocks;
    const int64_t group = granule / a->ranges / a->blocks, t0 = block * ATTN_QUERIES;
    const int64_t t1 = t0 + ATTN_QUERIES < a->T ? t0 + ATTN_QUERIES : a->T, stride = d + 2;
    const int64_t lo = a->base + range * a->span, hi = lo + a->span;
    float *states = a->scratch + granule * a->room, *s = states + (t1 - t0) * R * stride;  /* [queries, R, d + 2] */
    for (int64_t i = 0; i < (t1 - t0) * R; i++) {
        states[i * stride] = -INFINITY, states[i * stride + 1] = 0.f;
        for (int64_t j = 0; j < d; j++) states[i * stride + 2 + j] = 0.f;
    }
    const float *K = a->keys + group * a->capacity * d, *V = a->values + group * a->capacity * d;
    for (int64_t c0 = lo; c0 < hi && c0 < a->start + t1; c0 += ATTN_CHUNK)
        for (int64_t t = t0; t < t1; t++) {
            const int64_t pos = a->start + t, first = a->window > 0 && pos + 1 > a->window ? pos + 1 - a->window : 0;
            const int64_t from = c0 > first ? c0 : first, end = c0 + ATTN_CHUNK < hi ? c0 + ATTN_CHUNK : hi;
            const int64_t to = end < pos + 1 ? end : pos + 1;
            for (int64_t h = 0; from < to && h < R; h++)
                attn_update(states + ((t - t0) * R + h) * stride, a->q + ((group * R + h) * a->T + t) * d, K + from * d,
                            V + from * d, to - from, d, a->scale, s);
        }
    for (int64_t t = t0; t < t1; t++)
        for (int64_t h = 0; h < R; h++) {
            const float *state = states + ((t - t0) * R + h) * stride;
            const int64_t head = group * R + h;
            if (a->ranges > 1) {
                memcpy(a->partial + ((t * a->H + head) * a->ranges + range) * stride, state, sizeof(float) * (size_t)stride);
                continue;
            }
            float *out = a->out + (t * a->H + head) * d;
            const float inv = 1.f / state[1];
            for (int64_t i = 0; i < d; i++) out[i] = state[2 + i] * inv;
        }
}

/* The caller holds pool->call. -> 0, or -2 when out of memory. */
static int64_t attention_held(moe_pool *pool, const float *q, const float *keys, const float *values, int64_t capacity,
                              int64_t H, int64_t G, int64_t d, int64_t T, int64_t start, int64_t window, float *out) {
    const int64_t blocks = ceil_div(T, ATTN_QUERIES), R = H / G, stride = d + 2;
    const int64_t base = window > 0 && start + 1 > window ? start + 1 - window : 0, keys_seen = start + T - base;
    const int64_t span = blocks > 1 ? keys_seen : most(ATTN_SPAN, ceil_div(keys_seen, ATTN_RANGES));
    const int64_t ranges = ceil_div(keys_seen, span), granules = G * blocks * ranges;
    const int64_t room = (T < ATTN_QUERIES ? T : ATTN_QUERIES) * R * stride + ATTN_CHUNK;
    const size_t partial = ranges > 1 ? (size_t)(T * H * ranges * stride) : 0;
    float *arena = pool_arena(pool, sizeof(float) * ((size_t)(granules * room) + partial));
    if (!arena) return -2;
    attn_job a = {q, keys, values, out, arena + granules * room, arena, H, G, d, capacity, T, start, window, blocks,
                  ranges, base, span, room, 1.f / sqrtf((float)d)};
    pool_run(pool, attn_granule, &a, 1, &granules);
    for (int64_t t = 0; ranges > 1 && t < T; t++)  /* the ranges' states merged in range order */
        for (int64_t head = 0; head < H; head++) {
            const float *part = a.partial + (t * H + head) * ranges * stride;
            float top = -INFINITY, total = 0.f, *o = out + (t * H + head) * d;
            for (int64_t r = 0; r < ranges; r++) top = part[r * stride] > top ? part[r * stride] : top;
            for (int64_t i = 0; i < d; i++) o[i] = 0.f;
            for (int64_t r = 0; r < ranges; r++) {
                const float *state = part + r * stride;
                if (state[1] == 0.f) continue;  /* no key of this range */
                const float w = expf(state[0] - top);
                total += w * state[1];
                for (int64_t i = 0; i < d; i++) o[i] += w * state[2 + i];
            }
            const float inv = 1.f / total;
            for (int64_t i = 0; i < d; i++) o[i] *= inv;
        }
    return 0;
}

/* out [T, H d] = softmax(q k^T / sqrt(d)) v for T queries q [H, T, d] at positions start.. (causal, a sliding window
 * of `window` keys when window > 0) over caches keys / values [G, capacity, d]. -> 0, or -2 when out of memory. */
int64_t moe_attention(moe_pool *pool, const float *q, const float *keys, const float *values, int64_t capacity, int64_t H,
                      int64_t G, int64_t d, int64_t T, int64_t start, int64_t window, float *out) {
    pthread_mutex_lock(&pool->call);
    const int64_t status = attention_held(pool, q, keys, values, capacity, H, G, d, T, start, window, out);
    pthread_mutex_unlock(&pool->call);
    return status;
}

/* A linear-attention layer's output out [D] for x [D] (moetier.engine.deltanet.deltanet_layer for one token): the
 * in-projection into proj, the mixer into mixed (cpu_deltanet.h), the out-projection; its states advance in place.
 * -> 0, or -2 when out of memory. The caller holds pool->call. */
static int64_t linear_attention_held(moe_pool *pool, const step_model *m, const step_deltanet *L, const float *x,
                                     float *conv_state, float *state, float *proj, float *mixed, float *out) {
    const int64_t C = 2 * m->Hk * m->dk + m->Hv * m->dv, width = m->Hv * m->dv;
    const int64_t status = linear_held(pool, x, 1, m->D, L->in, L->in_parts, m->float_acts, proj);
    if (status) return status;
    const deltanet_mix mix = {proj, proj + C, proj + C + width, conv_state, state, L->conv, L->dt_bias, L->decay_rate,
                              L->norm, mixed, m->Hk, m->Hv, m->dk, m->dv, m->K, (float)m->eps,
                              (float)pow((double)m->dk, -0.5)};  /* as torch scales by a Python float */
    deltanet_mix_held(pool, &mix);
    return linear_held(pool, mixed, 1, width, &L->out, 1, m->float_acts, out);
}

/* A KDA layer's output out [D] for x [D] (moetier.engine.kda.kda_layer for one token): the in-projection and the
 * gates' up-projections into proj, the mixer (cpu_deltanet.h's kda_mix) into mixed, the out-projection; its states
 * advance in place. -> 0, or -2 when out of memory. The caller holds pool->call. */
static int64_t kda_layer_held(moe_pool *pool, const step_model *m, const step_kda *L, const float *x, float *conv_state,
                              float *state, float *proj, float *mixed, float *out) {
    const int64_t H = m->Hk, d = m->dk, width = H * d;
    float *f_a = proj + 3 * width + H, *g_a = f_a + d, *forget = g_a + d, *gate = forget + width;
    int64_t status = linear_held(pool, x, 1, m->D, L->in, L->in_parts, m->float_acts, proj);
    if (!status) status = linear_held(pool, f_a, 1, d, &L->forget_up, 1, m->float_acts, forget);
    if (!status) status = linear_held(pool, g_a, 1, d, &L->gate_up, 1, m->float_acts, gate);
    if (status) return status;
    const kda_mix a = kda_job(proj, proj + 3 * width, forget, gate, conv_state, state, L->conv, L->dt_bias, L->decay_rate,
                              L->norm, mixed, H, d, m->K, m->lower_bound, m->eps, 1);
    kda_mix_held(pool, &a);
    return linear_held(pool, mixed, 1, width, &L->out, 1, m->float_acts, out);
}

/* An attention layer's output o [D] for x [D] (Engine._attention for one token); its k, v land in the layer's cache.
 * qkv, att, gate: scratch of mix_rows, mix_outputs and H d floats. -> 0, or -2 when out of memory. The caller holds
 * pool->call. */
static int64_t attention_layer_held(moe_pool *pool, const step_model *m, const step_layer *L, const step_call *c,
                                    int64_t l, const float *x, float *qkv, float *att, float *gate, float *o) {
    const int64_t D = m->D, H = m->H, G = m->G, d = m->d, pos = c->position, gated = m->attention_gate;
    int64_t status;
    if ((status = linear_held(pool, x, 1, D, L->qkv, L->qkv_parts, m->float_acts, qkv))) return status;
    if (L->qkv_bias)
        for (int64_t i = 0; i < (H * (1 + gated) + 2 * G) * d; i++) qkv[i] += L->qkv_bias[i];
    if (gated) {  /* the gates out, then q, k, v packed as [H + 2G, d] (each move's target below its source) */
        for (int64_t head = 0; head < H; head++) {
            memcpy(gate + head * d, qkv + (2 * head + 1) * d, (size_t)d * sizeof(float));
            memmove(qkv + head * d, qkv + 2 * head * d, (size_t)d * sizeof(float));
        }
        memmove(qkv + H * d, qkv + 2 * H * d, (size_t)(2 * G * d) * sizeof(float));
    }
    float *K = c->keys[l] + pos * d, *V = c->values[l] + pos * d;
    for (int64_t head = 0; head < H + G; head++) {  /* q heads, then k heads */
        float *v = qkv + head * d;
        if (L->qk_norm) rms_norm_row(v, L->qk_norm + head * d, v, d, (float)m->eps);
        rotate(v, c->cos, c->sin, m->rotary_dim);
    }
    for (int64_t g = 0; g < G; g++) {
        memcpy(K + g * c->capacity * d, qkv + (H + g) * d, (size_t)d * sizeof(float));
        memcpy(V + g * c->capacity * d, qkv + (H + G + g) * d, (size_t)d * sizeof(float));
    }
    if ((status = attention_held(pool, qkv, c->keys[l], c->values[l], c->capacity, H, G, d, 1, pos, c->window, att)))
        return status;
    if (gated)
        for (int64_t i = 0; i < H * d; i++) att[i] *= 1.f / (1.f + expf(-gate[i]));
    return linear_held(pool, att, 1, H * d, &L->o, 1, m->float_acts, o);
}

/* A block's input: h, or the streams collapsed by the block's hyper-connection (its weights kept in st->weights). */
typedef struct { float *copy, *weights, *input; } streams_work;

static int64_t block_enter(moe_pool *pool, const step_model *m, const step_hyper *w, const float *h, streams_work *st,
                           const float **in) {
    *in = h;
    if (!m->streams) return 0;
    *in = st->input;
    return streams_enter(pool, w, h, m->streams, m->D, m->hc_iters, (float)m->hc_eps, (float)m->eps, st->copy,
                         st->weights, st->input);
}

/* A block's output y [D] into the residual h, or into the streams by the weights its block_enter kept. */
static void block_leave(const step_model *m, float *h, const float *y, streams_work *st) {
    if (m->streams) {
        streams_leave(h, m->streams, m->D, st->weights, y, st->copy);
        return;
    }
    for (int64_t i = 0; i < m->D; i++) h[i] += y[i];
}

/* One token through layers[0 .. n): see the top of this file. -> 0, -2 when out of memory, -3 when the caller's
 * `choose` failed. */
int64_t moe_step(moe_pool *pool, const step_model *m, const step_layer *layers, int64_t n, const step_call *c) {
    const int64_t D = m->D, E = m->E, k = m->k, S = m->streams ? m->streams : 1;
    const float eps = (float)m->eps, one = 1.f;
    float *h = c->h, *x = c->scratch, *mixing = x + D, *att = mixing + mix_rows(m), *gate = att + mix_outputs(m);
    float *o = gate + m->attention_gate * m->H * m->d, *routed = o + D, *shared = routed + D, *pick_scratch = shared + D;
    float *st_at = pick_scratch + E + 64;
    streams_work st = {st_at, st_at + S * D + (2 + S) * S, st_at + S * D + 2 * (2 + S) * S};
    int64_t status = 0, moe = 0, count = 0;  /* count: the positions in c->picked */
    const float *in;
    pthread_mutex_lock(&pool->call);  /* the scratch is the pool's caller's */
    if (c->token >= 0) {  /* the embedding row, dequantized as ggml's get_rows does, into every stream */
        const uint8_t *row = m->embed + c->token * row_bytes(m->embed_type, D);
        if (m->embed_type == TYPE_F32) memcpy(h, row, (size_t)D * sizeof(float));
        else dequantize_row(m->embed_type, row, h, D);
        for (int64_t j = 1; j < S; j++) memcpy(h + j * D, h, (size_t)D * sizeof(float));
    }
    for (int64_t l = 0; l < n && !status; l++) {
        const step_layer *L = &layers[l];
        if ((status = block_enter(pool, m, &L->hyper_attn, h, &st, &in))) break;
        rms_norm_row(in, L->input_norm, x, D, eps);
        if (L->deltanet.in_parts)
            status = linear_attention_held(pool, m, &L->deltanet, x, c->conv_states[l], c->recurrent_states[l], mixing,
                                           att, o);
        else if (L->kda.in_parts)
            status = kda_layer_held(pool, m, &L->kda, x, c->conv_states[l], c->recurrent_states[l], mixing, att, o);
        else if (L->latent.in_parts)
            status = latent_layer_held(pool, &m->latent, &L->latent, x, D, m->float_acts, eps, c->position, c->latents[l],
                                       c->index[l], c->picked, &count, c->choose, mixing, att, o);
        else if (!(status = attention_layer_held(pool, m, L, c, l, x, mixing, att, gate, o)) && L->o_bias)
            for (int64_t i = 0; i < D; i++) o[i] += L->o_bias[i];
        if (status) break;
        block_leave(m, h, o, &st);
        if ((status = block_enter(pool, m, &L->hyper_ffn, h, &st, &in))) break;
        rms_norm_row(in, L->post_norm, x, D, eps);
        if (!L->router) {  /* a dense layer */
            if ((status = experts_held(pool, x, 1, D, L->mlp_I, 1, L->mlp, NULL, NULL, &one, routed))) break;
            block_leave(m, h, routed, &st);
            continue;
        }
        const linear_part gate_rows = {(int64_t)(intptr_t)L->router, TYPE_F32, E};
        float *logits = c->logits + moe * E, *probs = c->probs + moe * E, *weights = c->weights + moe * k;
        int64_t *picks = c->picks + moe * k;
        const float *nudge = c->nudge ? c->nudge + moe * E : NULL;
        moe++;
        if ((status = linear_held(pool, x, 1, D, &gate_rows, 1, 0, logits))) break;
        if (m->router == 0)
            pick_softmax(logits, E, k, nudge, m->norm_topk, probs, picks, weights, pick_scratch);
        else
            pick_sigmoid(logits, E, k, L->correction, nudge, m->n_group, m->topk_group, m->norm_topk, (float)m->scaling,
                         probs, picks, weights, pick_scratch);
        int64_t records[k * RECORD_WORDS];
        for (int64_t j = 0; j < k; j++)
            memcpy(records + j * RECORD_WORDS, L->experts + picks[j] * RECORD_WORDS, RECORD_WORDS * sizeof(int64_t));
        if ((status = experts_held(pool, x, 1, D, m->I, k, records, NULL, NULL, weights, routed))) break;
        if (L->mlp) {
            if ((status = experts_held(pool, x, 1, D, L->mlp_I, 1, L->mlp, NULL, NULL, &one, shared))) break;
            if (L->shared_gate) {  /* Qwen3-Next: the shared expert's output scaled by sigmoid(x . w) */
                const float g = 1.f / (1.f + expf(-dot(L->shared_gate, x, D)));
                for (int64_t i = 0; i < D; i++) routed[i] += g * shared[i];
            } else {
                for (int64_t i = 0; i < D; i++) routed[i] += shared[i];
            }
        }
        block_leave(m, h, routed, &st);
    }
    if (!status && c->out) {
        in = h;
        if (m->streams) {  /* the hidden state: the streams' mean */
            for (int64_t i = 0; i < D; i++) {
                float sum = 0.f;
                for (int64_t j = 0; j < S; j++) sum += h[j * D + i];
                st.input[i] = sum / (float)S;
            }
            in = st.input;
        }
        rms_norm_row(in, m->final_norm, x, D, eps);
        status = linear_held(pool, x, 1, D, &m->head, 1, m->float_acts, c->out);
    }
    pthread_mutex_unlock(&pool->call);
    return status;
}
