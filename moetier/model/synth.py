"""Synthetic Hugging Face MoE checkpoints (qwen3_moe, glm4_moe, mixtral, qwen3_next, glm5_next) with realistic routing.

`write_synthetic` writes config.json + safetensors (one file, or shards with
model.safetensors.index.json) that transformers loads with the matching
*ForCausalLM class (glm5_next: Glm5NextForConditionalGeneration, its text model
only, no vision tower), plus moetier_synth.json describing the token families that
`sample_session` (synth_sessions) draws agent-like sessions from. The routing skew comes from
the weight design in synth_routing (qwen3_next's Gated DeltaNet layers follow
it in synth_linear, glm5_next's KDA, latent attention and hyper-connections in
synth_glm5). Invariants: output bytes are a pure
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
from dataclasses import asdict, dataclass, replace

import numpy as np

from moetier.model import synth_glm5 as glm5
from moetier.model import synth_linear as linear
from moetier.model import synth_routing as design
from moetier.model.synth_tokenizer import TOKENIZER_VERSION, write_synthetic_tokenizer
from moetier.model.output import new_folder
from moetier.model.synth_glm5 import Glm5Dims, Glm5Routing
from moetier.model.synth_linear import LinearDims
from moetier.model.synth_sessions import (
    SYNTH_FORMAT_VERSION,
    SYNTH_META,
    sample_session,
    token_families,
)

__all__ = ["ARCHES", "PRESETS", "SYNTH_META", "SynthPreset", "arch_preset", "sample_session", "synth_version",
           "token_families", "write_synthetic"]

ARCHES = ("qwen3_moe", "glm4_moe", "mixtral", "qwen3_next", "glm5_next")
ROUTED_SCALING = 2.5      # glm4_moe / glm5_next routed_scaling_factor (GLM-4.5's and GLM-5.3's value)
FULL_ATTENTION_INTERVAL = 4   # qwen3_next: every 4th layer full attention, the rest Gated DeltaNet (Qwen3-Next's)


@dataclass(frozen=True)
class SynthPreset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    dense_intermediate_size: int
    vocab_size: int
    shard_bytes: int | None = None     # None: one model.safetensors; else shards of about this size
    linear: LinearDims | None = None   # qwen3_next's linear-attention layers (glm5_next's KDA: value heads x key width)
    glm5: Glm5Dims | None = None       # glm5_next's latent attention, indexer, streams (arch_preset derives them)
    glm5_routing: Glm5Routing | None = None   # glm5_next's routing geometry where it is not the preset's


PRESETS: dict[str, SynthPreset] = {
    # a forward in milliseconds; ~1.5 MB (qwen3_next ~2 MB: 4 layers, linear-attention heads 16 wide; llama.cpp's
    # qwen3next sizes keys and values by one key, so unequal widths live in the transformers-config tests)
    "tiny": SynthPreset(64, 3, 4, 2, 16, 16, 4, 32, 128, 512, linear=LinearDims(2, 4, 16, 16)),
    # the built-in demo model; ~60 MB
    "small": SynthPreset(256, 4, 8, 4, 32, 48, 6, 96, 1024, 4096, linear=LinearDims(4, 8, 32, 32)),
    # every expert row a whole 256-value block (the K-quant and IQ formats' rows), for quantized GGUF files; ~14 MB
    "blocks": SynthPreset(256, 2, 4, 2, 64, 8, 2, 256, 256, 512, linear=LinearDims(2, 4, 64, 64)),
    # ~1.1 GB, fine-grained like Qwen3-Next (many small experts, top-10, many layers):
    # decode touches ~200 MB of weights per token, far beyond the caches (memory-bound)
    "medium": SynthPreset(512, 16, 8, 2, 64, 80, 10, 128, 1024, 16384, shard_bytes=300_000_000,
                          linear=LinearDims(4, 8, 64, 64)),
    # ~2.0 GB, experts of Qwen3-Next's shape (hidden 2048, width 512) in few layers: 1.6 GB of float32 experts,
    # ~0.7 GB read per decoded token: a layer's work is large next to its fixed costs (bench_decode --preset wide);
    # qwen3_next ~2.4 GB with Qwen3-Next's linear attention (16 key heads, 32 value heads, 128 wide)
    "wide": SynthPreset(2048, 4, 16, 2, 128, 32, 8, 512, 2048, 16384, shard_bytes=500_000_000,
                        linear=LinearDims(16, 32, 128, 128)),
    # Qwen3-Next's routing geometry (48 MoE layers of 512 experts, top-10) on small matrices: routing and
    # placement at the real expert count; ~0.6 GB for every arch (mixtral: 8 experts 1024 wide, the same bytes);
    # glm5_next GLM-5.3-Flash's (45 layers, 3 dense then 42 MoE of 288 experts, top-8): ~0.3 GB
    "seed": SynthPreset(128, 48, 4, 2, 32, 512, 10, 16, 256, 4096, shard_bytes=300_000_000,
                        linear=LinearDims(2, 4, 32, 32), glm5_routing=Glm5Routing(45, 3, 288, 8)),
}


def arch_preset(arch: str, preset: SynthPreset) -> SynthPreset:
    """Per-arch dims: mixtral has 8 experts top-2 with the same expert bytes per layer; qwen3_next a whole
    number of FULL_ATTENTION_INTERVAL layers (so its last layer is full attention) and linear-attention dims;
    glm5_next as many layers (every 4th latent attention), the first dense, KDA heads as wide as qwen3_next's
    key heads, latent dims in GLM-5.3's proportions, or the preset's glm5_routing where it has one."""
    if arch not in ARCHES:
        raise ValueError(f"unknown arch {arch!r}; expected one of {ARCHES}")
    routing, preset = preset.glm5_routing, replace(preset, glm5_routing=None, glm5=None)
    if arch in ("qwen3_next", "glm5_next"):
        if preset.linear is None:
            raise ValueError(f"{arch} needs a preset with linear-attention dims (SynthPreset.linear)")
        layers = -(-preset.num_layers // FULL_ATTENTION_INTERVAL) * FULL_ATTENTION_INTERVAL
        if arch == "qwen3_next":
            return replace(preset, num_layers=layers)
        lin, p = preset.linear, preset
        routing = routing or Glm5Routing(layers, 1, p.num_experts, p.top_k)
        return replace(p, num_layers=routing.num_layers, num_experts=routing.num_experts, top_k=routing.top_k,
                       num_kv_heads=p.num_heads,       # GLM-5.3's latent attention: a key and a value per head
                       linear=LinearDims(lin.value_heads, lin.value_heads, lin.key_head_dim, lin.key_head_dim, lin.conv_kernel),
                       glm5=glm5.glm5_dims(p.hidden_size, p.num_heads, p.head_dim, routing.dense_layers))
    preset = replace(preset, linear=None)
    if arch == "mixtral":
        inter = preset.moe_intermediate_size * preset.num_experts // 8
        return replace(preset, num_experts=8, top_k=2, moe_intermediate_size=inter)
    return preset


def _dims_dict(dims: SynthPreset) -> dict:
    """The dims as the version hash and moetier_synth.json hold them: without `linear` or the glm5 fields where an
    arch has none, so the other arches' versions (and the built-in model's cache) do not depend on fields they do not use."""
    out = asdict(dims)
    for key in ("linear", "glm5", "glm5_routing"):
        if out[key] is None:
            del out[key]
    return out


def layer_types(p: SynthPreset) -> list[str]:
    """qwen3_next's token mixer per layer: "full_attention" every FULL_ATTENTION_INTERVAL-th, else "linear_attention"."""
    return ["linear_attention" if (i + 1) % FULL_ATTENTION_INTERVAL else "full_attention" for i in range(p.num_layers)]


