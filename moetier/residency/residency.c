/* moetier's residency policies in C (moetier/tiers/residency.py, moetier/tiers/xlayer.py): the
 * runtime's one-layer access of LRU and LFU (admit_all_touch), and the `xlayer` policy
 * (CrossLayerPolicy) whole.
 *
 * Same state (the policy's numpy arrays, passed by address in one xlayer_state), same rules,
 * and the same IEEE operations in the same order as the numpy path: built without fast-math
 * and without FP contraction (moetier/native.py, STRICT_FLAGS), so both paths make
 * the same decisions, bit for bit. xlayer, per layer-token:
 *
 *   hits   = picks resident before the call
 *   learn    pair[l, a, b] += 1, seen[l, a] += 1  for a in the previous layer's first c picks, b in picks
 *   count    key[l, :E] *= decay; key[l, picks] += 1; mass[l] = mass[l] * decay + k
 *   admit    (layer 0, or prefetch off) a miss replaces the weakest resident whose key it beats
 *   prefetch into l + 1: score each b by
 *              key[b] * (k / mass) * (s * sum_j w_j / c) + (sum_j w_j * pair[l + 1, a_j, b]) / c + tie[b],
 *              w_j = 1 / (seen[l + 1, a_j] + s) (float32), sums in float64 in j order;
 *            then swap up to `budget` best non-residents for the worst residents they beat.
 *
 * The online call (xlayer_access) also records each layer's net changes since its last access
 * (`net`: +1 admitted, -1 evicted), which xlayer_changes reports: what the VRAM tier uploads.
 * The replay call (xlayer_block) runs many tokens of many rows (time shards stacked as rows,
 * `group` rows per token copy) without that bookkeeping.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef struct {
    int64_t rows, experts, width, group, budget, context;  /* context 0: every pick predicts */
    double decay, smoothing;
    int64_t *slots;         /* [rows, width] expert per slot: E empty, E + 1 beyond the row's capacity */
    int64_t *slot_of;       /* [rows, E + 2] slot of each expert, -1 when not resident */
    double *key;            /* [rows, E + 2] decayed pick frequency; columns E, E + 1: -inf, +inf */
    double *mass;           /* [rows] sum of the decayed frequencies */
    int64_t *clock;         /* [rows] accesses */
    double *per_token;      /* [rows] picks per token */
    float *pair;            /* [rows, E, E] co-occurrence counts with the row before */
    float *seen;            /* [rows, E] */
    int64_t *uploads;       /* [rows] admissions */
    const double *tie_key;  /* [E + 2] 1e-9 per id, lower id larger */
    const double *tie_score;/* [E + 2] 1e-12 per id */
    int8_t *net;            /* [rows, E] +1 admitted, -1 evicted since the row's last access ended */
    double *score;          /* [E + 1] scratch */
    double *acc;            /* [E] scratch */
    int64_t *prev;          /* [E] the last access's picks */
    int64_t prev_row, prev_k, prev_batched, track;  /* prev_k 0: no access yet */
} xlayer_state;

#define MAX_PAIRS 256 /* candidates paired per call: k picks or `budget` (checked by the caller) */

