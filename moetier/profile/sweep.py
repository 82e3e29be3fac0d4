"""`moetier sweep`: the quality dial measured: KL, hit rate and speed per arm, over one layout.

Arms: the plain router (run twice: the second run is the KL floor), one static
table per cap (kind graded by default, hot set = the layout's VRAM slots per
layer), and live-cache affinity per lambda. Every arm gets a fresh runtime of
the layout and decodes every request teacher-forced, one token at a time, as
real decode does (affinity is decode-only), with the VRAM cache carried from
request to request. KL is against the plain all-resident model; hit rate is
VRAM hits / picks from the runtime's counters; tok/s is decode steps over the
time in forward. Arms override the layout's [router] settings. Outputs:
sweep.md (table), sweep.json, kl_vs_hit_rate.png and tok_s_vs_kl.png, and the
tables used under tables/.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moetier.model.output import new_file
from moetier.profile.kl import kl_per_position, reference_logits, stepwise_logits
from moetier.profile.sessions import Request


@dataclass
class Arm:
    name: str
    method: str  # plain | table | affinity
    value: float  # the cap of a table arm, lambda of an affinity arm, 0 for plain
    kl: float = 0.0  # mean KL(plain || arm), nats per position
    top1_agreement: float = 1.0
    hit_rate: float = 0.0
    decode_tok_per_s: float = 0.0
    kl_per_phase: dict[str, float] = field(default_factory=dict)


@dataclass
class SweepResult:
    model: str
    layout: str
    kind: str
    hot: int
    positions: int
    floor_kl: float
    arms: list[Arm]

    def curve(self, method: str) -> list[Arm]:
        """The plain arm and a method's arms, by rising KL."""
        return sorted([a for a in self.arms if a.method in ("plain", method)], key=lambda a: a.kl)

    def to_dict(self) -> dict:
        return asdict(self) | {"equal_kl": equal_kl_rows(self)}


def hit_rate_at(curve: Sequence[Arm], kl: float) -> float:
    """Hit rate interpolated linearly along a curve of arms (sorted by KL) at a given KL."""
    kls = np.maximum.accumulate([a.kl for a in curve])  # a curve is read as non-decreasing in KL
    return float(np.interp(kl, kls, [a.hit_rate for a in curve]))


def equal_kl_rows(result: SweepResult) -> list[dict]:
    """At each table arm's KL inside the affinity curve's range: both methods' hit rates."""
    table, affinity = result.curve("table"), result.curve("affinity")
    if len(table) < 2 or len(affinity) < 2:
        return []
    top = max(a.kl for a in affinity)
    return [{"kl": arm.kl, "table_hit_rate": arm.hit_rate, "affinity_hit_rate": hit_rate_at(affinity, arm.kl)}
            for arm in table if arm.method == "table" and arm.kl <= top]


def _vram_hit_rate(executor) -> float:
    vram = [t for t in executor.tiers if t.kind == "vram"]
    hits = sum(executor.counters[t.name].hits for t in vram)
    picks = sum(executor.counters[t.name].picks for t in vram)
    return hits / picks if picks else 0.0


def _run_arm(checkpoint, layout, requests, table_path, affinity, on_step) -> tuple[list[np.ndarray], float, float]:
    """(logits per request, VRAM hit rate, decode tok/s) of one arm over a fresh runtime."""
    from moetier.engine.runtime import build_runtime
    from moetier.engine.router_bias import apply_router_options

    runtime = build_runtime(layout, checkpoint)
    try:
        runtime.engine.set_router_bias(None)
        apply_router_options(runtime.engine, table_path, affinity, "selection", False)
        logits, seconds, steps = [], 0.0, 0
        for request in requests:
            rows, spent = stepwise_logits(runtime.engine, request.ids)
            logits.append(rows)
            seconds, steps = seconds + spent, steps + len(request.ids)
            if on_step is not None:
                on_step(request)
        return logits, _vram_hit_rate(runtime.executor), steps / seconds if seconds > 0 else 0.0
    finally:
        runtime.close()


def vram_slots(layout, checkpoint) -> int:
    """Expert slots per layer of the layout's first VRAM tier (the natural hot-set size), as the runtime places them."""
    from moetier.sched.placement import ModelShape, place

    vram = [placed for placed in place(layout, ModelShape.from_checkpoint(checkpoint)).values() if placed.kind == "vram"]
    if not vram:
        raise ValueError(f"{layout.path}: the layout has no vram tier (a sweep measures the hit rate of its cache)")
    return vram[0].slots


