"""GGUF files, as llama.cpp writes them, read into moetier's checkpoint interface by HF tensor name.

`open_gguf(path)` opens a .gguf file, the first file of a split set
(NAME-00001-of-0000N.gguf: all N are opened; one missing is one error), or the
one GGUF set in a folder, through gguf.GGUFReader: memory-mapped, nothing read
until used. The spec comes from the metadata (moetier.model.gguf_spec). A
`GgufCheckpoint` answers what the engine asks a safetensors `Checkpoint`
(spec, fingerprint, tensor/load by HF name, expert, router, dense and shared
MLPs, sizes) with the values transformers sees in the HF checkpoint: where
llama.cpp's converter changed a value (Mixtral's Q/K rows, permuted for its
interleaved RoPE) the change is undone here. Qwen3-Next's changes are not all
undone: its norms hold 1 + w (`norm_offset` False says so), and the tensors
the converter made that no HF tensor holds (attn_qkv and attn_gate, split from
in_proj_qkvz; ssm_a = -exp(A_log)) keep their GGUF names; `deltanet(layer)`
serves a linear-attention layer in the engine's layout, the converter's own.
GLM-5.3's (glm5-next) are undone by HF name: kv_b_proj from k_b (transposed
back) and v_b, in their bytes when both are F32 / F16 / BF16 (a block format
is dequantized: its rows run along the other axis); A_log as the float32 whose
exp is -ssm_a, the value llama.cpp computes with, bit for bit (-exp cannot be
undone exactly, but the engine only ever takes the exp of A_log); conv taps
{K, 1, C, 1} as [C, 1, K].
Routed experts come out in their
stored bytes (`expert`, `stored`: uint8 GGML blocks, or F32/F16/BF16 values),
which every tier holds and computes from, and so do the trunk's matrices
(`stored`; `trunk_bytes` of RAM); `tensor` and `load` give float32 values,
dequantized by `dequantize` (gguf.quants, numpy): the norms and the router.
A layer's gate and up stacks must share a format (they are stacked into one
matrix).
Every read of the file is bounds-checked before it is made (moetier.model.gguf_read, which also finds a split
set's files), so a truncated or malformed file is one CheckpointError naming it, never a traceback or a hang.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType

from moetier.model.expert_weights import DeltaNetTensors, ExpertWeights, NamedWeights
from moetier.model.formats import BF16, F16, F32, GGML_FORMATS
from moetier.model.gguf_shapes import required_tensors
from moetier.model.gguf_spec import CONVERTED, EXPERT_STACKS, GGUF_ARCHITECTURES, expert_hf_name, hf_name, moe_prefix, spec_from_gguf, spec_keys
from moetier.model.gguf_read import _first_file, _metadata, _read, _split_paths
from moetier.model.gguf_undo import exp_preimage, kv_b_proj, unpermute
from moetier.model.host_memory import host_cat, host_copy
from moetier.model.safetensors_mmap import CheckpointError

# the GGML types moetier reads experts in: the stored formats (moetier.model.formats, the one table to extend)
EXPERT_TYPES = tuple(QType(qtype) for qtype in GGML_FORMATS)
# and the trunk in: those and the other types the gguf package dequantizes (the ternary TQ1_0 / TQ2_0), each
# dequantized to float32 once at load
DEQUANTIZED = EXPERT_TYPES + (QType.TQ1_0, QType.TQ2_0)
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")
_KEPT = {name for names in CONVERTED["qwen3_next"].values() for name in names}  # by GGUF name: no HF tensor holds these
# tensors of layouts llama.cpp can write that moetier does not read yet -> what they are
_NOT_YET = {"attn_qkv.weight": "fused Q/K/V (convert_hf_to_gguf.py --fuse-qkv)",
            "ffn_gate_up_exps.weight": "fused gate/up experts (--fuse-gate-up-exps)",
            "rope_freqs.weight": "RoPE frequency factors (llama3 rope scaling)"}


def dequantize(raw: np.ndarray, qtype: QType) -> np.ndarray:
    """float32 values of GGUF tensor data as GGUFReader maps it (elements, or rows of quantized blocks), in numpy
    order: a view of the mapping for F32, else a new array, bit for bit what gguf.quants computes."""
    if qtype not in DEQUANTIZED:
        raise CheckpointError(f"GGML type {qtype.name} is not supported yet (expected one of {', '.join(t.name for t in DEQUANTIZED)})")
    return gguf.quants.dequantize(raw, qtype)


@dataclass(frozen=True, eq=False)
class _Source:
    """Where one HF-named tensor lives: a GGUF tensor, one expert's slice of it, and what to undo: the Q/K
    permutation, a reshape to the HF shape, or glm5-next's kv_b (`partner`: v_b) and A_log."""

    tensor: gguf.ReaderTensor
    expert: int | None = None
    permuted_heads: int | None = None
    shape: tuple[int, ...] | None = None
    undo: str | None = None  # "kv_b" or "exp"
    partner: gguf.ReaderTensor | None = None

    @property
    def mapped(self) -> bool:
        """Whether the float32 values alias the file mapping (stored as F32, nothing undone but a reshape)."""
        return self.tensor.tensor_type == QType.F32 and self.permuted_heads is None and self.undo is None