static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* k in [1, min(E, MAX_PAIRS)] and every id in [0, E) (distinctness is the caller's to check). */
static int ids_ok(int64_t E, const int64_t *picks, int64_t k) {
    if (k < 1 || k > E || k > MAX_PAIRS) return 0;
    for (int64_t j = 0; j < k; j++)
        if (picks[j] < 0 || picks[j] >= E) return 0;
    return 1;
}

/* Put `expert` into `slot` of `row` (the slot's occupant, if any, leaves). */
static void place(xlayer_state *s, int64_t row, int64_t slot, int64_t expert) {
    const int64_t E = s->experts;
    int64_t *slots = s->slots + row * s->width, *slot_of = s->slot_of + row * (E + 2);
    const int64_t old = slots[slot];
    slot_of[old] = -1;
    slot_of[expert] = slot;
    slots[slot] = expert;
    s->uploads[row] += 1;
    if (s->track) {
        int8_t *net = s->net + row * E;
        if (old < E) net[old] -= 1;
        net[expert] += 1;
    }
}

/* Pair the best candidates (descending key; equal keys: the later one first) with the slots of the
 * lowest keys (ascending; equal keys: the lower slot first) and swap pair j while the candidate is
 * valid (> -inf), the slot usable (< +inf) and the candidate's key beats the slot's.
 * victim_key [W] is scratch: the chosen slots are overwritten. */
static void admit(xlayer_state *s, int64_t row, const int64_t *cand, const double *cand_key, int64_t m, double *victim_key) {
    const int64_t W = s->width, n = min64(m, W);
    int64_t order[MAX_PAIRS], vslot[MAX_PAIRS];
    double vkey[MAX_PAIRS];
    for (int64_t j = 0; j < m; j++) { /* insertion: a later equal key goes before */
        int64_t i = j;
        while (i > 0 && cand_key[order[i - 1]] <= cand_key[j]) { order[i] = order[i - 1]; i--; }
        order[i] = j;
    }
    for (int64_t j = 0; j < n; j++) { /* n passes for the n lowest slots */
        int64_t best = 0;
        for (int64_t w = 1; w < W; w++)
            if (victim_key[w] < victim_key[best]) best = w;
        vslot[j] = best, vkey[j] = victim_key[best];
        victim_key[best] = INFINITY; /* taken (a slot at +inf never swaps) */
    }
    for (int64_t j = 0; j < n; j++) {
        const double ck = cand_key[order[j]];
        if (ck > -INFINITY && vkey[j] < INFINITY && ck > vkey[j]) place(s, row, vslot[j], cand[order[j]]);
    }
}

static void count(xlayer_state *s, int64_t row, const int64_t *picks, int64_t k) {
    const int64_t E = s->experts;
    double *key = s->key + row * (E + 2);
    s->per_token[row] = (double)k;
    for (int64_t b = 0; b < E; b++) key[b] *= s->decay;
    for (int64_t j = 0; j < k; j++) key[picks[j]] += 1.0;
    s->mass[row] = s->mass[row] * s->decay + (double)k;
    s->clock[row] += 1;
}

static void learn(xlayer_state *s, int64_t row, const int64_t *pred, int64_t c, const int64_t *picks, int64_t k) {
    const int64_t E = s->experts;
    for (int64_t i = 0; i < c; i++) {
        float *counts = s->pair + (row * E + pred[i]) * E;
        for (int64_t j = 0; j < k; j++) counts[picks[j]] += 1.0f;
        s->seen[row * E + pred[i]] += 1.0f;
    }
}

/* Layer 0 (or prefetch off): misses, by key, against the residents' keys. */
static void admit_misses(xlayer_state *s, int64_t row, const int64_t *picks, int64_t k, const uint8_t *hit) {
    const int64_t E = s->experts, W = s->width;
    const double *key = s->key + row * (E + 2);
    const int64_t *slots = s->slots + row * W;
    double cand_key[MAX_PAIRS];
    int64_t misses = 0;
    for (int64_t j = 0; j < k; j++) {
        cand_key[j] = hit[j] ? -INFINITY : key[picks[j]] + s->tie_key[picks[j]];
        misses += !hit[j];
    }
    if (!misses) return;
    double *victim_key = s->score; /* [W] (W <= E + 1) */
    for (int64_t w = 0; w < W; w++) victim_key[w] = key[slots[w]] + s->tie_key[slots[w]];
    admit(s, row, picks, cand_key, k, victim_key);
}

/* Swap up to `budget` experts of `row` for this token, predicted from pred [c]: the picks of the row before. */
static void prefetch(xlayer_state *s, int64_t row, const int64_t *pred, int64_t c) {
    const int64_t E = s->experts, W = s->width, b_max = min64(s->budget, E);
    const double sm = s->smoothing, *key = s->key + row * (E + 2);
    double *score = s->score, *acc = s->acc, sum_w = 0.0;
    for (int64_t b = 0; b < E; b++) acc[b] = 0.0;
    for (int64_t j = 0; j < c; j++) {
        const float w = 1.0f / (s->seen[row * E + pred[j]] + (float)sm);
        const double wd = (double)w;
        const float *counts = s->pair + (row * E + pred[j]) * E;
        sum_w += wd;
        for (int64_t b = 0; b < E; b++) acc[b] += wd * (double)counts[b];
    }
    const double rate = s->per_token[row] / fmax(s->mass[row], 1e-300), smooth = sm * sum_w / (double)c;
    for (int64_t b = 0; b < E; b++) {
        double v = key[b] * rate;
        v = v * smooth;
        v = v + acc[b] / (double)c;
        score[b] = v + s->tie_score[b];
    }
    score[E] = -INFINITY;
    const int64_t *slots = s->slots + row * W;
    double victim_key[W > 0 ? W : 1];
    for (int64_t w = 0; w < W; w++) {
        const int64_t e = slots[w];
        victim_key[w] = e > E ? INFINITY : score[e];
    }
    for (int64_t w = 0; w < W; w++)
        if (slots[w] < E) score[slots[w]] = -INFINITY; /* residents are not candidates */
    int64_t cand[MAX_PAIRS];
    double cand_key[MAX_PAIRS];
    for (int64_t j = 0; j < b_max; j++) { /* the best non-residents; equal scores: the lower id */
        int64_t best = E;
        for (int64_t b = 0; b < E; b++)
            if (score[b] > score[best]) best = b;
        cand[j] = best;
        cand_key[j] = score[best] > 0.0 ? score[best] : -INFINITY; /* no evidence at all: no upload */
        if (best < E) score[best] = -INFINITY;
    }
    admit(s, row, cand, cand_key, b_max, victim_key);
}

/* One access of a row (row g = row % group within its token copy), as the numpy path's access_all. */
static void step_row(xlayer_state *s, int64_t row, const int64_t *picks, int64_t k, uint8_t *hit) {
    const int64_t g = row % s->group, E = s->experts, *slot_of = s->slot_of + row * (E + 2);
    const int64_t c = s->context ? min64(s->context, k) : k;
    const int prefetches = s->budget > 0;
    for (int64_t j = 0; j < k; j++) hit[j] = slot_of[picks[j]] >= 0;
    if (prefetches && g > 0) learn(s, row, picks - k, c, picks, k); /* the row before: k picks earlier */
    count(s, row, picks, k);
    if (g == 0 || !prefetches) admit_misses(s, row, picks, k, hit);
    if (prefetches && g + 1 < s->group) prefetch(s, row + 1, picks, c);
}

/* Replay: picks [n, rows, k] -> hit [n, rows, k], token after token, each token's rows in order
 * (the numpy path's access_all per token). 0 on success, -1 on an id out of range. */
int64_t xlayer_block(xlayer_state *s, int64_t n, const int64_t *picks, int64_t k, uint8_t *hit) {
    if (s->budget > MAX_PAIRS) return -1;
    for (int64_t i = 0; i < n * s->rows; i++)
        if (!ids_ok(s->experts, picks + i * k, k)) return -1;
    const int64_t track = s->track;
    s->track = 0;
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < s->rows; r++) {
            const int64_t at = (t * s->rows + r) * k;
            step_row(s, r, picks + at, k, hit + at);
        }
    s->track = track;
    if (n > 0) {
        memcpy(s->prev, picks + ((n - 1) * s->rows + s->rows - 1) * k, (size_t)k * sizeof *picks);
        s->prev_row = s->rows - 1, s->prev_k = k, s->prev_batched = 0;
    }
    return 0;
}

