"""The `xlayer` residency policy: predict layer l's picks from layer l-1's picks of the same token.

Learned online (co-occurrence counts between consecutive layers) and used to prefetch a
bounded number of experts per layer-token; see CrossLayerPolicy and docs/policies.md for
why (on real traces the previous layer's picks predict far better than frequency or recency).
Runs in C (moetier/residency/residency.c) where that library builds, with the numpy
path's decisions bit for bit; `native=False` (or no C compiler) runs the numpy path.
"""

from __future__ import annotations

import ctypes

import numpy as np

from moetier.residency.policies import ResidencyPolicy, add_counts, residency_library, lowest_keys


class _State(ctypes.Structure):
    """residency.c's xlayer_state: the policy's arrays by address, and the last access."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "experts", "width", "group", "budget", "context")] + [
        ("decay", ctypes.c_double), ("smoothing", ctypes.c_double)] + [
        (name, ctypes.c_void_p) for name in ("slots", "slot_of", "key", "mass", "clock", "per_token", "pair", "seen", "uploads",
                                             "tie_key", "tie_score", "net", "score", "acc", "prev")] + [
        (name, ctypes.c_int64) for name in ("prev_row", "prev_k", "prev_batched", "track")]


class CrossLayerPolicy(ResidencyPolicy):
    """Predict layer l's picks from layer l-1's picks of the same token, learned online; prefetch.

    Per layer l >= 1 it counts, over the tokens seen, how often expert a at layer l-1 and
    expert b at layer l were picked by the same token: pair[l, a, b], and seen[l, a]. With p_b
    the decayed pick rate of b at layer l (half-life `half_life` tokens; from the profile at
    the start when one is given), right after the access of layer l-1 it scores each b by
        v_b = mean over a in picks(l-1) of (pair[l, a, b] + s p_b) / (seen[l, a] + s),
    a smoothed estimate of P(b picked | a picked) (s = `smoothing`), then swaps at most
    `budget` experts: the best non-resident with v_b > 0 for the worst resident, while the
    newcomer's score is higher. Layer 0 has no layer before it: it keeps the experts of highest
    decayed frequency, admitting a miss only if it beats the weakest resident (no admission of
    one-offs), and so does every layer when `budget=0` (prefetch off). `context` limits the
    predicting picks to the previous layer's first (heaviest) ones. Ties: a tiny id-ordered
    offset (1e-9 per id on frequencies, 1e-12 on scores) makes keys distinct; lower id wins.
    A multi-token step (prefill) that calls each layer once per row, layer by layer, learns
    nothing (rows of different tokens would pair up) and prefetches once per layer.
    """

    name = "xlayer"
    prefetches = True
    admit_all = False
    key_dtype = np.float64
    history = ("_key", "_clock", "_mass", "_pair", "_seen", "_per_token")
    shard_tokens = 256  # a prefetch set forgets its start within ~100-200 tokens (budget 2)

    def __init__(self, num_layers, num_experts, capacity, profile=None, budget: int = 2, half_life: float = 128.0, smoothing: float = 1.0,
                 context: int | None = None, native: bool = True):
        if budget < 0 or half_life <= 0 or smoothing <= 0:
            raise ValueError(f"xlayer: need budget >= 0, half_life > 0, smoothing > 0; got {budget}, {half_life}, {smoothing}")
        if context is not None and context < 1:
            raise ValueError(f"xlayer: context must be >= 1 (or None: all picks), got {context}")
        self.budget, self.smoothing, self.decay = int(budget), float(smoothing), 0.5 ** (1.0 / half_life)
        self.context = slice(None, context)  # the previous layer's first (heaviest) picks that predict
        super().__init__(num_layers, num_experts, capacity, profile)
        L, E = self.num_layers, self.num_experts
        self.prefetches = self.budget > 0  # per instance: budget 0 turns prefetch off
        self._key[:, :E] = 0.0
        self._mass = np.zeros(L)  # [L] sum of the decayed frequencies
        if self.profile is not None:  # the EMA's steady state for the profile's shares (per pick)
            total = self.profile.sum(1, keepdims=True)
            self._key[:, :E] = np.divide(self.profile, total, out=np.zeros_like(self.profile), where=total > 0) / (1 - self.decay)
            self._mass[:] = self._key[:, :E].sum(1)
        rank = np.r_[np.arange(E, 0, -1), 0, 0].astype(np.float64)  # [E + 2] lower id, larger offset
        self._tie_key, self._tie_score = rank * 1e-9, rank * 1e-12
        self._pair = np.zeros((L, E, E), np.float32)  # [L, E, E] pair[l, a, b]
        self._seen = np.zeros((L, E), np.float32)  # [L, E]
        self._per_token = np.ones(L)  # [L] picks per token (k), known from the first access
        self._prev: tuple[int, np.ndarray, bool] | None = None  # (layer, picks, part of a multi-row step) of the last access
        self._layout: tuple | None = None
        self._c = self._bind(context) if native else None
        self.native = self._c is not None

    # -- the C path (residency.c): the same decisions, ~50x faster ------------------------
    def _bind(self, context: int | None):
        """The C state over this policy's arrays (they are only ever updated in place), or None without the library."""
        lib = residency_library()
        if lib is None or self.budget > 256:
            return None
        L, E = self.num_layers, self.num_experts
        self._net = np.zeros((L, E), np.int8)  # [L, E] net admitted (+1) / evicted (-1) since each layer's last access
        self._scratch = (np.empty(E + 1), np.empty(E), np.zeros(E, np.int64))  # score [E + 1], acc [E], previous picks [E]
        state = _State(rows=L, experts=E, width=self._slots.shape[1], group=L, budget=self.budget, context=context or 0,
                       decay=self.decay, smoothing=self.smoothing, prev_row=-1, track=1)
        for name, array in (("slots", self._slots), ("slot_of", self._slot_of), ("key", self._key), ("mass", self._mass),
                            ("clock", self._clock), ("per_token", self._per_token), ("pair", self._pair), ("seen", self._seen),
                            ("uploads", self.uploads), ("tie_key", self._tie_key), ("tie_score", self._tie_score), ("net", self._net),
                            ("score", self._scratch[0]), ("acc", self._scratch[1]), ("prev", self._scratch[2])):
            assert array.flags.c_contiguous
            setattr(state, name, array.ctypes.data)
        self._state = state
        self._address = ctypes.addressof(state)
        self._picks = (ctypes.c_int64 * E)()  # touch's picks
        self._hit = (ctypes.c_uint8 * E)()
        self._out = (ctypes.c_int64 * (5 + 4 * E))()  # reports: counts, then admitted and evicted ids
        self._evicted = ctypes.c_int64()
        return lib

    def _bad_picks(self, layer, picks) -> ValueError:
        return ValueError(f"{self.name}: picks must be distinct expert ids in [0, {self.num_experts}) at a layer in "
                          f"[0, {self.num_layers}), got layer {layer}, picks {np.asarray(picks).tolist()}")

    def _report(self, layer: int, clear: bool) -> tuple[list[int], list[int]]:
        admitted = self._c.xlayer_changes(self._address, layer, clear, self._out, ctypes.byref(self._evicted))
        return self._out[:admitted], self._out[admitted : admitted + self._evicted.value]

    def access(self, layer, picks):
        if self._c is None:
            return super().access(layer, picks)
        picks = np.ascontiguousarray(picks, dtype=np.int64)
        hit = np.empty(picks.shape, np.bool_)
        if picks.ndim != 1 or len(set(picks.tolist())) != picks.size or \
                self._c.xlayer_access(self._address, layer, picks.ctypes.data, picks.size, hit.ctypes.data) < 0:
            raise self._bad_picks(layer, picks)
        self._changes[layer] = self._report(layer, clear=True)
        return hit

    def touch(self, layer, picks):
        if self._c is None:
            return super().touch(layer, picks)
        return self.touch_next(layer, picks)[:3]

    def touch_next(self, layer, picks):
        if self._c is None:
            return super().touch_next(layer, picks)
        k = len(picks)
        if not 0 < k <= self.num_experts or len(set(picks)) != k:
            raise self._bad_picks(layer, picks)
        self._picks[:k] = picks
        out = self._out
        if self._c.xlayer_touch(self._address, layer, self._picks, k, self._hit, out) < 0:
            raise self._bad_picks(layer, picks)
        a, e, an, en = out[1], out[2], out[3], out[4]
        ids = out[5 : 5 + a + e + an + en]
        self._changes[layer] = admitted, evicted = ids[:a], ids[a : a + e]
        return out[0], admitted, evicted, ids[a + e : a + e + an], ids[a + e + an :]

    def prefetched(self, layer):
        if self._c is None:
            return super().prefetched(layer)
        admitted, evicted = self._report(layer, clear=False)
        return np.array(admitted, np.int64), np.array(evicted, np.int64)

    def access_block(self, picks):
        if self._c is None:
            return super().access_block(picks)
        picks = np.ascontiguousarray(picks, dtype=np.int64)
        n, rows, k = picks.shape
        if rows != self.num_layers:
            raise ValueError(f"{self.name}: access_block(picks [n, {self.num_layers}, k]), got shape {picks.shape}")
        hit = np.empty(picks.shape, np.bool_)
        self._state.group = self.layers_per_token
        if self._c.xlayer_block(self._address, n, picks.ctypes.data, k, hit.ctypes.data) < 0:
            raise ValueError(f"{self.name}: picks must be distinct expert ids in [0, {self.num_experts}), k <= 256")
        return hit

    def _rows_by_role(self):
        """(prefetch rows, their row selector, predecessor selector, demand rows) for layers_per_token.

        Selectors are slices when the rows are contiguous (one model copy), so gathers are views.
        """
        group = self.layers_per_token
        if self._layout is None or self._layout[0] != group:
            first = self._rows % group == 0
            pre = self._rows[~first] if self.prefetches else self._rows[:0]
            demand = self._rows[first] if self.prefetches else self._rows
            whole = group == self.num_layers and len(pre)
            sel, pred = (slice(1, None), slice(0, -1)) if whole else (pre, pre - 1)
            self._layout = (group, pre, sel, pred, demand)
        return self._layout[1:]

    def _access_layer(self, layer, picks):
        rows, ri, picks2 = self._rows[layer : layer + 1], self._ri[layer : layer + 1], picks[None, :]
        hit = self._slot_of[layer, picks] >= 0  # [k]
        prev = self._prev
        # A multi-token step (prefill) calls each layer once per row, layer by layer: a second
        # row of the same layer. Pair only picks of one token, and prefetch once per layer step.
        batched = prev is not None and prev[0] == layer
        if self.prefetches and layer > 0 and prev is not None and prev[0] == layer - 1 and not prev[2]:
            self._learn(rows, ri, prev[1][None, self.context], picks2)
        self._count(rows, ri, picks2)
        if layer == 0 or not self.prefetches:
            self._admit_misses(rows, ri, picks2, hit[None, :])
        if self.prefetches and layer + 1 < self.num_layers and not batched:
            self._prefetch(rows + 1, rows + 1, ri + 1, picks2[:, self.context])
        self._prev = (layer, picks, batched)
        return hit

    def access_all(self, picks):
        if self._c is not None:
            return self.access_block(picks[None])[0]
        pre, sel, pred, demand = self._rows_by_role()
        if len(pre):
            ri = pre[:, None]
            self._prefetch(pre, sel, ri, picks[pred, self.context])
        hit = self._slot_of[self._ri, picks] >= 0  # [L, k]
        if len(pre):
            self._learn(pre, ri, picks[pred, self.context], picks[sel])
        self._count(self._rows, self._ri, picks)
        self._admit_misses(demand, demand[:, None], picks[demand], hit[demand])
        self._prev = (self.num_layers - 1, picks[-1], False)
        return hit

    def observe_all(self, picks):
        pre, sel, pred, _ = self._rows_by_role()
        if len(pre):
            self._learn(pre, pre[:, None], picks[pred, self.context], picks[sel])
        self._count(self._rows, self._ri, picks)

    def observe_block(self, picks):
        pre, sel, pred, _ = self._rows_by_role()
        if len(pre):  # integer counts: adding them all at once gives the same floats
            E, before, after = self.num_experts, picks[:, pred, self.context], picks[:, sel]  # [n, R, c], [n, R, k]
            cell = ((pre[None, :, None, None] * E + before[..., :, None]) * E + after[..., None, :]).ravel()
            add_counts(self._pair.reshape(-1), cell)
            add_counts(self._seen.reshape(-1), (pre[None, :, None] * E + before).ravel())
        for token in picks:  # the decayed frequencies: same float steps as access_all
            self._count(self._rows, self._ri, token)

    def _count(self, rows, ri, picks):
        E = self.num_experts
        self._per_token[rows] = picks.shape[1]
        if len(rows) == self.num_layers:
            self._key[:, :E] *= self.decay
        else:
            self._key[rows, :E] *= self.decay
        self._key[ri, picks] += 1.0
        self._mass[rows] = self._mass[rows] * self.decay + picks.shape[1]
        self._clock[rows] += 1

    def _learn(self, rows, ri, pred, picks):
        """pair[row, pred, picks] += 1 and seen[row, pred] += 1 (integer counts: update order never matters)."""
        E = self.num_experts
        cell = ((rows[:, None, None] * E + pred[:, :, None]) * E + picks[:, None, :]).ravel()  # [R*k*k] distinct
        self._pair.reshape(-1)[cell] += 1.0
        self._seen[ri, pred] += 1.0

    def _admit_misses(self, rows, ri, picks, hit):
        if hit.all():
            return
        cand_key = np.where(hit, self._lo, self._key[ri, picks] + self._tie_key[picks])  # [R, k]
        slots = self._slots[rows]  # [R, W]
        victim_key = self._key[ri, slots] + self._tie_key[slots]  # [R, W]
        self._admit(rows, picks, cand_key, victim_key, forced=False)

    def _prefetch(self, rows, sel, ri, pred):
        """Swap up to `budget` experts of layer rows (`sel` selects them) for this token, from pred [R, k]:
        the picks of the layer before."""
        E, s = self.num_experts, self.smoothing
        gathered = self._pair[ri, pred]  # [R, c, E] float32 counts
        w = (1.0 / (self._seen[ri, pred] + np.float32(s))).astype(np.float64)  # [R, c] float32 values
        acc, sum_w = np.zeros((len(rows), E)), np.zeros(len(rows))  # [R, E], [R]
        for j in range(pred.shape[1]):  # in j order, as residency.c sums (the products are exact)
            acc += w[:, j, None] * gathered[:, j]
            sum_w += w[:, j]
        rate = self._key[sel, :E] * (self._per_token[sel] / np.maximum(self._mass[sel], 1e-300))[:, None]  # [R, E] p_b
        score = np.empty((len(rows), E + 1))  # [R, E + 1] the last column: empty slots
        np.multiply(rate, (s * sum_w / pred.shape[1])[:, None], out=score[:, :E])
        score[:, :E] += acc / pred.shape[1]
        score[:, :E] += self._tie_score[:E]
        score[:, E] = self._lo
        lr = np.arange(len(rows))[:, None]
        slots = self._slots[sel]  # [R, W]
        col = np.minimum(slots, E)  # [R, W] padding slots read (and write) the empty column
        victim_key = np.where(slots > E, self._hi, score[lr, col])  # [R, W]
        score[lr, col] = self._lo  # residents are not candidates
        cand, cand_key = lowest_keys(np.negative(score, out=score), min(self.budget, E), lr, np.inf, scratch=True)  # [R, b] best non-residents
        cand_key = -cand_key
        cand_key[cand_key <= 0] = self._lo  # no evidence at all: no upload
        self._admit(rows, cand, cand_key, victim_key, forced=False)
