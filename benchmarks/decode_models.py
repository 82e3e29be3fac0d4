"""bench_decode's model files: the synthetic checkpoint or a user's own, its F32 GGUF (moetier's writer) and the
quantized GGUFs (llama.cpp's own quantizer, in a child process), cached under one folder per checkpoint; and the
weight bytes a decoded token reads from a GGUF (the roofline's numerator).

Only the standard library at the top level: bench_decode's spawned workers import this module's callers.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from pathlib import Path

FTYPES = {"BF16": 32, "Q8_0": 7, "Q4_K_M": 15, "Q6_K": 18, "IQ3_S": 26}  # LLAMA_FTYPE_MOSTLY_*
FORMATS = ("F32", *FTYPES)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def checkpoint_arch_and_vocab(folder: Path) -> tuple[str, int]:
    """A user's HF checkpoint folder for --checkpoint: (its model_type, its vocabulary size) as moetier reads its config
    (a text_config included); ValueError with one line naming what is missing."""
    from moetier.model import CheckpointError, open_checkpoint
    from moetier.model.spec import SpecError

    if not (folder / "config.json").is_file():
        raise ValueError(f"--checkpoint {folder}: no readable config.json with model_type and vocab_size")
    if not any(folder.glob("*.safetensors")):
        raise ValueError(f"--checkpoint {folder}: no *.safetensors files (expected an HF checkpoint folder)")
    try:
        spec = open_checkpoint(folder).spec
    except (CheckpointError, SpecError) as error:  # one line already
        raise ValueError(f"--checkpoint {folder}: {error}") from None
    return spec.arch, spec.vocab_size


def _quantize(source: str, out: str, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, os.cpu_count()
    rc = llama_cpp.llama_model_quantize(source.encode(), out.encode(), params)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize returned {rc}")


def quantize(source: Path, out: Path, ftype: int) -> None:
    """llama.cpp's quantizer in a child process (so a crash is one format's error), out appearing whole."""
    staged = out.with_name(f".{out.name}.partial-{os.getpid()}")
    process = multiprocessing.get_context("spawn").Process(target=_quantize, args=(str(source), str(staged), ftype))
    process.start()
    process.join()
    if process.exitcode != 0:
        staged.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's quantizer to ftype {ftype} failed (exit code {process.exitcode})")
    os.replace(staged, out)


def checkpoint_digest(hf: Path) -> str:
    """A user's checkpoint folder's identity for the file cache: its config.json and its weight files' names,
    sizes and modification times (a changed checkpoint gets new GGUF files)."""
    import hashlib

    parts = [(hf / "config.json").read_bytes()]
    for f in sorted(hf.glob("*.safetensors")):
        stat = f.stat()
        parts.append(f"{f.name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
    return hashlib.sha256(b"\0\0".join(parts)).hexdigest()[:8]


def prepare_models(root: Path, arch: str, preset: str, formats: list[str],
                   checkpoint: Path | None = None) -> tuple[Path, dict[str, Path], dict[str, str]]:
    """(HF folder, format -> GGUF file, format -> why its file is missing); written once, reused after.
    The folder name carries the synthetic generator's version (or a user checkpoint's digest), so files of an
    older generator or checkpoint are never reused."""
    from moetier.model.gguf_write import write_gguf
    from moetier.model.synth import synth_version, write_synthetic

    if checkpoint is not None:
        hf, folder = checkpoint, root / f"{checkpoint.resolve().name}-{checkpoint_digest(checkpoint)}"
    else:
        folder = root / f"{arch}-{preset}-seed0-{synth_version(arch, preset)}"
        hf = folder / "hf"
    if not (hf / "config.json").exists():
        log(f"writing the synthetic {arch} {preset} checkpoint to {hf} (once)")
        write_synthetic(hf, arch=arch, preset=preset)
    files, errors = {"F32": folder / "F32.gguf"}, {}
    if not files["F32"].exists():
        log(f"writing {files['F32']} (once)")
        write_gguf(hf, files["F32"], "F32")
    for name in (f for f in formats if f != "F32"):
        path = folder / f"{name}.gguf"
        if not path.exists():
            log(f"quantizing to {path} with llama.cpp (once)")
            try:
                quantize(files["F32"], path, FTYPES[name])
            except RuntimeError as error:
                errors[name] = str(error)
                continue
        files[name] = path
    return hf, files, errors


def weight_bytes_per_token(path: Path) -> tuple[int, dict[str, int]]:
    """(weight bytes one decoded token reads, in the file's stored bytes; expert tensors per GGML type)."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    experts, top_k = (int(reader.fields[f"{arch}.{key}"].contents()) for key in ("expert_count", "expert_used_count"))
    names = {t.name for t in reader.tensors}
    total, expert_types = 0, {}
    for t in reader.tensors:
        if "_exps." in t.name:  # [E, rows, cols] stacked: top_k of E
            total += int(t.n_bytes) // experts * top_k
            expert_types[t.tensor_type.name] = expert_types.get(t.tensor_type.name, 0) + 1
        elif t.name == "token_embd.weight" and "output.weight" in names:  # one row [D] of [V, D]
            total += int(t.n_bytes) // int(t.shape[-1])
        else:
            total += int(t.n_bytes)
    return total, expert_types
