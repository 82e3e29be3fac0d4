"""Layout commands: `layout check`, `layout show`, `calibrate`, and the report of `run --layout`.

The report answers "where
does a token's time go": hit rate and experts served per tier, ms per token
by category (attention, GPU experts, CPU-lane wait per part, transfers,
remote, dispatch) and tok/s, as a table or one JSON object.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from moetier.cli.common import console, errors_to_exit, set_torch_threads


def layout_report(runtime, result, times) -> dict:
    """The `run --layout` JSON: tiers, parts, ms per token by category, speeds, hit rate."""
    executor, engine, layout = runtime.executor, runtime.engine, runtime.layout
    steps = max(len(result.ids) - 1, 1)
    tiers, hits, picks = [], 0, 0
    for config in layout.tiers:
        counters = executor.counters[config.name]
        device = config.device or config.host or "local"
        tiers.append({
            "name": config.name, "kind": config.kind, "device": device,
            "emulated": runtime.emulated.get(config.device, False),
            "experts_served": counters.served, "experts_served_per_token": counters.served / steps,
            "hits": counters.hits, "picks": counters.picks,
            "hit_rate": counters.hits / counters.picks if config.kind == "vram" and counters.picks else None,
        })
        if config.kind == "vram":
            hits += counters.hits
    picks = steps * len(engine.spec.moe_layers) * engine.spec.top_k
    ms = times.ms_per_token()
    parts = []
    for index, (config, part) in enumerate(zip(layout.parts, engine.parts)):
        parts.append({"name": config.name, "device": config.device, "torch_device": str(part.device),
                      "layers": [part.layers.start, part.layers.stop],
                      "cpu_lane_wait_ms_per_token": ms.get(f"cpu lane wait (part {index})", 0.0)})
    return {
        "layout": str(layout.path), "model": str(engine.checkpoint.folder), "fingerprint": engine.checkpoint.fingerprint,
        "defer_cpu": engine.defer_cpu, "defer_into_linear": engine.defer_into_linear,
        "deferred_layers": sorted(l for l in engine.deferred if engine.spec.is_moe(l)), "tail_skip": executor.tail_skip, "budget_us": executor.budget_us,
        "prompt_ids": result.prompt_ids, "generated_ids": result.ids, "prefill_tok_per_s": result.prefill_tok_per_s,
        "decode_tok_per_s": result.decode_tok_per_s, "decode_tokens": len(result.ids) - 1,
        "hit_rate": hits / picks if picks else 0.0, "skipped_per_token": executor.skipped / steps,
        "ms_per_token": ms, "tiers": tiers, "parts": parts,
    }


def run_over_layout(runtime, prompt, max_new_tokens, sampling, trace_path: Optional[Path], as_json: bool, out: Console,
                    tokenizer=None, stop_ids: tuple[int, ...] = ()) -> dict:
    from moetier.engine import generate
    from moetier.engine.tier_executor import TraceRows
    from moetier.engine.timing import StepTimes

    engine, executor = runtime.engine, runtime.executor
    times = StepTimes()
    if trace_path is not None:  # the prompt's rows too: they warm the caches the decode then counts on
        executor.trace = TraceRows(layers=list(engine.spec.moe_layers), tier_index=dict(executor.index))
    prompt_rows = 0

    def start_decode() -> None:
        nonlocal prompt_rows
        executor.reset_counters()
        engine.times = executor.times = times
        if trace_path is not None:
            prompt_rows = executor.trace.tokens

    try:
        result = generate(engine, prompt, max_new_tokens, sampling, stop_ids=stop_ids, before_decode=start_decode)
    finally:
        engine.times = executor.times = None
        runtime.close()
    report = layout_report(runtime, result, times)
    if tokenizer is not None:
        ids = result.ids[:-1] if result.ids[-1] in stop_ids else result.ids
        report["text"] = tokenizer.decode(ids, skip_special=True)
    if trace_path is not None:
        write_trace(trace_path, executor.trace, runtime, prompt_rows)
        report["trace"] = str(trace_path)
    if as_json:
        print(json.dumps(report))
    else:
        print_report(report, out)
    return report


def write_trace(path: Path, rows, runtime, prompt_rows: int) -> None:
    """The DESIGN.md routing-trace npz, plus the tier that served each pick: the prompt's `prompt_rows` rows first
    (phase "prefill"), then the decoded tokens' ("decode")."""
    import numpy as np

    from moetier.model.output import new_file
    from moetier.sim.traces import RUN_PHASES

    engine = runtime.engine
    metadata = {"fingerprint": engine.checkpoint.fingerprint, "top_k": engine.spec.top_k,
                "num_experts": engine.spec.num_experts, "layers": list(engine.spec.moe_layers),
                "tier_names": [t.name for t in runtime.layout.tiers], "source": f"moetier run --layout {runtime.layout.path}",
                "phase_names": list(RUN_PHASES)}
    picks = np.concatenate(rows.picks).astype(np.int16)  # [T, L, k]
    phase = (np.arange(len(picks)) >= prompt_rows).astype(np.int8)  # [T] 0: prefill, 1: decode
    with new_file(path, ".npz") as partial:  # whole file or nothing
        np.savez_compressed(partial, picks=picks, weights=np.concatenate(rows.weights).astype(np.float16),
                            probs=np.concatenate(rows.probs).astype(np.float16), tiers=np.concatenate(rows.tiers),
                            phase=phase, metadata=np.array(json.dumps(metadata)))


