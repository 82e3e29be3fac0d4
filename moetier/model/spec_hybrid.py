"""The hybrid architectures' layer geometry, and how their HF configs give it (qwen3_next, glm5_next).

`LinearAttention` (Gated DeltaNet, KDA), `HyperConnections`, `LatentAttention`
and `SparseIndexer` are the parts of a `ModelSpec` (moetier.model.spec) that
only the hybrids fill in. `_qwen3_next` and `_glm5_next` read a Qwen3NextConfig
and a Glm5NextTextConfig as transformers reads them, with its defaults, and
return the ModelSpec fields, which ModelSpec.from_hf_config builds and
validates; `_moe_layers` is Qwen's rule for its MoE layers (Qwen3-MoE's too).
Invariant: a key these readers refuse is one SpecError line naming the file and
the key; counts and domains are ModelSpec.validate's to check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetier.model.hf_config import SpecError, _ConfigReader, _is_int


@dataclass(frozen=True)
class LinearAttention:
    """The geometry of a linear-attention layer: a causal depthwise convolution of `conv_kernel` taps over q, k and
    v, then a delta-rule state [value_heads, key_dim, value_dim] per layer; each key head serves value_heads /
    key_heads consecutive value heads. kind "gated_deltanet" (Qwen3-Next: one decay per head) or "kda" (GLM-5.3's
    Kimi Delta Attention: one decay per key channel, from a low-rank forget gate bounded below by `lower_bound`)."""

    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    conv_kernel: int
    kind: str = "gated_deltanet"
    lower_bound: float | None = None  # kda: the forget gate is lower_bound * sigmoid(...) (None: -exp(A) softplus(...))

    @property
    def conv_channels(self) -> int:
        """q, k and v as the convolution sees them: key_heads x key_dim twice, value_heads x value_dim."""
        return 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_dim


@dataclass(frozen=True)
class HyperConnections:
    """Manifold-constrained hyper-connections (GLM-5.3): the residual is `streams` streams; before each block they
    are collapsed into its input, after it its output is expanded back and mixed with them by a doubly stochastic
    matrix (`sinkhorn_iters` Sinkhorn-Knopp steps with floor `eps`)."""

    streams: int
    eps: float
    sinkhorn_iters: int


@dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention without rotary dims (GLM-5.3's NoPE MLA): q through a rank-`q_rank` bottleneck,
    keys and values expanded per head from one cached latent of `kv_rank` per position; heads score key_dim dims and
    return value_dim."""

    q_rank: int
    kv_rank: int
    key_dim: int
    value_dim: int


@dataclass(frozen=True)
class SparseIndexer:
    """The DSA indexer of latent-attention layers: it scores pools of `pool` consecutive positions (their keys pooled
    by a learned softmax) with `heads` ReLU heads of `head_dim`, and each query attends to the positions of its
    topk / pool best pools (plus the incomplete last pool when `select_tail`). A layer in `shared_layers` reuses the
    previous layer's selection instead of running its own indexer."""

    topk: int
    heads: int
    head_dim: int
    pool: int
    select_tail: bool
    shared_layers: tuple[int, ...] = ()


def _moe_layers(reader: _ConfigReader, layers: range, keys: dict[str, str]) -> tuple[int, ...]:
    """Qwen's MoE layers: every decoder_sparse_step-th layer not in mlp_only_layers (Qwen3-MoE, Qwen3-Next)."""
    source = reader.source
    step = reader.get("decoder_sparse_step", int, default=1)
    if step < 1:
        raise SpecError(f"{source}: key 'decoder_sparse_step' is {step} (expected an integer >= 1)")
    mlp_only = reader.get("mlp_only_layers", list, default=[])
    for layer in mlp_only:
        if not _is_int(layer, 0, len(layers) - 1):
            raise SpecError(f"{source}: key 'mlp_only_layers' holds {layer!r} (expected layer indices from 0 to num_hidden_layers - 1)")
    dense = set(mlp_only)
    keys["moe_layers"] = f"decoder_sparse_step {step}, mlp_only_layers {sorted(mlp_only)}"
    return tuple(l for l in layers if l not in dense and (l + 1) % step == 0)


