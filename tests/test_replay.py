"""Routing traces (format, adapters, count files) and replay: replay equals the online policies
(sequential and sharded), Belady equals a brute-force optimum on tiny cases and bounds every
policy that only admits requested experts, and on the real traces xlayer beats LRU, LFU and a
first-half static profile on the second half at 25% and 50% capacity."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from moetier.sim import RoutingTrace, belady, from_flame, from_qwen15moe, load_counts, replay, replay_with_affinity, synthetic_trace
from moetier.sim.replay import next_use, slots_for
from moetier.residency import make_policy

FLAME = "flame_moe_290m_prefill_4x512_layers2-9.npz"
QWEN = "qwen15moe_gsm8k_layers_0_8_12_18_23.npz"
FLAME_RATIO_FLOOR = 0.80  # xlayer / Belady (demand) on FLAME's second half at 25%: measured 0.84


def random_trace(seed: int, tokens: int, layers: int, experts: int, k: int, skew: float = 1.0) -> RoutingTrace:
    rng = np.random.default_rng(seed)
    logits = -skew * np.log(np.arange(1, experts + 1)) + rng.gumbel(size=(tokens, layers, experts))
    picks = np.argsort(-logits, axis=-1)[..., :k]
    return RoutingTrace(picks=picks, weights=np.ones(picks.shape), num_experts=experts, layer_ids=range(layers))


@pytest.fixture(scope="module")
def flame(traces_dir):
    return from_flame(traces_dir / FLAME)


@pytest.fixture(scope="module")
def qwen(traces_dir):
    return from_qwen15moe(traces_dir / QWEN)


def online_hits(trace: RoutingTrace, policy: str, capacity, profile=None, **options) -> np.ndarray:
    pol = make_policy(policy, trace.num_layers, trace.num_experts, capacity, profile, **options)
    return np.array([[pol.access(l, trace.picks[t, l]) for l in range(trace.num_layers)] for t in range(trace.num_tokens)])


# -- trace format --------------------------------------------------------------------
def test_trace_round_trip(tmp_path):
    base = random_trace(0, 50, 3, 16, 4)
    rng = np.random.default_rng(0)
    trace = RoutingTrace(picks=base.picks, weights=rng.random(base.picks.shape), num_experts=16, layer_ids=(1, 3, 5),
                         model="m-fp", source="test", probs=rng.random((50, 3, 16)), phase=rng.integers(0, 2, 50),
                         phase_names=("explore", "edit"), extra={"note": [1, 2]})
    path = tmp_path / "t.npz"
    trace.save(path)
    back = RoutingTrace.load(path)
    assert back.picks.dtype == np.int16 and back.weights.dtype == np.float16 and back.probs.dtype == np.float16
    assert back.phase.dtype == np.int8
    for name in ("picks", "weights", "probs", "phase"):
        assert np.array_equal(getattr(back, name), getattr(trace, name))
    assert (back.layer_ids, back.model, back.phase_names, back.extra, back.top_k) == ((1, 3, 5), "m-fp", ("explore", "edit"), {"note": [1, 2]}, 4)
    assert back.tokens(10, 20).num_tokens == 10 and back.counts().sum() == 50 * 3 * 4


def bad_file(tmp_path, name, **entries):
    path = tmp_path / name
    np.savez_compressed(path, **entries)
    return path


def test_trace_bad_files(tmp_path):
    good = random_trace(0, 5, 2, 8, 2)
    meta = json.dumps(good.meta())
    ok = dict(picks=good.picks, weights=good.weights, meta=np.array(meta))
    cases = {
        "garbage.npz": None,
        "missing.npz": dict(picks=good.picks, meta=np.array(meta)),
        "shape.npz": {**ok, "picks": good.picks[:, :, 0]},
        "range.npz": {**ok, "picks": good.picks + 8},
        "dup.npz": {**ok, "picks": np.zeros_like(good.picks)},
        "weights.npz": {**ok, "weights": good.weights[:3]},
        "format.npz": {**ok, "meta": np.array(json.dumps({**good.meta(), "format": "other"}))},
        "topk.npz": {**ok, "meta": np.array(json.dumps({**good.meta(), "top_k": 3}))},
        "layers.npz": {**ok, "meta": np.array(json.dumps({**good.meta(), "layer_ids": [0]}))},
    }
    expect = {"garbage.npz": "not a valid", "missing.npz": "missing entries", "shape.npz": "tokens, layers, k", "range.npz": "in \\[0, 8\\)",
              "dup.npz": "twice", "weights.npz": "weights", "format.npz": "format", "topk.npz": "top_k", "layers.npz": "layer_ids"}
    for name, entries in cases.items():
        if entries is None:
            path = tmp_path / name
            path.write_bytes(b"not a zip")
        else:
            path = bad_file(tmp_path, name, **entries)
        with pytest.raises(ValueError, match=expect[name]) as err:
            RoutingTrace.load(path)
        assert str(path) in str(err.value)


def test_real_trace_adapters(flame, qwen):
    assert flame.picks.shape == (2048, 8, 6) and flame.num_experts == 64 and flame.layer_ids == tuple(range(2, 10))
    assert flame.probs.shape == (2048, 8, 64) and flame.extra["sequence_starts"] == [0, 512, 1024, 1536]
    assert qwen.picks.shape == (4292, 5, 4) and qwen.num_experts == 60 and qwen.layer_ids == (0, 8, 12, 18, 23)
    assert qwen.probs is None and qwen.extra["batch_starts"][:2] == [0, 1406]


def test_load_counts(traces_dir):
    mixtral = load_counts(traces_dir / "mixtral_expert_activation_counts.npy")
    assert mixtral.counts.shape == (32, 8) and mixtral.layer_ids == tuple(range(32))
    switch = load_counts(traces_dir / "switch_base_128_layer_expert_counts.npz")
    assert switch.counts.shape == (6, 128) and switch.layer_ids == (1, 3, 5, 7, 9, 11)
    with pytest.raises(ValueError, match="choose key=.*olmoe__expert_counts__c4"):
        load_counts(traces_dir / "olmoe_expert_counts_layers_0_7_15.npz")
    olmoe = load_counts(traces_dir / "olmoe_expert_counts_layers_0_7_15.npz", key="olmoe__expert_counts__c4")
    assert olmoe.counts.shape == (3, 64) and olmoe.layer_ids == (0, 7, 15)
    static = replay(random_trace(0, 20, 3, 64, 8), "static", 16, olmoe.counts)  # usable as a profile
    assert static.capacity == (16, 16, 16)


def test_slots_for():
    assert slots_for(0.25, 2, 60).tolist() == [15, 15] and slots_for(1.0, 1, 8).tolist() == [8]
    assert slots_for(3, 2, 8).tolist() == [3, 3] and slots_for([1, 2], 2, 8).tolist() == [1, 2]
    with pytest.raises(ValueError):
        slots_for(1.5, 2, 8)


# -- replay == online ----------------------------------------------------------------
@pytest.mark.parametrize("policy", ["static", "lru", "lfu", "xlayer"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replay_equals_online_random(policy, seed):
    trace = random_trace(seed, 300, 4, 24, 3, skew=seed / 2)
    profile = trace.tokens(0, 100).counts()
    want = online_hits(trace, policy, [4, 6, 8, 24], profile)  # [T, L, k]
    for shards, warmup in ((1, 0), (7, 0), (5, 37)):
        got = replay(trace, policy, [4, 6, 8, 24], profile, warmup_tokens=warmup, shards=shards)
        assert got.hits.tolist() == want[warmup:].sum(axis=(0, 2)).tolist(), (shards, warmup)
        assert got.tokens == 300 - warmup


@pytest.mark.parametrize("policy", ["lru", "lfu", "xlayer"])
def test_replay_equals_online_real(policy, flame, qwen):
    for trace in (flame.tokens(1024, 1324), qwen.tokens(2000, 2400)):
        profile = trace.counts()
        want = online_hits(trace, policy, trace.num_experts // 4, profile)
        for shards in (1, 6):
            got = replay(trace, policy, trace.num_experts // 4, profile, shards=shards)
            assert got.hits.tolist() == want.sum(axis=(0, 2)).tolist()


@pytest.mark.parametrize("options", [{}, {"context": 2}])
def test_xlayer_in_c_replays_the_numpy_hits_on_real_traces(options, flame, qwen):
    """The whole FLAME trace and 1,000 tokens of Qwen1.5-MoE at 25%: residency.c gives the numpy path's hits, token by token."""
    if not make_policy("xlayer", 1, 2, 1).native:
        pytest.skip("xlayer's C path did not build here")
    for trace in (flame, qwen.tokens(0, 1000)):
        slots, profile = trace.num_experts // 4, trace.counts()
        fast, slow = (make_policy("xlayer", trace.num_layers, trace.num_experts, slots, profile, native=native, **options)
                      for native in (True, False))
        picks = trace.picks.astype(np.int64)
        assert (fast.access_block(picks) == slow.access_block(picks)).all()
        assert (fast.uploads == slow.uploads).all()


