"""Synthetic Hugging Face MoE checkpoints (qwen3_moe, glm4_moe, mixtral, qwen3_next, glm5_next) with realistic routing.

`write_synthetic` writes config.json + safetensors (one file, or shards with
model.safetensors.index.json) that transformers loads with the matching
*ForCausalLM class (glm5_next: Glm5NextForConditionalGeneration, its text model
only, no vision tower), plus moetier_synth.json describing the token families that
`sample_session` (synth_sessions) draws agent-like sessions from. The routing skew comes from
the weight design in synth_routing (qwen3_next's Gated DeltaNet layers follow
it in synth_linear, glm5_next's KDA, latent attention and hyper-connections in
synth_glm5); the presets, each arch's dims and config.json are synth_config's. Invariants: output bytes are a pure
function of (arch, preset, seed, fused), whatever the BLAS or thread count;
tensors are streamed one at a time, expert-major, so one expert's tensors are
contiguous in the file and memory stays at one tensor (plus the embedding);
the model directory appears, fsynced, only when it is complete.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from moetier.model import synth_glm5 as glm5
from moetier.model import synth_linear as linear
from moetier.model import synth_routing as design
from moetier.model.synth_tokenizer import write_synthetic_tokenizer
from moetier.model.output import new_folder
from moetier.model.synth_config import (ARCHES, PRESETS, ROUTED_SCALING, SynthPreset, _config, _dims_dict, _glm_groups,
                                        arch_preset, layer_types, synth_version)
from moetier.model.synth_sessions import (
    SYNTH_FORMAT_VERSION,
    SYNTH_META,
    sample_session,
    token_families,
)

__all__ = ["ARCHES", "PRESETS", "SYNTH_META", "SynthPreset", "arch_preset", "sample_session", "synth_version",
           "token_families", "write_synthetic"]

# --- tensor plan -------------------------------------------------------------

Chunks = Callable[[], Iterator[np.ndarray]]


@dataclass(frozen=True)
class _Tensor:
    name: str
    shape: tuple[int, ...]
    chunks: Chunks        # yields float32 arrays whose bytes, concatenated, are the tensor
    group: str            # tensors of one group never straddle a shard boundary

    @property
    def nbytes(self) -> int:
        return 4 * int(np.prod(self.shape))


def _one(fn: Callable[[], np.ndarray]) -> Chunks:
    return lambda: iter([np.ascontiguousarray(fn(), dtype=np.float32)])


class _Plan:
    """Every tensor of one checkpoint, in file order, each with a lazy value."""

    def __init__(self, arch: str, p: SynthPreset, seed: int, fused: bool):
        self.arch, self.p, self.seed, self.fused = arch, p, seed, fused
        self.family = design.family_of_tokens(p.vocab_size, seed)          # [V]
        self.sub = design.subspaces(p.hidden_size, seed)
        self.glm = arch in ("glm4_moe", "glm5_next")     # GLM's router, correction bias and shared expert
        self.router_kind = "sigmoid" if self.glm else "softmax"
        self.first_moe = p.glm5.dense_layers if arch == "glm5_next" else 1 if arch == "glm4_moe" else 0
        # qwen3_next's RMSNorms scale by 1 + w (zero-centred), but for the gated one inside linear attention
        self.norm_centre = 0.0 if arch == "qwen3_next" else 1.0
        self.mixers = layer_types(p) if arch == "qwen3_next" else glm5.layer_types(p.num_layers) if arch == "glm5_next" \
            else ["full_attention"] * p.num_layers
        self.text = "model.language_model." if arch == "glm5_next" else "model."   # a vision-language model's text model
        self.tensors: list[_Tensor] = []
        self._build()

    def moe_layers(self) -> range:
        return range(self.first_moe, self.p.num_layers)

    def _add(self, name: str, shape: tuple[int, ...], fn: Callable[[], np.ndarray], group: str = "") -> None:
        self.tensors.append(_Tensor(name, shape, _one(fn), group or name))

    def _norm(self, name: str, n: int, centre: float | None = None) -> None:
        # an effective weight near 1, not exactly 1, so that a loader which swaps two norms is caught by parity tests
        c = self.norm_centre if centre is None else centre
        self._add(name, (n,), lambda: c + design.normal(self.seed, name, (n,), 0.05))

    def _build(self) -> None:
        p, s = self.p, self.seed
        emb = design.embeddings(self.family, self.sub, s)                  # [V, D]
        self._add(self.text + "embed_tokens.weight", emb.shape, lambda: emb)
        for layer in range(p.num_layers):
            self._layer(layer)
        self._norm(self.text + "norm.weight", p.hidden_size)
        self._add("lm_head.weight", emb.shape, lambda: design.lm_head(emb, self.sub, p.num_layers, s))

    def _layer(self, layer: int) -> None:
        p, D = self.p, self.p.hidden_size
        pre = f"{self.text}layers.{layer}."
        self._hyper(pre + "hc_attn_", 2 * layer)
        self._norm(pre + "input_layernorm.weight", D)
        if self.arch == "glm5_next":
            self._specs(glm5.kda(self.seed, pre + "self_attn.", self.sub, p.linear, layer)
                        if self.mixers[layer] == "linear_attention" else
                        glm5.latent_attention(self.seed, pre + "self_attn.", self.sub, p.glm5, p.num_heads, p.head_dim, layer))
        elif self.mixers[layer] == "linear_attention":
            self._linear_attention(layer, pre + "linear_attn.")
        else:
            self._attention(layer, pre + "self_attn.")
        self._hyper(pre + "hc_ffn_", 2 * layer + 1)
        self._norm(pre + "post_attention_layernorm.weight", D)
        if layer < self.first_moe:
            self._mlp(pre + "mlp.", p.dense_intermediate_size, f"L{layer}.dense", layer, 1.0)
            return
        moe = pre + ("block_sparse_moe." if self.arch == "mixtral" else "mlp.")
        self._add(moe + "gate.weight", (p.num_experts, D), lambda: self._router(layer))
        if self.glm:
            self._add(moe + "gate.e_score_correction_bias", (p.num_experts,),
                      lambda: design.correction_bias(self.mass(layer), design.session_family_mix()))
            self._mlp(moe + "shared_experts.", p.moe_intermediate_size, f"L{layer}.shared", layer, 0.5)
        if self.arch == "qwen3_next":
            # sigmoid(gate) * shared expert writes ~0.5 * UPDATE_RMS, as GLM's ungated shared expert does
            self._mlp(moe + "shared_expert.", p.moe_intermediate_size, f"L{layer}.shared", layer, 0.5 / design.GATE_SIGMOID_RMS)
            self._add(moe + "shared_expert_gate.weight", (1, D), lambda: self._gate_rows(moe + "shared_expert_gate", 1, layer))
        self._experts(layer, moe + "experts.")

    def _specs(self, specs: list[glm5.Spec]) -> None:
        for name, shape, fn in specs:
            self._add(name, shape, fn)

    def _hyper(self, prefix: str, sublayers_before: int) -> None:
        """glm5_next's hyper-connection around the next block (synth_glm5.hyper_base: a plain residual)."""
        if self.arch == "glm5_next":
            self._specs(glm5.hyper(self.seed, prefix, self.sub, self.p.glm5.streams, sublayers_before))

    def _gate_rows(self, key: str, rows: int, layer: int) -> np.ndarray:
        """[rows, D] logits of a sigmoid gate: identity reads of rms GATE_LOGIT_RMS (a gate near 0.5 that varies by token)."""
        read = design.reader(design.rng_for(self.seed, key), self.sub, rows, 2 * layer, identity_only=True)
        return read * np.float32(design.GATE_LOGIT_RMS)

    def _attention(self, layer: int, pre: str) -> None:
        p, s, D = self.p, self.seed, self.p.hidden_size
        H, KV, hd = p.num_heads * p.head_dim, p.num_kv_heads * p.head_dim, p.head_dim
        gated = self.arch == "qwen3_next"
        q_key = pre + "q_proj.weight"
        if gated:   # per head: hd query rows, then hd rows of the sigmoid gate on that head's output
            def q_rows() -> np.ndarray:
                q = design.normal(s, q_key, (H, D), D**-0.5).reshape(p.num_heads, 1, hd, D)
                g = self._gate_rows(q_key + ".gate", H, layer).reshape(p.num_heads, 1, hd, D)
                return np.concatenate([q, g], axis=1).reshape(2 * H, D)                   # [2H, D]
            self._add(q_key, (2 * H, D), q_rows)
        else:
            self._add(q_key, (H, D), lambda: design.normal(s, q_key, (H, D), D**-0.5))
        k_key = pre + "k_proj.weight"
        self._add(k_key, (KV, D), lambda: design.normal(s, k_key, (KV, D), D**-0.5))
        v_key = pre + "v_proj.weight"
        self._add(v_key, (KV, D), lambda: design.reader(
            design.rng_for(s, v_key), self.sub, KV, 2 * layer, identity_only=True))
        o_key = pre + "o_proj.weight"
        mix_rms = design.ATTN_MIX_RMS * (design.GATE_SIGMOID_RMS if gated else 1.0)
        self._add(o_key, (D, H), lambda: design.writer(design.rng_for(s, o_key), self.sub, H, mix_rms))
        if self.arch in ("qwen3_moe", "qwen3_next"):
            self._norm(pre + "q_norm.weight", hd)
            self._norm(pre + "k_norm.weight", hd)

    def _linear_attention(self, layer: int, pre: str) -> None:
        """Gated DeltaNet (synth_linear); its out-projection reads RMSNorm(o) * silu(z), rms ~ SILU_GLU_RMS."""
        s, D, lin = self.seed, self.p.hidden_size, self.p.linear
        C, qkvz = lin.conv_channels, 2 * lin.key_heads * lin.key_head_dim + 2 * lin.value_width
        self._add(pre + "in_proj_qkvz.weight", (qkvz, D), lambda: linear.in_proj_qkvz(s, pre + "qkvz", self.sub, lin, layer))
        self._add(pre + "in_proj_ba.weight", (2 * lin.value_heads, D), lambda: linear.in_proj_ba(s, pre + "ba", self.sub, lin, layer))
        self._add(pre + "conv1d.weight", (C, 1, lin.conv_kernel), lambda: linear.conv_weight(s, pre + "conv1d", lin))
        self._add(pre + "dt_bias", (lin.value_heads,), lambda: linear.decay(s, pre + "decay", lin.value_heads)[0])
        self._add(pre + "A_log", (lin.value_heads,), lambda: linear.decay(s, pre + "decay", lin.value_heads)[1])
        self._norm(pre + "norm.weight", lin.value_head_dim, centre=1.0)
        out_key = pre + "out_proj.weight"
        self._add(out_key, (D, lin.value_width), lambda: design.writer(
            design.rng_for(s, out_key), self.sub, lin.value_width, design.SILU_GLU_RMS))

    def roles(self, layer: int) -> dict[str, np.ndarray]:
        n_group = _glm_groups(self.p.num_experts)[0] if self.glm else 1
        return design.expert_roles(self.p.num_experts, self.p.top_k, layer, self.seed, n_group)

    def mass(self, layer: int) -> np.ndarray:
        roles = self.roles(layer)
        return design.target_mass(roles, self.p.num_experts)              # [F, E]

    def _router(self, layer: int) -> np.ndarray:
        return design.router_weight(self.mass(layer), self.sub, layer, self.router_kind,
                                    self.p.top_k, self.seed)               # [E, D]

    def _glu(self, key: str, inter: int, layer: int, scale: float, part: int) -> np.ndarray:
        """Part 0 gate [I, D], 1 up [I, D], 2 down [D, I] of a SwiGLU block writing rms ~scale * UPDATE_RMS."""
        s = self.seed
        if part == 2:
            return design.writer(design.rng_for(s, key + ".down"), self.sub, inter, design.SILU_GLU_RMS, scale)
        return design.reader(design.rng_for(s, key + (".gate", ".up")[part]), self.sub, inter, 2 * layer + 1)

    def _mlp(self, pre: str, inter: int, key: str, layer: int, scale: float) -> None:
        D = self.p.hidden_size
        for i, (proj, shape) in enumerate((("gate_proj", (inter, D)), ("up_proj", (inter, D)),
                                           ("down_proj", (D, inter)))):
            self._add(f"{pre}{proj}.weight", shape,
                      lambda i=i: self._glu(key, inter, layer, scale, i), group=pre)

    def _expert_scale(self) -> float:
        # The block writes sum_k w_k y_k with sum w = 1: rms ~ rms(y) sqrt(sum w^2), and
        # sum w^2 ~ 1.5 / k for the designed routing; glm4 multiplies w by routed_scaling_factor.
        gain = np.sqrt(self.p.top_k / 1.5)
        return gain / (ROUTED_SCALING if self.glm else 1.0)

    def _experts(self, layer: int, pre: str) -> None:
        p, D, inter, sc = self.p, self.p.hidden_size, self.p.moe_intermediate_size, self._expert_scale()
        key = f"L{layer}.E{{}}"
        if self.fused:
            def gate_up() -> Iterator[np.ndarray]:
                for e in range(p.num_experts):
                    yield self._glu(key.format(e), inter, layer, sc, 0)            # [I, D] gate rows
                    yield self._glu(key.format(e), inter, layer, sc, 1)            # [I, D] then up rows

            def down() -> Iterator[np.ndarray]:
                for e in range(p.num_experts):
                    yield self._glu(key.format(e), inter, layer, sc, 2)            # [D, I]
            E = p.num_experts
            self.tensors.append(_Tensor(pre + "gate_up_proj", (E, 2 * inter, D), gate_up, pre))       # [E, 2I, D]
            self.tensors.append(_Tensor(pre + "down_proj", (E, D, inter), down, pre + "down"))       # [E, D, I]
            return
        names = ("w1", "w3", "w2") if self.arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
        for e in range(p.num_experts):
            for i, (proj, shape) in enumerate(zip(names, ((inter, D), (inter, D), (D, inter)))):
                self._add(f"{pre}{e}.{proj}.weight", shape,
                          lambda e=e, i=i: self._glu(key.format(e), inter, layer, sc, i), group=f"{pre}{e}")