def _qwen3_next(reader: _ConfigReader, common: dict[str, Any], layers: range, keys: dict[str, str]) -> dict[str, Any]:
    """Qwen3NextConfig as transformers reads it: `layer_types` (or every full_attention_interval-th layer full
    attention), the Gated DeltaNet geometry, a gated shared expert beside the routed ones; -> the ModelSpec fields."""
    source = reader.source
    types = reader.get("layer_types", list, default=None)
    if types is None:
        interval = reader.get("full_attention_interval", int, default=4)
        if interval < 1:
            raise SpecError(f"{source}: key 'full_attention_interval' is {interval} (expected an integer >= 1)")
        types = ["linear_attention" if (l + 1) % interval else "full_attention" for l in layers]
        keys["linear_layers"] = f"full_attention_interval {interval}"
    else:
        keys["linear_layers"] = "layer_types"
    if len(types) != len(layers) or any(t not in ("linear_attention", "full_attention") for t in types):
        raise SpecError(f"{source}: key 'layer_types' is {str(types)[:60]!r} (expected {len(layers)} entries, each "
                        "'linear_attention' or 'full_attention')")
    keys["num_experts"], num_experts = "num_experts", reader.get("num_experts", int)
    keys |= {"key_heads": "linear_num_key_heads", "value_heads": "linear_num_value_heads", "key_dim": "linear_key_head_dim",
             "value_dim": "linear_value_head_dim", "conv_kernel": "linear_conv_kernel_dim",
             "shared_intermediate_size": "shared_expert_intermediate_size"}
    shared = reader.get("shared_expert_intermediate_size", int, default=512)
    if shared < 1:
        raise SpecError(f"{source}: key 'shared_expert_intermediate_size' is {shared} (expected an integer >= 1)")
    return dict(
        **common,
        qk_norm=True,
        attention_bias=reader.get("attention_bias", bool, default=False),
        output_bias=reader.get("attention_bias", bool, default=False),
        sliding_window=None,
        dense_intermediate_size=reader.get("intermediate_size", int, default=5632),
        num_experts=num_experts,
        top_k=reader.get("num_experts_per_tok", int, default=10),
        moe_intermediate_size=reader.get("moe_intermediate_size", int, default=512),
        router="softmax",
        norm_topk_prob=reader.get("norm_topk_prob", bool, default=True),
        routed_scaling_factor=1.0,
        n_group=1,
        topk_group=1,
        n_shared_experts=1,
        moe_layers=_moe_layers(reader, layers, keys),
        linear_layers=tuple(l for l, t in zip(layers, types) if t == "linear_attention"),
        linear_attention=LinearAttention(
            key_heads=reader.get("linear_num_key_heads", int, default=16),
            value_heads=reader.get("linear_num_value_heads", int, default=32),
            key_dim=reader.get("linear_key_head_dim", int, default=128),
            value_dim=reader.get("linear_value_head_dim", int, default=128),
            conv_kernel=reader.get("linear_conv_kernel_dim", int, default=4)),
        attention_gate=True,
        shared_intermediate_size=shared,
        shared_expert_gate=True,
    )


def _layer_kinds(reader: _ConfigReader, key: str, layers: range, kinds: tuple[str, ...], default: list[str]) -> list[str]:
    """A per-layer list of kind names (layer_types, mlp_layer_types, indexer_types), or `default`; refused unless it has
    one entry per layer, each one of `kinds`."""
    value = reader.get(key, list, default=default)
    if len(value) != len(layers) or any(v not in kinds for v in value):
        raise SpecError(f"{reader.source}: key {key!r} is {str(value)[:60]!r} (expected {len(layers)} entries, each one of "
                        f"{', '.join(map(repr, kinds))})")
    return value


