"""Profile commands: `profile`, `bias` (build / show / write), `kl`, `sweep`, `example-sessions`.

Thin like the rest of the CLI: parse, call moetier.profile, print a rich
table or one JSON object; bad input is one line `moetier: error: ...` and
exit 2. `run` and `score` take the same router options (--bias, --affinity,
--bias-mode) through moetier.engine.router_bias.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from moetier.cli.common import UsageError, console, errors_to_exit, layout_model, load_ids, parse_list, status


def _model(model: Optional[Path]):
    from moetier.model.builtin import builtin_model
    from moetier.model import open_checkpoint

    return open_checkpoint(model if model is not None else builtin_model())


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=status, transient=True)


def _requests(checkpoint, sessions: List[Path]):
    from moetier.profile.sessions import load_sessions

    return load_sessions(sessions, checkpoint.folder, checkpoint.spec.vocab_size)


@errors_to_exit
def example_sessions(out: Path = typer.Option(..., help="session file to write (.jsonl)"),
                     model: Optional[Path] = typer.Option(None, help="synthetic model folder; default: the built-in"),
                     sessions: int = typer.Option(3, help="sessions of explore / edit / verify"),
                     tokens_per_phase: int = typer.Option(64),
                     seed: int = typer.Option(0)):
    """Write example sessions of a synthetic model: three phases, plus a held-out second-language family."""
    from moetier.profile.sessions import write_example_sessions

    from moetier.model.builtin import builtin_model
    from moetier.model.output import check_output

    check_output(out, "--out", [("--model", model)])
    path = write_example_sessions(model if model is not None else builtin_model(), out, sessions, tokens_per_phase, seed=seed)
    console.print(f"wrote {path}", highlight=False)


@errors_to_exit
def profile(sessions: List[Path] = typer.Argument(..., metavar="SESSIONS...", help="session files (.jsonl)"),
            out: Path = typer.Option(..., help="profile to write (.npz or .safetensors)"),
            model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file; default: the built-in synthetic model"),
            npy: Optional[Path] = typer.Option(None, help="also write the brightness [MoE layers, experts] as .npy (a static cache's profile in cluster.toml)"),
            as_json: bool = typer.Option(False, "--json")):
    """Run sessions teacher-forced and record each layer's router mass per expert and phase."""
    import numpy as np

    from moetier.engine import Engine
    from moetier.model.output import check_output, new_file
    from moetier.profile.brightness import profile_requests, summary_rows

    inputs = [("SESSIONS", path) for path in sessions] + [("--model", model)]
    check_output(out, "--out", inputs + [("--npy", npy)], suffixes=(".npz", ".safetensors"))
    if npy is not None:
        check_output(npy, "--npy", inputs)
    checkpoint = _model(model)
    requests = _requests(checkpoint, sessions)
    engine = Engine(checkpoint)
    with _progress() as bar:
        task = bar.add_task("profiling", total=sum(1 for r in requests if r.profile))
        result = profile_requests(engine, requests, on_request=lambda _: bar.advance(task))
    result.save(out)
    if npy is not None:
        with new_file(npy, ".npy") as partial:
            np.save(partial, result.brightness)
    report = {"profile": str(out), "fingerprint": result.fingerprint, "model_fingerprint": result.model_fingerprint,
              "phases": dict(zip(result.phases, result.tokens.tolist())), "layers": summary_rows(result)}
    if as_json:
        print(json.dumps(report))
        return
    console.print(f"wrote {out} ({result.fingerprint}); tokens per phase: "
                  + ", ".join(f"{p} {n}" for p, n in report["phases"].items()), highlight=False)
    table = Table("MoE layer", "brightest experts", f"share of top {result.top_k}", "max brightness")
    for row in report["layers"]:
        table.add_row(str(row["layer"]), str(row["brightest"]), f"{row['top_k_share']:.1%}", f"{row['max_brightness']:.3f}")
    console.print(table)


bias_app = typer.Typer(help="Build (the default), show and write router bias tables.")


def build(profile_path: Optional[Path], hot: Optional[int], kind: str, cap: float, out: Optional[Path], as_json: bool):
    from moetier.model.output import check_output
    from moetier.profile.bias import build_table, describe, summarize
    from moetier.profile.brightness import Profile

    if profile_path is None or hot is None or out is None:
        raise UsageError("bias needs --profile P --hot N --out T.safetensors (or a command: build, show, write)")
    check_output(out, "--out", [("--profile", profile_path)], suffixes=(".safetensors",))
    table = build_table(Profile.load(profile_path), hot, kind, cap)
    table.save(out)
    if as_json:
        print(json.dumps(describe(table) | {"table": str(out), "layers": summarize(table)}))
        return
    console.print(f"wrote {out}: {kind}, hot {hot}, cap {table.cap:g} ({table.space} space)", highlight=False)