/* The runtime's access of one layer (one copy: group == rows): hits -> hit [k], returns how many.
 * A multi-token step that calls each layer once per row, layer by layer, learns nothing (rows of
 * different tokens would pair up) and prefetches once per layer. -1 on bad picks. */
int64_t xlayer_access(xlayer_state *s, int64_t layer, const int64_t *picks, int64_t k, uint8_t *hit) {
    if (layer < 0 || layer >= s->rows || s->budget > MAX_PAIRS || !ids_ok(s->experts, picks, k)) return -1;
    const int64_t E = s->experts, *slot_of = s->slot_of + layer * (E + 2);
    const int64_t c = s->context ? min64(s->context, k) : k;
    const int prefetches = s->budget > 0, batched = s->prev_k > 0 && s->prev_row == layer;
    int64_t hits = 0;
    for (int64_t j = 0; j < k; j++) hits += hit[j] = slot_of[picks[j]] >= 0;
    if (prefetches && layer > 0 && s->prev_k > 0 && s->prev_row == layer - 1 && !s->prev_batched)
        learn(s, layer, s->prev, s->context ? min64(s->context, s->prev_k) : s->prev_k, picks, k);
    count(s, layer, picks, k);
    if (layer == 0 || !prefetches) admit_misses(s, layer, picks, k, hit);
    if (prefetches && layer + 1 < s->rows && !batched) prefetch(s, layer + 1, picks, c);
    memcpy(s->prev, picks, (size_t)k * sizeof *picks);
    s->prev_row = layer, s->prev_k = k, s->prev_batched = batched;
    return hits;
}

/* Net changes of `row` since its last access ended: admitted ids ascending into out, then the
 * evicted ones ascending after them; returns the number admitted, *evicted the number evicted.
 * clear: this is the end of an access (the next report starts from here). */
int64_t xlayer_changes(xlayer_state *s, int64_t row, int64_t clear, int64_t *out, int64_t *evicted) {
    const int64_t E = s->experts;
    int8_t *net = s->net + row * E;
    int64_t admitted = 0, gone = 0;
    for (int64_t b = 0; b < E; b++) admitted += net[b] > 0, gone += net[b] < 0;
    int64_t a = 0, e = admitted;
    for (int64_t b = 0; b < E; b++) {
        if (net[b] > 0) out[a++] = b;
        else if (net[b] < 0) out[e++] = b;
    }
    if (clear) memset(net, 0, (size_t)E);
    *evicted = gone;
    return admitted;
}

