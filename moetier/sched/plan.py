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

    def tier_of(self) -> dict[int, str]:
        return {e: tier for tier, experts in self.assign.items() for e in experts}


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
    # One row per way to serve an expert: (tier, holds, fetch cost or None, kind rank, fast kind?)
    ways = [(name, held, None, KIND_ORDER[costs[name].kind], costs[name].kind != "cpu") for name, held in holders.items()]
    ways += [(name, fetchable[name], costs[name].fetch_us, KIND_ORDER[costs[name].kind], False) for name in fetchable]
    finish = {name: None for name in costs}  # None: the tier is not used yet
    tokens_on = dict.fromkeys(costs, 0)
    assign: dict[str, list[int]] = {}
    fetch: dict[str, list[int]] = {}
    skipped: list[int] = []
    order = sorted(expert_tokens, key=lambda e: (-expert_tokens[e], e)) if len(set(expert_tokens.values())) > 1 else sorted(expert_tokens)
    for expert in order:
        tokens = expert_tokens[expert]
        best = None
        held_somewhere = False
        for name, members, fetch_us, rank, fast in ways:
            if expert not in members:
                continue
            if fetch_us is not None and expert in holders.get(name, ()):
                continue  # already resident: served as a hit, not fetched
            held_somewhere |= fast
            cost = costs[name]
            start = finish[name]
            done = (cost.fixed_us if start is None else start) + (cost.us_per_expert + cost.us_per_token_expert * (tokens - 1)) / cost.lanes
            if tokens > tokens_on[name]:
                done += cost.hidden_us_per_token * (tokens - tokens_on[name])
            if fetch_us is not None:
                done += fetch_us
            if best is None or (done, rank, name) < best[:3]:
                best = (done, rank, name, fetch_us is not None)
        if best is None:
            raise ValueError(f"expert {expert}: no tier holds it and none can fetch it (a layout needs a cpu tier)")
        done, _, name, fetched = best
        if tail_skip and done > budget_us and not held_somewhere:
            skipped.append(expert)
            continue
        finish[name] = done
        tokens_on[name] = max(tokens_on[name], tokens)
        assign.setdefault(name, []).append(expert)
        if fetched:
            fetch.setdefault(name, []).append(expert)
    return LayerPlan(assign, fetch, skipped, {name: value for name, value in finish.items() if value is not None})


def cpu_only_us(expert_tokens: Mapping[int, int], cpu: TierCost) -> float:
    """The reference plan every plan must match or beat: everything on the CPU lane."""
    return cpu.serve_us(list(expert_tokens.values()))


__all__: Sequence[str] = ["LayerPlan", "cpu_only_us", "plan_layer"]