@pytest.mark.parametrize("bypass", [False, True])
def test_belady_in_c_gives_the_numpy_hits_and_uploads(bypass, flame, qwen):
    """residency.c's belady_block against the numpy oracle: random traces (ties included) and real ones."""
    if not make_policy("xlayer", 1, 2, 1).native:
        pytest.skip("residency.c did not build here")
    traces = [random_trace(seed, 200, 3, 16, 3, skew=seed / 2) for seed in range(4)] + [flame, qwen.tokens(0, 1500)]
    for trace in traces:
        for capacity in (0.25, 0.5):
            fast, slow = (belady(trace, capacity, bypass=bypass, native=native) for native in (True, False))
            assert fast.hits.tolist() == slow.hits.tolist() and fast.uploads.tolist() == slow.uploads.tolist(), (trace.source, capacity)


def test_replay_uploads_match_online():
    trace = random_trace(3, 200, 3, 16, 2)
    for policy in ("lru", "lfu", "xlayer"):
        pol = make_policy(policy, 3, 16, 5)
        for t in range(200):
            for l in range(3):
                pol.access(l, trace.picks[t, l])
        for shards in (1, 4):
            assert replay(trace, policy, 5, shards=shards).uploads.tolist() == pol.uploads.tolist()


# -- Belady --------------------------------------------------------------------------
def brute_force(stream: np.ndarray, experts: int, capacity: int, bypass: bool, prefilled: bool) -> int:
    """Max hits over every legal schedule of one layer (exhaustive, tiny cases only)."""
    subsets = lambda pool, most: [frozenset(c) for n in range(most + 1) for c in itertools.combinations(sorted(pool), n)]  # noqa: E731
    best = {s: 0 for s in (subsets(range(experts), capacity) if prefilled else [frozenset()])}
    for picks in stream:
        need, nxt = frozenset(picks.tolist()), {}
        for state, hits in best.items():
            gained = hits + len(need & state)
            if bypass:
                options = subsets(state | need, capacity)
            else:
                options = [need | x for x in subsets(state - need, capacity - len(need))]
            for s in options:
                nxt[s] = max(nxt.get(s, -1), gained)
        best = nxt
    return max(best.values())