/* The runtime's access with its reports, in one call: xlayer_access, then out = [hits, admitted n,
 * evicted n, next admitted n, next evicted n, ids...]: this layer's changes (as xlayer_changes with
 * clear) and what it prefetched into the next layer so far (without), each admitted then evicted.
 * out holds 5 + 4E. Returns the hits, or -1 on bad picks. */
int64_t xlayer_touch(xlayer_state *s, int64_t layer, const int64_t *picks, int64_t k, uint8_t *hit, int64_t *out) {
    const int64_t hits = xlayer_access(s, layer, picks, k, hit);
    if (hits < 0) return -1;
    int64_t *ids = out + 5, evicted = 0;
    out[0] = hits;
    out[1] = xlayer_changes(s, layer, 1, ids, &evicted), out[2] = evicted;
    out[3] = out[4] = 0;
    if (layer + 1 < s->rows) out[3] = xlayer_changes(s, layer + 1, 0, ids + out[1] + out[2], &evicted), out[4] = evicted;
    return hits;
}

/* -- LRU and LFU: admit every miss ------------------------------------------------------------ */

typedef struct {
    int64_t rows, experts, width;
    int64_t *slots;    /* [rows, width] as xlayer_state's */
    int64_t *slot_of;  /* [rows, E + 2] */
    int64_t *key;      /* [rows, E + 2] LRU: recency stamp; LFU: count << 32 | stamp */
    int64_t *clock;    /* [rows] accesses */
    int64_t *uploads;  /* [rows] */
} cache_state;

#define STAMP 1024 /* recency stamp = access count * STAMP + position in picks (residency._STAMP) */

static void sort_ascending(int64_t *v, int64_t n) {
    for (int64_t j = 1; j < n; j++) {
        const int64_t x = v[j];
        int64_t i = j;
        while (i > 0 && v[i - 1] > x) { v[i] = v[i - 1]; i--; }
        v[i] = x;
    }
}

/* hit[j] = pick j resident; the misses' positions into order, best key first (a later equal key
 * first). Returns how many miss. */
static int64_t order_misses(const int64_t *slot_of, const int64_t *key, const int64_t *picks, int64_t k, uint8_t *hit, int64_t *order) {
    int64_t misses = 0;
    for (int64_t j = 0; j < k; j++) {
        hit[j] = slot_of[picks[j]] >= 0;
        if (hit[j]) continue;
        int64_t i = misses++;
        while (i > 0 && key[picks[order[i - 1]]] <= key[picks[j]]) { order[i] = order[i - 1]; i--; }
        order[i] = j;
    }
    return misses;
}

/* Admit every miss of one layer-token whose picks carry their new keys already (key[picks] set):
 * the misses, best key first (later pick first on ties), take the slots of the lowest keys among
 * experts not picked (empty slots first, then the lower slot). hit [k] set; out as admit_all_touch's
 * (NULL: no report). Returns the hits. */
static int64_t admit_every_miss(cache_state *s, int64_t layer, const int64_t *picks, int64_t k, uint8_t *hit, int64_t *out) {
    const int64_t E = s->experts, W = s->width;
    int64_t *slots = s->slots + layer * W, *slot_of = s->slot_of + layer * (E + 2), *key = s->key + layer * (E + 2);
    int64_t miss[MAX_PAIRS];
    const int64_t misses = order_misses(slot_of, key, picks, k, hit, miss);
    int64_t admitted = 0, evicted = 0, adm[MAX_PAIRS], ev[MAX_PAIRS];
    for (int64_t i = 0; i < misses; i++) { /* the lowest-key slot not holding a pick, empty first */
        int64_t best = -1, best_key = 0;
        for (int64_t w = 0; w < W; w++) {
            const int64_t e = slots[w];
            if (e > E) continue; /* beyond the capacity */
            int picked = 0;
            for (int64_t j = 0; j < k && e < E; j++) picked |= picks[j] == e;
            if (picked) continue; /* a pick: resident before, or admitted just now */
            const int64_t v = e == E ? INT64_MIN : key[e];
            if (best < 0 || v < best_key) best = w, best_key = v;
        }
        if (best < 0) break; /* no slot left: the rest are not admitted */
        const int64_t old = slots[best], p = picks[miss[i]];
        if (old < E) slot_of[old] = -1, ev[evicted++] = old;
        slot_of[p] = best, slots[best] = p, adm[admitted++] = p;
    }
    s->uploads[layer] += admitted;
    if (out) {
        sort_ascending(adm, admitted);
        sort_ascending(ev, evicted);
        out[0] = k - misses, out[1] = admitted, out[2] = evicted;
        memcpy(out + 3, adm, (size_t)admitted * sizeof *adm);
        memcpy(out + 3 + admitted, ev, (size_t)evicted * sizeof *ev);
    }
    return k - misses;
}

