"""The `moetier` command line: parse, call the library, print (a rich table or --json).

Thin by design: every command is a few lines over the library. Bad input — a
missing folder, an unsupported architecture, a malformed ids file — prints one
line `moetier: error: ...` on stderr and exits 2, never a traceback.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import typer
from rich.console import Console
from rich.table import Table
from moetier.paths import moetier_home

app = typer.Typer(no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
                  help="Run Mixture-of-Experts models whose experts do not fit in GPU memory.")
console = Console()
status = Console(stderr=True)  # progress notes; stdout stays clean for --json

BUILTIN = {"arch": "qwen3_moe", "preset": "small", "seed": 0}


class UsageError(ValueError):
    """Bad input found by the CLI itself."""


def errors_to_exit(command: Callable) -> Callable:
    """Expected failures become one line on stderr and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        from moetier.backends import BackendError
        from moetier.model import CheckpointError, SpecError

        try:
            return command(*args, **kwargs)
        except BrokenPipeError:  # `moetier ... | head`: the reader left; nothing to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        except (UsageError, SpecError, CheckpointError, BackendError, ValueError, OSError) as err:
            message = str(err) if not isinstance(err, OSError) else f"{err.filename or ''}: {err.strerror or err}"
            print(f"moetier: error: {message}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper


def cached_synthetic(arch: str, preset: str, seed: int = 0) -> Path:
    """A synthetic checkpoint in the cache folder, written the first time it is asked for."""
    from moetier.model.synth import write_synthetic

    from moetier.model.synth import synth_version

    # The folder name carries the generator's version (format and preset dims), so a cache
    # written by an older generator is never mistaken for this one's output.
    folder = moetier_home() / "models" / f"{arch}-{preset}-seed{seed}-{synth_version(arch, preset)}"
    if not (folder / "config.json").exists():
        status.print(f"[dim]writing the synthetic {arch} {preset} model to {folder} (once)[/dim]", highlight=False)
        write_synthetic(folder, arch=arch, preset=preset, seed=seed)
    return folder


def builtin_model() -> Path:
    """The built-in model: the synthetic `small` preset."""
    return cached_synthetic(**BUILTIN)


def _open_engine(model: Optional[Path], backend: str, device: str, threads: Optional[int], layout: Optional[Path] = None):
    """(engine, tiered runtime or None): the plain all-resident engine, or one built from a layout."""
    import torch

    from moetier.engine import Engine
    from moetier.model import open_checkpoint

    if threads is not None:
        if threads < 1:
            raise UsageError(f"--threads is {threads} (expected >= 1)")
        torch.set_num_threads(threads)
    if layout is not None:
        from moetier.config import load_layout
        from moetier.engine.layout_runtime import build_runtime

        plan = load_layout(layout)
        folder = model or (Path(plan.model) if plan.model else None)
        runtime = build_runtime(plan, open_checkpoint(folder if folder is not None else builtin_model()))
        return runtime.engine, runtime
    return Engine(open_checkpoint(model if model is not None else builtin_model()), backend=backend, device=device), None


def parse_list(text: str, option: str, kind: type = int) -> list:
    """A comma-separated option value -> [kind]; one clear UsageError when it is not one."""
    what, example = ("integers", "1,2,3") if kind is int else ("numbers", "-0.25,-0.5,-1")
    try:
        values = [kind(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"{option} {text!r} is not a comma-separated list of {what}") from None
    if not values:
        raise UsageError(f"{option} is empty (expected {what} like {example})")
    return values


def _default_prompt(engine, length: int = 16) -> list[int]:
    """A prompt from the synthetic model's own session sampler, else ids spread over the vocabulary."""
    from moetier.model.synth import SYNTH_META, sample_session

    folder = engine.checkpoint.folder
    if (folder / SYNTH_META).exists():
        return [int(i) for _, ids in sample_session(folder, tokens_per_phase=length, seed=0)[:1] for i in ids[:length]]
    return [int(i) for i in np.linspace(1, engine.spec.vocab_size - 1, length).astype(int)]


@app.command()
@errors_to_exit
def run(
    model: Optional[Path] = typer.Option(None, help="HF model folder; default: the built-in synthetic model"),
    max_new_tokens: int = typer.Option(32, help="tokens to generate"),
    prompt_ids: Optional[str] = typer.Option(None, help="prompt token ids, e.g. 1,2,3"),
    seed: Optional[int] = typer.Option(None, help="sample with this seed (greedy when omitted and temperature is 0)"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    backend: str = typer.Option("torch", help="expert backend: torch, numpy, cupy, or an entry point"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    layout: Optional[Path] = typer.Option(None, help="cluster.toml: run over its tiers and report where time goes"),
    trace: Optional[Path] = typer.Option(None, help="with --layout: write the decode routing trace (.npz)"),
    bias: Optional[Path] = typer.Option(None, help="router bias table (.safetensors, from `moetier bias`)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (needs --layout with a vram tier)"),
    bias_mode: Optional[str] = typer.Option(None, help="selection | damped (weights from the biased scores too)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Generate tokens and report prefill and decode speed."""
    from moetier.engine import Sampling, generate

    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens is {max_new_tokens} (expected >= 1)")
    if trace is not None and layout is None:
        raise UsageError("--trace needs --layout (the trace records which tier served each expert)")
    engine, runtime = _open_engine(model, backend, device, threads, layout)
    apply_router_options(engine, bias, affinity, bias_mode)
    prompt = parse_list(prompt_ids, "--prompt-ids") if prompt_ids else _default_prompt(engine)
    if seed is not None and temperature == 0.0:
        temperature = 1.0  # a seed asks for sampling
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    engine.warm_up()
    if runtime is not None:
        from moetier.cli_layout import run_over_layout

        run_over_layout(runtime, prompt, max_new_tokens, sampling, trace, as_json, console)
        return
    result = generate(engine, prompt, max_new_tokens, sampling)
    report = {
        "model": str(engine.checkpoint.folder),
        "fingerprint": engine.checkpoint.fingerprint,
        "backend": engine.backend.describe(),
        "prompt_ids": result.prompt_ids,
        "generated_ids": result.ids,
        "prefill_tokens": len(result.prompt_ids),
        "prefill_s": result.prefill_s,
        "prefill_tok_per_s": result.prefill_tok_per_s,
        "decode_tokens": len(result.ids) - 1,
        "decode_s": result.decode_s,
        "decode_tok_per_s": result.decode_tok_per_s,
    }
    if as_json:
        print(json.dumps(report))
        return
    console.print(f"model {report['model']} ({report['fingerprint']}), backend {report['backend']}", highlight=False)
    console.print(f"prompt    {result.prompt_ids}", highlight=False)
    console.print(f"generated {result.ids}", highlight=False)
    table = Table("phase", "tokens", "seconds", "tok/s")
    table.add_row("prefill", str(report["prefill_tokens"]), f"{result.prefill_s:.3f}", f"{result.prefill_tok_per_s:.1f}")
    table.add_row("decode", str(report["decode_tokens"]), f"{result.decode_s:.3f}", f"{result.decode_tok_per_s:.1f}")
    console.print(table)


@app.command()
@errors_to_exit
def score(
    model: Path = typer.Argument(..., help="HF model folder"),
    ids: Path = typer.Option(..., help="token ids: a 1-D integer .npy file"),
    out: Path = typer.Option(..., help="where to write float32 logits [T, vocab] (.npy)"),
    backend: str = typer.Option("torch"),
    device: str = typer.Option("cpu"),
    threads: Optional[int] = typer.Option(None),
    layout: Optional[Path] = typer.Option(None, help="cluster.toml: score over its tiers"),
    bias: Optional[Path] = typer.Option(None, help="router bias table (.safetensors, from `moetier bias`)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (needs --layout with a vram tier)"),
    bias_mode: Optional[str] = typer.Option(None, help="selection | damped"),
):
    """Teacher-forced logits for every position of a sequence."""
    from moetier.engine import score as score_ids

    token_ids = load_ids(ids)
    engine, runtime = _open_engine(model, backend, device, threads, layout)
    try:
        apply_router_options(engine, bias, affinity, bias_mode)
        logits = score_ids(engine, token_ids)
    finally:
        if runtime is not None:
            runtime.close()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(out.name + ".partial.npy")
    np.save(partial, logits)
    partial.replace(out)  # whole file or nothing
    console.print(f"wrote logits {list(logits.shape)} float32 to {out}", highlight=False)


def load_ids(path: Path) -> np.ndarray:
    """Token ids [T] int64 from a .npy file ([T] or [1, T], any integer dtype); a bad file is a UsageError naming it."""
    try:
        ids = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"{path}: no such ids file (expected a .npy of token ids)") from None
    except (ValueError, OSError) as err:
        raise UsageError(f"{path}: not a readable .npy file ({err})") from None
    if ids.dtype.kind not in "iu":
        raise UsageError(f"{path}: ids have dtype {ids.dtype} (expected an integer array)")
    if ids.ndim == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.ndim != 1 or ids.size == 0:
        raise UsageError(f"{path}: ids have shape {list(ids.shape)} (expected a non-empty 1-D array [T])")
    return ids.astype(np.int64)


@app.command()
@errors_to_exit
def info(
    model: Path = typer.Argument(..., help="HF model folder"),
    as_json: bool = typer.Option(False, "--json"),
):
    """Layers, experts, router and sizes of a checkpoint (reads headers only)."""
    from moetier.model import open_checkpoint

    checkpoint = open_checkpoint(model)
    s = checkpoint.spec
    summary = {
        "model": str(model),
        "arch": s.arch,
        "layers": s.num_layers,
        "moe_layers": len(s.moe_layers),
        "experts_per_layer": s.num_experts,
        "top_k": s.top_k,
        "router": s.router,
        "n_group": s.n_group,
        "topk_group": s.topk_group,
        "shared_experts": s.n_shared_experts,
        "hidden_size": s.hidden_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "vocab_size": s.vocab_size,
        "bytes_per_expert": checkpoint.expert_nbytes,
        "expert_bytes_total": checkpoint.expert_nbytes * s.num_experts * len(s.moe_layers),
        "total_bytes": checkpoint.total_bytes,
        "fingerprint": checkpoint.fingerprint,
    }
    if as_json:
        print(json.dumps(summary))
        return
    table = Table("field", "value", title=f"{model}")
    for key, value in summary.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) and "bytes" in key else str(value))
    console.print(table)


@app.command()
@errors_to_exit
def synth(
    out: Path = typer.Option(..., help="folder to write the checkpoint into"),
    arch: str = typer.Option("qwen3_moe", help="qwen3_moe | glm4_moe | mixtral"),
    preset: str = typer.Option("tiny", help="tiny | small | medium"),
    seed: int = typer.Option(0),
    fused: bool = typer.Option(False, help="fused expert tensors (experts.gate_up_proj) instead of per-expert names"),
):
    """Write a synthetic HF-format MoE checkpoint with realistic routing."""
    from moetier.model.synth import ARCHES, PRESETS, write_synthetic

    if arch not in ARCHES:
        raise UsageError(f"--arch {arch!r} is not supported (expected one of {', '.join(ARCHES)})")
    if preset not in PRESETS:
        raise UsageError(f"--preset {preset!r} is unknown (expected one of {', '.join(PRESETS)})")
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {out} exists and is not empty (expected a new folder)")
    folder = write_synthetic(out, arch=arch, preset=preset, seed=seed, fused=fused)
    console.print(f"wrote {arch} {preset} (seed {seed}) to {folder}", highlight=False)


# The other command modules register into `app` (each imports errors_to_exit from here, so they come last).
from moetier.cli_layout import register as register_layout  # noqa: E402
from moetier.cli_profile import apply_router_options, register as register_profile  # noqa: E402
from moetier.cli_sim import register as register_sim  # noqa: E402
from moetier.transport.commands import register as register_transport, register_launch  # noqa: E402

for _register in (register_layout, register_profile, register_transport, register_launch, register_sim):
    _register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
