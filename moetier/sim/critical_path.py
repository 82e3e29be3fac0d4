"""The per-token critical path of a layout: where a decode pass's time goes, predicted.

A pass runs the parts in sequence; within a part, one GPU timeline and one
CPU-lane timeline (shared by all parts), layer by layer, as the engine does:
trunk work (attention, norms, router, dense MLPs) on the GPU, the embedding,
final norm and lm head once per pass ("head"); dispatch; the
CPU lane starts its misses; the GPU computes its hits; helper GPUs and
remote workers answer after their round trips; the layer ends when every
non-deferred partial is in. DEFER_CPU lets a layer's CPU partial land after
the next layer's attention where the engine's rule does (moetier.sched.defer:
never across a part boundary, nor into a linear-attention layer unless
`defer_into_linear`). A pass verifies
`tokens_per_pass` tokens (multi-token prediction) over `rows_per_pass` token
rows (1 + drafts; default: one row per token); per-token figures divide the
pass by the tokens. Besides the categories, a prediction keeps each part's
wall time and each tier's busy time (the CPU lane's load, even when hidden).
Costs come from the same `TierCost` model the runtime plans
with, so predictions and `moetier run --layout` share categories and numbers.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Collection, Mapping, Sequence

from moetier.sched.cost import Calibration, TierCost
from moetier.sched.defer import deferred_layers


@dataclass(frozen=True)
class TierLoad:
    """Expected work one tier does for one MoE layer in one pass."""

    experts: float  # distinct experts computed
    pairs: float  # (token, expert) pairs, >= experts
    uploads: float = 0.0  # experts fetched over the link on the critical path (vram)


@dataclass(frozen=True)
class PartSpec:
    name: str
    layers: Sequence[int]


@dataclass
class PassPrediction:
    ms_per_token: dict[str, float] = field(default_factory=dict)
    pass_ms: float = 0.0
    tokens_per_pass: float = 1.0
    part_ms_per_token: dict[str, float] = field(default_factory=dict)  # wall time inside each part
    busy_ms_per_token: dict[str, float] = field(default_factory=dict)  # tier name -> time it computes or waits on its link

    @property
    def tok_per_s(self) -> float:
        return 1e3 * self.tokens_per_pass / self.pass_ms if self.pass_ms > 0 else float("inf")

    @property
    def token_ms(self) -> float:
        return self.pass_ms / self.tokens_per_pass


def predict_pass(
    parts: Sequence[PartSpec],
    moe_layers: Sequence[int],
    loads: Mapping[int, Mapping[str, TierLoad]],
    costs: Mapping[str, TierCost],
    calibration: Calibration,
    defer_cpu: int = 0,
    tokens_per_pass: float = 1.0,
    part_attention_us: Mapping[str, float] | None = None,
    rows_per_pass: float | None = None,
    linear_layers: Collection[int] = (),
    defer_into_linear: bool = False,
) -> PassPrediction:
    """loads: MoE layer -> tier name -> its expected load in one pass. Returns ms per token by category.
    linear_layers: the model's linear-attention layers, which DEFER_CPU defers into only with defer_into_linear."""
    moe = set(moe_layers)
    deferred = deferred_layers(defer_cpu, [part.layers for part in parts], linear_layers, defer_into_linear)
    rows = tokens_per_pass if rows_per_pass is None else rows_per_pass
    spent: dict[str, float] = defaultdict(float)
    busy_us: dict[str, float] = defaultdict(float)
    part_us: dict[str, float] = {}
    clock = 0.0  # the pass's wall clock: parts run one after another
    lane_free = 0.0  # when the CPU lane is free
    for index, part in enumerate(parts):
        attention_us = (part_attention_us or {}).get(part.name, calibration.attention_us_per_layer)
        pending = None  # when the deferred CPU partial of the previous layer lands
        part_start = clock
        for layer in part.layers:
            clock += attention_us
            spent["attention"] += attention_us
            if pending is not None:
                wait = max(0.0, pending - clock)
                spent[f"cpu lane wait (part {index})"] += wait
                clock += wait
                pending = None
            if layer not in moe:
                continue
            clock += calibration.dispatch_us_per_layer
            spent["dispatch"] += calibration.dispatch_us_per_layer
            start = lane_done = clock  # every tier is handed its work now; the GPU's own comes last
            replies, gpu_busy = [], 0.0
            for name, load in loads.get(layer, {}).items():
                cost = costs[name]
                busy = cost.call_us(load.experts, load.pairs, rows, load.uploads)
                if busy <= 0:
                    continue
                busy_us[name] += busy
                if cost.kind == "cpu":
                    lane_done = max(start, lane_free) + busy
                    lane_free = lane_done
                elif cost.kind == "vram":  # the GPU itself: hits now, fetched misses after their upload
                    upload = cost.upload_us(load.uploads)
                    spent["gpu experts"] += busy - upload
                    spent["transfers"] += upload
                    gpu_busy += busy
                else:
                    replies.append((cost.kind, start + busy))
            clock += gpu_busy
            # helper GPUs and remote workers started with the lane; wait for their answers now
            for kind, done in replies:
                wait = max(0.0, done - clock)
                spent["remote" if kind == "remote" else "gpu experts"] += wait
                clock += wait
            if layer in deferred:
                pending = lane_done
            else:
                wait = max(0.0, lane_done - clock)
                spent[f"cpu lane wait (part {index})"] += wait
                clock += wait
        part_us[part.name] = clock - part_start
    clock += calibration.head_us
    spent["head"] += calibration.head_us
    prediction = PassPrediction(tokens_per_pass=tokens_per_pass, pass_ms=clock / 1e3)
    prediction.ms_per_token = {name: value / 1e3 / tokens_per_pass for name, value in sorted(spent.items())}
    prediction.part_ms_per_token = {name: value / 1e3 / tokens_per_pass for name, value in part_us.items()}
    prediction.busy_ms_per_token = {name: value / 1e3 / tokens_per_pass for name, value in sorted(busy_us.items())}
    return prediction
