"""`bias write`: bake a bias table into a copy of a sigmoid-router checkpoint.

GLM-4 MoE / GLM-5.3 / DeepSeek-V3 style routers select by sigmoid score plus a
per-expert `e_score_correction_bias`; moetier's table for such a model lives
in the same (probability) space, so correction_bias + table routes exactly as
moetier does with the table. The copy: shards holding a correction bias are
rewritten with safetensors (every other tensor carried over as stored, dtype
and metadata kept); every other file is hard-linked (copied when linking is not
possible); config.json records where the bias came from, which also changes
the copy's fingerprint, so the table cannot be applied twice. A GGUF file (or
split set) is copied whole, key by key and tensor by tensor, with each layer's
exp_probs_b plus the table's row and a `moetier.router_bias` key (which its
fingerprint covers). An engine that knows nothing of moetier (transformers,
llama.cpp) then routes with the bias. Invariant: the new folder
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
    """The biased copy of a HF folder (out_dir: a new folder) or of a GGUF file or split set (out_dir: the new file,
    or the first file of the new set, named as the source's: NAME-00001-of-0000N.gguf)."""
    from moetier.model import open_checkpoint
    from moetier.model.gguf_file import GgufCheckpoint

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    checkpoint = open_checkpoint(model_dir)
    gguf_copy = isinstance(checkpoint, GgufCheckpoint)
    if gguf_copy:
        check_output(out_dir, "--out", [("--model", p) for p in checkpoint.files] + [("--table", table_path)],
                     suffixes=(".gguf",))
    else:
        check_output(out_dir, "--out", [("--model", model_dir), ("--table", table_path)], kind="new folder")
    spec = checkpoint.spec
    names = [_correction_name(layer) for layer in spec.moe_layers]
    if spec.router != "sigmoid" or not all(checkpoint.has(n) for n in names):
        raise BiasError(f"{model_dir}: bias write needs a sigmoid-router checkpoint with e_score_correction_bias "
                        f"(glm4_moe, glm5_next); this {spec.arch} model has none: apply the table at run time with --bias")
    table = load_table(table_path, spec, checkpoint.fingerprint)
    if gguf_copy:
        return _write_biased_gguf(checkpoint, table, Path(table_path), out_dir)
    rows = {checkpoint.file_name(name): table.bias[i].astype(np.float32) for i, name in enumerate(names)}  # -> [E]
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
                    config["moetier_router_bias"] = _provenance(table, Path(table_path), checkpoint.fingerprint)
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


def _provenance(table, table_path: Path, source_fingerprint: str) -> dict:
    return {"table": table_path.name, "kind": table.kind, "hot": table.hot_size,
            "cap": table.cap if np.isfinite(table.cap) else None, "space": table.space,
            "profile_fingerprint": table.profile_fingerprint, "source_fingerprint": source_fingerprint}


GGUF_PROVENANCE = "moetier.router_bias"  # the JSON a biased GGUF copy carries (and its fingerprint covers)


def _write_biased_gguf(checkpoint, table, table_path: Path, out: Path) -> WriteResult:
    """Copy every file of a GGUF set with each MoE layer's exp_probs_b (F32 [E]) plus the table's row and, in the
    first file, GGUF_PROVENANCE; every other key and tensor as stored. The files appear together, whole, or not."""
    import gguf
    from contextlib import ExitStack

    from moetier.model.gguf_spec import GGUF_ARCHITECTURES, gguf_name
    from moetier.model.output import new_file

    spec = checkpoint.spec
    rows = {gguf_name(spec.arch, _correction_name(layer)): table.bias[i].astype(np.float32)
            for i, layer in enumerate(spec.moe_layers)}
    sources = list(checkpoint.files)
    targets = [out] if len(sources) == 1 else [out.with_name(_split_name(out.name, i + 1, len(sources))) for i in range(len(sources))]
    if len(sources) > 1 and targets[0] != out:
        raise BiasError(f"{out}: a split set's copy is named NAME-00001-of-{len(sources):05d}.gguf (expected that for --out)")
    result = WriteResult(out, "")
    provenance = json.dumps(_provenance(table, table_path, checkpoint.fingerprint))
    with ExitStack() as stack:
        staged = [stack.enter_context(new_file(target)) for target in targets]
        for index, (source, tmp) in enumerate(zip(sources, staged)):
            reader = gguf.GGUFReader(source)
            writer = gguf.GGUFWriter(tmp, GGUF_ARCHITECTURES[spec.arch], endianess=reader.endianess)
            writer.data_alignment = reader.alignment
            for field in reader.fields.values():
                if field.name == gguf.Keys.General.ARCHITECTURE or field.name.startswith("GGUF.") or field.name == GGUF_PROVENANCE:
                    continue
                kind = field.types[0]
                writer.add_key_value(field.name, field.contents(), kind,
                                     sub_type=field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
            if index == 0:
                writer.add_string(GGUF_PROVENANCE, provenance)
            for tensor in reader.tensors:
                writer.add_tensor_info(tensor.name, tensor.data.shape, tensor.data.dtype, tensor.data.nbytes, tensor.tensor_type)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for tensor in reader.tensors:
                data = tensor.data
                if tensor.name in rows:  # F32 [E], checked by the reader's shape checks
                    data = (np.asarray(data, dtype=np.float32) + rows[tensor.name]).astype(np.float32)
                writer.write_tensor_data(data, tensor_endianess=reader.endianess)
            writer.close()
        from moetier.model.gguf_file import open_gguf

        written = open_gguf(staged[0]) if len(staged) == 1 else None
        if written is not None:
            _check_written(checkpoint, written, table, spec, staged[0])
    if written is None:  # a split set is checked where it landed (its files find each other by name)
        from moetier.model import open_checkpoint

        written = open_checkpoint(out)
        _check_written(checkpoint, written, table, spec, out)
    result.fingerprint = written.fingerprint
    result.rewritten = [t.name for t in targets]
    return result


def _split_name(name: str, index: int, count: int) -> str:
    """NAME-0000i-of-0000N.gguf for the split named NAME-00001-of-0000N.gguf."""
    return name.replace(f"-00001-of-{count:05d}.gguf", f"-{index:05d}-of-{count:05d}.gguf")


def _check_written(checkpoint, written, table, spec, where) -> None:
    for i, layer in enumerate(spec.moe_layers):
        expected = checkpoint.router_bias(layer).numpy() + table.bias[i]  # [E] float32
        if not np.array_equal(expected, written.router_bias(layer).numpy()):
            raise BiasError(f"{where}: layer {layer} correction bias does not equal original + table after writing")
    if written.fingerprint == checkpoint.fingerprint:
        raise BiasError(f"{where}: the copy has the source's fingerprint (its table could be applied twice)")


def _holds_correction(path: Path) -> bool:
    """Whether a safetensors file holds a router correction bias (reads the header only)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="numpy") as f:
        return any(key.endswith(CORRECTION) for key in f.keys())