/* Admit a miss only where its key beats a slot's (no pick protected): candidates best key first
 * (later pick first on ties), slots lowest key first (empty first, then the lower slot), pair j
 * swaps while the candidate's key is higher (ResidencyPolicy._admit, not forced). */
static int64_t admit_what_beats(cache_state *s, int64_t layer, const int64_t *picks, int64_t k, uint8_t *hit) {
    const int64_t E = s->experts, W = s->width;
    int64_t *slots = s->slots + layer * W, *slot_of = s->slot_of + layer * (E + 2), *key = s->key + layer * (E + 2);
    int64_t order[MAX_PAIRS];
    const int64_t misses = order_misses(slot_of, key, picks, k, hit, order);
    const int64_t n = misses < W ? misses : W;
    int64_t taken[MAX_PAIRS];
    for (int64_t i = 0; i < n; i++) {
        int64_t best = -1, best_key = 0;
        for (int64_t w = 0; w < W; w++) {
            int used = 0;
            for (int64_t u = 0; u < i; u++) used |= taken[u] == w;
            const int64_t e = slots[w], v = e == E ? INT64_MIN : e > E ? INT64_MAX : key[e];
            if (!used && (best < 0 || v < best_key)) best = w, best_key = v;
        }
        taken[i] = best;
        const int64_t p = picks[order[i]];
        if (best_key == INT64_MAX || key[p] <= best_key) break; /* the rest are weaker still */
        const int64_t old = slots[best];
        if (old < E) slot_of[old] = -1;
        slot_of[p] = best, slots[best] = p;
        s->uploads[layer] += 1;
    }
    return k - misses;
}

/* One token's picks at `layer` (mode 0: LRU, 1: LFU), as _ScalarAccess.touch: key the picks, then
 * admit every miss. out: [hits, admitted n, evicted n, admitted ids ascending..., evicted ids
 * ascending...]. Returns the hits, or -1 on bad picks (nothing changed). */
int64_t admit_all_touch(cache_state *s, int64_t layer, int64_t mode, const int64_t *picks, int64_t k, int64_t *out) {
    const int64_t E = s->experts;
    if (layer < 0 || layer >= s->rows || !ids_ok(E, picks, k)) return -1;
    for (int64_t j = 0; j < k; j++)
        for (int64_t i = 0; i < j; i++)
            if (picks[i] == picks[j]) return -1;
    int64_t *key = s->key + layer * (E + 2);
    const int64_t base = s->clock[layer] * STAMP;
    for (int64_t j = 0; j < k; j++) {
        const int64_t p = picks[j], count = key[p] >> 32 > 0 ? (key[p] >> 32) + 1 : 1;
        key[p] = mode ? (count << 32 | (base + j)) : base + j;
    }
    s->clock[layer] += 1;
    uint8_t hit[MAX_PAIRS];
    return admit_every_miss(s, layer, picks, k, hit, out);
}

/* Belady's replay (moetier.sim.replay.belady): picks and each pick's next use (the token that picks
 * it next, T when none) [n, rows, k], token after token, each row in order; a pick's key is
 * -(its next use), so the nearest next use is kept. Demand paging admits every miss; `bypass` only
 * a miss that beats a slot. hit [n, rows, k]. 0, or -1 on an id out of range. */
int64_t belady_block(cache_state *s, int64_t n, const int64_t *picks, const int64_t *next, int64_t k, int64_t bypass, uint8_t *hit) {
    const int64_t E = s->experts, R = s->rows;
    for (int64_t i = 0; i < n * R; i++)
        if (!ids_ok(E, picks + i * k, k)) return -1;
    for (int64_t t = 0; t < n; t++)
        for (int64_t r = 0; r < R; r++) {
            const int64_t at = (t * R + r) * k;
            int64_t *key = s->key + r * (E + 2);
            for (int64_t j = 0; j < k; j++) key[picks[at + j]] = -next[at + j];
            if (bypass) admit_what_beats(s, r, picks + at, k, hit + at);
            else admit_every_miss(s, r, picks + at, k, hit + at, NULL);
        }
    return 0;
}
