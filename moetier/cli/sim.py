"""`moetier simulate`: what a layout would do with a routing trace, before it is built or wired.

Prints the predicted decode
tok/s and where a token's time goes, in the categories `moetier run --layout`
measures (attention, dispatch, gpu experts, cpu lane wait (part N), transfers,
remote, head), per part and per tier; DEFER_CPU defers where the engine would
(not into the shape's linear-attention layers unless defer_into_linear); `--sweep` turns one knob (slots, rtt_us,
lambda); `--plot DIR` draws hit rate vs slots per policy against Belady's
optimum, tok/s vs slots, and tok/s vs the LAN round trip (with a remote tier).
Bad input is one line `moetier: error: ...` and exit 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from moetier.cli.common import console, errors_to_exit


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """"slots=8,16,32" -> ("slots", [8, 16, 32])."""
    from moetier.sim.layout_sim import SWEEPS

    name, _, values = text.partition("=")
    name = name.strip()
    if name not in SWEEPS or not values.strip():
        raise ValueError(f"--sweep {text!r} (expected NAME=V1,V2,... with NAME one of {', '.join(SWEEPS)})")
    try:
        numbers = [float(v) for v in values.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--sweep {text!r}: the values must be numbers") from None
    if not numbers or (name in ("slots", "rtt_us") and min(numbers) < (1 if name == "slots" else 0)):
        raise ValueError(f"--sweep {text!r}: expected {'slots >= 1' if name == 'slots' else 'rtt_us >= 0'}")
    return name, numbers


def resolve_shape(layout, trace, model: Optional[Path], shape: Optional[str], expert_bytes: Optional[int],
                  hidden_bytes: Optional[int], calibration):
    """The model shape: --model (or the layout's model), a named --shape, else the trace plus --expert-bytes."""
    from moetier.sched.placement import ModelShape
    from moetier.sim.layout_sim import SHAPES

    if model is not None or (layout.model and shape is None and expert_bytes is None):
        from moetier.model.checkpoint import open_checkpoint  # the headers only, but the readers import torch

        folder = model or layout.model_path()
        return ModelShape.from_checkpoint(open_checkpoint(folder), str(model or layout.model))
    if shape is not None:
        if shape not in SHAPES:
            raise ValueError(f"--shape {shape!r} is unknown (expected one of {', '.join(SHAPES)}, or --model)")
        return SHAPES[shape]
    size = expert_bytes or calibration.expert_bytes
    if not size:
        raise ValueError("no model shape: give --model, --shape NAME, or --expert-bytes (the rest comes from the trace)")
    layers = tuple(trace.layer_ids)
    return ModelShape(max(layers) + 1, layers, trace.num_experts, trace.top_k, size, hidden_bytes or 0, "from the trace")


def _print(result: dict, out: Console) -> None:
    table = Table("tier", "kind", "slots/layer", "experts/token", "hit rate", "busy ms/token")
    for tier in result["tiers"]:
        rate = f"{tier['hit_rate']:.1%}" if tier["hit_rate"] is not None else "-"
        table.add_row(tier["name"], tier["kind"], str(tier["slots_per_layer"]), f"{tier['experts_per_token']:.1f}", rate,
                      f"{tier['busy_ms_per_token']:.2f}")
    out.print(table)
    times = Table("where a token's time goes (predicted)", "ms/token")
    for category, value in result["ms_per_token"].items():
        times.add_row(category, f"{value:.2f}")
    for part, value in result["part_ms_per_token"].items():
        times.add_row(f"[dim]part {part} (wall)[/dim]", f"[dim]{value:.2f}[/dim]")
    out.print(times)
    out.print(f"predicted decode {result['decode_tok_per_s']:.1f} tok/s ({result['tokens_per_pass']:g} tokens per pass), "
              f"VRAM hit rate {result['hit_rate']:.1%}, skipped {result['skipped_per_token']:.2f} experts/token", highlight=False)
    if result.get("warmup_tokens"):
        out.print(f"[dim]the trace's first {result['warmup_tokens']} tokens warmed the caches (a run's prompt, or --warmup) "
                  "and are not counted[/dim]", highlight=False)
    for note in result["notes"]:
        out.print(f"[dim]note: {note}[/dim]", highlight=False)


def report(layout, simulation) -> dict:
    data = simulation.to_dict()
    data["tiers"] = [{"name": t.name, "kind": t.kind, "slots_per_layer": simulation.slots_per_layer.get(t.name),
                      "experts_per_token": simulation.served_per_token.get(t.name, 0.0),
                      "hit_rate": simulation.tier_hit_rate.get(t.name) if t.kind == "vram" else None,
                      "busy_ms_per_token": simulation.prediction.busy_ms_per_token.get(t.name, 0.0)} for t in layout.tiers]
    return data


def plot(folder: Path, layout, shape, calibration, trace, options: dict, sweeps: dict) -> list[str]:
    """The three pictures; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moetier.sim.layout_sim import hit_rate_curves, sweep

    folder.mkdir(parents=True, exist_ok=True)
    E, k = shape.num_experts, shape.top_k
    grid = sweeps.get("slots") or sorted({max(k, int(round(E * f))) for f in (0.1, 0.15, 0.25, 0.4, 0.6, 0.8, 1.0)})
    written = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for policy, rates in hit_rate_curves(trace, grid, warmup_tokens=options.get("warmup_tokens")).items():
        style = (dict(color="black", linestyle="--", label="Belady (optimum without prefetch)") if policy == "belady"
                 else dict(marker="o", label=policy))
        ax.plot(grid, [100 * r for r in rates], **style)
    name = (trace.model or Path(trace.source.split(":")[-1]).stem or "trace")[:40]
    ax.set(xlabel="VRAM slots per layer", ylabel="hit rate (%)", title=f"hit rate vs slots: {name}")
    ax.grid(alpha=0.3)
    ax.legend()
    written.append(_save(fig, folder / "hit_rate_vs_slots.png"))
    points = sweep(layout, shape, calibration, trace, "slots", grid, **options)
    written.append(_line(folder / "tok_s_vs_slots.png", grid, [s.tok_per_s for _, s in points], "VRAM slots per layer", plt))
    if any(t.kind == "remote" for t in layout.tiers):
        rtts = sweeps.get("rtt_us") or [5, 20, 50, 100, 167, 250, 400]
        points = sweep(layout, shape, calibration, trace, "rtt_us", rtts, **options)
        written.append(_line(folder / "tok_s_vs_rtt.png", rtts, [s.tok_per_s for _, s in points], "LAN round trip (us)", plt))
    return written


def _line(path: Path, xs, ys, xlabel: str, plt) -> str:
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, ys, marker="o")
    ax.set(xlabel=xlabel, ylabel="predicted decode tok/s")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    fig.clf()
    return str(path)


@errors_to_exit
def simulate(
    layout: Path = typer.Option(..., help="cluster.toml"),
    trace: Path = typer.Option(..., help="routing trace (.npz): RoutingTrace format or `run --layout --trace` output"),
    model: Optional[Path] = typer.Option(None, help="model folder or GGUF file for the shape (default: the layout's model)"),
    shape: Optional[str] = typer.Option(None, help="a named shape instead of a model: glm-5.3-flash-ud-iq3_xxs | glm-4.5-air-q4k | qwen3-next-80b-a3b-iq3_s"),
    expert_bytes: Optional[int] = typer.Option(None, help="without a model: bytes of one expert (the rest from the trace)"),
    hidden_bytes: Optional[int] = typer.Option(None, help="without a model: bytes of one hidden state on the wire"),
    calibration: Optional[Path] = typer.Option(None, help="calibration JSON (default: the one the layout names under scheduler)"),
    rows_per_pass: int = typer.Option(1, help="token rows per forward pass (1 + drafts under multi-token prediction)"),
    tokens_per_pass: Optional[float] = typer.Option(None, help="tokens accepted per pass (default: rows per pass)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (default: the layout's)"),
    defer_into_linear: Optional[bool] = typer.Option(
        None, "--defer-into-linear/--no-defer-into-linear",
        help="DEFER_CPU into linear-attention layers too, as `run --defer-into-linear` (default: the layout's)"),
    warmup: Optional[int] = typer.Option(None, help="trace tokens that warm the caches before counting (default: the "
                                                    "prompt's, in a `run --layout --trace` trace; else 0)"),
    sweep_spec: Optional[str] = typer.Option(None, "--sweep", help="slots=8,16,32 | rtt_us=50,167 | lambda=0,0.25"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    plot_dir: Optional[Path] = typer.Option(None, "--plot", help="write PNG plots into this folder"),
):
    """Predict a layout's decode speed and where its time goes, from a routing trace."""
    from moetier.config import load_layout
    from moetier.sched.cost import Calibration
    from moetier.sim import layout_sim

    plan = load_layout(layout).with_scheduler(defer_into_linear=defer_into_linear)
    cal = Calibration.load(calibration) if calibration is not None else Calibration.for_layout(plan)
    routing = layout_sim.load_trace(trace)
    model_shape = resolve_shape(plan, routing, model, shape, expert_bytes, hidden_bytes, cal)
    if tokens_per_pass is not None and tokens_per_pass <= 0:
        raise ValueError(f"--tokens-per-pass is {tokens_per_pass} (expected > 0)")
    warmup = routing.warmup_tokens(warmup)  # shown in the report
    options = dict(rows_per_pass=rows_per_pass, tokens_per_pass=tokens_per_pass, affinity=affinity, warmup_tokens=warmup)
    result = {"layout": str(layout), "trace": str(trace), "shape": model_shape.name, "warmup_tokens": warmup,
              "calibration": str(calibration or plan.scheduler.calibration or "defaults"),
              "defer_cpu": plan.scheduler.defer_cpu, "defer_into_linear": plan.scheduler.defer_into_linear,
              "linear_layers": list(model_shape.linear_layers)}
    sweeps = {}
    if sweep_spec:
        name, values = parse_sweep(sweep_spec)
        sweeps[name] = values
        points = layout_sim.sweep(plan, model_shape, cal, routing, name, values, **options)
        result["sweep"] = {"parameter": name, "points": [{"value": v, **report(layout_sim.with_value(plan, name, v), s)}
                                                         for v, s in points]}
    result.update(report(plan, layout_sim.simulate(plan, model_shape, cal, routing, **options)))
    if plot_dir is not None:
        result["plots"] = plot(plot_dir, plan, model_shape, cal, routing, options, sweeps)
    if as_json:
        print(json.dumps(result))
        return
    console.print(f"layout {layout}  trace {trace}  shape {model_shape.name}  calibration {result['calibration']}", highlight=False)
    _print(result, console)
    if "sweep" in result:
        table = Table(result["sweep"]["parameter"], "tok/s", "hit rate", "ms/token", title="sweep")
        for point in result["sweep"]["points"]:
            table.add_row(f"{point['value']:g}", f"{point['decode_tok_per_s']:.1f}", f"{point['hit_rate']:.1%}",
                          f"{1e3 / point['decode_tok_per_s']:.2f}")
        console.print(table)
    for path in result.get("plots", []):
        console.print(f"wrote {path}", highlight=False)
