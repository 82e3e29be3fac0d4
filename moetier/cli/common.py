"""What every command of the CLI shares: its one-line errors, its consoles, option parsing, opening a model.

Expected failures (bad input, a missing file, a refused layout) become one
line `moetier: error: ...` on stderr and exit code 2, never a traceback.
stdout carries the result (a rich table, or one JSON object with --json);
progress notes go to stderr.
"""

from __future__ import annotations

import functools
import os
import sys
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import typer
from rich.console import Console

from moetier.config import thread_limit

console = Console()
status = Console(stderr=True)  # progress notes; stdout stays clean for --json


class UsageError(ValueError):
    """Bad input found by the CLI itself."""


def errors_to_exit(command: Callable) -> Callable:
    """Expected failures become one line on stderr and exit code 2. Every error moetier raises for bad input
    (UsageError, ConfigError, SpecError, CheckpointError, BackendError, BiasError, ...) is a ValueError."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except BrokenPipeError:  # `moetier ... | head`: the reader left; nothing to report
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            raise typer.Exit(0) from None
        except (ValueError, OSError) as err:
            message = str(err) if not isinstance(err, OSError) else f"{err.filename or ''}: {err.strerror or err}"
            print(f"moetier: error: {message}", file=sys.stderr)
            raise typer.Exit(2) from None

    return wrapper


def open_engine(model: Optional[Path], backend: str, device: str, threads: Optional[int], layout: Optional[Path] = None,
                defer_into_linear: Optional[bool] = None):
    """(engine, layout runtime or None): the plain all-resident engine, or one built from a layout.
    --device and --threads are checked first, whether or not a layout then places the work.
    defer_into_linear: over the layout's [scheduler].defer_into_linear (None: the layout's)."""
    from moetier.engine import Engine
    from moetier.model import open_checkpoint
    from moetier.model.builtin import builtin_model

    check_device(device)
    set_torch_threads(threads)
    if layout is not None:
        from moetier.config import load_layout
        from moetier.engine.runtime import build_runtime

        plan = load_layout(layout).with_scheduler(defer_into_linear=defer_into_linear)
        folder = model or plan.model_path()
        runtime = build_runtime(plan, open_checkpoint(folder if folder is not None else builtin_model()))
        return runtime.engine, runtime
    return Engine(open_checkpoint(model if model is not None else builtin_model()), backend=backend, device=device), None


def model_given(argument: Optional[Path], option: Optional[Path]) -> Optional[Path]:
    """The model of a command that takes it as its argument or as --model, as the other commands do (None: neither)."""
    if argument is not None and option is not None and argument != option:
        raise UsageError(f"the model is given twice, MODEL {argument} and --model {option} (expected one of them)")
    return argument if argument is not None else option


def layout_model(layout: Optional[Path]) -> Optional[Path]:
    """The model the cluster.toml at `layout` names (relative to it), None for no layout or none named."""
    from moetier.config import load_layout

    return load_layout(layout).model_path() if layout is not None else None


def check_device(device: str) -> None:
    """--device: cpu, cuda or cuda:N naming a CUDA device this machine has (torch would raise, or assert, on the rest)."""
    kind, colon, index = device.partition(":")
    if kind not in ("cpu", "cuda") or (colon and (kind == "cpu" or not (index.isascii() and index.isdigit()))):
        raise UsageError(f"--device {device!r} is not a device (expected cpu, cuda or cuda:N)")
    if kind == "cuda":
        import torch

        present = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if not present:
            raise UsageError(f"--device {device}: this machine has no CUDA device (expected cpu)")
        if colon and int(index) >= present:
            raise UsageError(f"--device {device}: this machine has {present} CUDA device(s) (expected cuda:0 to cuda:{present - 1})")


def set_torch_threads(threads: Optional[int]) -> None:
    """--threads: torch's CPU threads and the native kernels' (MOETIER_THREADS), 1 to what this machine can start
    (torch crashes far past its CPUs); None leaves them (the kernels then take every CPU this process may use)."""
    if threads is None:
        return
    limit = thread_limit()
    if not 1 <= threads <= limit:
        raise UsageError(f"--threads is {threads} (expected 1 to {limit} on this machine, which has {os.cpu_count()} CPUs)")
    import torch

    torch.set_num_threads(threads)
    os.environ["MOETIER_THREADS"] = str(threads)


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


def default_prompt(engine, length: int = 16) -> list[int]:
    """A prompt from the synthetic model's own session sampler, else ids spread over the vocabulary."""
    from moetier.model.synth import SYNTH_META, sample_session

    folder = engine.checkpoint.folder
    if (folder / SYNTH_META).exists():
        return [int(i) for _, ids in sample_session(folder, tokens_per_phase=length, seed=0)[:1] for i in ids[:length]]
    return [int(i) for i in np.linspace(1, engine.spec.vocab_size - 1, length).astype(int)]


def expert_formats(checkpoint) -> str:
    """The stored formats of a checkpoint's experts, layer counts where they differ: "Q4_K" or
    "Q4_K x 5 layers, Q4_K/Q6_K x 3 layers" (gate and up / down)."""
    counts: dict[str, int] = {}
    for layer in checkpoint.spec.moe_layers:
        name = checkpoint.expert_format(layer)
        counts[name] = counts.get(name, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{name} x {count} layers" for name, count in counts.items())
