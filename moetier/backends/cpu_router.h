/* moetier's decode router (included once, by cpu_kernels.c, after its gemv): one token's gate logits, scores, top-k
 * picks and weights, the arithmetic of moetier/engine/router.py in float32. route_* take the gate and compute the
 * logits here (cpu_kernels.c's gemv order); pick_* start from logits (the decode step's, cpu_step.h). Picks come
 * in descending order of their selection score, ties to the lower expert id.
 */

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
static void pick_softmax(const float *logits, int64_t E, int64_t k, const float *nudge, int64_t norm, float *probs,
                         int64_t *picks, float *weights, float *scratch) {
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

void route_softmax_f32(const float *W, const float *x, int64_t E, int64_t D, int64_t k, const float *nudge, int64_t norm,
                       float *logits, float *probs, int64_t *picks, float *weights, float *scratch) {
    gemv(W, x, logits, E, D);
    pick_softmax(logits, E, k, nudge, norm, probs, picks, weights, scratch);
}

/* sigmoid routers: scores = sigmoid(logits); choice = scores (+ correction) (+ nudge), limited to the
 * topk_group groups whose two best choices sum highest when n_group > 1; picks = top k of choice;
 * weights = scores[picks], renormalised (+1e-20) when norm, times scaling. scratch: E + n_group floats. */
static void pick_sigmoid(const float *logits, int64_t E, int64_t k, const float *correction, const float *nudge,
                         int64_t n_group, int64_t topk_group, int64_t norm, float scaling, float *scores, int64_t *picks,
                         float *weights, float *scratch) {
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

void route_sigmoid_f32(const float *W, const float *x, int64_t E, int64_t D, int64_t k, const float *correction,
                       const float *nudge, int64_t n_group, int64_t topk_group, int64_t norm, float scaling,
                       float *logits, float *scores, int64_t *picks, float *weights, float *scratch) {
    gemv(W, x, logits, E, D);
    pick_sigmoid(logits, E, k, correction, nudge, n_group, topk_group, norm, scaling, scores, picks, weights, scratch);
}