def _glm_groups(experts: int) -> tuple[int, int]:
    """(n_group, topk_group): 4 groups of >= 2 experts, 2 kept, where the count allows."""
    return (4, 2) if experts % 4 == 0 and experts // 4 >= 2 else (1, 1)


def synth_version(arch: str, preset: str) -> str:
    """A short hash of the generator's format version and the preset's dims for `arch`."""
    import hashlib

    dims = _dims_dict(arch_preset(arch, PRESETS[preset]))
    return hashlib.sha256(json.dumps([SYNTH_FORMAT_VERSION, arch, dims, TOKENIZER_VERSION], sort_keys=True).encode()).hexdigest()[:8]


def _config(arch: str, p: SynthPreset) -> dict:
    if arch == "glm5_next":
        return _glm5_config(p)
    common = {
        "architectures": [{"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                           "mixtral": "MixtralForCausalLM", "qwen3_next": "Qwen3NextForCausalLM"}[arch]],
        "model_type": arch, "hidden_size": p.hidden_size, "num_hidden_layers": p.num_layers,
        "num_attention_heads": p.num_heads, "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim, "vocab_size": p.vocab_size, "hidden_act": "silu",
        "max_position_embeddings": 4096, "tie_word_embeddings": False, "attention_dropout": 0.0,
        "num_experts_per_tok": p.top_k, "dtype": "float32", "use_cache": True,
        "bos_token_id": design.SPECIAL_TOKENS["bos"], "eos_token_id": design.SPECIAL_TOKENS["eos"],
        "pad_token_id": design.SPECIAL_TOKENS["pad"], "rope_theta": 1_000_000.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0},
    }
    if arch == "qwen3_moe":
        return common | {
            "num_experts": p.num_experts, "moe_intermediate_size": p.moe_intermediate_size,
            "intermediate_size": p.dense_intermediate_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
            "rms_norm_eps": 1e-6, "use_sliding_window": False, "sliding_window": None,
            "router_aux_loss_coef": 0.001, "output_router_logits": False}
    if arch == "qwen3_next":
        lin = p.linear
        return common | {
            "num_experts": p.num_experts, "moe_intermediate_size": p.moe_intermediate_size,
            "shared_expert_intermediate_size": p.moe_intermediate_size,
            "intermediate_size": p.dense_intermediate_size, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "attention_bias": False,
            "rms_norm_eps": 1e-6, "layer_types": layer_types(p), "partial_rotary_factor": 0.25,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.25},
            "linear_num_key_heads": lin.key_heads, "linear_num_value_heads": lin.value_heads,
            "linear_key_head_dim": lin.key_head_dim, "linear_value_head_dim": lin.value_head_dim,
            "linear_conv_kernel_dim": lin.conv_kernel, "router_aux_loss_coef": 0.001, "output_router_logits": False}
    if arch == "glm4_moe":
        n_group, topk_group = _glm_groups(p.num_experts)
        return common | {
            "n_routed_experts": p.num_experts, "n_shared_experts": 1, "first_k_dense_replace": 1,
            "moe_intermediate_size": p.moe_intermediate_size,
            "intermediate_size": p.dense_intermediate_size, "n_group": n_group,
            "topk_group": topk_group, "routed_scaling_factor": ROUTED_SCALING,
            "norm_topk_prob": True, "partial_rotary_factor": 0.5, "use_qk_norm": False,
            "attention_bias": False, "rms_norm_eps": 1e-5, "num_nextn_predict_layers": 0,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1_000_000.0,
                                "partial_rotary_factor": 0.5}}
    return common | {
        "num_local_experts": p.num_experts, "intermediate_size": p.moe_intermediate_size,
        "rms_norm_eps": 1e-5, "sliding_window": None, "router_jitter_noise": 0.0,
        "router_aux_loss_coef": 0.001, "output_router_logits": False}


