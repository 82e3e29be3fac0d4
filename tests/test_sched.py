"""The per-layer plan honours its contract over random cost models and picks (hypothesis)."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.sched.cost import TierCost
from moetier.sched.plan import PlanCache, cpu_only_us, plan_layer

E = 32


def tier_costs(draw, kind: str, name: str) -> TierCost:
    positive = st.floats(min_value=0.0, max_value=2000.0, allow_nan=False)
    fetch = draw(st.one_of(st.just(math.inf), positive)) if kind == "vram" else math.inf
    return TierCost(name, kind, draw(positive), draw(st.floats(1.0, 1000.0)), draw(positive), draw(positive) if kind != "vram" else 0.0,
                    fetch, 1)


@st.composite
def problems(draw):
    kinds = ["cpu"] + draw(st.lists(st.sampled_from(["vram", "helper", "remote"]), max_size=3))
    names = [f"{kind}{i}" for i, kind in enumerate(kinds)]
    costs = {name: tier_costs(draw, kind, name) for name, kind in zip(names, kinds)}
    experts = draw(st.lists(st.integers(0, E - 1), min_size=1, max_size=12, unique=True))
    expert_tokens = {e: draw(st.integers(1, 16)) for e in experts}
    holders = {name: (frozenset(range(E)) if costs[name].kind == "cpu" else frozenset(draw(st.sets(st.integers(0, E - 1)))))
               for name in names}
    fetchable = {name: frozenset(draw(st.sets(st.integers(0, E - 1)))) for name in names if costs[name].kind == "vram"}
    budget = draw(st.floats(1.0, 5000.0))
    return expert_tokens, holders, costs, budget, fetchable


@settings(max_examples=300, deadline=None)
@given(problems(), st.booleans())
def test_every_expert_served_once_by_a_tier_that_can(problem, tail_skip):
    expert_tokens, holders, costs, budget, fetchable = problem
    plan = plan_layer(expert_tokens, holders, costs, budget, tail_skip, fetchable)
    served = [e for experts in plan.assign.values() for e in experts]
    assert sorted(served + plan.skipped) == sorted(expert_tokens)
    for tier, experts in plan.assign.items():
        fetched = set(plan.fetch.get(tier, []))
        for expert in experts:
            assert expert in holders[tier] or (expert in fetched and expert in fetchable.get(tier, ()))
    if not tail_skip:
        assert plan.skipped == []


@settings(max_examples=300, deadline=None)
@given(problems())
def test_tail_skip_drops_only_misses_that_would_miss_the_budget(problem):
    expert_tokens, holders, costs, budget, fetchable = problem
    plan = plan_layer(expert_tokens, holders, costs, budget, True, fetchable)
    fast = {name for name, cost in costs.items() if cost.kind != "cpu"}
    for expert in plan.skipped:
        assert not any(expert in holders[name] for name in fast)  # a hit is never dropped
    full = plan_layer(expert_tokens, holders, costs, budget, False, fetchable)
    if full.critical_us <= budget:
        assert plan.skipped == []  # nothing is dropped when everything fits


@settings(max_examples=300, deadline=None)
@given(problems())
def test_no_plan_is_slower_than_the_cpu_lane_alone(problem):
    expert_tokens, holders, costs, budget, fetchable = problem
    plan = plan_layer(expert_tokens, holders, costs, budget, False, fetchable)
    assert plan.critical_us <= cpu_only_us(expert_tokens, costs["cpu0"]) + 1e-6


def test_misses_go_to_the_cheapest_tier():
    cpu = TierCost("cpu", "cpu", 0.0, 400.0, 0.0, 0.0, math.inf, 1)
    vram = TierCost("vram", "vram", 0.0, 50.0, 0.0, 0.0, 100.0, 1)
    plan = plan_layer({1: 1, 2: 1}, {"cpu": frozenset(range(E)), "vram": frozenset({1})}, {"cpu": cpu, "vram": vram}, 1000.0,
                      fetchable={"vram": frozenset({2})})
    assert plan.assign == {"vram": [1, 2]} and plan.fetch == {"vram": [2]}  # 50 + 150 < 400
    slow_link = TierCost("vram", "vram", 0.0, 50.0, 0.0, 0.0, 1000.0, 1)
    plan = plan_layer({1: 1, 2: 1}, {"cpu": frozenset(range(E)), "vram": frozenset({1})}, {"cpu": cpu, "vram": slow_link}, 1000.0,
                      fetchable={"vram": frozenset({2})})
    assert plan.assign == {"vram": [1], "cpu": [2]}


SHARED = PlanCache(limit=64)  # across examples: hits, misses and start-overs


@settings(max_examples=300, deadline=None)
@given(problems(), st.booleans(), st.integers(1, 4), st.integers(0, 3))
def test_the_plan_cache_gives_plan_layers_plans(problem, tail_skip, tokens, shift):
    """Decode-shaped steps (one token count): the memoised plan equals plan_layer's, the first time, the
    second, and for other experts in the same pattern (ids moved apart, order kept)."""
    expert_tokens, holders, costs, budget, fetchable = problem
    expert_tokens = dict.fromkeys(expert_tokens, tokens)
    moved = {e: e * (shift + 1) + shift for e in range(E)}  # increasing: the same pattern in id order
    relabel = lambda experts: frozenset(moved[e] for e in experts)  # noqa: E731
    moved_problem = ({moved[e]: n for e, n in expert_tokens.items()}, {n: relabel(h) for n, h in holders.items()},
                     {n: relabel(f) for n, f in fetchable.items()})
    for step_tokens, step_holders, step_fetchable in ((expert_tokens, holders, fetchable),) * 2 + (moved_problem,):
        want = plan_layer(step_tokens, step_holders, costs, budget, tail_skip, step_fetchable)
        assert SHARED(step_tokens, step_holders, costs, budget, tail_skip, step_fetchable) == want