def print_report(report: dict, out: Console) -> None:
    out.print(f"layout {report['layout']}  model {report['model']} ({report['fingerprint']})  "
              f"DEFER_CPU={report['defer_cpu']}{' (into linear layers too)' if report['defer_into_linear'] else ''}  "
              f"tail_skip={report['tail_skip']}", highlight=False)
    if "text" in report:
        out.print(report["text"], highlight=False, markup=False)
    table = Table("tier", "kind", "device", "experts/token", "hit rate")
    for tier in report["tiers"]:
        device = tier["device"] + (" (emulated)" if tier["emulated"] else "")
        rate = f"{tier['hit_rate']:.1%}" if tier["hit_rate"] is not None else "-"
        table.add_row(tier["name"], tier["kind"], device, f"{tier['experts_served_per_token']:.1f}", rate)
    out.print(table)
    times = Table("where a token's time goes", "ms/token")
    for category, value in report["ms_per_token"].items():
        times.add_row(category, f"{value:.2f}")
    out.print(times)
    out.print(f"decode {report['decode_tok_per_s']:.1f} tok/s, prefill {report['prefill_tok_per_s']:.1f} tok/s, "
              f"VRAM hit rate {report['hit_rate']:.1%}, skipped {report['skipped_per_token']:.2f} experts/token", highlight=False)


layout_app = typer.Typer(no_args_is_help=True, help="Check and show cluster.toml layouts.")


@layout_app.command("check")
@errors_to_exit
def check(file: Path = typer.Argument(..., help="cluster.toml"),
          model: Optional[Path] = typer.Option(None, help="also check against this model")):
    """Validate a layout (and, with --model, that it fits the model)."""
    from moetier.config import load_layout

    layout = load_layout(file)
    if model is not None:
        from moetier.model import open_checkpoint

        spec = open_checkpoint(model).spec
        layout.check_model(spec.num_layers, spec.num_experts)
    console.print(f"{file}: ok ({len(layout.parts)} parts, {len(layout.tiers)} tiers)", highlight=False)


@layout_app.command("show")
@errors_to_exit
def show(file: Path = typer.Argument(..., help="cluster.toml"),
         model: Optional[Path] = typer.Option(None, help="model folder or GGUF file (default: the layout's, else the built-in)"),
         as_json: bool = typer.Option(False, "--json")):
    """Per tier: slots, bytes, initial residency; and the per-token cost the layout implies."""
    from moetier.config import load_layout
    from moetier.sched.estimate import describe_layout

    layout = load_layout(file)
    from moetier.model.builtin import builtin_model

    folder = model or layout.model_path() or builtin_model()
    summary = describe_layout(layout, folder)
    if as_json:
        print(json.dumps(summary))
        return
    table = Table("tier", "kind", "where", "slots/layer", "bytes", "policy", "initial residency", "us/expert", title=str(file))
    for t in summary["tiers"]:
        table.add_row(t["name"], t["kind"], t["where"], str(t["slots_per_layer"] or "-"), f"{t['bytes']:,}",
                      t["policy"] or "-", t["initial_residency"], f"{t['us_per_expert']:.0f}")
    console.print(table)
    console.print(f"experts held as {summary['expert_formats']}: {summary['expert_bytes']:,} bytes each (stored bytes; "
                  "the largest layer's)", highlight=False)
    c = summary["per_token"]
    console.print(f"implied per token: {c['ms']:.2f} ms ({c['tok_per_s']:.1f} tok/s) = trunk {c['trunk_ms']:.2f} ms + "
                  f"MoE layers {c['moe_ms']:.2f} ms at an estimated VRAM hit rate of {c['hit_rate']:.0%} "
                  f"(calibration: {summary['calibration']})", highlight=False)


@errors_to_exit
def calibrate(layout: Optional[Path] = typer.Option(None, help="cluster.toml whose [scheduler].calibration names the output"),
              model: Optional[Path] = typer.Option(None, help="model to measure (default: the layout's, else the built-in)"),
              out: Optional[Path] = typer.Option(None, help="where to write the calibration JSON"),
              threads: Optional[int] = typer.Option(None, help="torch CPU threads")):
    """Measure the cost model's parameters on this machine and write them to a file."""
    from moetier.calibrate import measure

    set_torch_threads(threads)  # refused here, before torch would crash on it
    calibration, target = measure(layout, model, out, threads)
    console.print(f"wrote {target}", highlight=False)
    for key, value in json.loads(calibration.to_json()).items():
        console.print(f"  {key:28} {value}", highlight=False)
