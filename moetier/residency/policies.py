"""Expert residency policies (the base machinery, static, LRU, LFU): which experts each MoE layer's VRAM cache holds.

One policy object covers all layers: per layer `l` a cache of `capacity[l]` slots over
`num_experts` experts. `access(layer, picks)` looks a token's k picks up (hits = the picks
resident right before the call), then updates the policy's state and admits/evicts by its
own rule. Layers are called in order 0..L-1 for each token, so a policy may use layer l's
picks to prefetch into layer l+1 (`xlayer` does). `last_changes(layer)` is the net
(admitted, evicted) of that layer between the ends of its last two accesses: what the VRAM
tier uploads and frees. `access_all(picks [L, k])` is the replay path: one token, every layer
in one set of numpy ops, with exactly the state changes of access(0), ..., access(L-1).
Invariants: at most capacity[l] experts resident; decisions are a pure function of the picks
seen and of the resident *sets* (never of slot order: resident keys are distinct), so replay
can also run time shards side by side (moetier.sim.replay) and get the same hits. LRU and
LFU's `touch` (the runtime's one-layer access) runs in C (residency.c) where it builds,
with the same decisions as the Python and numpy paths.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np

from moetier.native import STRICT_FLAGS, library

_STAMP = 1024  # recency stamp = access count * _STAMP + position in picks (k < _STAMP)
_NEVER = -(1 << 62)  # int key of an expert never accessed


@functools.cache
def residency_library() -> ctypes.CDLL | None:
    """residency.c, built with IEEE arithmetic as written (its decisions equal the numpy paths'), or None."""
    lib = library(Path(__file__).with_name("residency.c"), STRICT_FLAGS)[0]
    if lib is not None:
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        for name, args in (("xlayer_block", [p, i64, p, i64, p]), ("xlayer_access", [p, i64, p, i64, p]),
                           ("xlayer_changes", [p, i64, i64, p, p]), ("xlayer_touch", [p, i64, p, i64, p, p]),
                           ("admit_all_touch", [p, i64, i64, p, i64, p]), ("belady_block", [p, i64, p, p, i64, i64, p])):
            getattr(lib, name).restype, getattr(lib, name).argtypes = i64, args
    return lib


class ResidencyPolicy:
    """Per-layer expert caches on a slot table, with the shared admit/evict machinery.

    State: `_slots [L, W]` expert id per slot (E = empty, E + 1 = beyond this layer's
    capacity), `_slot_of [L, E + 2]` slot of each expert (-1 = not resident), `_key [L, E + 2]`
    the policy's eviction key (higher = keep; the two sentinel columns hold the lowest and
    highest key, so empty slots fill first and padding slots are never used). The arrays named
    in `history` change with the picks alone, never with residency (`observe_all`).
    """

    name: ClassVar[str]
    prefetches: ClassVar[bool] = False  # access(l) may also change layer l + 1
    mutable: ClassVar[bool] = True  # False: the resident sets never change
    admit_all: ClassVar[bool] = True  # every miss is admitted (else only if its key beats the victim's)
    key_dtype: ClassVar[type] = np.int64
    history: ClassVar[tuple[str, ...]] = ("_key", "_clock")
    shard_tokens: ClassVar[int] = 64  # replay shards shorter than this rarely converge (see moetier.sim.replay)
    native: bool = False  # True: steps run in C, one call for a whole block of tokens (no time shards needed)

    def __init__(self, num_layers: int, num_experts: int, capacity: int | Sequence[int], profile: np.ndarray | None = None):
        L, E = int(num_layers), int(num_experts)
        if L < 1 or E < 1:
            raise ValueError(f"{type(self).__name__}: need num_layers >= 1 and num_experts >= 1, got {L}, {E}")
        cap = np.asarray(capacity, dtype=np.int64)
        cap = np.full(L, int(cap)) if cap.ndim == 0 else cap
        if cap.shape != (L,) or (cap < 0).any() or (cap > E).any():
            raise ValueError(f"{type(self).__name__}: capacity must be an int or {L} ints in [0, {E}], got {capacity!r}")
        if profile is not None:
            profile = np.asarray(profile, dtype=np.float64)
            if profile.shape != (L, E) or not np.isfinite(profile).all() or (profile < 0).any():
                raise ValueError(f"{type(self).__name__}: profile must be finite non-negative [{L}, {E}], got shape {profile.shape}")
        self.num_layers, self.num_experts, self.capacity, self.profile = L, E, cap, profile
        self.layers_per_token = L  # a sharded replay stacks several copies of the layers as rows
        self.uploads = np.zeros(L, np.int64)  # [L] admissions so far (a warm start is not counted)
        self._rows = np.arange(L)
        self._ri = self._rows[:, None]
        self._slots = np.full((L, max(int(cap.max()), 1)), E)  # [L, W]
        self._slots[np.arange(self._slots.shape[1])[None, :] >= cap[:, None]] = E + 1
        self._slot_of = np.full((L, E + 2), -1)  # [L, E + 2]
        floating = np.issubdtype(self.key_dtype, np.floating)
        self._lo = -np.inf if floating else np.iinfo(self.key_dtype).min
        self._hi = np.inf if floating else np.iinfo(self.key_dtype).max
        self._key = np.full((L, E + 2), 0 if floating else _NEVER, self.key_dtype)  # [L, E + 2]
        self._key[:, E], self._key[:, E + 1] = self._lo, self._hi
        self._clock = np.zeros(L, np.int64)  # [L] accesses per layer
        if profile is not None:
            for layer in range(L):
                top = np.argsort(-profile[layer], kind="stable")[: cap[layer]]  # most popular first
                self._slots[layer, : len(top)] = top
                self._slot_of[layer, top] = np.arange(len(top))
                self._key[layer, top] = -1 - np.arange(len(top))  # int policies: oldest last
        self._snapshot = [self.resident(layer) for layer in range(L)]
        none = np.zeros(0, np.int64)
        self._no_changes = (none, none)
        self._changes = [self._no_changes] * L

    # -- public API -----------------------------------------------------------------
    def access(self, layer: int, picks: np.ndarray) -> np.ndarray:
        """picks [k] distinct expert ids of one token -> hits [k] bool; updates the state."""
        picks = np.asarray(picks, dtype=np.int64)
        if not 0 <= layer < self.num_layers or picks.ndim != 1 or picks.size == 0:
            raise ValueError(f"{self.name}: access(layer in [0, {self.num_layers}), picks [k]), got layer {layer}, shape {picks.shape}")
        listed = picks.tolist()  # k is small: Python checks beat numpy's per-call overhead here
        if min(listed) < 0 or max(listed) >= self.num_experts or len(set(listed)) != len(listed):
            raise ValueError(f"{self.name}: picks must be distinct expert ids in [0, {self.num_experts}), got {listed}")
        if self._snapshot[layer] is None:  # touch() left it: the resident set as it is now
            self._snapshot[layer] = self.resident(layer)
        hits = self._access_layer(layer, picks)
        if not self.mutable and not self.prefetches:
            return hits  # nothing ever changes: last_changes stays empty
        after = self.resident(layer)
        self._changes[layer] = self._since_snapshot(layer, after)
        self._snapshot[layer] = after
        return hits

    def touch(self, layer: int, picks: list[int]) -> tuple[int, list[int], list[int]]:
        """The runtime's access: one token's picks as a list -> (hits, admitted, evicted), the counts and
        `last_changes(layer)` as lists; the same state and checks as `access`."""
        hits = int(self.access(layer, np.asarray(picks, dtype=np.int64)).sum())
        admitted, evicted = self.last_changes(layer)
        return hits, admitted.tolist(), evicted.tolist()

    def touch_next(self, layer: int, picks: list[int]) -> tuple[int, list[int], list[int], list[int], list[int]]:
        """touch, and what it prefetched into layer + 1 so far (`prefetched` as lists; empty without prefetch):
        (hits, admitted, evicted, admitted next, evicted next)."""
        hits, admitted, evicted = self.touch(layer, picks)
        if not self.prefetches or layer + 1 >= self.num_layers:
            return hits, admitted, evicted, [], []
        admitted_next, evicted_next = self.prefetched(layer + 1)
        return hits, admitted, evicted, admitted_next.tolist(), evicted_next.tolist()

    def resident(self, layer: int) -> np.ndarray:
        """Expert ids of `layer` cached now, ascending."""
        slots = self._slots[layer]
        return np.sort(slots[slots < self.num_experts])

    def last_changes(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(admitted, evicted) of `layer` since the end of its previous access, up to the end of its last.

        Without prefetch these are exactly the changes made by the last access of that layer; a
        prefetching policy adds what the access of layer - 1 admitted into it (see `prefetched`).
        """
        admitted, evicted = self._changes[layer]
        if isinstance(admitted, list):  # as touch() left them
            self._changes[layer] = admitted, evicted = np.array(admitted, np.int64), np.array(evicted, np.int64)
        return admitted, evicted

    def prefetched(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(admitted, evicted) of `layer` since its last access: a prefetch the tier may upload early.

        They are reported again by last_changes(layer) after the next access of that layer.
        """
        return self._since_snapshot(layer, self.resident(layer))

    def _since_snapshot(self, layer: int, now: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(admitted, evicted), each ascending, between the layer's snapshot and `now` (its resident ids, ascending);
        no snapshot (None, left by touch) means the set has not moved since."""
        before = self._snapshot[layer]
        if before is None:
            return self._no_changes
        if now.shape == before.shape and (now == before).all():
            return self._no_changes
        now_set, then = set(now.tolist()), set(before.tolist())  # a cache's few ids: sets beat numpy's set routines here
        return np.array(sorted(now_set - then), np.int64), np.array(sorted(then - now_set), np.int64)

    # -- replay protocol (moetier.sim.replay) ---------------------------------------
    def access_all(self, picks: np.ndarray) -> np.ndarray:
        """picks [L, k] of one token -> hits [L, k]; same state as access(0..L-1); last_changes is not tracked."""
        return self._step(self._rows, self._ri, picks)

    def access_block(self, picks: np.ndarray) -> np.ndarray:
        """picks [n, L, k]: access_all for each token in turn -> hits [n, L, k]."""
        hits = np.empty(picks.shape, bool)  # [n, L, k]
        for t, token in enumerate(picks):
            hits[t] = self.access_all(token)
        return hits

    def observe_all(self, picks: np.ndarray) -> None:
        """Update only the `history` arrays for one token's picks [L, k] (as access_all would)."""
        self._observe(self._rows, self._ri, picks)

    def observe_block(self, picks: np.ndarray) -> None:
        """observe_all for each token of picks [n, L, k] in turn (policies vectorise it over time)."""
        for token in picks:
            self.observe_all(token)

    def _flat_cells(self, picks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """For picks [n, L, k]: (flat index into _key, recency stamp) of each pick, [n*L*k] each."""
        n, L, k = picks.shape
        stamp = (self._clock[None, :, None] + np.arange(n)[:, None, None]) * _STAMP + np.arange(k)  # [n, L, k]
        return (self._rows[None, :, None] * self._key.shape[1] + picks).ravel(), stamp.ravel()

    def contains(self, picks: np.ndarray) -> np.ndarray:
        """picks [..., L, k] -> [..., L, k] bool: resident now (no state change)."""
        return self._slot_of[self._ri, picks] >= 0

    def residency(self) -> np.ndarray:
        """[L, W] the slot table (a copy); rows compare as sets after np.sort(axis=1)."""
        return self._slots.copy()

    def history_state(self) -> dict[str, np.ndarray]:
        return {name: getattr(self, name).copy() for name in self.history}

    def load_state(self, history: dict[str, np.ndarray], slots: np.ndarray) -> None:
        """Replace the history arrays and the slot table (rows as in `residency`)."""
        for name in self.history:
            getattr(self, name)[...] = history[name]
        self._slots[...] = slots
        self._slot_of.fill(-1)
        r, s = np.nonzero(slots < self.num_experts)
        self._slot_of[r, slots[r, s]] = s

    def guess_residency(self) -> np.ndarray:
        """[L, W] a slot table holding each layer's top-capacity experts by key (a shard's first guess)."""
        E, slots = self.num_experts, self._slots.copy()
        order = np.argsort(-self._key[:, :E], axis=1, kind="stable")  # [L, E] best first
        for layer, cap in enumerate(self.capacity):
            slots[layer, :cap] = order[layer, :cap]
        return slots

    # -- hooks ----------------------------------------------------------------------
    def _observe(self, rows: np.ndarray, ri: np.ndarray, picks: np.ndarray) -> np.ndarray:
        """Update history for picks [R, k]; return the picks' admission keys [R, k]."""
        raise NotImplementedError(f"{type(self).__name__} does not implement _observe")

    def _access_layer(self, layer: int, picks: np.ndarray) -> np.ndarray:
        return self._step(self._rows[layer : layer + 1], self._ri[layer : layer + 1], picks[None, :])[0]

    def _step(self, rows: np.ndarray, ri: np.ndarray, picks: np.ndarray) -> np.ndarray:
        hit = self._slot_of[ri, picks] >= 0  # [R, k]
        key = self._observe(rows, ri, picks)  # [R, k]
        if not hit.all():
            cand_key = np.where(hit, self._lo, key)  # [R, k] hits are not candidates
            self._admit(rows, picks, cand_key, self._victim_keys(rows, ri, picks), self.admit_all)
        return hit

    # -- shared machinery -----------------------------------------------------------
    def _victim_keys(self, rows: np.ndarray, ri: np.ndarray, picks: np.ndarray) -> np.ndarray:
        """[R, W] key of each slot's expert; when every miss is admitted the picks themselves are protected."""
        key = self._key[ri, self._slots[rows]]  # [R, W]
        if self.admit_all:
            slot = self._slot_of[ri, picks]  # [R, k]
            r, j = np.nonzero(slot >= 0)
            key[r, slot[r, j]] = self._hi
        return key

    def _admit(self, rows, cand, cand_key, victim_key, forced: bool) -> None:
        """Pair the best candidates with the worst slots and swap while the rule allows.

        cand [R, m] expert ids not resident (key = lowest: not a candidate), victim_key [R, W].
        Candidates go in descending key order into slots in ascending key order; pair j swaps
        if the candidate is valid, the slot is usable, and (`forced`: admission on every miss)
        or the candidate's key beats the slot's. Ties: among equal candidate keys the later
        column goes first; slot keys of residents are distinct, so slot order never matters.
        """
        m, width = cand.shape[1], victim_key.shape[1]
        lr = np.arange(len(rows))[:, None]  # [R, 1] local row index
        vslot, vkey = lowest_keys(victim_key, min(m, width), lr, self._hi)  # [R, n] ascending
        n = min(m, width)
        corder = np.argsort(cand_key, axis=1, kind="stable")[:, ::-1][:, :n]  # [R, n] best first
        ckey, cexp = cand_key[lr, corder], cand[lr, corder]
        ok = (ckey > self._lo) & (vkey < self._hi)
        if not forced:
            ok &= ckey > vkey
        r, j = np.nonzero(ok)
        if r.size == 0:
            return
        rr, slot, new = rows[r], vslot[r, j], cexp[r, j]
        self._slot_of[rr, self._slots[rr, slot]] = -1
        self._slot_of[rr, new] = slot
        self._slots[rr, slot] = new
        self.uploads += np.bincount(rr, minlength=self.num_layers)


def lowest_keys(key: np.ndarray, n: int, lr: np.ndarray, hi, scratch: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(columns, keys) [R, n] of the n lowest keys per row of key [R, W], ascending; equal keys: the
    lower column first (as residency.c breaks them, so Belady's ties fall alike in both).

    Wide rows and few picks: n argmin passes (numpy's argpartition costs ~3 us a row), which
    overwrite `key` if it is `scratch`; otherwise a stable sort of the rows.
    """
    if key.shape[1] >= 64 and n <= 16:
        key, col = key if scratch else key.copy(), np.empty((len(key), n), np.intp)
        val = np.empty((len(key), n), key.dtype)
        for j in range(n):
            col[:, j] = c = key.argmin(1)
            val[:, j] = key[lr[:, 0], c]
            key[lr[:, 0], c] = hi
        return col, val
    col = np.argsort(key, axis=1, kind="stable")[:, :n]  # [R, n]
    return col, key[lr, col]


def add_counts(table: np.ndarray, cells: np.ndarray) -> None:
    """table[cells] += 1 for every occurrence (bincount when the table is small: ufunc.at is ~60 ns a cell)."""
    if table.size <= 4 * len(cells) or table.size <= 1 << 20:
        table += np.bincount(cells, minlength=table.size)
    else:
        np.add.at(table, cells, 1.0)


class StaticPolicy(ResidencyPolicy):
    """The top-`capacity` experts of the profile per layer (stable order on ties); never changes."""

    name = "static"
    mutable = False

    def __init__(self, num_layers, num_experts, capacity, profile=None):
        if profile is None:
            raise ValueError("static: needs a profile [layers, experts] (counts or brightness)")
        super().__init__(num_layers, num_experts, capacity, profile)

    def _step(self, rows, ri, picks):
        return self._slot_of[ri, picks] >= 0

    def _observe(self, rows, ri, picks):
        return np.zeros(picks.shape, self.key_dtype)


class _CacheState(ctypes.Structure):
    """residency.c's cache_state: a policy's slot table and int64 keys by address."""

    _fields_ = [(name, ctypes.c_int64) for name in ("rows", "experts", "width")] + [
        (name, ctypes.c_void_p) for name in ("slots", "slot_of", "key", "clock", "uploads")]


def cache_state(policy: ResidencyPolicy) -> _CacheState:
    """The C view of a policy with int64 keys (its arrays are only ever updated in place)."""
    assert policy._key.dtype == np.int64
    return _CacheState(policy.num_layers, policy.num_experts, policy._slots.shape[1], *(a.ctypes.data for a in (
        policy._slots, policy._slot_of, policy._key, policy._clock, policy.uploads)))


class _ScalarAccess(ResidencyPolicy):
    """`touch` for one layer without numpy (k and the slots are few, where numpy's per-call overhead
    dominates), for policies that admit every miss and key each pick by `_key_one`: one call of
    residency.c (`c_mode` names the key), or plain Python over the same arrays without it.

    Equal to `access`: hits are the picks resident before; the misses, best key first (later pick
    first on ties), take the slots of the lowest keys among experts not picked (empty slots first).
    """

    c_mode: ClassVar[int]  # admit_all_touch's mode: 0 LRU, 1 LFU

    def __init__(self, num_layers, num_experts, capacity, profile=None, native: bool = True):
        super().__init__(num_layers, num_experts, capacity, profile)
        lib = residency_library() if native else None
        self.native_touch = lib is not None
        if lib is not None:
            E = self.num_experts
            self._state = cache_state(self)
            self._touch_c = functools.partial(lib.admit_all_touch, ctypes.addressof(self._state))
            self._picks, self._out = (ctypes.c_int64 * E)(), (ctypes.c_int64 * (3 + 2 * E))()

    def _key_one(self, layer: int, picks: list[int]) -> list[int]:
        raise NotImplementedError(f"{type(self).__name__} does not implement _key_one")

    def touch(self, layer: int, picks: list[int]) -> tuple[int, list[int], list[int]]:
        E = self.num_experts
        if not 0 <= layer < self.num_layers or not picks:
            raise ValueError(f"{self.name}: touch(layer in [0, {self.num_layers}), picks [k]), got layer {layer}, picks {picks}")
        if self.native_touch and len(picks) <= E:
            k, out = len(picks), self._out
            self._picks[:k] = picks
            if self._touch_c(layer, self.c_mode, self._picks, k, out) >= 0:
                admitted, evicted = out[3 : 3 + out[1]], out[3 + out[1] : 3 + out[1] + out[2]]
                self._changes[layer] = (admitted, evicted)  # arrays when last_changes asks
                self._snapshot[layer] = None
                return out[0], admitted, evicted
        if min(picks) < 0 or max(picks) >= E or len(set(picks)) != len(picks):
            raise ValueError(f"{self.name}: picks must be distinct expert ids in [0, {E}), got {picks}")
        slot_of, slots, key = self._slot_of[layer], self._slots[layer], self._key[layer]
        held = slot_of[picks].tolist()  # [k] slot or -1
        keys = self._key_one(layer, picks)
        misses = [(keys[j], j) for j, slot in enumerate(held) if slot < 0]
        if not misses:
            self._changes[layer] = self._no_changes
            self._snapshot[layer] = None
            return len(picks), [], []
        occupant = slots.tolist()  # [W] expert per slot (E: empty, E + 1: padding)
        protected = set(held)
        slot_key = key[slots].tolist()  # [W]
        lo = self._lo
        victims = sorted((lo if occupant[w] == E else slot_key[w], w) for w in range(len(occupant))
                         if occupant[w] <= E and w not in protected)
        misses.sort(reverse=True)  # best key first; equal keys: the later pick first
        admitted, evicted = [], []
        for (_, j), (_, w) in zip(misses, victims):
            new, old = picks[j], occupant[w]
            if old < E:
                slot_of[old] = -1
                evicted.append(old)
            slot_of[new], slots[w] = w, new
            admitted.append(new)
        self.uploads[layer] += len(admitted)
        admitted.sort(), evicted.sort()
        self._changes[layer] = (admitted, evicted)  # arrays when last_changes asks
        self._snapshot[layer] = None  # the resident set now; access() takes a snapshot if it needs one
        return len(picks) - len(misses), admitted, evicted


class LruPolicy(_ScalarAccess):
    """Admit every miss; evict the least recently used expert that the token did not pick.

    Ties: within one token a later pick counts as more recent. When capacity < k, misses are
    admitted latest pick first while a non-picked slot is left. A warm start from a profile
    counts the most popular expert as the most recent.
    """

    name = "lru"
    c_mode = 0

    def observe_block(self, picks):
        cell, stamp = self._flat_cells(picks)
        np.maximum.at(self._key.reshape(-1), cell, stamp)  # the last access is the latest stamp
        self._clock += len(picks)

    def _observe(self, rows, ri, picks):
        stamp = self._clock[rows][:, None] * _STAMP + np.arange(picks.shape[1])  # [R, k]
        self._key[ri, picks] = stamp
        self._clock[rows] += 1
        return stamp

    def _key_one(self, layer, picks):
        base = int(self._clock[layer]) * _STAMP
        keys = list(range(base, base + len(picks)))
        self._key[layer, picks] = keys
        self._clock[layer] += 1
        return keys


class LfuPolicy(_ScalarAccess):
    """Admit every miss; evict the least frequently used expert that the token did not pick.

    Frequency counts every access since the start (resident or not: "perfect" LFU). Ties are
    broken by recency (the least recently used of the least frequent goes), as in LRU.
    """

    name = "lfu"
    c_mode = 1

    def observe_block(self, picks):
        cell, stamp = self._flat_cells(picks)
        size = self._key.size
        count = np.bincount(cell, minlength=size).reshape(self._key.shape)  # [L, E + 2]
        last = np.full(size, -1, np.int64)
        np.maximum.at(last, cell, stamp)
        had = np.maximum(self._key >> 32, 0)  # warm and never-seen keys count 0
        self._key[...] = np.where(count > 0, (had + count) << 32 | last.reshape(self._key.shape), self._key)
        self._clock += len(picks)

    def _observe(self, rows, ri, picks):
        stamp = self._clock[rows][:, None] * _STAMP + np.arange(picks.shape[1])  # [R, k]
        count = np.maximum(self._key[ri, picks] >> 32, 0) + 1  # [R, k] (warm and never-seen keys are < 0: count 0)
        key = count << 32 | stamp  # [R, k] count, then recency
        self._key[ri, picks] = key
        self._clock[rows] += 1
        return key

    def _key_one(self, layer, picks):
        base = int(self._clock[layer]) * _STAMP
        keys = [(max(had >> 32, 0) + 1) << 32 | (base + j) for j, had in enumerate(self._key[layer, picks].tolist())]
        self._key[layer, picks] = keys
        self._clock[layer] += 1
        return keys
