"""The synthetic checkpoints' dims and config.json: presets, each arch's dims, the version hash, the HF config.

`PRESETS` are the sizes moetier synth offers (tiny .. seed); `arch_preset`
gives one arch's dims of a preset (mixtral's 8 experts, qwen3_next's whole
number of full-attention intervals, glm5_next's latent and indexer dims);
`synth_version` hashes the generator's format version with those dims;
`_config` writes the config.json transformers reads for them (glm5_next: a
Glm5NextConfig, the text model's keys in text_config). Invariant: all of it is
a pure function of (arch, preset), so two runs agree on the dims, the config
and the version that the cache and the model fingerprint rely on.
moetier.model.synth writes the tensors for these dims.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace

from moetier.model import synth_glm5 as glm5
from moetier.model import synth_routing as design
from moetier.model.synth_glm5 import Glm5Dims, Glm5Routing
from moetier.model.synth_linear import LinearDims
from moetier.model.synth_sessions import SYNTH_FORMAT_VERSION
from moetier.model.synth_tokenizer import TOKENIZER_VERSION

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
    # ~7.5 GB, `wide`'s layer 16 times over: 6.4 GB of float32 experts, ~0.9 GB even as Q4_K, so every stored format's
    # experts exceed a large last-level cache several times (the roofline's premise; bench_decode --preset deep)
    "deep": SynthPreset(2048, 16, 16, 2, 128, 32, 8, 512, 2048, 16384, shard_bytes=500_000_000,
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