def run_sweep(checkpoint, requests: Sequence[Request], layout_path: Path, caps: Sequence[float], lambdas: Sequence[float],
              out_dir: Path, profile=None, hot: int | None = None, kind: str = "graded",
              on_step: Callable[[Request], None] | None = None) -> SweepResult:
    """Run every arm; write the tables it builds under out_dir/tables. See the module docstring."""
    from moetier.config import load_layout
    from moetier.engine import Engine
    from moetier.profile.bias import build_table
    from moetier.profile.brightness import ProfileError, profile_requests

    layout = load_layout(layout_path)
    hot = hot if hot is not None else vram_slots(layout, checkpoint)
    if profile is None:
        profile = profile_requests(Engine(checkpoint), requests)
    elif profile.model_fingerprint != checkpoint.fingerprint:
        raise ProfileError(f"the profile was made for model {profile.model_fingerprint}, this model is {checkpoint.fingerprint}")
    tables = Path(out_dir) / "tables"
    reference = reference_logits(checkpoint, requests)
    phases = np.concatenate([np.full(len(r.ids), r.phase, dtype=object) for r in requests])  # [N]

    def measure(arm: Arm, logits: list[np.ndarray]) -> None:
        kl = np.concatenate([kl_per_position(r, c) for r, c in zip(reference, logits)])  # [N]
        arm.kl = float(kl.mean())
        arm.top1_agreement = float(np.mean(np.concatenate([r.argmax(-1) == c.argmax(-1) for r, c in zip(reference, logits)])))
        arm.kl_per_phase = {p: float(kl[phases == p].mean()) for p in dict.fromkeys(phases.tolist())}

    plain = Arm("plain", "plain", 0.0)
    first, plain.hit_rate, _ = _run_arm(checkpoint, layout, requests, None, None, on_step)
    second, _, plain.decode_tok_per_s = _run_arm(checkpoint, layout, requests, None, None, on_step)  # warm timings
    measure(plain, first)
    floor = float(np.concatenate([kl_per_position(a, b) for a, b in zip(first, second)]).mean())
    arms = [plain]
    for cap in caps:
        path = build_table(profile, hot, kind, cap).save(tables / f"{kind}-hot{hot}-cap{cap:g}.safetensors")
        arm = Arm(f"table {kind} cap {cap:g}", "table", float(cap))
        logits, arm.hit_rate, arm.decode_tok_per_s = _run_arm(checkpoint, layout, requests, path, None, on_step)
        measure(arm, logits)
        arms.append(arm)
    for lam in lambdas:
        arm = Arm(f"affinity {lam:g}", "affinity", float(lam))
        logits, arm.hit_rate, arm.decode_tok_per_s = _run_arm(checkpoint, layout, requests, None, lam, on_step)
        measure(arm, logits)
        arms.append(arm)
    return SweepResult(str(checkpoint.folder), str(layout_path), kind, hot, int(len(phases)), floor, arms)


def markdown(result: SweepResult) -> str:
    lines = [f"Sweep of `{Path(result.model).name}` over `{Path(result.layout).name}`: {result.positions} positions "
             f"decoded teacher-forced per arm; tables {result.kind}, hot set {result.hot} experts per layer.", "",
             "| arm | cap / lambda | KL (nats/token) | top-1 agreement | VRAM hit rate | decode tok/s |",
             "|---|---:|---:|---:|---:|---:|"]
    for arm in result.arms:
        value = "-" if arm.method == "plain" else f"{arm.value:g}"
        lines.append(f"| {arm.name} | {value} | {arm.kl:.4g} | {arm.top1_agreement:.1%} | {arm.hit_rate:.1%} | "
                     f"{arm.decode_tok_per_s:.1f} |")
    lines += ["", f"Run-to-run floor (the plain arm twice): KL {result.floor_kl:.2g} nats/token."]
    rows = equal_kl_rows(result)
    if rows:
        lines += ["", "At equal KL (affinity interpolated along its curve):", "",
                  "| KL | static table hit rate | affinity hit rate |", "|---:|---:|---:|"]
        lines += [f"| {r['kl']:.4g} | {r['table_hit_rate']:.1%} | {r['affinity_hit_rate']:.1%} |" for r in rows]
    return "\n".join(lines) + "\n"


def plot(result: SweepResult, out_dir: Path) -> list[Path]:
    """kl_vs_hit_rate.png and tok_s_vs_kl.png (matplotlib, Agg: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for name, y_key, y_label in (("kl_vs_hit_rate.png", "hit_rate", "VRAM hit rate"),
                                 ("tok_s_vs_kl.png", "decode_tok_per_s", "decode tok/s")):
        figure, axes = plt.subplots(figsize=(6, 4), dpi=110)
        for method, marker, label in (("table", "o", f"static table ({result.kind})"), ("affinity", "s", "live-cache affinity")):
            curve = result.curve(method)
            axes.plot([a.kl for a in curve], [getattr(a, y_key) for a in curve], marker=marker, label=label)
            for arm in curve[1:] if len(curve) > 1 else []:
                axes.annotate(f"{arm.value:g}", (arm.kl, getattr(arm, y_key)), textcoords="offset points", xytext=(4, 4), fontsize=7)
        plain = next(a for a in result.arms if a.method == "plain")
        axes.plot([plain.kl], [getattr(plain, y_key)], "k*", markersize=10, label="plain router")
        axes.axvline(result.floor_kl, color="grey", linestyle=":", linewidth=1, label="run-to-run floor")
        axes.set_xlabel("KL(plain || arm), nats per token")
        axes.set_ylabel(y_label)
        if y_key == "hit_rate":
            axes.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        axes.set_title(f"{Path(result.model).name}: {y_label} vs KL", fontsize=10)
        axes.grid(alpha=0.3)
        axes.legend(fontsize=8)
        figure.tight_layout()
        path = Path(out_dir) / name
        with new_file(path, path.suffix) as partial:  # each file whole or not at all
            figure.savefig(partial)
        plt.close(figure)
        paths.append(path)
    return paths


def write_outputs(result: SweepResult, out_dir: Path) -> list[Path]:
    out_dir = Path(out_dir)
    for name, text in (("sweep.md", markdown(result)), ("sweep.json", json.dumps(result.to_dict(), indent=2) + "\n")):
        with new_file(out_dir / name) as partial:  # each file whole or not at all
            partial.write_text(text)
    return [out_dir / "sweep.md", out_dir / "sweep.json", *plot(result, out_dir)]
