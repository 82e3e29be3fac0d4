"""Residency policies: hand-checked rules, invariants under random access streams (hypothesis),
the replay path (access_all) equal to the online one, and xlayer's cross-layer learning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.residency import POLICIES, make_policy

PROFILED = {"static", "lru", "lfu", "xlayer"}
VARIANTS = [("static", {}), ("lru", {}), ("lfu", {}), ("xlayer", {}), ("xlayer", {"budget": 0}), ("xlayer", {"budget": 3}),
            ("xlayer", {"native": False}), ("xlayer", {"budget": 3, "context": 1, "native": False}),
            ("lru", {"native": False}), ("lfu", {"native": False})]  # native=False: the paths without residency.c


def distinct_picks(rng: np.random.Generator, tokens: int, layers: int, experts: int, k: int, skew: float = 1.0) -> np.ndarray:
    """[T, L, k] distinct picks per token and layer, Zipf-skewed (Gumbel top-k)."""
    logits = -skew * np.log(np.arange(1, experts + 1)) + rng.gumbel(size=(tokens, layers, experts))
    return np.argsort(-logits, axis=-1)[..., :k]


def test_registry_and_errors():
    assert {"static", "lru", "lfu", "xlayer"} <= set(POLICIES)
    with pytest.raises(ValueError, match="unknown residency policy 'nope'"):
        make_policy("nope", 2, 8, 2)
    with pytest.raises(ValueError, match="capacity"):
        make_policy("lru", 2, 8, 9)
    with pytest.raises(ValueError, match="capacity"):
        make_policy("lru", 2, 8, [1, 2, 3])
    with pytest.raises(ValueError, match="needs a profile"):
        make_policy("static", 2, 8, 2)
    with pytest.raises(ValueError, match="profile"):
        make_policy("lfu", 2, 8, 2, profile=np.ones((3, 8)))
    with pytest.raises(ValueError, match="distinct expert ids"):
        make_policy("lru", 2, 8, 2).access(0, np.array([8]))
    with pytest.raises(ValueError, match="distinct expert ids"):
        make_policy("lru", 2, 8, 2).access(0, np.array([3, 3]))


def test_lru_by_hand():
    pol = make_policy("lru", 1, 6, 3)
    assert pol.access(0, np.array([0, 1])).tolist() == [False, False]
    assert pol.access(0, np.array([2, 0])).tolist() == [False, True]  # 1 is now least recent
    assert pol.access(0, np.array([3])).tolist() == [False]  # evicts 1
    assert pol.resident(0).tolist() == [0, 2, 3]
    assert [a.tolist() for a in pol.last_changes(0)] == [[3], [1]]
    assert pol.access(0, np.array([4, 5])).tolist() == [False, False]  # evicts 2 (stamp before 0's), then 0
    assert pol.resident(0).tolist() == [3, 4, 5]


def test_lfu_by_hand_ties_by_recency():
    pol = make_policy("lfu", 1, 6, 2)
    for picks in ([0], [0], [1], [2]):  # counts 0:2 1:1; 2 evicts 1 (least frequent)
        pol.access(0, np.array(picks))
    assert pol.resident(0).tolist() == [0, 2]
    pol.access(0, np.array([1]))  # 1 (count 2) in; 0 and 2 tie? no: 0 has 2, 2 has 1 -> 2 goes
    assert pol.resident(0).tolist() == [0, 1]
    pol.access(0, np.array([3]))  # 0 and 1 both count 2: the least recent (0) goes
    assert pol.resident(0).tolist() == [1, 3]


def test_static_is_profile_top():
    profile = np.array([[1, 9, 3, 7, 0], [5, 5, 5, 0, 1]], float)
    pol = make_policy("static", 2, 5, [2, 3], profile)
    assert pol.resident(0).tolist() == [1, 3] and pol.resident(1).tolist() == [0, 1, 2]
    assert pol.access(0, np.array([1, 2])).tolist() == [True, False]
    assert pol.resident(0).tolist() == [1, 3] and all(len(a) == 0 for a in pol.last_changes(0))


def test_warm_start_from_profile():
    profile = np.arange(12, dtype=float).reshape(2, 6)
    for name in PROFILED:
        pol = make_policy(name, 2, 6, 2, profile)
        assert pol.resident(0).tolist() == [4, 5], name
        assert pol.uploads.sum() == 0


@st.composite
def streams(draw):
    layers, experts = draw(st.integers(1, 4)), draw(st.integers(2, 12))
    k = draw(st.integers(1, min(4, experts)))
    capacity = draw(st.lists(st.integers(0, experts), min_size=layers, max_size=layers))
    tokens = draw(st.integers(1, 25))
    seed = draw(st.integers(0, 2**31 - 1))
    picks = distinct_picks(np.random.default_rng(seed), tokens, layers, experts, k, draw(st.sampled_from([0.0, 1.0, 2.0])))
    profile = np.random.default_rng(seed + 1).integers(0, 5, (layers, experts)).astype(float) if draw(st.booleans()) else None
    return picks, experts, capacity, profile


def policy_for(name: str, options: dict, stream):
    """A fresh policy for a generated stream; static needs a profile, so it gets a flat one when the stream has none."""
    picks, experts, capacity, profile = stream
    layers = picks.shape[1]
    if name == "static" and profile is None:
        profile = np.ones((layers, experts))
    return make_policy(name, layers, experts, capacity, profile, **options)


@pytest.mark.parametrize("name, options", VARIANTS)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams())
def test_invariants_online(name, options, stream):
    picks, _, capacity, _ = stream
    tokens, layers, k = picks.shape
    pol = policy_for(name, options, stream)
    after = [set(pol.resident(l).tolist()) for l in range(layers)]  # each layer's set at the end of its last access
    reported = 0
    for t in range(tokens):
        for l in range(layers):
            before = set(pol.resident(l).tolist())
            pending_in, pending_out = (set(a.tolist()) for a in pol.prefetched(l))
            assert before == (after[l] - pending_out) | pending_in
            hits = pol.access(l, picks[t, l])
            assert hits.tolist() == [int(e) in before for e in picks[t, l]]
            now = set(pol.resident(l).tolist())
            assert len(now) <= capacity[l]
            admitted, evicted = (set(a.tolist()) for a in pol.last_changes(l))
            assert not admitted & after[l] and evicted <= after[l]
            assert now == (after[l] - evicted) | admitted
            after[l] = now
            reported += len(admitted)
    pending = sum(len(pol.prefetched(l)[0]) for l in range(layers))
    assert pol.uploads.sum() == reported + pending
    if name in ("lru", "lfu"):  # admission on every miss: the last picks are resident where they fit
        for l in range(layers):
            if capacity[l] >= k:
                assert set(picks[-1, l].tolist()) <= set(pol.resident(l).tolist())


@pytest.mark.parametrize("name, options", VARIANTS)
@settings(max_examples=40, deadline=None)
@given(stream=streams())
def test_access_all_equals_access(name, options, stream):
    picks, *_ = stream
    tokens, layers, _ = picks.shape
    online, replayed = policy_for(name, options, stream), policy_for(name, options, stream)
    for t in range(tokens):
        want = np.stack([online.access(l, picks[t, l]) for l in range(layers)])
        assert (replayed.access_all(picks[t]) == want).all()
        for l in range(layers):
            assert (online.resident(l) == replayed.resident(l)).all()
    assert (online.uploads == replayed.uploads).all()


@pytest.mark.parametrize("name, options", VARIANTS)
@settings(max_examples=40, deadline=None)
@given(stream=streams())
def test_touch_equals_access(name, options, stream):
    """The runtime's `touch` (C, or plain Python with native=False, for LRU and LFU) makes access's hits, changes and state."""
    picks, *_ = stream
    tokens, layers, _ = picks.shape
    online, touched, mixed = (policy_for(name, options, stream) for _ in range(3))  # mixed: touch, then access, ...
    for t in range(tokens):
        for l in range(layers):
            hits = int(online.access(l, picks[t, l]).sum())
            admitted, evicted = (a.tolist() for a in online.last_changes(l))
            assert touched.touch(l, picks[t, l].tolist()) == (hits, admitted, evicted)
            assert [a.tolist() for a in touched.last_changes(l)] == [admitted, evicted]
            assert (online.resident(l) == touched.resident(l)).all()
            if t % 2:
                assert int(mixed.access(l, picks[t, l]).sum()) == hits
            else:
                assert mixed.touch(l, picks[t, l].tolist())[0] == hits
            assert [a.tolist() for a in mixed.last_changes(l)] == [admitted, evicted]
            assert [a.tolist() for a in mixed.prefetched(l)] == [a.tolist() for a in online.prefetched(l)]
    assert (online.uploads == touched.uploads).all()
    for name_ in online.history:
        assert (getattr(online, name_) == getattr(touched, name_)).all()
    with pytest.raises(ValueError, match="must be distinct expert ids"):
        touched.touch(0, [0, 0])


@pytest.mark.parametrize("name", ["lru", "lfu", "xlayer"])
@settings(max_examples=30, deadline=None)
@given(stream=streams(), cut=st.integers(0, 24), seed=st.integers(0, 1000))
def test_decisions_ignore_slot_order(name, stream, cut, seed):
    """Sharded replay relies on it: same history and same resident sets -> same future, whatever the slot order."""
    picks, experts, capacity, profile = stream
    tokens, layers, _ = picks.shape
    cut = min(cut, tokens)
    a = make_policy(name, layers, experts, capacity, profile)
    for t in range(cut):
        a.access_all(picks[t])
    b = make_policy(name, layers, experts, capacity, profile)
    slots = a.residency()
    rng = np.random.default_rng(seed)
    for row, cap in zip(slots, capacity):
        row[:cap] = row[:cap][rng.permutation(cap)]
    b.load_state(a.history_state(), slots)
    for t in range(cut, tokens):
        assert (a.access_all(picks[t]) == b.access_all(picks[t])).all()


def test_xlayer_prefetch_budget():
    rng = np.random.default_rng(0)
    picks = distinct_picks(rng, 200, 3, 16, 3)
    pol = make_policy("xlayer", 3, 16, 6, budget=2)
    for t in range(200):
        for l in range(3):
            before = pol.uploads.copy()
            pol.access(l, picks[t, l])
            if l + 1 < 3:
                assert pol.uploads[l + 1] - before[l + 1] <= 2
            assert pol.uploads[l] == before[l] or l == 0  # only layer 0 admits on its own access


def test_xlayer_learns_cross_layer_map():
    """Layer 1's picks are a fixed function of layer 0's: xlayer learns it, recency and frequency can't."""
    rng = np.random.default_rng(1)
    E, k, tokens = 32, 2, 600
    mapping = rng.permutation(E)
    first = distinct_picks(rng, tokens, 1, E, k, skew=0.0)[:, 0]  # [T, k] uniform
    picks = np.stack([first, mapping[first]], axis=1)  # [T, 2, k]
    rates = {}
    for name in ("lru", "lfu", "xlayer"):
        pol = make_policy(name, 2, E, 8)
        hits = np.stack([pol.access_all(picks[t]) for t in range(tokens)])
        rates[name] = hits[300:, 1].mean()
    assert rates["xlayer"] > 0.95 and max(rates["lru"], rates["lfu"]) < 0.5, rates


