"""Replay routing traces through residency policies, and Belady's offline optimum.

`replay` drives a `ResidencyPolicy` one token at a time with all layers' picks [L, k] in one
set of numpy ops (`access_all`); narrow traces are also cut into time shards replayed side by
side as extra rows (`_sharded`). Either way the hits are exactly those of calling
`access(l, picks)` for l = 0..L-1 token by token (tests hold them equal). `belady` is the optimum with the future
known: multi-expert requests (the k picks of a token are needed together), evicting the
resident expert whose next use is furthest away; `bypass=True` also lets a miss stay out
(served elsewhere), which bounds every policy that only admits requested experts, admission
control and static sets included (not prefetching ones: those load experts no one asked for).
`replay_with_affinity` re-picks each token's experts with a bonus for resident ones (the
router's live-cache affinity) from the trace's router probabilities.
"""

from __future__ import annotations

import ctypes
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moetier.sim.traces import RoutingTrace
from moetier.residency import ResidencyPolicy, make_policy
from moetier.residency.policies import cache_state, residency_library


@dataclass(frozen=True, eq=False)
class ReplayResult:
    policy: str
    capacity: tuple[int, ...]  # [L] slots per layer
    tokens: int  # tokens counted (after warm-up)
    top_k: int
    hits: np.ndarray  # [L] int64
    uploads: np.ndarray  # [L] int64 experts admitted while counting
    seconds: float  # wall time of the whole replay (warm-up included)
    cpu_seconds: float  # this process's CPU time for it (steadier than wall time on a shared machine)
    replayed_lookups: int  # lookups done in `seconds` (warm-up included)
    shards: int = 1  # time shards replayed side by side
    rounds: int = 1  # passes until every shard started from its predecessor's end

    @property
    def lookups(self) -> np.ndarray:
        return np.full(len(self.hits), self.tokens * self.top_k, np.int64)  # [L]

    @property
    def misses(self) -> np.ndarray:
        return self.lookups - self.hits  # [L]

    @property
    def hit_rate_per_layer(self) -> np.ndarray:
        return self.hits / np.maximum(self.lookups, 1)  # [L]

    @property
    def hit_rate(self) -> float:
        return float(self.hits.sum() / max(self.lookups.sum(), 1))

    @property
    def uploads_per_token(self) -> float:
        return float(self.uploads.sum() / max(self.tokens, 1))

    @property
    def lookups_per_s(self) -> float:
        return self.replayed_lookups / max(self.seconds, 1e-12)

    @property
    def lookups_per_cpu_s(self) -> float:
        return self.replayed_lookups / max(self.cpu_seconds, 1e-12)

    def to_dict(self) -> dict:
        return {
            "policy": self.policy, "capacity": list(self.capacity), "tokens": self.tokens,
            "hit_rate": self.hit_rate, "hit_rate_per_layer": self.hit_rate_per_layer.tolist(),
            "hits": int(self.hits.sum()), "misses": int(self.misses.sum()),
            "uploads_per_token": self.uploads_per_token, "lookups_per_s": self.lookups_per_s,
            "lookups_per_cpu_s": self.lookups_per_cpu_s, "shards": self.shards, "rounds": self.rounds,
        }


def slots_for(capacity: int | float | Sequence[int], num_layers: int, num_experts: int) -> np.ndarray:
    """Slots per layer [L]: an int, a float in (0, 1] (share of the experts, rounded, >= 1), or L ints."""
    if isinstance(capacity, float):
        if not 0 < capacity <= 1:
            raise ValueError(f"capacity as a fraction must be in (0, 1], got {capacity}")
        return np.full(num_layers, max(1, int(round(capacity * num_experts))), np.int64)
    slots = np.asarray(capacity, dtype=np.int64)
    return np.full(num_layers, int(slots), np.int64) if slots.ndim == 0 else slots


TARGET_LOOKUPS = 512  # auto sharding: look-ups per step (shards * L * k) that amortise numpy's per-call cost
MAX_HISTORY_BYTES = 256 << 20  # all shards' history snapshots together (xlayer keeps [L, E, E] counts)