build_options = dict(
    profile_path=typer.Option(None, "--profile", help="profile from `moetier profile`"),
    hot=typer.Option(None, help="hot-set size N per layer (experts that get 0)"),
    kind=typer.Option("graded", help="graded | flat | hard"),
    cap=typer.Option(-0.5, help="penalty floor for cold experts (graded, flat); sigmoid routers: ~10x smaller"),
    out=typer.Option(None, help="table to write (.safetensors)"),
    as_json=typer.Option(False, "--json"),
)


@bias_app.callback(invoke_without_command=True)
@errors_to_exit
def bias_default(ctx: typer.Context, profile_path: Optional[Path] = build_options["profile_path"],
                 hot: Optional[int] = build_options["hot"], kind: str = build_options["kind"],
                 cap: float = build_options["cap"], out: Optional[Path] = build_options["out"],
                 as_json: bool = build_options["as_json"]):
    """`moetier bias --profile P --hot N --kind graded|flat|hard --cap C --out T.safetensors` builds a table."""
    if ctx.invoked_subcommand is not None:
        return
    if profile_path is None and out is None:
        console.print(ctx.get_help())
        raise typer.Exit(0)
    build(profile_path, hot, kind, cap, out, as_json)


@bias_app.command("build")
@errors_to_exit
def bias_build(profile_path: Optional[Path] = build_options["profile_path"], hot: Optional[int] = build_options["hot"],
               kind: str = build_options["kind"], cap: float = build_options["cap"],
               out: Optional[Path] = build_options["out"], as_json: bool = build_options["as_json"]):
    """Build a table from a profile (same as `moetier bias --profile ...`)."""
    build(profile_path, hot, kind, cap, out, as_json)


@bias_app.command("show")
@errors_to_exit
def bias_show(table_path: Path = typer.Argument(..., metavar="TABLE", help="bias table (.safetensors)"),
              as_json: bool = typer.Option(False, "--json")):
    """Per MoE layer: hot-set size, b_edge and the quantiles of the cold experts' penalties."""
    from moetier.engine.router_bias import load_table
    from moetier.profile.bias import describe, summarize

    table = load_table(table_path)
    rows = summarize(table)
    if as_json:
        print(json.dumps(describe(table) | {"table": str(table_path), "layers": rows}))
        return
    console.print(f"{table_path}: {table.kind}, hot {table.hot_size}, cap {table.cap:g}, {table.space} space "
                  f"({table.router} router); model {table.model_fingerprint}, profile {table.profile_fingerprint}",
                  highlight=False)
    grid = Table("layer", "hot", "b_edge", "never", "at cap", "min", "p10", "p50", "p90", "max", title="cold penalties")
    number = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    for row in rows:
        grid.add_row(str(row["moe_layer"]), str(row["hot"]), f"{row['b_edge']:.3g}", str(row["never"]), str(row["at_cap"]),
                     *(number(row[k]) for k in ("min", "p10", "p50", "p90", "max")))
    console.print(grid)


@bias_app.command("write")
@errors_to_exit
def bias_write(model: Path = typer.Option(..., help="glm4_moe / glm5_next model folder, GGUF file or first file of a split set"),
               table_path: Path = typer.Option(..., "--table", help="bias table built for that model"),
               out: Path = typer.Option(..., help="new folder for a folder's copy; the new .gguf (or first split) for a GGUF's"),
               as_json: bool = typer.Option(False, "--json")):
    """Copy a sigmoid-router checkpoint with the table added to its e_score_correction_bias (a GGUF's exp_probs_b)."""
    from moetier.profile.write import write_biased_checkpoint

    result = write_biased_checkpoint(model, table_path, out)
    report = {"out": str(result.out), "fingerprint": result.fingerprint, "rewritten": result.rewritten,
              "linked": result.linked, "copied": result.copied}
    if as_json:
        print(json.dumps(report))
        return
    console.print(f"wrote {out} ({result.fingerprint}): rewrote {', '.join(result.rewritten)}; "
                  f"linked {len(result.linked)}, copied {len(result.copied)} other files", highlight=False)