@pytest.mark.parametrize("seed", range(12))
def test_belady_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    experts, k = int(rng.integers(3, 7)), int(rng.integers(1, 3))
    capacity = int(rng.integers(k, min(experts, 3) + 1))
    trace = random_trace(seed, int(rng.integers(3, 9)), 2, experts, k, skew=float(rng.random() * 2))
    for bypass, prefilled in itertools.product((False, True), repeat=2):
        want = sum(brute_force(trace.picks[:, l], experts, capacity, bypass, prefilled) for l in range(2))
        assert belady(trace, capacity, bypass=bypass, prefilled=prefilled).hits.sum() == want, (bypass, prefilled)


def straightforward_belady(stream: np.ndarray, capacity: int, bypass: bool) -> int:
    """Set-based Belady on one layer: keep the residents needed soonest (independent of the vectorised one)."""
    future = [set(p.tolist()) for p in stream]
    cache, hits = set(), 0
    for t, need in enumerate(future):
        hits += len(need & cache)
        soon = lambda e: next((u for u in range(t + 1, len(future)) if e in future[u]), len(future))  # noqa: E731
        if bypass:
            cache = set(sorted(cache | need, key=lambda e: (soon(e), e))[:capacity])
        else:
            cache = need | set(sorted(cache - need, key=lambda e: (soon(e), e))[: capacity - len(need)])
    return hits


