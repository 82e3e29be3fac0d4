"""Small random Qwen3-Next checkpoints saved by transformers, and GGUF copies with edits, for the GGUF tests.

`save_qwen3_next` writes a Qwen3NextForCausalLM with its weights drawn
N(0, std) (norms, which Qwen3-Next stores as offsets from 1, N(0, 0.5)): at
larger scales transformers' own float32 drifts ~1e-4 from its float64.
`rewritten` copies a GGUF with metadata keys set or dropped and its tensor
list edited; `legacy_in_projection` and `with_nextn_block` are two such edits:
the fused ssm_in older converters wrote, and a NextN/MTP block after the layers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

Tensors = list[tuple[str, np.ndarray, QType]]  # (name, data as GGUFReader maps it: numpy order, type)


def save_qwen3_next(folder: Path, config: dict[str, Any], seed: int, std: float = 0.1, dtype: str = "float32") -> Path:
    import torch

    build_qwen3_next(config, seed, std).to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def build_qwen3_next(config: dict[str, Any], seed: int, std: float = 0.1):
    """A random Qwen3NextForCausalLM of this config: weights N(0, std), norms (offsets from 1) N(0, 0.5)."""
    import torch
    import transformers

    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**config)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else std)
    return model


Key = tuple[Any, GGUFValueType, GGUFValueType | None]  # value, type, element type (arrays)


def rewritten(source: Path, out: Path, keys: dict[str, Key | None] | None = None,
              tensors: Callable[[Tensors], Tensors] | None = None) -> Path:
    """A copy of `source`: keys set (name -> (value, type, element type)) or dropped (None), new ones last; the
    tensor list edited by `tensors`."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    keys, ordered = dict(keys or {}), {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        ordered[name] = keys.pop(name) if name in keys else (field.contents(), kind, field.types[1] if kind == GGUFValueType.ARRAY else None)
    for name, key in (ordered | keys).items():
        if key is not None:
            writer.add_key_value(name, key[0], key[1], sub_type=key[2])
    listed = [(t.name, np.asarray(t.data), t.tensor_type) for t in reader.tensors]
    for name, data, qtype in (tensors(listed) if tensors else listed):
        writer.add_tensor(name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def legacy_in_projection(source: Path, out: Path, key_heads: int, key_dim: int, value_width: int) -> Path:
    """`source` with each linear layer's attn_qkv + attn_gate fused back into one ssm_in whose rows are HF's
    in_proj_qkvz (per key head: q, k, then its value heads' v, then their z), as converters before the split wrote."""
    def fuse(listed: Tensors) -> Tensors:
        by_name = {name: (data, qtype) for name, data, qtype in listed}
        out_list: Tensors = []
        for name, data, qtype in listed:
            if name.endswith(".attn_gate.weight"):
                continue
            if name.endswith(".attn_qkv.weight"):
                gate = by_name[name.replace("attn_qkv", "attn_gate")][0]
                width = value_width // key_heads
                q, k, v = np.split(data, [key_heads * key_dim, 2 * key_heads * key_dim])
                heads = [np.concatenate([q[h * key_dim:(h + 1) * key_dim], k[h * key_dim:(h + 1) * key_dim],
                                         v[h * width:(h + 1) * width], gate[h * width:(h + 1) * width]]) for h in range(key_heads)]
                out_list.append((name.replace("attn_qkv", "ssm_in"), np.concatenate(heads), qtype))
                continue
            out_list.append((name, data, qtype))
        return out_list

    return rewritten(source, out, tensors=fuse)


def with_nextn_block(source: Path, out: Path, layers: int, copy_layer: int, hidden: int) -> Path:
    """`source` with a NextN/MTP block appended as block `layers` (a copy of full-attention block `copy_layer`, plus
    its eh_proj and norms), block_count and recurrent_layers grown by one and nextn_predict_layers = 1."""
    rng = np.random.default_rng(0)

    def append(listed: Tensors) -> Tensors:
        prefix = f"blk.{copy_layer}."
        block = [(f"blk.{layers}." + name[len(prefix):], data, qtype) for name, data, qtype in listed if name.startswith(prefix)]
        extra = [(f"blk.{layers}.nextn.eh_proj.weight", rng.normal(0, 0.1, (hidden, 2 * hidden)).astype(np.float32), QType.F32)]
        extra += [(f"blk.{layers}.nextn.{n}.weight", np.ones(hidden, np.float32), QType.F32) for n in ("enorm", "hnorm", "shared_head_norm")]
        return listed + block + extra

    flags = gguf.GGUFReader(source).fields["qwen3next.attention.recurrent_layers"].contents()
    return rewritten(source, out, tensors=append, keys={
        "qwen3next.block_count": (layers + 1, GGUFValueType.UINT32, None),
        "qwen3next.attention.recurrent_layers": (list(flags) + [False], GGUFValueType.ARRAY, GGUFValueType.BOOL),
        "qwen3next.nextn_predict_layers": (1, GGUFValueType.UINT32, None)})