@errors_to_exit
def kl(model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file; default: the layout's model, else the "
                                                       "built-in synthetic model"),
       sessions: Optional[List[Path]] = typer.Option(None, help="session file(s) (.jsonl); repeatable"),
       ids: Optional[Path] = typer.Option(None, help="token ids: a 1-D integer .npy file"),
       bias: Optional[Path] = typer.Option(None, help="candidate: bias table"),
       affinity: float = typer.Option(0.0, help="candidate: live-cache lambda (needs --layout)"),
       bias_mode: str = typer.Option("selection", help="candidate: selection | damped"),
       affinity_prefill: bool = typer.Option(False, help="candidate: affinity in prefill too"),
       layout: Optional[Path] = typer.Option(None, help="candidate: run over this cluster.toml"),
       stepwise: bool = typer.Option(False, help="feed tokens one at a time (always with affinity)"),
       floor: bool = typer.Option(True, help="run the candidate twice for the run-to-run floor"),
       as_json: bool = typer.Option(False, "--json")):
    """Teacher-forced KL(plain || candidate): pooled, per phase and token family, top-1 agreement, floor."""
    from moetier.profile.kl import Candidate, measure_kl
    from moetier.profile.sessions import requests_from_ids

    if (sessions is None) == (ids is None):
        raise UsageError("kl needs exactly one of --sessions S.jsonl or --ids F.npy")
    checkpoint = _model(model or layout_model(layout))  # --model, else the layout's, else the built-in
    requests = _requests(checkpoint, sessions) if sessions else requests_from_ids(load_ids(ids), "all", str(ids))
    candidate = Candidate(bias, affinity, bias_mode, affinity_prefill, layout, stepwise)
    with _progress() as bar:
        task = bar.add_task("scoring", total=len(requests) * (2 if floor else 1))
        result = measure_kl(checkpoint, requests, candidate, floor, on_request=lambda _: bar.advance(task))
    if as_json:
        print(json.dumps(result.to_dict()))
        return
    floor_text = f", floor {result.floor_kl:.2g}" if result.floor_kl is not None else ""
    console.print(f"KL(plain || {result.candidate}) = {result.mean_kl:.5f} nats/token over {result.positions} positions"
                  f"{floor_text}; top-1 agreement {result.top1_agreement:.1%}; p99 {result.p99_kl:.4f}, max {result.max_kl:.4f}",
                  highlight=False)
    table = Table("group", "name", "tokens", "mean KL")
    for kind, means, counts in (("phase", result.per_phase, result.tokens_per_phase),
                                ("token family", result.per_family, result.tokens_per_family)):
        for name, value in means.items():
            table.add_row(kind, name, str(counts[name]), f"{value:.5f}")
    console.print(table)


@errors_to_exit
def sweep(sessions: List[Path] = typer.Option(..., help="session file(s) (.jsonl); repeatable"),
          layout: Path = typer.Option(..., help="cluster.toml with a vram tier"),
          out: Path = typer.Option(..., help="folder for sweep.md, sweep.json, the plots and the tables"),
          model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file; default: the layout's model, else the "
                                                          "built-in synthetic model"),
          caps: Optional[str] = typer.Option(None, help="static table arms: caps, comma-separated [default: -0.25,-0.5,-1; sigmoid routers /10]"),
          lambdas: Optional[str] = typer.Option(None, help="affinity arms: lambdas, comma-separated [default: 0.1,0.25,0.5; sigmoid routers /10]"),
          profile_path: Optional[Path] = typer.Option(None, "--profile", help="profile for the tables; default: profile the sessions"),
          hot: Optional[int] = typer.Option(None, help="hot-set size; default: the vram tier's slots per layer"),
          kind: str = typer.Option("graded", help="table kind: graded | flat | hard"),
          as_json: bool = typer.Option(False, "--json")):
    """KL, VRAM hit rate and decode tok/s per arm (static tables by cap, affinity by lambda); table and plots."""
    from moetier.model.output import check_output
    from moetier.profile.brightness import Profile
    from moetier.profile.sweep import markdown, run_sweep, write_outputs

    named = layout_model(layout)
    check_output(out, "--out", [("--sessions", path) for path in sessions]
                 + [("--layout", layout), ("--profile", profile_path), ("--model", model), ("layout's model", named)],
                 kind="folder")
    checkpoint = _model(model or named)
    # sigmoid routers take the bias in probability space, where useful values are ~10x smaller
    scale = 0.1 if checkpoint.spec.router == "sigmoid" else 1.0
    cap_values = parse_list(caps, "--caps", float) if caps else [c * scale for c in (-0.25, -0.5, -1.0)]
    lambda_values = parse_list(lambdas, "--lambdas", float) if lambdas else [x * scale for x in (0.1, 0.25, 0.5)]
    requests = _requests(checkpoint, sessions)
    profile = Profile.load(profile_path) if profile_path is not None else None
    arms = 2 + len(cap_values) + len(lambda_values)
    with _progress() as bar:
        task = bar.add_task(f"sweep: {arms} runs", total=arms * len(requests))
        result = run_sweep(checkpoint, requests, layout, cap_values, lambda_values, out, profile, hot, kind,
                           on_step=lambda _: bar.advance(task))
    paths = write_outputs(result, out)
    if as_json:
        print(json.dumps(result.to_dict() | {"files": [str(p) for p in paths]}))
        return
    console.print(markdown(result), highlight=False)
    console.print("wrote " + ", ".join(str(p) for p in paths), highlight=False)