@pytest.mark.parametrize("name", ["lru", "lfu", "xlayer"])
@settings(max_examples=40, deadline=None)
@given(stream=streams())
def test_history_ignores_residency(name, stream):
    """Sharded replay relies on it: observe_block, observe_all and access_all leave the same history."""
    picks, experts, capacity, profile = stream
    tokens, layers, _ = picks.shape
    block, steps, full = (make_policy(name, layers, experts, capacity, profile) for _ in range(3))
    block.observe_block(picks)
    for t in range(tokens):
        steps.observe_all(picks[t])
        full.access_all(picks[t])
    for other in (steps, full):
        for key, value in block.history_state().items():
            assert np.array_equal(value, other.history_state()[key]), key


needs_c = pytest.mark.skipif(not make_policy("xlayer", 1, 2, 1).native, reason="xlayer's C path did not build here")


@needs_c
@pytest.mark.parametrize("options", [{}, {"budget": 0}, {"budget": 3, "context": 1}, {"half_life": 4.0, "smoothing": 0.25}])
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=streams(), prefill=st.integers(0, 3))
def test_xlayer_in_c_makes_the_numpy_decisions(options, stream, prefill):
    """residency.c and the numpy path, step for step: a prefill of `prefill` rows, tokens by access,
    touch and touch_next in turn, then by access_all -> the same hits, changes, resident sets, uploads and history, bit for bit."""
    picks, *_ = stream
    tokens, layers, _ = picks.shape
    c, py = policy_for("xlayer", options, stream), policy_for("xlayer", {**options, "native": False}, stream)
    assert c.native and not py.native
    for layer in range(layers):  # a multi-row step: each layer once per row
        for row in picks[:prefill, layer]:
            assert (c.access(layer, row) == py.access(layer, row)).all()
    for t in range(tokens):  # online (access and touch), then the replay path (access_all: changes not tracked)
        if t >= tokens // 2:
            assert (c.access_all(picks[t]) == py.access_all(picks[t])).all()
        for l in range(layers if t < tokens // 2 else 0):
            if t % 4 == 1:
                assert c.touch(l, picks[t, l].tolist()) == py.touch(l, picks[t, l].tolist())
            elif t % 4 == 3:  # touch and the prefetch into l + 1, in one call
                assert c.touch_next(l, picks[t, l].tolist()) == py.touch_next(l, picks[t, l].tolist())
            else:
                assert (c.access(l, picks[t, l]) == py.access(l, picks[t, l])).all()
            assert [a.tolist() for a in c.last_changes(l)] == [a.tolist() for a in py.last_changes(l)]
            if l + 1 < layers:
                assert [a.tolist() for a in c.prefetched(l + 1)] == [a.tolist() for a in py.prefetched(l + 1)]
        assert all((c.resident(l) == py.resident(l)).all() for l in range(layers))
    assert (c.uploads == py.uploads).all()
    for name, value in py.history_state().items():
        assert np.array_equal(value, c.history_state()[name]), name


@needs_c
def test_lru_and_lfu_touch_in_c_where_it_builds():
    """test_touch_equals_access then checks the C touch (and its native=False variants the Python one)."""
    assert all(make_policy(name, 1, 4, 2).native_touch for name in ("lru", "lfu"))
    assert not any(make_policy(name, 1, 4, 2, native=False).native_touch for name in ("lru", "lfu"))


def test_xlayer_multi_row_steps():
    """A prefill calls each layer once per token row, layer by layer: no pairs across tokens, one prefetch per layer step."""
    picks = distinct_picks(np.random.default_rng(2), 5, 3, 16, 2)  # [5 rows, 3 layers, k=2]
    pol = make_policy("xlayer", 3, 16, 4, budget=2)
    for layer in range(3):
        for row in picks[:, layer]:
            pol.access(layer, row)
    assert pol.history_state()["_pair"].sum() == 0
    assert pol.uploads[1] <= 2 and pol.uploads[2] <= 2
    for layer in range(3):  # then a decode step (one row per layer) learns
        pol.access(layer, picks[0, layer])
    assert pol.history_state()["_pair"].sum() == 2 * 2 * 2  # layers 1 and 2, k x k pairs each