def _auto_shards(pol: ResidencyPolicy, tokens: int, top_k: int) -> int:
    if not pol.mutable or pol.native:
        return 1
    per_shard = sum(a.nbytes for a in pol.history_state().values())
    lookups = pol.num_layers * top_k
    return max(1, min(tokens // pol.shard_tokens, TARGET_LOOKUPS // lookups, MAX_HISTORY_BYTES // max(per_shard, 1)))


def _sequential(pol: ResidencyPolicy, picks: np.ndarray, warmup: int) -> tuple[np.ndarray, np.ndarray, int]:
    pol.access_block(picks[:warmup])
    before = pol.uploads.copy()
    hits = pol.access_block(picks[warmup:])  # [T', L, k]
    return hits, pol.uploads - before, 1


def _sharded(make, picks: np.ndarray, warmup: int, shards: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Time shards replayed side by side as extra rows, then re-run until each starts where its predecessor ends.

    History (keys, counts) does not depend on residency, so one cheap sequential pass gives it
    exactly at every shard start; the resident sets there are guessed. Decisions depend on the
    resident sets only, so a shard whose start set equals its predecessor's end set replays
    exactly; one that does not is re-run from that end, and the re-run stops as soon as its
    sets meet the previous run's trail (from there on both runs are the same). Every round
    settles at least the first unsettled shard, so the hits are exactly the sequential ones.
    """
    T, L, k = picks.shape
    n = -(-T // shards)  # tokens per shard
    S = -(-T // n)
    base = make(L)
    first_slots = base.residency()
    hist = [base.history_state()]
    for s in range(1, S):
        base.observe_block(picks[(s - 1) * n : s * n])
        hist.append(base.history_state())
    guess = make(S * L)
    guess.load_state({name: np.concatenate([h[name] for h in hist]) for name in base.history}, np.tile(first_slots, (S, 1)))
    guessed = guess.guess_residency()
    start = [first_slots] + [guessed[s * L : (s + 1) * L] for s in range(1, S)]
    hits = np.empty((T, L, k), bool)  # [T, L, k]
    cum: list = [None] * S  # per shard [n + 1, L]: uploads before each step
    trail: list = [None] * S  # per shard [n + 1, L, W]: sorted slot table before each step ([n]: the end)
    todo, rounds = list(range(S)), 0
    while todo:
        rounds += 1
        R = len(todo)
        pol = make(R * L)
        pol.layers_per_token = L
        pol.load_state({name: np.concatenate([hist[s][name] for s in todo]) for name in base.history}, np.concatenate([start[s] for s in todo]))
        tok = np.minimum(np.array(todo)[:, None] * n + np.arange(n), T - 1)  # [R, n] padded past the end
        steps = picks[tok].transpose(1, 0, 2, 3).reshape(n, R * L, k)  # [n, R*L, k]
        got = np.empty((n, R * L, k), bool)  # [n, R*L, k]
        W = first_slots.shape[1]
        rec = np.empty((n + 1, R, L * W), np.int32)  # [n + 1, R, L*W] sorted slot tables
        up = np.empty((n + 1, R * L), np.int64)  # [n + 1, R*L]
        old = None if rounds == 1 else np.stack([trail[s].reshape(n + 1, L * W) for s in todo], axis=1)  # [n + 1, R, L*W]
        met = np.full(R, n)  # step where each shard met its old trail
        for i in range(n + 1):
            rec[i] = np.sort(pol.residency(), axis=1).reshape(R, L * W)
            up[i] = pol.uploads
            if old is not None:
                fresh = (met == n) & (rec[i] == old[i]).all(1)
                met[fresh] = i
                if (met < n).all():
                    break
            if i < n:
                got[i] = pol.access_all(steps[i])
        for j, s in enumerate(todo):
            m, rows = met[j], slice(j * L, (j + 1) * L)
            hits[s * n : min(s * n + m, T)] = got[: min(m, T - s * n), rows]  # past m the old run's hits stand
            new = up[: m + 1, rows] - up[0, rows]  # [m + 1, L]
            cum[s] = new if m == n else np.concatenate([new, cum[s][m + 1 :] - cum[s][m] + new[m]])
            rec_s = rec[: m + 1, j].reshape(m + 1, L, W)
            trail[s] = rec_s if m == n else np.concatenate([rec_s, trail[s][m + 1 :]])
        todo = []
        for s in range(1, S):
            if not np.array_equal(trail[s - 1][n], np.sort(start[s], axis=1)):
                start[s] = trail[s - 1][n]
                todo.append(s)
    uploads = np.zeros(L, np.int64)
    for s in range(S):
        stop = min(n, T - s * n)
        uploads += cum[s][stop] - cum[s][min(max(warmup - s * n, 0), stop)]
    return hits[warmup:], uploads, rounds


def _run(trace: RoutingTrace, make, name: str, warmup_tokens: int, shards: int | None) -> ReplayResult:
    T, L, k = trace.picks.shape
    if not 0 <= warmup_tokens < T:
        raise ValueError(f"warmup_tokens must be in [0, {T}), got {warmup_tokens}")
    picks = trace.picks.astype(np.intp)  # [T, L, k]
    started, cpu_started = time.perf_counter(), time.process_time()
    pol = make(L)
    shards = _auto_shards(pol, T, k) if shards is None else max(1, min(int(shards), T))
    if not pol.mutable:
        hits, uploads, rounds = pol.contains(picks[warmup_tokens:]), np.zeros(L, np.int64), 0  # [T', L, k]
    elif shards == 1:
        hits, uploads, rounds = _sequential(pol, picks, warmup_tokens)
    else:
        hits, uploads, rounds = _sharded(make, picks, warmup_tokens, shards)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    return ReplayResult(name, tuple(int(c) for c in pol.capacity), T - warmup_tokens, k, hits.sum(axis=(0, 2)).astype(np.int64),
                        uploads, seconds, cpu_seconds, (T if pol.mutable else T - warmup_tokens) * L * k, shards, rounds)


def replay(trace: RoutingTrace, policy: str, capacity: int | float | Sequence[int], profile: np.ndarray | None = None,
           warmup_tokens: int = 0, shards: int | None = None, **options) -> ReplayResult:
    """Run `policy` over the trace; count hits after the first `warmup_tokens` tokens (state starts
    cold, or warm from `profile`). `shards`: time shards replayed side by side (None: automatic,
    1: one token at a time); the hits are the same either way. `options` go to the policy."""
    L, E = trace.num_layers, trace.num_experts
    slots = slots_for(capacity, L, E)
    prof = None if profile is None else np.asarray(profile)

    def make(rows: int) -> ResidencyPolicy:  # rows = copies * L: shards stacked as extra layers
        copies = rows // L
        return make_policy(policy, rows, E, np.tile(slots, copies), None if prof is None else np.tile(prof, (copies, 1)), **options)

    return _run(trace, make, policy, warmup_tokens, shards)


def next_use(picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """picks [T, L, k] -> (next [T, L, k]: the next token that picks the same expert at that layer, or T;
    first [L, E]: the first token that picks each expert, or T)."""
    T, L, k = picks.shape
    E = int(picks.max()) + 1
    t = np.broadcast_to(np.arange(T)[:, None, None], picks.shape).ravel()  # [T*L*k]
    cell = (np.arange(L)[None, :, None] * E + picks).ravel()  # [T*L*k] layer-expert id
    order = np.lexsort((t, cell))  # by cell, then time
    same = cell[order][1:] == cell[order][:-1]
    nxt = np.full(t.size, T, np.int64)
    nxt[order[:-1][same]] = t[order][1:][same]
    first = np.full(L * E, T, np.int64)
    head = np.ones(t.size, bool)
    head[1:] = ~same
    first[cell[order][head]] = t[order][head]
    return nxt.reshape(picks.shape), first.reshape(L, E)


class _BeladyOracle(ResidencyPolicy):
    """Key = -(token of next use): the nearest next use is kept; fed by `belady` only (a token at a time in numpy, a block in C)."""

    name = "belady"

    def __init__(self, picks: np.ndarray, num_experts: int, slots: np.ndarray, bypass: bool, prefilled: bool, native: bool = True):
        T, L, _ = picks.shape
        self._next, first = next_use(picks)  # [T, L, k], [L, E']
        self._t = 0
        super().__init__(L, num_experts, slots)
        self.admit_all = not bypass
        self.native = native and residency_library() is not None
        self._key[:, : first.shape[1]] = -first  # never-used experts keep _NEVER (< -T)
        if prefilled:  # start from the best possible content: the experts needed first
            for layer in range(L):
                top = np.argsort(first[layer], kind="stable")[: self.capacity[layer]]
                top = top[first[layer, top] < T]
                self._slots[layer, : len(top)] = top
                self._slot_of[layer, top] = np.arange(len(top))

    def _observe(self, rows, ri, picks):
        key = -self._next[self._t]  # [L, k]
        self._key[ri, picks] = key
        self._t += 1
        return key

    def access_block(self, picks):
        """In C (residency.c, belady_block) where it builds, with the same hits: one call per block."""
        if not self.native:
            return super().access_block(picks)
        lib = residency_library()
        picks = np.ascontiguousarray(picks, dtype=np.int64)
        n, _, k = picks.shape
        nxt = np.ascontiguousarray(self._next[self._t : self._t + n], dtype=np.int64)
        hit = np.empty(picks.shape, np.bool_)
        state = cache_state(self)
        if lib.belady_block(ctypes.addressof(state), n, picks.ctypes.data, nxt.ctypes.data, k, int(not self.admit_all),
                            hit.ctypes.data) < 0:
            raise ValueError(f"belady: picks must be expert ids in [0, {self.num_experts}), k <= 256")
        self._t += n
        return hit


def belady(trace: RoutingTrace, capacity: int | float | Sequence[int], bypass: bool = False, prefilled: bool = False,
           warmup_tokens: int = 0, native: bool = True) -> ReplayResult:
    """Offline optimum: demand paging (every miss admitted, evicting the furthest next use among
    residents the token did not pick), or with `bypass` a miss is admitted only if it is needed
    again before some resident; `prefilled` starts from the best content instead of empty.
    Runs in C where residency.c builds (`native=False`: numpy), with the same hits."""
    slots = slots_for(capacity, trace.num_layers, trace.num_experts)
    if not bypass and (slots < trace.top_k).any():
        raise ValueError(f"belady without bypass needs capacity >= k = {trace.top_k} (the picks are needed together)")
    picks = trace.picks.astype(np.intp)
    oracle = _BeladyOracle(picks, trace.num_experts, slots, bypass, prefilled, native)
    return _run(trace, lambda rows: oracle, "belady-bypass" if bypass else "belady", warmup_tokens, 1)


@dataclass(frozen=True, eq=False)
class AffinityReplay:
    hit_rate: float
    hits: int
    lookups: int
    picks: np.ndarray  # [T, L, k] int16 the picks re-ranked with the affinity bonus
    changed: float  # share of lookups whose expert is not among the trace's own picks


def replay_with_affinity(trace: RoutingTrace, policy: str, capacity: int | float | Sequence[int], lam: float,
                         profile: np.ndarray | None = None, **options) -> AffinityReplay:
    """Re-pick each token's top-k by probs + lam * (resident now), layer by layer, through the online policy."""
    if trace.probs is None:
        raise ValueError(f"replay_with_affinity needs router probabilities; trace {trace.source!r} has none")
    T, L, k = trace.picks.shape
    E = trace.num_experts
    slots = slots_for(capacity, L, E)
    pol = make_policy(policy, L, E, slots, profile, **options)
    probs = trace.probs.astype(np.float32)  # [T, L, E]
    picks = np.empty((T, L, k), np.int16)
    hits = 0
    bonus = np.zeros(E, np.float32)  # [E]
    for t in range(T):
        for layer in range(L):
            bonus[:] = 0.0
            bonus[pol.resident(layer)] = lam
            new = np.argsort(-(probs[t, layer] + bonus), kind="stable")[:k]  # [k]
            picks[t, layer] = new
            hits += int(pol.access(layer, new).sum())
    kept = int((picks[..., :, None] == trace.picks[..., None, :]).any(-1).sum())  # re-picks the trace also had
    return AffinityReplay(hits / (T * L * k), hits, T * L * k, picks, 1.0 - kept / (T * L * k))
