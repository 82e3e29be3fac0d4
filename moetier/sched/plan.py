"""The per-layer plan: which tier serves each picked expert, under the layer's budget.

Greedy list scheduling over tiers that run in parallel: experts in order of
decreasing token count; each goes to the option (a tier that holds it, or a
VRAM tier that fetches it over its link) whose finish time after taking it is
earliest. Guarantees: every picked expert is served exactly once, by a tier
that holds it or fetches it; no plan is slower (in the cost model) than
sending every expert to the CPU lane; with `tail_skip` a miss that cannot
finish inside the budget is dropped (lossy), never a hit.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from moetier.sched.cost import TierCost

KIND_ORDER = {"vram": 0, "helper": 1, "remote": 2, "cpu": 3}  # tie-break: the fastest kind first


@dataclass
class LayerPlan:
    assign: dict[str, list[int]] = field(default_factory=dict)  # tier -> experts it computes
    fetch: dict[str, list[int]] = field(default_factory=dict)  # vram tier -> experts uploaded before computing
    skipped: list[int] = field(default_factory=list)
    finish_us: dict[str, float] = field(default_factory=dict)  # predicted finish time per tier

    @property
    def critical_us(self) -> float:
        return max(self.finish_us.values(), default=0.0)


def plan_layer(
    expert_tokens: Mapping[int, int],
    holders: Mapping[str, frozenset[int]],
    costs: Mapping[str, TierCost],
    budget_us: float,
    tail_skip: bool = False,
    fetchable: Mapping[str, frozenset[int]] | None = None,
) -> LayerPlan:
    """expert -> tokens routed to it; tier -> experts it holds now; tier -> cost; vram tier -> experts it
    may fetch now (None: any expert, on every tier with a finite fetch cost). See module docstring."""
    if fetchable is None:
        everything = frozenset(expert_tokens)
        fetchable = {name: everything for name, cost in costs.items() if cost.fetch_us != float("inf")}
    # One row per way to serve an expert: (tier, experts, experts it must not fetch (held) or None,
    # fetch cost, kind rank, fast kind?, cost); a way with no experts now is left out.
    ways = [(name, held, None, 0.0, KIND_ORDER[costs[name].kind], costs[name].kind != "cpu", costs[name])
            for name, held in holders.items() if held]
    ways += [(name, fetchable[name], holders.get(name, frozenset()), costs[name].fetch_us, KIND_ORDER[costs[name].kind], False, costs[name])
             for name in fetchable if fetchable[name]]
    finish: dict[str, float] = {}  # tiers in use -> predicted finish time
    tokens_on: dict[str, int] = {}  # tiers in use -> the most tokens of one expert there (hidden states shipped)
    assign: dict[str, list[int]] = {}
    fetch: dict[str, list[int]] = {}
    skipped: list[int] = []
    uniform = len(set(expert_tokens.values())) == 1  # decode: every expert serves the one token
    order = sorted(expert_tokens) if uniform else sorted(expert_tokens, key=lambda e: (-expert_tokens[e], e))
    for expert in order:
        tokens = expert_tokens[expert]
        done = best_key = name = fetched = None  # the earliest finish; ties: the faster kind, then the name
        held_somewhere = False
        for way_name, members, resident, fetch_us, rank, fast, cost in ways:
            if expert not in members or (resident is not None and expert in resident):
                continue  # not here, or already resident: served as a hit, not fetched
            held_somewhere |= fast
            start = finish.get(way_name)
            way_done = (cost.fixed_us if start is None else start) + fetch_us + cost.expert_us(tokens)
            shipped = tokens_on.get(way_name, 0)
            if tokens > shipped:
                way_done += cost.hidden_us_per_token * (tokens - shipped)
            if done is None or way_done < done or (way_done == done and (rank, way_name) < best_key):
                done, best_key, name, fetched = way_done, (rank, way_name), way_name, resident is not None
        if done is None:
            raise ValueError(f"expert {expert}: no tier holds it and none can fetch it (a layout needs a cpu tier)")
        if tail_skip and done > budget_us and not held_somewhere:
            skipped.append(expert)
            continue
        finish[name] = done
        tokens_on[name] = max(tokens_on.get(name, 0), tokens)
        assign.setdefault(name, []).append(expert)
        if fetched:
            fetch.setdefault(name, []).append(expert)
    return LayerPlan(assign, fetch, skipped, finish)


class PlanCache:
    """plan_layer, memoised for steps whose experts all have the same token count (decode).

    Such a plan depends on the experts only through which ways may serve each of them, taken in
    ascending id order (ties between ways never look at ids), so steps with the same pattern of
    eligibility share one plan, kept as positions in that order. Returns exactly plan_layer's
    LayerPlan; steps with unequal token counts, or no `fetchable`, are planned each time. Keeps at
    most `limit` patterns (then starts over). A cost table is keyed by identity: one changed in
    place must not be passed again (the runtime's never change).
    """

    def __init__(self, limit: int = 1 << 14):
        self.limit = limit
        self._plans: dict[tuple, tuple] = {}
        self._costs: dict[int, Mapping[str, TierCost]] = {}  # keeps each keyed cost table alive (its id stays unique)

    def __call__(self, expert_tokens: Mapping[int, int], holders: Mapping[str, frozenset[int]], costs: Mapping[str, TierCost],
                 budget_us: float, tail_skip: bool = False, fetchable: Mapping[str, frozenset[int]] | None = None) -> LayerPlan:
        counts = set(expert_tokens.values())
        if len(counts) != 1 or fetchable is None:
            return plan_layer(expert_tokens, holders, costs, budget_us, tail_skip, fetchable)
        order = sorted(expert_tokens)
        key = (id(costs), budget_us, tail_skip, counts.pop(),
               tuple((name, tuple(map(held.__contains__, order))) for name, held in holders.items() if held),
               tuple((name, tuple(map((ways - holders.get(name, frozenset())).__contains__, order)))
                     for name, ways in fetchable.items() if ways))
        known = self._plans.get(key)
        if known is None:
            plan = plan_layer(expert_tokens, holders, costs, budget_us, tail_skip, fetchable)
            if len(self._plans) >= self.limit:
                self._plans.clear()
                self._costs.clear()
            at = {expert: i for i, expert in enumerate(order)}
            positions = lambda table: {name: [at[e] for e in experts] for name, experts in table.items()}  # noqa: E731
            self._plans[key] = (positions(plan.assign), positions(plan.fetch), [at[e] for e in plan.skipped], plan.finish_us)
            self._costs[id(costs)] = costs
            return plan
        assign, fetch, skipped, finish = known
        return LayerPlan({name: [order[i] for i in at] for name, at in assign.items()},
                         {name: [order[i] for i in at] for name, at in fetch.items()}, [order[i] for i in skipped], dict(finish))


def cpu_only_us(expert_tokens: Mapping[int, int], cpu: TierCost) -> float:
    """The reference plan every plan must match or beat: everything on the CPU lane."""
    return cpu.serve_us(list(expert_tokens.values()))


__all__: Sequence[str] = ["LayerPlan", "PlanCache", "cpu_only_us", "plan_layer"]
