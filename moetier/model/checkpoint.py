"""A HF-format MoE checkpoint: spec, tensors by name, experts by (layer, expert).

`open_checkpoint(dir)` reads config.json and the safetensors header(s) — a
single `model.safetensors`, a sharded set named by `model.safetensors.index.json`,
or any `*.safetensors` in the folder — and maps the files without reading
tensor data. Experts are reached lazily per (layer, expert) in either layout a
checkpoint may use: per-expert tensors (`experts.{e}.gate_proj.weight`, Mixtral's
`w1/w3/w2`) or fused stacks (`experts.gate_up_proj` [E, 2I, D],
`experts.down_proj` [E, D, I]). `tensor(name)` comes back in float32 (a view of the
mapping when stored in float32): the trunk's matrices; experts keep the format
they are stored in (F32, F16, BF16), as views of the mapping or, stacked, as
copies in those bytes. The fingerprint hashes the config and the
tensor index (names, dtypes, shapes, byte offsets), so it identifies the
weights without reading them. An index is trusted no further than it checks:
its shard names stay inside the folder (no absolute path, no '..'; symlinks,
as in the HF cache, are followed) and every tensor it names is in the shard it
names. `open_checkpoint` is also the one place that tells formats apart: a
.gguf file, or a folder holding one GGUF set, opens as moetier.model.gguf_file's
GgufCheckpoint, which answers the same calls by the same HF names.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import torch

from moetier.model.expert_weights import DeltaNetTensors, ExpertWeights, NamedWeights
from moetier.model.formats import BY_DTYPE, F32
from moetier.model.hf_config import read_config
from moetier.model.host_memory import host_cat, host_copy
from moetier.model.safetensors_mmap import CheckpointError, SafetensorsFile, TensorEntry
from moetier.model.spec import ModelSpec
from moetier.model.untrusted import read_json

if TYPE_CHECKING:
    from moetier.model.gguf_file import GgufCheckpoint


class Checkpoint(NamedWeights):
    """Tensors of one model folder, mapped lazily; see the module docstring."""

    def __init__(self, folder: Path, spec: ModelSpec, files: list[SafetensorsFile], config: dict):
        self.folder = folder
        self.spec = spec
        self.config = config
        self._where: dict[str, SafetensorsFile] = {}
        self._in_file: dict[str, str] = {}  # a tensor's name -> its name in the file, where the two differ
        for file in files:
            for stored_name in file.entries:
                name = _text_name(spec.arch, stored_name)
                if name is None:  # a vision tower's tensor: moetier runs the text model
                    continue
                if name in self._where:
                    raise CheckpointError(f"{file.path}: tensor {stored_name!r} also appears in {self._where[name].path}")
                self._where[name] = file
                if name != stored_name:
                    self._in_file[name] = stored_name
        self._mlp = "block_sparse_moe" if spec.arch == "mixtral" else "mlp"
        # per-expert tensor names of (gate, up, down)
        self._expert_names = ("w1", "w3", "w2") if spec.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        self._fused = f"model.layers.{spec.moe_layers[0]}.{self._mlp}.experts.gate_up_proj" in self._where if spec.moe_layers else False
        self.norm_offset = spec.arch == "qwen3_next"  # Qwen3NextRMSNorm: x_normed * (1 + w)
        self.fingerprint = _fingerprint(config, {n: self.entry(n) for n in self._where})
        self._check_complete()

    # -- raw tensors --------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self._where)

    def has(self, name: str) -> bool:
        return name in self._where

    def file_name(self, name: str) -> str:
        """The name a tensor has in its file (a glm5_next file keeps its text model under model.language_model.)."""
        return self._in_file.get(name, name)

    def entry(self, name: str) -> TensorEntry:
        return self._where[name].entries[self._in_file.get(name, name)]

    def tensor(self, name: str) -> torch.Tensor:
        """float32 tensor by name: a view of the mapping when stored as float32, else a converted copy."""
        try:
            raw = self._where[name].tensor(self._in_file.get(name, name))
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found") from None
        return raw if raw.dtype == torch.float32 else raw.float()

    def load(self, name: str) -> torch.Tensor:
        """float32 tensor by name, copied into process memory (never aliases the mapping)."""
        tensor = self.tensor(name)
        return tensor.clone() if self._mapped(name) else tensor

    def drop_pages(self) -> None:
        """Release the file pages read so far from this process's resident set (SafetensorsFile.drop_pages): called
        once what runs holds its own copies, so a model is resident once, in its own bytes."""
        for file in {id(f): f for f in self._where.values()}.values():
            file.drop_pages()

    def _mapped(self, name: str) -> bool:
        return self.entry(name).dtype == "F32"

    @property
    def total_bytes(self) -> int:
        return sum(self.entry(n).nbytes for n in self._where)

    @property
    def expert_nbytes(self) -> int:
        """Bytes of one routed expert as stored (dtype of the file, not float32)."""
        if not self.spec.moe_layers:
            return 0
        experts = f"model.layers.{self.spec.moe_layers[0]}.{self._mlp}.experts"
        if self._fused:
            stacked = self.entry(f"{experts}.gate_up_proj").nbytes + self.entry(f"{experts}.down_proj").nbytes
            return stacked // self.spec.num_experts
        return sum(self.entry(f"{experts}.0.{n}.weight").nbytes for n in self._expert_names)

    def expert_format(self, layer: int) -> str:
        """The stored format of a MoE layer's experts: "F32", "BF16" or "F16" ("BF16/F32" when gate and up / down differ)."""
        experts = f"model.layers.{layer}.{self._mlp}.experts"
        names = (f"{experts}.gate_up_proj", f"{experts}.down_proj") if self._fused else \
            (f"{experts}.0.{self._expert_names[0]}.weight", f"{experts}.0.{self._expert_names[2]}.weight")
        gate, down = (self.entry(n).dtype if self.entry(n).dtype in ("F32", "F16", "BF16") else "F32" for n in names)
        return gate if gate == down else f"{gate}/{down}"

    @property
    def trunk_bytes(self) -> int:
        """Bytes of the trunk as stored (every tensor but the routed experts): what the engine holds of it, its
        matrices in their formats (norms, router and embedding of a bf16 file are held as float32: up to twice theirs)."""
        return sum(self.entry(n).nbytes for n in self._where
                   if ".experts." not in n and not n.endswith((".experts.gate_up_proj", ".experts.down_proj")))

    def expert_nbytes_at(self, layer: int) -> int:
        """Bytes of one routed expert of a MoE layer as stored (the same for every layer of a safetensors model)."""
        return self.expert_nbytes

    # -- structured access ----------------------------------------------------
    def layer_prefix(self, layer: int) -> str:
        return f"model.layers.{layer}."

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """One routed expert in its stored format (F32, F16 or BF16; another dtype as a float32 copy)."""
        experts = f"model.layers.{layer}.{self._mlp}.experts"
        if self._fused:
            (gate_up, gate_up_type), (down, down_type) = self.stored(f"{experts}.gate_up_proj"), self.stored(f"{experts}.down_proj")
            return ExpertWeights(gate_up[expert], down[expert], True, gate_up_type, down_type,
                                 swiglu_limit=self.spec.swiglu_limit)  # [2I, D], [D, I]: views
        (gate, gate_type), (up, up_type), (down, down_type) = (self.stored(f"{experts}.{expert}.{n}.weight") for n in self._expert_names)
        if gate_type != up_type:  # stacked, they must share a format
            gate, up, gate_type = gate.float(), up.float(), F32
        # gate and up are copied by the stacking anyway: copy down too, so the result owns its memory
        return ExpertWeights(host_cat([gate, up]), host_copy(down), False, gate_type, down_type,
                             swiglu_limit=self.spec.swiglu_limit)  # [2I, D], [D, I]

    def deltanet(self, layer: int) -> DeltaNetTensors:
        """A Qwen3-Next linear-attention layer in the engine's layout: in_proj_qkvz's rows, stored per key head as
        q, k, v, z, regrouped into q|k|v of every head and z (row copies in the stored format, as llama.cpp's
        converter regroups them); A_log as -exp(A_log) (float32, as transformers computes it)."""
        g, p = self.spec.linear_attention, f"model.layers.{layer}.linear_attn."
        data, qtype = self.stored(p + "in_proj_qkvz.weight")  # [Hk * (2dk + 2r dv), D]
        width = g.value_dim * (g.value_heads // g.key_heads)  # r dv: one key head's v (and z) rows
        q, k, v, z = data.reshape(g.key_heads, -1, data.shape[-1]).split([g.key_dim, g.key_dim, width, width], dim=1)
        rows = lambda t: t.reshape(-1, data.shape[-1])  # noqa: E731  [Hk, n, cols] -> [Hk * n, cols]
        return DeltaNetTensors(
            qkv=(torch.cat([rows(q), rows(k), rows(v)]), qtype), z=(rows(z).clone(), qtype),
            ba=self.stored(p + "in_proj_ba.weight"),
            conv=self.tensor(p + "conv1d.weight").reshape(g.conv_channels, g.conv_kernel).clone(),
            dt_bias=self.load(p + "dt_bias"), decay_rate=-self.tensor(p + "A_log").exp(),
            norm=self.load(p + "norm.weight"), out=self.stored(p + "out_proj.weight"))

    def stored(self, name: str) -> tuple[torch.Tensor, int]:
        """(tensor, its GGML type id) in the format stored: a view of the mapping for F32, F16 and BF16,
        a float32 copy of any other dtype."""
        try:
            raw = self._where[name].tensor(self._in_file.get(name, name))
        except KeyError:
            raise CheckpointError(f"{self.folder}: tensor {name!r} not found") from None
        qtype = BY_DTYPE.get(raw.dtype)
        return (raw.float(), F32) if qtype is None else (raw, qtype)

    def _check_complete(self) -> None:
        """Every tensor the engine will ask for exists with the shape the spec implies.

        Each is checked as it comes up, so a config claiming more layers or experts than the files hold fails
        at the first one missing, not after listing them all."""
        s = self.spec

        def expect(name: str, shape: tuple[int, ...]) -> None:
            if name not in self._where:
                raise CheckpointError(f"{self.folder}: tensor {name!r} is missing (expected shape {list(shape)})")
            got = self.entry(name).shape
            if got != shape:
                raise CheckpointError(f"{self.folder}: tensor {name!r} has shape {list(got)} (expected {list(shape)})")

        expect("model.embed_tokens.weight", (s.vocab_size, s.hidden_size))
        expect("model.norm.weight", (s.hidden_size,))
        if not s.tie_word_embeddings:
            expect("lm_head.weight", (s.vocab_size, s.hidden_size))
        inter, hidden = s.moe_intermediate_size, s.hidden_size
        for layer in range(s.num_layers):
            p = self.layer_prefix(layer)
            for name, shape in _mixer_shapes(s, layer):
                expect(p + name, shape)
            if s.is_moe(layer) and s.shared_expert_gate:
                for w, shape in _ffn_shapes(hidden, s.shared_width).items():
                    expect(f"{p}mlp.shared_expert.{w}_proj.weight", shape)
                expect(f"{p}mlp.shared_expert_gate.weight", (1, hidden))
            expect(f"{p}input_layernorm.weight", (s.hidden_size,))
            expect(f"{p}post_attention_layernorm.weight", (s.hidden_size,))
            if not s.is_moe(layer):
                for w, shape in _ffn_shapes(s.hidden_size, s.dense_intermediate_size).items():
                    expect(f"{p}mlp.{w}_proj.weight", shape)
                continue
            expect(f"{p}{self._mlp}.gate.weight", (s.num_experts, s.hidden_size))
            if self._fused:
                expect(f"{p}{self._mlp}.experts.gate_up_proj", (s.num_experts, 2 * inter, s.hidden_size))
                expect(f"{p}{self._mlp}.experts.down_proj", (s.num_experts, s.hidden_size, inter))
            else:
                shapes = tuple(_ffn_shapes(s.hidden_size, inter).values())
                for e in range(s.num_experts):
                    for w, shape in zip(self._expert_names, shapes):
                        expect(f"{p}{self._mlp}.experts.{e}.{w}.weight", shape)


def _mixer_shapes(s: ModelSpec, layer: int) -> list[tuple[str, tuple[int, ...]]]:
    """(name inside model.layers.N., shape) of every tensor of a layer's token mixer (and its hyper-connections)."""
    hidden, g, mla, index = s.hidden_size, s.linear_attention, s.latent_attention, s.indexer
    shapes: list[tuple[str, tuple[int, ...]]] = []
    if s.hyper is not None:
        n = s.hyper.streams
        for block in ("attn", "ffn"):
            shapes += [(f"hc_{block}_fn", ((2 + n) * n, n * hidden)), (f"hc_{block}_base", ((2 + n) * n,)), (f"hc_{block}_scale", (3,))]
    if s.is_linear(layer) and g.kind == "kda":  # GLM-5.3's Kimi Delta Attention
        width, d = g.value_width, g.key_dim
        shapes += [(f"self_attn.{n}_proj.weight", (width, hidden)) for n in "qkv"]
        shapes += [(f"self_attn.{n}_conv1d.weight", (width, 1, g.conv_kernel)) for n in "qkv"]
        shapes += [("self_attn.f_a_proj.weight", (d, hidden)), ("self_attn.f_b_proj.weight", (width, d)),
                   ("self_attn.dt_bias", (width,)), ("self_attn.A_log", (g.key_heads,)),
                   ("self_attn.b_proj.weight", (g.key_heads, hidden)), ("self_attn.g_a_proj.weight", (d, hidden)),
                   ("self_attn.g_b_proj.weight", (width, d)), ("self_attn.o_norm.weight", (d,)),
                   ("self_attn.o_proj.weight", (hidden, width))]
    elif s.is_linear(layer):  # Qwen3-Next's Gated DeltaNet
        shapes += [(f"linear_attn.{name}", shape) for name, shape in (
            ("in_proj_qkvz.weight", (g.conv_channels + g.value_width, hidden)), ("in_proj_ba.weight", (2 * g.value_heads, hidden)),
            ("conv1d.weight", (g.conv_channels, 1, g.conv_kernel)), ("dt_bias", (g.value_heads,)), ("A_log", (g.value_heads,)),
            ("norm.weight", (g.value_dim,)), ("out_proj.weight", (hidden, g.value_width)))]
    elif mla is not None:  # latent attention, its indexer where the layer runs one
        heads = s.num_heads
        shapes += [(f"self_attn.{name}", shape) for name, shape in (
            ("q_a_proj.weight", (mla.q_rank, hidden)), ("q_a_layernorm.weight", (mla.q_rank,)),
            ("q_b_proj.weight", (heads * mla.key_dim, mla.q_rank)), ("kv_a_proj_with_mqa.weight", (mla.kv_rank, hidden)),
            ("kv_a_layernorm.weight", (mla.kv_rank,)), ("kv_b_proj.weight", (heads * (mla.key_dim + mla.value_dim), mla.kv_rank)),
            ("o_proj.weight", (hidden, heads * mla.value_dim)))]
        if layer not in index.shared_layers:
            shapes += [(f"self_attn.indexer.{name}", shape) for name, shape in (
                ("wq_b.weight", (index.heads * index.head_dim, mla.q_rank)), ("wk.weight", (index.head_dim, hidden)),
                ("k_norm.weight", (index.head_dim,)), ("k_norm.bias", (index.head_dim,)),
                ("weights_proj.weight", (index.heads, hidden)), ("index_kpool_compress_ape", (index.pool, index.head_dim)),
                ("index_kpool_compress_gate", (index.head_dim, hidden)))]
    else:
        q_out, kv_out = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        shapes += [("self_attn.q_proj.weight", (q_out * (2 if s.attention_gate else 1), hidden)),
                   ("self_attn.k_proj.weight", (kv_out, hidden)), ("self_attn.v_proj.weight", (kv_out, hidden)),
                   ("self_attn.o_proj.weight", (hidden, q_out))]
    return shapes


TEXT_PREFIX = "model.language_model."  # a vision-language checkpoint's text model (glm5_next)


def _text_name(arch: str, name: str) -> str | None:
    """The name the engine asks for of a tensor stored as `name`: a glm5_next file's text model under
    model.language_model. answers as model.; its vision tower (model.visual.) is not read (None)."""
    if arch != "glm5_next":
        return name
    if name.startswith(TEXT_PREFIX):
        return "model." + name[len(TEXT_PREFIX):]
    return None if name.startswith("model.visual.") else name


def _ffn_shapes(hidden: int, inter: int) -> dict[str, tuple[int, int]]:
    return {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}


def _fingerprint(config: dict, entries: dict[str, TensorEntry]) -> str:
    digest = hashlib.sha256()
    # transformers_version and dtype bookkeeping do not change the weights
    canonical = {k: v for k, v in config.items() if k not in ("transformers_version", "_name_or_path")}
    digest.update(json.dumps(canonical, sort_keys=True).encode())
    for name in sorted(entries):
        e = entries[name]
        digest.update(f"{name}|{e.dtype}|{list(e.shape)}|{e.nbytes}|{e.offset}\n".encode())
    return digest.hexdigest()[:16]


def open_checkpoint(folder: str | Path) -> "Checkpoint | GgufCheckpoint":
    """Open a HF model folder (config.json + safetensors), or a .gguf file, the first file of a split set, or a
    folder without config.json holding one GGUF set (moetier.model.gguf_file): the one place that tells the formats
    apart. Raises CheckpointError / SpecError with one clear line."""
    folder = Path(folder)
    if folder.suffix.lower() == ".gguf" or (folder.is_dir() and not (folder / "config.json").exists()
                                           and any(p.suffix.lower() == ".gguf" for p in folder.iterdir())):
        from moetier.model.gguf_file import open_gguf

        return open_gguf(folder)
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: not a directory (expected a HF model folder with config.json, or a .gguf file)")
    config = read_config(folder / "config.json")
    spec = ModelSpec.from_hf_config(config, source=str(folder / "config.json"))
    index = folder / "model.safetensors.index.json"
    weight_map: dict[str, str] = {}
    if index.exists():
        weight_map = _read_index(index)
        paths = sorted({folder / shard for shard in weight_map.values()})
    elif (folder / "model.safetensors").exists():
        paths = [folder / "model.safetensors"]
    else:
        paths = sorted(folder.glob("*.safetensors"))
    if not paths:
        raise CheckpointError(f"{folder}: no safetensors weights (expected model.safetensors or an index)")
    for path in paths:
        if not path.exists():
            raise CheckpointError(f"{path}: shard named by the index is missing")
    files = [SafetensorsFile(p) for p in paths]
    by_path = {file.path: file for file in files}
    for name, shard in weight_map.items():
        if name not in by_path[folder / shard].entries:
            raise CheckpointError(f"{index}: tensor {name!r} is not in {shard}, the shard the index names for it")
    return Checkpoint(folder, spec, files, config)


def _read_index(index: Path) -> dict[str, str]:
    """The weight_map of a shard index (tensor name -> shard file), each shard a relative path inside the folder."""
    data = read_json(index, CheckpointError)
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not (isinstance(weight_map, dict) and all(isinstance(shard, str) for shard in weight_map.values())):
        raise CheckpointError(f"{index}: expected a JSON object with a 'weight_map' of tensor name -> shard file name")
    for shard in sorted(set(weight_map.values())):
        relative = PurePosixPath(shard)
        if not relative.parts or relative.is_absolute() or ".." in relative.parts or "\0" in shard:
            raise CheckpointError(f"{index}: shard {shard!r} is not a file name inside the folder "
                                  "(expected a relative name like 'model-00001-of-00002.safetensors')")
    return weight_map