def _glm5_next(reader: _ConfigReader, common: dict[str, Any], layers: range, keys: dict[str, str]) -> dict[str, Any]:
    """Glm5NextTextConfig (the text_config of a Glm5NextConfig) as transformers reads it: KDA linear-attention layers
    and NoPE latent-attention layers with a DSA indexer (`layer_types`, `indexer_types`), hyper-connections,
    dense / sparse MLPs (`mlp_layer_types`) with clamped SwiGLUs, GLM's grouped sigmoid router; -> the ModelSpec fields."""
    source = reader.source
    count = len(layers)
    types = _layer_kinds(reader, "layer_types", layers, ("linear_attention", "indexed_attention", "full_attention"),
                         ["linear_attention" if l % 4 != 3 else "indexed_attention" for l in layers])
    mlp_types = _layer_kinds(reader, "mlp_layer_types", layers, ("dense", "sparse"),
                             ["dense"] * min(3, count) + ["sparse"] * (count - 3))
    indexers = _layer_kinds(reader, "indexer_types", layers, ("full", "shared"), ["full"] * count)
    keys |= {"key_heads": "linear_num_heads", "value_heads": "linear_num_heads", "key_dim": "linear_head_dim",
             "value_dim": "linear_head_dim", "conv_kernel": "linear_conv_kernel_dim", "lower_bound": "linear_lower_bound",
             "streams": "hc_mult", "eps": "hc_eps", "sinkhorn_iters": "hc_sinkhorn_iters", "q_rank": "q_lora_rank",
             "kv_rank": "kv_lora_rank", "value_dim_mla": "v_head_dim", "topk": "index_topk", "heads": "index_n_heads",
             "pool": "index_kpool", "shared_layers": "indexer_types", "linear_layers": "layer_types",
             "moe_layers": "mlp_layer_types", "num_experts": "n_routed_experts", "head_dim": "qk_nope_head_dim"}
    rope = reader.get("qk_rope_head_dim", int, default=0)
    if rope != 0:
        raise SpecError(f"{source}: key 'qk_rope_head_dim' is {rope} (expected 0: GLM-5.3's latent attention is NoPE)")
    heads, nope = reader.get("num_attention_heads", int), reader.get("qk_nope_head_dim", int, default=256)
    linear_heads, linear_dim = reader.get("linear_num_heads", int, default=64), reader.get("linear_head_dim", int, default=128)
    # null is meaningful here (no lower bound: the softplus gate), so only an absent key takes the default
    lower = reader.config.get("linear_lower_bound", -5.0)
    lower = None if lower is None else reader.get("linear_lower_bound", float)
    indexed = [l for l, t in zip(layers, types) if t != "linear_attention"]
    return dict(
        **(common | {"head_dim": nope, "rotary_dim": 0, "num_kv_heads": reader.get("num_key_value_heads", int, default=heads)}),
        qk_norm=False,
        attention_bias=reader.get("attention_bias", bool, default=False),
        output_bias=reader.get("attention_bias", bool, default=False),
        sliding_window=None,
        dense_intermediate_size=reader.get("intermediate_size", int, default=12288),
        num_experts=reader.get("n_routed_experts", int, default=288),
        top_k=reader.get("num_experts_per_tok", int, default=8),
        moe_intermediate_size=reader.get("moe_intermediate_size", int, default=2048),
        router="sigmoid",
        norm_topk_prob=reader.get("norm_topk_prob", bool, default=True),
        routed_scaling_factor=reader.get("routed_scaling_factor", float, default=2.5),
        n_group=reader.get("n_group", int, default=1),
        topk_group=reader.get("topk_group", int, default=1),
        n_shared_experts=reader.get("n_shared_experts", int, default=1),
        moe_layers=tuple(l for l, t in zip(layers, mlp_types) if t == "sparse"),
        linear_layers=tuple(l for l, t in zip(layers, types) if t == "linear_attention"),
        linear_attention=LinearAttention(key_heads=linear_heads, value_heads=linear_heads, key_dim=linear_dim,
                                         value_dim=linear_dim, conv_kernel=reader.get("linear_conv_kernel_dim", int, default=4),
                                         kind="kda", lower_bound=lower),
        hyper=HyperConnections(streams=reader.get("hc_mult", int, default=4), eps=reader.get("hc_eps", float, default=1e-6),
                               sinkhorn_iters=reader.get("hc_sinkhorn_iters", int, default=20)),
        latent_attention=LatentAttention(q_rank=reader.get("q_lora_rank", int, default=1536),
                                         kv_rank=reader.get("kv_lora_rank", int, default=512), key_dim=nope,
                                         value_dim=reader.get("v_head_dim", int, default=256)),
        indexer=SparseIndexer(topk=reader.get("index_topk", int, default=2048), heads=reader.get("index_n_heads", int, default=32),
                              head_dim=reader.get("index_head_dim", int, default=128), pool=reader.get("index_kpool", int, default=16),
                              select_tail=reader.get("index_kpool_always_select_tail", bool, default=True),
                              shared_layers=tuple(l for l in indexed if indexers[l] == "shared")),
        swiglu_limit=reader.get("swiglu_limit", float, default=10.0),
    )