# --- safetensors streaming writer ---------------------------------------------

def _shards(tensors: list[_Tensor], shard_bytes: int | None) -> list[list[_Tensor]]:
    if shard_bytes is None:
        return [tensors]
    shards: list[list[_Tensor]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        starts_group = i == 0 or tensors[i - 1].group != t.group
        if starts_group and size >= shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def _write_safetensors(path: pathlib.Path, tensors: list[_Tensor]) -> None:
    """One tensor in memory at a time; the header is known up front from the shapes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": "F32", "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for t in tensors:
            written = 0
            for chunk in t.chunks():
                buf = np.ascontiguousarray(chunk, dtype="<f4")
                if not np.isfinite(buf).all():
                    raise ValueError(f"{t.name}: non-finite values")
                f.write(memoryview(buf).cast("B"))
                written += buf.nbytes
            if written != t.nbytes:
                raise AssertionError(f"{t.name}: wrote {written} bytes, shape needs {t.nbytes}")
        f.flush()
        os.fsync(f.fileno())


def _write_text(path: pathlib.Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _synth_meta(plan: _Plan, arch: str, preset: str, dims: SynthPreset) -> dict:
    tokens = design.family_tokens(plan.family, plan.seed)
    layers = {}
    for layer in plan.moe_layers():
        layers[str(layer)] = {k: v.tolist() for k, v in plan.roles(layer).items()}
    return {
        "format": "moetier-synth", "version": SYNTH_FORMAT_VERSION, "arch": arch, "preset": preset,
        "seed": plan.seed, "fused": plan.fused, "dims": _dims_dict(dims),
        "phases": list(design.PHASE_FAMILIES), "special_tokens": design.SPECIAL_TOKENS,
        # token ids per family in frequency-rank order (first = most frequent in sessions)
        "families": {k: v.tolist() for k, v in tokens.items()},
        # designed expert sets per MoE layer: core, explore, edit, verify, second_language, tail
        "expert_roles": layers,
    }


def write_synthetic(out_dir, arch: str = "qwen3_moe", preset: str = "tiny", seed: int = 0,
                    fused: bool = False) -> pathlib.Path:
    """Write a synthetic checkpoint to out_dir (must not exist, or be empty); returns its path.
    It appears whole or not at all (moetier.model.output.new_folder), even on SIGTERM."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; expected one of {tuple(PRESETS)}")
    dims = arch_preset(arch, PRESETS[preset])
    out = pathlib.Path(out_dir)
    with new_folder(out) as tmp:
        plan = _Plan(arch, dims, seed, fused)
        shards = _shards(plan.tensors, dims.shard_bytes)
        if len(shards) == 1:
            _write_safetensors(tmp / "model.safetensors", shards[0])
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_safetensors(tmp / fname, shard)
                weight_map.update({t.name: fname for t in shard})
            index = {"metadata": {"total_size": sum(t.nbytes for t in plan.tensors)},
                     "weight_map": weight_map}
            _write_text(tmp / "model.safetensors.index.json", json.dumps(index, indent=2) + "\n")
        # The generator's identity goes into config.json, so the model fingerprint (config + tensor
        # index) tells apart two synthetic models that differ only in seed or generator version.
        config = _config(arch, dims) | {"moetier_synthetic": {"seed": seed, "version": synth_version(arch, preset)}}
        _write_text(tmp / "config.json", json.dumps(config, indent=2) + "\n")
        _write_text(tmp / SYNTH_META, json.dumps(_synth_meta(plan, arch, preset, dims)) + "\n")
        write_synthetic_tokenizer(tmp)  # a real tokenizer.json: the model takes and prints text
    return out