@pytest.mark.parametrize("seed", range(4))
def test_belady_equals_straightforward(seed):
    trace = random_trace(seed, 150, 3, 20, 3, skew=1.0)
    for bypass in (False, True):
        want = sum(straightforward_belady(trace.picks[:, l], 6, bypass) for l in range(3))
        assert belady(trace, 6, bypass=bypass).hits.sum() == want


def test_next_use():
    picks = np.array([[[0, 1]], [[1, 2]], [[0, 2]]])  # [T=3, L=1, k=2]
    nxt, first = next_use(picks)
    assert nxt[:, 0].tolist() == [[2, 1], [3, 2], [3, 3]] and first[0].tolist() == [0, 0, 1]


@pytest.mark.parametrize("seed", range(4))
def test_belady_bounds_policies(seed):
    trace = random_trace(seed, 400, 3, 32, 4, skew=0.5 + seed / 2)
    profile = trace.tokens(0, 200).counts()
    for capacity in (4, 8, 16):
        demand = belady(trace, capacity).hits.sum()
        bound = belady(trace, capacity, bypass=True, prefilled=True).hits.sum()
        assert bound >= demand
        for policy in ("lru", "lfu"):
            assert demand >= replay(trace, policy, capacity).hits.sum()
        for policy, options in (("static", {}), ("lru", {}), ("lfu", {}), ("xlayer", {"budget": 0})):
            assert bound >= replay(trace, policy, capacity, profile, **options).hits.sum(), policy


# -- real traces ---------------------------------------------------------------------
@pytest.mark.parametrize("which", ["flame", "qwen"])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_xlayer_beats_baselines_on_second_half(which, fraction, request):
    trace = request.getfixturevalue(which)
    half = trace.num_tokens // 2
    first, second = trace.tokens(0, half), trace.tokens(half)
    profile = first.counts()
    rates = {p: replay(second, p, fraction, profile).hit_rate for p in ("static", "lru", "lfu", "xlayer")}
    opt = belady(second, fraction).hit_rate
    ratio = rates["xlayer"] / opt
    print(f"\n{which} {fraction:.0%}: " + " ".join(f"{p} {r:.3f}" for p, r in rates.items()) + f" belady {opt:.3f} xlayer/belady {ratio:.3f}")
    assert rates["xlayer"] > max(rates["static"], rates["lru"], rates["lfu"])
    if which == "flame" and fraction == 0.25:
        assert ratio >= FLAME_RATIO_FLOOR


def test_affinity(flame):
    trace = flame.tokens(1024, 1224)
    profile = flame.tokens(0, 1024).counts()
    plain = replay_with_affinity(trace, "lfu", 16, 0.0, profile)
    assert plain.changed == 0.0 and (np.sort(plain.picks, -1) == np.sort(trace.picks, -1)).all()
    assert plain.hits == replay(trace, "lfu", 16, profile).hits.sum()
    biased = replay_with_affinity(trace, "lfu", 16, 0.05, profile)
    assert biased.hit_rate > plain.hit_rate and 0 < biased.changed < 0.5
    with pytest.raises(ValueError, match="router probabilities"):
        replay_with_affinity(random_trace(0, 5, 1, 8, 2), "lru", 2, 0.1)


def test_synthetic_trace_is_valid_and_skewed():
    trace = synthetic_trace(300, 4, 64, 6, seed=3)
    assert trace.picks.shape == (300, 4, 6) and trace.picks.max() < 64
    counts = np.sort(trace.counts(), axis=1)[:, ::-1]
    assert (counts[:, :16].sum(1) / counts.sum(1) > 0.3).all()  # top quarter carries more than its share