def _ne(shape) -> str:
    return "{" + ", ".join(str(int(d)) for d in shape) + "}"


class GgufCheckpoint(NamedWeights):
    """The tensors of one GGUF file or split set, by HF name; see the module docstring. `folder` is the path
    opened (the first file of a set): where the model came from, as a Checkpoint's folder is."""

    def __init__(self, path: Path, files: list[Path], readers: list[gguf.GGUFReader], meta: dict[str, Any], lengths: dict[str, int]):
        self.folder = path
        self.files = files
        self._readers = readers
        self.metadata = meta
        self._tensors: dict[str, gguf.ReaderTensor] = {}
        self._offsets: dict[str, str] = {}  # name -> "file index:offset in its data section", for the fingerprint
        for index, (file, reader) in enumerate(zip(files, readers)):
            for t in reader.tensors:
                if t.name in self._tensors:
                    raise CheckpointError(f"{file}: tensor {t.name!r} also appears in an earlier file of the set")
                self._tensors[t.name] = t
                self._offsets[t.name] = f"{index}:{t.data_offset - reader.data_offset}"
        self.spec = spec_from_gguf(meta, list(self._tensors), lengths.get("tokenizer.ggml.tokens"), str(path))
        self._mlp = moe_prefix(self.spec.arch)  # HF names of the MoE block, for NamedWeights
        self._check_complete()
        self._sources = self._index()
        for source in self._sources.values():
            kind, allowed = ("experts", EXPERT_TYPES) if source.expert is not None else ("trunk tensors", DEQUANTIZED)
            if source.tensor.tensor_type not in allowed:
                raise CheckpointError(f"{path}: tensor {source.tensor.name!r} is {source.tensor.tensor_type.name}: not supported yet "
                                      f"for {kind} (expected one of {', '.join(t.name for t in allowed)})")
        for layer in self.spec.moe_layers:
            gate, up = (self._tensors[f"blk.{layer}.{EXPERT_STACKS[part]}"] for part in ("gate", "up"))
            if gate.tensor_type != up.tensor_type:
                raise CheckpointError(f"{path}: tensors {gate.name!r} and {up.name!r} are {gate.tensor_type.name} and "
                                      f"{up.tensor_type.name} (expected one format: moetier stacks an expert's gate and up rows)")
        self.fingerprint = self._fingerprint()

    # -- raw tensors --------------------------------------------------------
    def names(self) -> list[str]:
        """HF names of the tensors of the model that runs (NextN/MTP blocks left out), experts one by one."""
        return sorted(self._sources)

    def has(self, name: str) -> bool:
        return name in self._sources

    def tensor(self, name: str) -> torch.Tensor:
        """float32 tensor by HF name: a view of the mapping when stored as F32, else a dequantized copy."""
        source = self._sources.get(name)
        if source is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found")
        values = self._values(source)
        if not values.flags.aligned:  # a file with an odd alignment: kernels read whole elements
            values = values.copy()
        with warnings.catch_warnings():
            # weights are read-only by contract; torch warns that the mapping is not writable
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(values)

    def _values(self, source: _Source) -> np.ndarray:
        """A source's float32 values in numpy order (HF's), what the converter changed undone."""
        raw = source.tensor.data if source.expert is None else source.tensor.data[source.expert]
        values = dequantize(raw, source.tensor.tensor_type)
        if source.permuted_heads is not None:
            values = unpermute(values, source.permuted_heads)
        if source.undo == "kv_b":
            values = kv_b_proj(values, dequantize(source.partner.data, source.partner.tensor_type))
        elif source.undo == "exp":
            values = exp_preimage(-values, f"{self.folder}: tensor {source.tensor.name!r}")
        return values if source.shape is None else values.reshape(source.shape)

    def drop_pages(self) -> None:
        """Release the file pages read so far from this process's resident set (they stay in the page cache; a later
        read maps them again): called once what runs holds its own copies, so a model is resident once."""
        for reader in self._readers:
            mapping = getattr(reader.data, "_mmap", None)  # np.memmap's mmap.mmap
            if mapping is not None:
                mapping.madvise(mmap.MADV_DONTNEED)

    float_acts = False  # F16 / BF16 matrices multiply the activations llama.cpp converts for them
    norm_offset = False  # a qwen3next file's norms hold 1 + w already (the converter added the 1)

    def stored(self, name: str) -> tuple[torch.Tensor, int]:
        """(tensor, its GGML type id) by HF name, in the bytes stored, a view of the mapping (Mixtral's Q/K rows:
        a copy, put back in HF order): float32 / float16 / bfloat16 [rows, cols] for F32 / F16 / BF16, uint8 [rows,
        row bytes] for a block format; a trunk tensor of a type outside the stored formats (TQ1_0, TQ2_0) as
        its float32 values (F32), dequantized once."""
        source = self._sources.get(name)
        if source is None:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found")
        if int(source.tensor.tensor_type) not in GGML_FORMATS or source.undo == "exp":  # TQ1_0, TQ2_0 or A_log: float32 values
            return self.load(name), F32
        if source.undo == "kv_b":  # rows of either kind: in their bytes for a float type, else float32 values
            types = {int(source.tensor.tensor_type), int(source.partner.tensor_type)}
            if len(types) > 1 or types - {F32, F16, BF16}:
                return self.load(name), F32
            # the reader maps BF16 as bytes: as 2-byte elements, so the transposition moves whole values
            data = (np.asarray(t.data).view(np.uint16) if types == {BF16} else np.asarray(t.data) for t in (source.tensor, source.partner))
            tensor = torch.from_numpy(kv_b_proj(*data))
            return (tensor.view(torch.bfloat16) if types == {BF16} else tensor), types.pop()
        raw = source.tensor.data if source.expert is None else source.tensor.data[source.expert]
        if source.permuted_heads is not None:  # whole rows move: a row's blocks stay as they are (a copy)
            raw = unpermute(raw, source.permuted_heads).copy()
        qtype = int(source.tensor.tensor_type)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # weights are read-only by contract
            tensor = torch.from_numpy(raw)
        return (tensor.view(torch.bfloat16) if qtype == BF16 else tensor), qtype

    def load(self, name: str) -> torch.Tensor:
        """float32 tensor by HF name, in process memory (never aliases the mapping)."""
        tensor = self.tensor(name)
        return tensor.clone() if self._sources[name].mapped else tensor

    @property
    def total_bytes(self) -> int:
        return sum(int(t.n_bytes) for t in self._tensors.values())

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert as stored, the largest over the MoE layers (see expert_nbytes_at)."""
        return max(self.expert_nbytes_at(layer) for layer in self.spec.moe_layers)

    # -- structured access ----------------------------------------------------
    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """One routed expert in its stored bytes (gate and up stacked: a copy; down copied beside it)."""
        (gate, gate_type), (up, _), (down, down_type) = (self.stored(expert_hf_name(self.spec.arch, layer, expert, part))
                                                         for part in ("gate", "up", "down"))
        return ExpertWeights(host_cat([gate, up]), host_copy(down), False, gate_type, down_type, float_acts=False,
                             swiglu_limit=self.spec.swiglu_limit)  # [2I, D], [D, I]

    def deltanet(self, layer: int) -> DeltaNetTensors:
        """A Qwen3-Next linear-attention layer in the engine's layout, which is the converter's: attn_qkv (every key
        head's q, then k, then every value head's v) and attn_gate in their stored bytes, or an older file's ssm_in
        (q, k, v, z per key head, as HF's in_proj_qkvz) regrouped so (row copies in the stored bytes); ssm_a holds
        -exp(A_log) already, ssm_conv1d the taps [C, K]."""
        g, b, p = self.spec.linear_attention, f"blk.{layer}.", f"model.layers.{layer}.linear_attn."
        if self.has(p + "in_proj_qkvz.weight"):
            data, qtype = self.stored(p + "in_proj_qkvz.weight")  # [Hk * (2dk + 2r dv), cols]
            width = g.value_dim * (g.value_heads // g.key_heads)  # r dv: one key head's v (and z) rows
            q, k, v, z = data.reshape(g.key_heads, -1, data.shape[-1]).split([g.key_dim, g.key_dim, width, width], dim=1)
            rows = lambda t: t.reshape(-1, data.shape[-1])  # noqa: E731  [Hk, n, cols] -> [Hk * n, cols]
            qkv, gate = (torch.cat([rows(q), rows(k), rows(v)]), qtype), (rows(z).clone(), qtype)
        else:
            qkv, gate = self.stored(b + "attn_qkv.weight"), self.stored(b + "attn_gate.weight")
        return DeltaNetTensors(
            qkv=qkv, z=gate, ba=self.stored(p + "in_proj_ba.weight"),
            conv=self.load(p + "conv1d.weight").reshape(g.conv_channels, g.conv_kernel), dt_bias=self.load(p + "dt_bias"),
            decay_rate=self.load(b + "ssm_a"), norm=self.load(p + "norm.weight"), out=self.stored(p + "out_proj.weight"))

    def shared_expert_gate(self, layer: int) -> torch.Tensor | None:
        """Qwen3-Next's shared-expert gate [1, D] (the converter stores it {D, 1}; the loader takes {D} too)."""
        gate = super().shared_expert_gate(layer)
        return None if gate is None else gate.reshape(1, -1)

    def expert_format(self, layer: int) -> str:
        """The stored format of a MoE layer's experts, e.g. "Q4_K" or "Q4_K/Q6_K" (gate and up / down)."""
        gate, down = (self._tensors[f"blk.{layer}.{EXPERT_STACKS[part]}"].tensor_type.name for part in ("gate", "down"))
        return gate if gate == down else f"{gate}/{down}"

    @property
    def trunk_bytes(self) -> int:
        """Bytes of the trunk as stored (every tensor of the blocks that run but the routed experts): what the engine
        holds of it (its matrices in their formats; norms and router are float32 in every GGUF)."""
        return sum(int(source.tensor.n_bytes) for source in self._sources.values() if source.expert is None)

    def expert_nbytes_at(self, layer: int) -> int:
        """Bytes of one routed expert of a MoE layer as stored (a mixed file's layers differ)."""
        return sum(int(self._tensors[f"blk.{layer}.{stack}"].n_bytes) for stack in EXPERT_STACKS.values()) // self.spec.num_experts

    # -- index and checks -------------------------------------------------------
    def _index(self) -> dict[str, _Source]:
        """HF name -> source, for every tensor of the blocks that run (layers past num_layers are NextN/MTP)."""
        s, sources = self.spec, {}
        stacks = {stack: part for part, stack in EXPERT_STACKS.items()}
        for name, tensor in self._tensors.items():
            match = _BLOCK.fullmatch(name)
            if match and int(match.group(1)) >= s.num_layers:
                continue
            hf = hf_name(s.arch, name)
            if hf is not None:
                heads = None
                if s.arch == "mixtral" and ".self_attn.q_proj." in hf:
                    heads = s.num_heads
                elif s.arch == "mixtral" and ".self_attn.k_proj." in hf:
                    heads = s.num_kv_heads
                shape = None
                if s.arch == "glm5_next" and "_conv1d." in hf:  # {K, 1, C, 1} (or {K, 1, C}) -> [C, 1, K]
                    shape = (s.linear_attention.value_width, 1, s.linear_attention.conv_kernel)
                sources[hf] = _Source(tensor, permuted_heads=heads, shape=shape)
            elif match and s.arch == "glm5_next" and match.group(2) == "ssm_a":  # -exp(A_log)
                sources[f"model.layers.{match.group(1)}.self_attn.A_log"] = _Source(tensor, undo="exp")
            elif match and s.arch == "glm5_next" and match.group(2) == "attn_k_b.weight":  # and attn_v_b: kv_b_proj
                sources[f"model.layers.{match.group(1)}.self_attn.kv_b_proj.weight"] = _Source(
                    tensor, undo="kv_b", partner=self._tensors[f"blk.{match.group(1)}.attn_v_b.weight"])
            elif match and s.arch == "qwen3_next" and match.group(2) in _KEPT:  # attn_qkv, attn_gate, ssm_a
                sources[name] = _Source(tensor)
            elif match and match.group(2) in stacks:
                for e in range(s.num_experts):
                    sources[expert_hf_name(s.arch, int(match.group(1)), e, stacks[match.group(2)])] = _Source(tensor, e)
        return sources

    def _check_complete(self) -> None:
        """Every tensor the engine reads exists with the shape (ggml order, as llama.cpp's loader checks it: trailing
        dims of 1 aside) the metadata implies (moetier.model.gguf_shapes); the first that does not is the error."""
        s, where = self.spec, self.folder
        for name in self._tensors:
            match = _BLOCK.fullmatch(name)
            inner = match.group(2) if match else name
            if match and int(match.group(1)) >= s.num_layers:  # a NextN/MTP block: not run
                continue
            if inner in _NOT_YET and not (match and inner == "attn_qkv.weight" and s.is_linear(int(match.group(1)))):
                raise CheckpointError(f"{where}: tensor {name!r}: {_NOT_YET[inner]} is not supported yet")
        for name, dims in required_tensors(s, spec_keys(GGUF_ARCHITECTURES[s.arch], self.metadata), set(self._tensors)):
            ne = tuple(size for size, _ in dims)
            if name not in self._tensors:
                raise CheckpointError(f"{where}: tensor {name!r} is missing (expected shape {_ne(ne)}, ggml order)")
            t = self._tensors[name]
            got = tuple(int(n) for n in t.shape)
            if len(got) > len(ne) and all(n == 1 for n in got[len(ne):]):  # {D, 1} is {D} to the loader
                got = got[: len(ne)]
            elif len(got) < len(ne) and got + (1,) * (len(ne) - len(got)) == ne:  # and {D} is {D, 1}: llama.cpp's
                # quantizer writes ggml_n_dims dims, so one head's k_b {r, d, 1} is stored {r, d}: read as the metadata says
                self._tensors[name] = t._replace(shape=np.array(ne, dtype=t.shape.dtype),
                                                 data=t.data.reshape((1,) * (len(ne) - len(got)) + t.data.shape))
                got = ne
            if got != ne:
                why = "; ".join(f"dim {i} is {origin} = {size}" for i, (size, origin) in enumerate(dims)
                                if i >= len(got) or got[i] != size) or f"{len(got)} dims, not {len(ne)}"
                raise CheckpointError(f"{where}: tensor {name!r} has shape {_ne(self._tensors[name].shape)} (expected {_ne(ne)} from "
                                      f"the metadata, ggml order: {why})")

    def _fingerprint(self) -> str:
        """Hashes the metadata that shapes the model and the tensor index (names, types, shapes, offsets): a
        different quantization of the same model differs; a renamed model or another tokenizer does not."""
        digest = hashlib.sha256()
        arch = GGUF_ARCHITECTURES[self.spec.arch]
        # moetier.* keys are moetier's own edits of a file (a baked router bias: moetier.profile.write)
        shaping = {k: v for k, v in self.metadata.items()
                   if k == "general.architecture" or k.startswith(f"{arch}.") or k.startswith("moetier.")}
        digest.update(json.dumps(shaping, sort_keys=True).encode())
        for name in sorted(self._tensors):
            t = self._tensors[name]
            digest.update(f"{name}|{t.tensor_type.name}|{[int(d) for d in t.shape]}|{int(t.n_bytes)}|{self._offsets[name]}\n".encode())
        return digest.hexdigest()[:16]


# -- opening ----------------------------------------------------------------------


def open_gguf(path: str | Path) -> GgufCheckpoint:
    """Open a .gguf file, a split set by its first file, or a folder holding one GGUF set; raises CheckpointError /
    SpecError with one line naming the file."""
    path = Path(path)
    first = _first_file(path) if path.is_dir() else path
    reader = _read(first)
    meta, lengths = _metadata(reader, first)
    paths = _split_paths(first, meta)
    readers = [reader]
    for i, part in enumerate(paths[1:], start=1):
        readers.append(_read(part))
        part_meta, _ = _metadata(readers[-1], part)
        if part_meta.get("split.no") != i or part_meta.get("split.count") != len(paths):
            raise CheckpointError(f"{part}: keys 'split.no' = {part_meta.get('split.no')!r}, 'split.count' = "
                                  f"{part_meta.get('split.count')!r} (expected {i} and {len(paths)}: a file of another set?)")
    total = meta.get("split.tensors.count")
    if total is not None and total != sum(len(r.tensors) for r in readers):
        raise CheckpointError(f"{first}: key 'split.tensors.count' is {total} but the {len(paths)} files hold "
                              f"{sum(len(r.tensors) for r in readers)} tensors")
    return GgufCheckpoint(first, paths, readers, meta, lengths)

