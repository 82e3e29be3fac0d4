"""`bias write`: bake a bias table into a copy of a sigmoid-router checkpoint.

GLM-4 MoE / DeepSeek-V3 style routers select by sigmoid score plus a
per-expert `e_score_correction_bias`; moetier's table for such a model lives
in the same (probability) space, so correction_bias + table routes exactly as
moetier does with the table. The copy: shards holding a correction bias are
rewritten with safetensors (every other tensor carried over as stored, dtype
and metadata kept); every other file is hard-linked (copied when linking is not
possible); config.json records where the bias came from, which also changes
the copy's fingerprint, so the table cannot be applied twice. An engine that
knows nothing of moetier then routes with the bias. Invariant: the new folder
appears only when it is complete and its correction biases check out (staged
by moetier.model.output.new_folder: nothing is left behind on an error, Ctrl-C
or SIGTERM); --out is refused before any work when it is, or lies inside, the
--model folder or the table.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from moetier.engine.router_bias import BiasError, load_table
from moetier.model.output import check_output, new_folder

CORRECTION = "mlp.gate.e_score_correction_bias"


@dataclass
class WriteResult:
    out: Path
    fingerprint: str
    rewritten: list[str] = field(default_factory=list)
    linked: list[str] = field(default_factory=list)
    copied: list[str] = field(default_factory=list)


def _correction_name(layer: int) -> str:
    return f"model.layers.{layer}.{CORRECTION}"


def _carry(source: Path, target: Path, result: WriteResult, relative: str) -> None:
    try:
        os.link(source, target)
        result.linked.append(relative)
    except OSError:  # another file system, or links not allowed
        shutil.copy2(source, target)
        result.copied.append(relative)


def _rewrite_shard(source: Path, target: Path, rows: dict[str, np.ndarray]) -> None:
    """Copy a safetensors file, adding rows[name] [E] to the correction biases it holds."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(source), framework="pt") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    for name, row in rows.items():
        if name in tensors:
            stored = tensors[name]
            tensors[name] = (stored.float() + torch.from_numpy(row)).to(stored.dtype)  # [E]
    save_file(tensors, str(target), metadata=metadata)


def write_biased_checkpoint(model_dir: Path, table_path: Path, out_dir: Path) -> WriteResult:
    from moetier.model import open_checkpoint

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    check_output(out_dir, "--out", [("--model", model_dir), ("--table", table_path)], kind="new folder")
    checkpoint = open_checkpoint(model_dir)
    spec = checkpoint.spec
    names = [_correction_name(layer) for layer in spec.moe_layers]
    if spec.router != "sigmoid" or not all(checkpoint.has(n) for n in names):
        raise BiasError(f"{model_dir}: bias write needs a sigmoid-router checkpoint with e_score_correction_bias "
                        f"(glm4_moe); this {spec.arch} model has none: apply the table at run time with --bias")
    table = load_table(table_path, spec, checkpoint.fingerprint)
    rows = {name: table.bias[i].astype(np.float32) for i, name in enumerate(names)}  # name -> [E]
    result = WriteResult(out_dir, "")
    with new_folder(out_dir) as tmp:
        shutil.copymode(model_dir, tmp)
        for folder, subfolders, files in os.walk(model_dir):
            subfolders[:] = [d for d in subfolders if not d.startswith(".")]
            for name in sorted(files):
                source = Path(folder) / name
                relative = str(source.relative_to(model_dir))
                target = tmp / relative
                target.parent.mkdir(parents=True, exist_ok=True)
                if relative == "config.json":
                    config = json.loads(source.read_text())
                    config["moetier_router_bias"] = {
                        "table": Path(table_path).name, "kind": table.kind, "hot": table.hot_size,
                        "cap": table.cap if np.isfinite(table.cap) else None, "space": table.space,
                        "profile_fingerprint": table.profile_fingerprint, "source_fingerprint": checkpoint.fingerprint}
                    target.write_text(json.dumps(config, indent=2) + "\n")
                    result.rewritten.append(relative)
                elif name.endswith(".safetensors") and _holds_correction(source):
                    _rewrite_shard(source, target, rows)
                    shutil.copymode(source, target)
                    result.rewritten.append(relative)
                else:
                    _carry(source, target, result, relative)
        written = open_checkpoint(tmp)
        for i, layer in enumerate(spec.moe_layers):
            expected = checkpoint.router_bias(layer).numpy() + table.bias[i]  # [E] float32
            got = written.router_bias(layer).numpy()  # [E]
            exact = checkpoint.entry(_correction_name(layer)).dtype == "F32"
            if not (np.array_equal(expected, got) if exact else np.allclose(expected, got, rtol=1e-2, atol=1e-3)):
                raise BiasError(f"{tmp}: layer {layer} correction bias does not equal original + table after writing")
        result.fingerprint = written.fingerprint
    return result


def _holds_correction(path: Path) -> bool:
    """Whether a safetensors file holds a router correction bias (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return any(key.endswith(CORRECTION) for key in f.keys())