def _glm5_config(p: SynthPreset) -> dict:
    """A Glm5NextConfig: the text model's keys in text_config, a vision tower small enough to build in milliseconds
    (none is written: transformers initialises it, moetier never reads it)."""
    g, lin, n_layers = p.glm5, p.linear, p.num_layers
    n_group, topk_group = _glm_groups(p.num_experts)
    text = {
        "model_type": "glm5_next_text", "vocab_size": p.vocab_size, "hidden_size": p.hidden_size,
        "num_hidden_layers": n_layers, "num_attention_heads": p.num_heads, "num_key_value_heads": p.num_kv_heads,
        "hidden_act": "silu", "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "use_cache": True,
        "tie_word_embeddings": False, "attention_bias": False, "attention_dropout": 0.0, "dtype": "float32",
        "bos_token_id": design.SPECIAL_TOKENS["bos"], "eos_token_id": design.SPECIAL_TOKENS["eos"],
        "pad_token_id": design.SPECIAL_TOKENS["pad"],
        # the MoE: GLM's grouped sigmoid router over routed experts, one shared expert, dense first layers
        "intermediate_size": p.dense_intermediate_size, "moe_intermediate_size": p.moe_intermediate_size,
        "n_routed_experts": p.num_experts, "num_experts_per_tok": p.top_k, "n_shared_experts": 1,
        "n_group": n_group, "topk_group": topk_group, "routed_scaling_factor": ROUTED_SCALING, "norm_topk_prob": True,
        "mlp_layer_types": ["dense"] * g.dense_layers + ["sparse"] * (n_layers - g.dense_layers),
        "swiglu_limit": glm5.SWIGLU_LIMIT, "router_aux_loss_coef": 0.001, "output_router_logits": False,
        # the token mixers: KDA, and NoPE latent attention over the positions a DSA indexer picks
        "layer_types": glm5.layer_types(n_layers), "indexer_types": ["full"] * n_layers,
        "q_lora_rank": g.q_rank, "kv_lora_rank": g.kv_rank, "qk_nope_head_dim": p.head_dim, "v_head_dim": p.head_dim,
        "qk_rope_head_dim": 0, "index_topk": g.index_topk, "index_kpool": g.index_pool,
        "index_kpool_always_select_tail": True, "index_n_heads": g.index_heads, "index_head_dim": g.index_head_dim,
        "linear_num_heads": lin.value_heads, "linear_head_dim": lin.key_head_dim, "linear_conv_kernel_dim": lin.conv_kernel,
        "linear_lower_bound": glm5.LOWER_BOUND,
        "hc_mult": g.streams, "hc_eps": 1e-6, "hc_sinkhorn_iters": 20,
    }
    return {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next", "text_config": text,
            "vision_config": glm5.VISION_CONFIG | {"out_hidden_size": p.hidden_size}, "tie_word_embeddings": False,
            "dtype": "float32"}


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
