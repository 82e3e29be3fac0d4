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
    plan = LayerPlan()
    finish: dict[str, float] = {}
    tokens_on: dict[str, int] = {}
    if fetchable is None:
        everything = frozenset(expert_tokens)
        fetchable = {name: everything for name, cost in costs.items() if cost.fetch_us != float("inf")}
    for expert in sorted(expert_tokens, key=lambda e: (-expert_tokens[e], e)):
        tokens = expert_tokens[expert]
        options: list[tuple[float, int, str, bool]] = []
        held_somewhere = False
        for name, held in holders.items():
            if expert in held:
                options.append((_finish_after(costs[name], finish, tokens_on, tokens, fetch=False), KIND_ORDER[costs[name].kind], name, False))
                held_somewhere |= costs[name].kind != "cpu"
        for name, may_fetch in fetchable.items():
            if expert in may_fetch and expert not in holders.get(name, frozenset()):
                options.append((_finish_after(costs[name], finish, tokens_on, tokens, fetch=True), KIND_ORDER[costs[name].kind], name, True))
        if not options:
            raise ValueError(f"expert {expert}: no tier holds it and none can fetch it (a layout needs a cpu tier)")
        done_us, _, name, fetch = min(options)
        if tail_skip and done_us > budget_us and not held_somewhere:
            plan.skipped.append(expert)
            continue
        finish[name] = done_us
        tokens_on[name] = max(tokens_on.get(name, 0), tokens)
        plan.assign.setdefault(name, []).append(expert)
        if fetch:
            plan.fetch.setdefault(name, []).append(expert)
    plan.finish_us = finish
    return plan


def _finish_after(cost: TierCost, finish: dict[str, float], tokens_on: dict[str, int], tokens: int, fetch: bool) -> float:
    """The tier's finish time if it also served this expert (first use pays the fixed cost)."""
    start = finish.get(cost.name)
    if start is None:
        start = cost.fixed_us
    extra_tokens = max(0, tokens - tokens_on.get(cost.name, 0))
    work = (cost.us_per_expert + cost.us_per_token_expert * (tokens - 1)) / cost.lanes
    return start + work + cost.hidden_us_per_token * extra_tokens + (cost.fetch_us if fetch else 0.0)


def cpu_only_us(expert_tokens: Mapping[int, int], cpu: TierCost) -> float:
    """The reference plan every plan must match or beat: everything on the CPU lane."""
    return cpu.serve_us(list(expert_tokens.values()))


__all__: Sequence[str] = ["LayerPlan", "cpu_only_us", "plan_layer"]
