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
from moetier.sched.cost import Calibration, tier_cost
from moetier.sched.placement import ModelShape, place
from moetier.sched.plan import plan_layer


def describe_layout(layout: Layout, folder: Path) -> dict:
    """The `layout show` summary of a layout for the model at `folder` (a HF folder or a GGUF file: its headers are
    all it reads)."""
    from moetier.model.checkpoint import open_checkpoint  # the headers only, but the readers import torch

    checkpoint = open_checkpoint(folder)
    spec = checkpoint.spec
    shape = ModelShape.from_checkpoint(checkpoint)
    calibration = Calibration.for_layout(layout)
    tiers, hit_rates = [], []
    for name, placed in place(layout, shape).items():
        tier = placed.config
        coverage = _coverage(placed.profile, placed.slots, spec.num_experts)
        if tier.kind == "vram":
            hit_rates.append(coverage)
            residency = (f"top {placed.slots} by profile ({coverage:.0%} of its mass)" if tier.policy == "static"
                         else f"{'warm from profile' if placed.profile is not None else 'empty'}; {tier.policy} admits on miss")
        elif tier.kind == "cpu":
            residency = "all experts (host RAM)"
        else:
            residency = f"{tier.experts or ('all' if tier.kind == 'remote' else 'hot')} experts, fixed"
        cost = tier_cost(layout, tier, calibration, shape.expert_bytes, shape.hidden_bytes)
        tiers.append({"name": name, "kind": tier.kind, "where": tier.device or tier.host or "local", "layers": len(placed.layers),
                      "slots_per_layer": placed.slots if tier.kind != "cpu" else None, "bytes": placed.bytes,
                      "policy": tier.policy if tier.kind == "vram" else "", "initial_residency": residency,
                      "us_per_expert": cost.us_per_expert, "estimated_hit_rate": coverage if tier.kind == "vram" else None})
    hit_rate = float(np.mean(hit_rates)) if hit_rates else 0.0
    layer_us = _expected_layer_us(layout, calibration, spec.top_k, hit_rate, shape)
    trunk_us = calibration.attention_us_per_layer * spec.num_layers + calibration.head_us
    moe_us = (layer_us + calibration.dispatch_us_per_layer) * len(shape.moe_layers)
    total_ms = (trunk_us + moe_us) / 1e3
    formats = sorted({checkpoint.expert_format(layer) for layer in spec.moe_layers})
    return {"layout": str(layout.path), "model": str(folder), "calibration": layout.scheduler.calibration or "defaults",
            "expert_formats": ", ".join(formats), "expert_bytes": shape.expert_bytes,
            "tiers": tiers, "per_token": {"ms": total_ms, "tok_per_s": 1e3 / total_ms, "trunk_ms": trunk_us / 1e3,
                                          "moe_ms": moe_us / 1e3, "hit_rate": hit_rate}}


def _coverage(profile: np.ndarray | None, slots: int, experts: int) -> float:
    """Share of router mass the top `slots` experts hold, averaged over layers (slots / experts without a profile)."""
    if profile is None:
        return slots / experts
    mass = np.sort(profile, axis=1)[:, ::-1]  # [L, E] descending
    return float(np.mean(mass[:, :slots].sum(axis=1) / np.maximum(mass.sum(axis=1), 1e-12)))


def _expected_layer_us(layout: Layout, calibration: Calibration, k: int, hit_rate: float, shape: ModelShape) -> float:
    hits = int(round(hit_rate * k))
    holders, costs = {}, {}
    for tier in layout.tiers:
        costs[tier.name] = tier_cost(layout, tier, calibration, shape.expert_bytes, shape.hidden_bytes)
        if tier.kind == "vram":
            holders[tier.name] = frozenset(range(hits))
        elif tier.kind == "cpu":
            holders[tier.name] = frozenset(range(k))
        else:
            holders[tier.name] = frozenset()
    plan = plan_layer({e: 1 for e in range(k)}, holders, costs, layout.scheduler.budget_us, layout.scheduler.tail_skip, fetchable={})
    return plan.critical_us
