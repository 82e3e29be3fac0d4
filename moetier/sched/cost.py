"""The cost model: what serving experts on each tier costs, in microseconds.

One `TierCost` per tier, built from the layout (links, threads, slots) and
from calibrated rates (`Calibration`, written by `moetier calibrate`). The
runtime scheduler and the simulator read the same numbers, so a prediction
and a measurement can be compared line by line. Expert math at batch 1 is
bound by streaming the expert's weights, so compute is modelled per expert
plus per (token, expert) pair; links cost half a round trip plus bytes over
the rate.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from moetier.config import ConfigError, Layout, TierConfig


@dataclass(frozen=True)
class Calibration:
    """Rates measured on one machine (defaults are conservative guesses for an uncalibrated layout)."""

    cpu_us_per_expert: float = 400.0  # one expert at one token on one CPU-lane thread
    cpu_us_per_token_expert: float = 5.0  # each further token row through the same expert
    gpu_us_per_expert: float = 60.0  # one expert at one token on a GPU (or its CPU emulation)
    gpu_us_per_token_expert: float = 1.0
    attention_us_per_layer: float = 150.0  # trunk work per layer: norms, attention, router, dense MLPs
    head_us: float = 500.0  # embedding, final norm, lm head
    dispatch_us_per_layer: float = 30.0  # router + scheduler + dispatch bookkeeping
    cpu_lane_fixed_us: float = 30.0  # per CPU-lane call: handing the lane its work, waking it, its Python around the math
    remote_extra_us: float = 0.0  # per remote call beyond its link's round trip (framing, Python at both ends; < 0: less)
    expert_bytes: int = 0  # stored bytes one expert of the calibrated model takes in a tier (Checkpoint.expert_nbytes)
    machine: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        path = Path(path)
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ValueError(f"{path}: no calibration file (run `moetier calibrate` to write one)") from None
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: not valid JSON ({err.msg})") from None
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"{path}: unknown key {sorted(unknown)[0]!r} (expected calibration fields: {', '.join(sorted(known))})")
        return cls(**raw)

    @classmethod
    def for_layout(cls, layout: Layout) -> "Calibration":
        """The calibration a layout names under [scheduler].calibration, else the defaults; a bad file is a ConfigError."""
        if not layout.scheduler.calibration:
            return cls()
        try:
            return cls.load(layout.relative(layout.scheduler.calibration))
        except ValueError as err:
            raise ConfigError(f"{layout.path}: [scheduler].calibration: {err}") from None


@dataclass(frozen=True)
class TierCost:
    name: str
    kind: str
    fixed_us: float  # per call: dispatch, a round trip for helper / remote
    us_per_expert: float
    us_per_token_expert: float
    hidden_us_per_token: float  # shipping one token's hidden state there and its partial back
    fetch_us: float  # vram: uploading one missed expert over the link (inf: cannot fetch)
    lanes: int  # experts computed concurrently (1: a call's experts run one after another, each on all its threads)

    def compute_us(self, experts: float, pairs: float) -> float:
        """Compute time of `experts` distinct experts over `pairs` (token, expert) pairs in one call: the one
        per-expert formula the planner, `serve_us` and the simulator's critical path all use."""
        return (self.us_per_expert * experts + self.us_per_token_expert * max(0.0, pairs - experts)) / self.lanes

    def expert_us(self, tokens: int) -> float:
        """Compute time one more expert of `tokens` tokens adds to a call."""
        return self.compute_us(1, tokens)

    def call_us(self, experts: float, pairs: float, rows: float, uploads: float = 0.0) -> float:
        """One call serving `experts` over `pairs`, with `rows` token rows shipped there and back and `uploads`
        experts fetched first (0 when it serves nothing)."""
        if experts <= 0:
            return 0.0
        return self.fixed_us + self.hidden_us_per_token * rows + self.compute_us(experts, pairs) + self.upload_us(uploads)

    def upload_us(self, uploads: float) -> float:
        """Fetching `uploads` missed experts over the link (a tier that cannot fetch adds nothing)."""
        return uploads * self.fetch_us if uploads and self.fetch_us != float("inf") else 0.0

    def serve_us(self, expert_tokens: list[int]) -> float:
        """Time to serve experts with these token counts in one call."""
        return self.call_us(len(expert_tokens), sum(expert_tokens), max(expert_tokens, default=0))


def tier_cost(layout: Layout, tier: TierConfig, calibration: Calibration, expert_bytes: int, hidden_bytes: int) -> TierCost:
    """The cost of one tier of a layout for a model whose experts weigh expert_bytes."""
    link = layout.link(tier.link) if tier.link else None
    inf = float("inf")
    if tier.kind == "cpu":
        # the calibrated rate already uses the lane's torch threads; pool threads only let calls overlap
        return TierCost(tier.name, "cpu", calibration.cpu_lane_fixed_us, calibration.cpu_us_per_expert,
                        calibration.cpu_us_per_token_expert, 0.0, inf, 1)
    if tier.kind == "vram":
        fetch = link.transfer_us(expert_bytes) if link else inf
        return TierCost(tier.name, "vram", 0.0, calibration.gpu_us_per_expert, calibration.gpu_us_per_token_expert, 0.0, fetch, 1)
    # helper and remote: hidden states cross the link both ways, one round trip per call
    ship = 2 * hidden_bytes * 8 / (link.gbps * 1e3) if link else 0.0
    rtt = link.rtt_us if link else 0.0
    if tier.kind == "remote":
        rtt = max(0.0, rtt + calibration.remote_extra_us)
    per_expert = calibration.gpu_us_per_expert if tier.kind == "helper" else calibration.cpu_us_per_expert
    per_token = calibration.gpu_us_per_token_expert if tier.kind == "helper" else calibration.cpu_us_per_token_expert
    return TierCost(tier.name, tier.kind, rtt, per_expert, per_token, ship, inf, 1)
