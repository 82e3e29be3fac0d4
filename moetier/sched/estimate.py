"""What a layout implies before it runs: per-tier slots, bytes and initial residency, and an estimated cost per token.

The estimate uses the same cost model and planner as the runtime: one
expected MoE layer (k picks, of which a share are VRAM hits, estimated from
the profile's mass in the resident set, else slots / experts) is planned
across the layout's tiers; a token costs the trunk (attention per layer plus
the head) plus that layer's critical path per MoE layer. DEFER_CPU overlap
is not credited here; the simulator models it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moetier.config import Layout
from moetier.model import open_checkpoint
from moetier.sched.cost import Calibration, tier_cost
from moetier.sched.plan import plan_layer


def describe_layout(layout: Layout, folder: Path) -> dict:
    """The `layout show` summary of a layout for the model in `folder`."""
    spec = open_checkpoint(folder).spec
    layout.check_model(spec.num_layers, spec.num_experts)
    calibration = Calibration.load(layout.relative(layout.scheduler.calibration)) if layout.scheduler.calibration else Calibration()
    expert_bytes = 3 * spec.hidden_size * spec.moe_intermediate_size * 4
    moe = list(spec.moe_layers)
    tiers, hit_rates = [], []
    for tier in layout.tiers:
        profile = np.load(layout.relative(tier.profile), allow_pickle=False) if tier.profile else None
        if tier.kind == "vram":
            served = [l for p in layout.parts if p.device == tier.device for l in p.layers(spec.num_layers) if spec.is_moe(l)]
        else:
            served = moe
        slots = min(tier.slots or tier.capacity_bytes // max(1, expert_bytes * max(len(served), 1)), spec.num_experts)
        if tier.kind == "cpu":
            slots = spec.num_experts
        coverage = _coverage(profile, slots, spec.num_experts)
        if tier.kind == "vram":
            hit_rates.append(coverage)
            residency = (f"top {slots} by profile ({coverage:.0%} of its mass)" if tier.policy == "static"
                         else f"{'warm from profile' if profile is not None else 'empty'}; {tier.policy} admits on miss")
        elif tier.kind == "cpu":
            residency = "all experts (host RAM)"
        else:
            residency = f"{tier.experts or 'hot'} experts, fixed"
        cost = tier_cost(layout, tier, calibration, expert_bytes, spec.hidden_size * 4)
        where = tier.device or tier.host or "local"
        tiers.append({"name": tier.name, "kind": tier.kind, "where": where, "layers": len(served),
                      "slots_per_layer": slots if tier.kind != "cpu" else None, "bytes": slots * len(served) * expert_bytes,
                      "policy": tier.policy if tier.kind == "vram" else "", "initial_residency": residency,
                      "us_per_expert": cost.us_per_expert, "estimated_hit_rate": coverage if tier.kind == "vram" else None})
    hit_rate = float(np.mean(hit_rates)) if hit_rates else 0.0
    layer_us = _expected_layer_us(layout, calibration, spec.top_k, hit_rate, expert_bytes, spec.hidden_size * 4)
    trunk_us = calibration.attention_us_per_layer * spec.num_layers + calibration.head_us
    moe_us = (layer_us + calibration.dispatch_us_per_layer) * len(moe)
    total_ms = (trunk_us + moe_us) / 1e3
    return {"layout": str(layout.path), "model": str(folder), "calibration": layout.scheduler.calibration or "defaults",
            "tiers": tiers, "per_token": {"ms": total_ms, "tok_per_s": 1e3 / total_ms, "trunk_ms": trunk_us / 1e3,
                                          "moe_ms": moe_us / 1e3, "hit_rate": hit_rate}}


def _coverage(profile: np.ndarray | None, slots: int, experts: int) -> float:
    """Share of router mass the top `slots` experts hold, averaged over layers (slots / experts without a profile)."""
    if profile is None:
        return slots / experts
    mass = np.sort(profile, axis=1)[:, ::-1]  # [L, E] descending
    return float(np.mean(mass[:, :slots].sum(axis=1) / np.maximum(mass.sum(axis=1), 1e-12)))


def _expected_layer_us(layout: Layout, calibration: Calibration, k: int, hit_rate: float, expert_bytes: int, hidden_bytes: int) -> float:
    hits = int(round(hit_rate * k))
    holders, costs = {}, {}
    for tier in layout.tiers:
        costs[tier.name] = tier_cost(layout, tier, calibration, expert_bytes, hidden_bytes)
        if tier.kind == "vram":
            holders[tier.name] = frozenset(range(hits))
        elif tier.kind == "cpu":
            holders[tier.name] = frozenset(range(k))
        else:
            holders[tier.name] = frozenset()
    plan = plan_layer({e: 1 for e in range(k)}, holders, costs, layout.scheduler.budget_us, layout.scheduler.tail_skip, fetchable={})
    return plan.critical_us
