"""Model spec: the shape and routing rules of a MoE checkpoint, read from HF config.json.

One frozen `ModelSpec` describes every architecture moetier runs (qwen3_moe,
glm4_moe, mixtral, and two hybrids: qwen3_next, whose layers mix Gated
DeltaNet linear attention with gated full attention, and glm5_next, whose
layers mix KDA linear attention with NoPE latent attention over positions a
sparse indexer picks, on hyper-connected residual streams). The engine reads only this spec, never the raw config, so
architecture differences live here and nowhere else (the hybrids' layer geometry and their config readers in
moetier.model.spec_hybrid; the config.json itself read, its keys typed, by moetier.model.hf_config). Invariant: a spec that
builds is complete — every field the engine needs has a concrete value — and
valid: every constructor path ends in `ModelSpec.validate`, which checks that
every count is positive and consistent (top-k within the experts and the kept
groups, heads dividing, at least one MoE layer) and every float finite and in
its domain, so the engine and its native kernels never see a spec they would
crash on. A config moetier cannot run exactly is refused with one `SpecError`
line naming the file and the key, never approximated.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal, NoReturn, get_args

from moetier.model.hf_config import SpecError, _ConfigReader, _is_int, read_config
from moetier.model.spec_hybrid import (HyperConnections, LatentAttention, LinearAttention, SparseIndexer, _glm5_next,
                                       _moe_layers, _qwen3_next)

ARCHITECTURES = ("qwen3_moe", "glm4_moe", "mixtral", "qwen3_next", "glm5_next")

RouterKind = Literal["softmax", "sigmoid"]

MAX_COUNT = 2**31 - 1  # no dimension of a real model comes near; beyond it sizes only overflow what they index
MAX_LAYERS = 65536  # a model of more layers than this is a malformed file, not a model (the spec holds a tuple per layer)
# field that counts something -> the most it may be (the least is 1); in this order, so a count is refused
# before a count derived from it (head_dim = hidden_size / num_attention_heads when the config gives none)
_COUNTS = {"vocab_size": MAX_COUNT, "hidden_size": MAX_COUNT, "num_layers": MAX_LAYERS, "num_heads": MAX_COUNT,
           "num_kv_heads": MAX_COUNT, "head_dim": MAX_COUNT, "dense_intermediate_size": MAX_COUNT,
           "num_experts": MAX_COUNT, "moe_intermediate_size": MAX_COUNT, "n_group": MAX_COUNT}


@dataclass(frozen=True)
class ModelSpec:
    arch: str
    vocab_size: int
    hidden_size: int  # D
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int  # leading head dims that rotate (partial rotary: GLM)
    rms_norm_eps: float
    qk_norm: bool
    attention_bias: bool  # bias on the q/k/v projections
    output_bias: bool  # bias on o_proj (Qwen3-MoE ties it to attention_bias)
    sliding_window: int | None
    tie_word_embeddings: bool
    dense_intermediate_size: int  # I of dense (non-MoE) MLP layers
    num_experts: int  # E routed experts per MoE layer
    top_k: int  # k
    moe_intermediate_size: int  # I of one routed expert
    router: RouterKind
    norm_topk_prob: bool
    routed_scaling_factor: float
    n_group: int
    topk_group: int
    n_shared_experts: int
    moe_layers: tuple[int, ...]  # layer indices whose MLP is a MoE block
    max_position_embeddings: int | None = None  # the context the model was built for (None: the config does not say)
    # qwen3_next: which layers mix tokens by linear attention (the rest by full attention), and how
    linear_layers: tuple[int, ...] = ()
    linear_attention: LinearAttention | None = None
    attention_gate: bool = False  # q_proj gives each head's output a sigmoid gate as wide as the head (Qwen3-Next)
    shared_intermediate_size: int = 0  # I of the shared expert MLP; 0: n_shared_experts x moe_intermediate_size (GLM)
    shared_expert_gate: bool = False  # the shared expert's output scaled by sigmoid(x . w) (Qwen3-Next)
    # glm5_next: hyper-connected residual streams, latent attention with a sparse indexer, clamped SwiGLU
    hyper: HyperConnections | None = None
    latent_attention: LatentAttention | None = None
    indexer: SparseIndexer | None = None
    swiglu_limit: float | None = None  # SwiGLU's gate clamped to <= limit, its up to [-limit, limit] (None: no clamp)

    # -- derived ------------------------------------------------------------
    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    def is_linear(self, layer: int) -> bool:
        """Whether `layer` mixes tokens by linear attention (a recurrent state) rather than attention over a KV cache."""
        return layer in self.linear_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with full attention: the ones that keep a KV cache."""
        return tuple(l for l in range(self.num_layers) if l not in self.linear_layers)

    @property
    def shared_width(self) -> int:
        """I of the shared expert MLP of a MoE layer (0: none)."""
        return self.shared_intermediate_size or self.n_shared_experts * self.moe_intermediate_size

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- validation -----------------------------------------------------------
    def validate(self, source: str = "ModelSpec", keys: Mapping[str, str] | None = None) -> ModelSpec:
        """This spec, if the engine can run it; else one SpecError naming `source` and the key.

        `keys` maps a field to the key it was read from in `source` (a field's own name where it says nothing).
        """
        keys = keys or {}

        def key(field: str) -> str:
            return keys.get(field, field)

        def refuse(field: str, expected: str) -> NoReturn:
            raise SpecError(f"{source}: key {key(field)!r} is {getattr(self, field)!r} (expected {expected})")

        if self.arch not in ARCHITECTURES or self.router not in get_args(RouterKind):
            raise SpecError(f"{source}: architecture {self.arch!r} with router {self.router!r} is not one moetier runs")
        for field, most in _COUNTS.items():
            if not _is_int(getattr(self, field), 1, most):
                refuse(field, f"an integer from 1 to {most}")
        for field in ("sliding_window", "max_position_embeddings"):
            if getattr(self, field) is not None and not _is_int(getattr(self, field), 1, MAX_COUNT):
                refuse(field, f"an integer from 1 to {MAX_COUNT}, or null")
        if not _is_int(self.n_shared_experts, 0, MAX_COUNT):
            refuse("n_shared_experts", f"an integer from 0 to {MAX_COUNT}")
        for field in ("rope_theta", "rms_norm_eps", "routed_scaling_factor"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                refuse(field, "a finite number > 0")

        if self.num_heads % self.num_kv_heads:
            raise SpecError(f"{source}: {key('num_heads')} {self.num_heads} is not a multiple of {key('num_kv_heads')} {self.num_kv_heads}")
        # the rotary table pairs dim i with dim i + rotary_dim/2 (moetier.engine.layers.RotaryTable); latent attention
        # here is NoPE: no rotary dims at all
        if self.latent_attention is not None:
            if self.rotary_dim != 0:
                raise SpecError(f"{source}: key {key('rotary_dim')!r} gives {self.rotary_dim!r} rotary dims (expected 0: "
                                "moetier's latent attention is NoPE)")
        elif not (_is_int(self.rotary_dim, 2, self.head_dim) and self.rotary_dim % 2 == 0):
            raise SpecError(f"{source}: key {key('rotary_dim')!r} gives {self.rotary_dim!r} rotary dims of head_dim {self.head_dim}"
                            " (expected an even number from 2 to head_dim)")
        if not _is_int(self.top_k, 1, self.num_experts):
            refuse("top_k", f"an integer from 1 to {key('num_experts')} = {self.num_experts}")
        if self.num_experts % self.n_group:
            raise SpecError(f"{source}: {key('num_experts')} {self.num_experts} is not a multiple of {key('n_group')} {self.n_group}")
        if not _is_int(self.topk_group, 1, self.n_group):
            refuse("topk_group", f"an integer from 1 to {key('n_group')} = {self.n_group}")
        kept = self.topk_group * (self.num_experts // self.n_group)  # experts in the groups a token may route to
        if self.top_k > kept:
            raise SpecError(f"{source}: {key('top_k')} {self.top_k} exceeds the {kept} experts of the {key('topk_group')} = "
                            f"{self.topk_group} groups a token keeps (expected at most {kept})")

        layers = self.moe_layers
        if not (isinstance(layers, tuple) and all(_is_int(l, 0, self.num_layers - 1) for l in layers)
                and list(layers) == sorted(set(layers))):
            raise SpecError(f"{source}: MoE layers {layers!r} from {key('moe_layers')} "
                            f"(expected increasing layer indices from 0 to {self.num_layers - 1})")
        if not layers:
            raise SpecError(f"{source}: no MoE layer among the {self.num_layers} layers ({key('moe_layers')}; expected at least one)")
        self._validate_hybrid(source, key)
        self._validate_latent(source, key)
        return self

    def _validate_latent(self, source: str, key: Callable[[str], str]) -> None:
        """The glm5_next fields: hyper-connection, latent-attention and indexer counts, and where shared indexers sit."""
        def count(owner: Any, field: str, least: int = 1) -> None:
            value = getattr(owner, field)
            if not _is_int(value, least, MAX_COUNT):
                raise SpecError(f"{source}: key {key(field)!r} is {value!r} (expected an integer from {least} to {MAX_COUNT})")

        def positive(owner: Any, field: str) -> None:
            value = getattr(owner, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not (math.isfinite(value) and value > 0):
                raise SpecError(f"{source}: key {key(field)!r} is {value!r} (expected a finite number > 0)")

        if self.swiglu_limit is not None:
            positive(self, "swiglu_limit")
        if self.hyper is not None:
            count(self.hyper, "streams")
            count(self.hyper, "sinkhorn_iters")
            positive(self.hyper, "eps")
        mla, index = self.latent_attention, self.indexer
        if mla is None:
            return
        for field in ("q_rank", "kv_rank", "key_dim", "value_dim"):
            count(mla, field)
        if self.num_kv_heads != self.num_heads or self.head_dim != mla.key_dim:
            raise SpecError(f"{source}: latent attention with {key('num_kv_heads')} {self.num_kv_heads} of {self.num_heads} heads "
                            f"and head dim {self.head_dim} (expected one kv head per head and head dim {key('key_dim')})")
        if index is None:
            raise SpecError(f"{source}: latent attention without an indexer (expected {key('topk')} and its keys)")
        for field in ("topk", "heads", "head_dim", "pool"):
            count(index, field)
        if index.topk % index.pool:
            raise SpecError(f"{source}: {key('topk')} {index.topk} is not a multiple of {key('pool')} {index.pool}")
        for layer in index.shared_layers:
            previous = layer - 1
            if (self.is_linear(layer) or previous < 0 or self.is_linear(previous) or previous in index.shared_layers):
                raise SpecError(f"{source}: {key('shared_layers')} makes layer {layer} reuse the previous layer's selection, "
                                "but that layer runs no indexer (expected 'shared' only right after a 'full' indexed layer)")

    def _validate_hybrid(self, source: str, key: Callable[[str], str]) -> None:
        """The qwen3_next fields: linear layers within range, their geometry complete and its heads dividing."""
        for field in ("shared_intermediate_size",):
            if not _is_int(getattr(self, field), 0, MAX_COUNT):
                raise SpecError(f"{source}: key {key(field)!r} is {getattr(self, field)!r} (expected an integer from 0 to {MAX_COUNT})")
        linear = self.linear_layers
        if not (isinstance(linear, tuple) and all(_is_int(l, 0, self.num_layers - 1) for l in linear)
                and list(linear) == sorted(set(linear))):
            raise SpecError(f"{source}: linear-attention layers {linear!r} from {key('linear_layers')} "
                            f"(expected increasing layer indices from 0 to {self.num_layers - 1})")
        geometry = self.linear_attention
        if linear and geometry is None:
            raise SpecError(f"{source}: {len(linear)} linear-attention layers from {key('linear_layers')} but no geometry for them")
        if geometry is None:
            return
        for field in ("key_heads", "value_heads", "key_dim", "value_dim", "conv_kernel"):
            if not _is_int(getattr(geometry, field), 1, MAX_COUNT):
                raise SpecError(f"{source}: key {key(field)!r} is {getattr(geometry, field)!r} (expected an integer from 1 to {MAX_COUNT})")
        if geometry.value_heads % geometry.key_heads:
            raise SpecError(f"{source}: {key('value_heads')} {geometry.value_heads} is not a multiple of "
                            f"{key('key_heads')} {geometry.key_heads}")
        if geometry.kind not in ("gated_deltanet", "kda") or (geometry.lower_bound is not None and not (
                isinstance(geometry.lower_bound, float) and math.isfinite(geometry.lower_bound) and geometry.lower_bound < 0)):
            raise SpecError(f"{source}: linear attention {geometry.kind!r} with lower bound {geometry.lower_bound!r} from "
                            f"{key('lower_bound')} (expected 'gated_deltanet' or 'kda', a finite bound < 0 or none)")

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_config_file(cls, path: str | Path) -> "ModelSpec":
        path = Path(path)
        return cls.from_hf_config(read_config(path), source=str(path))

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> "ModelSpec":
        if config.get("model_type") == "glm5_next":  # a vision-language config: the text model's keys are in text_config
            text = config.get("text_config")
            if not isinstance(text, dict):
                raise SpecError(f"{source}: glm5_next without a 'text_config' object (expected the text model's keys there)")
            # the top-level tie_word_embeddings decides whether lm_head is the embedding (Glm5NextConfig's, default False)
            tied = config.get("tie_word_embeddings", False)
            config, source = text | {"model_type": "glm5_next", "tie_word_embeddings": tied}, f"{source} text_config"
        reader = _ConfigReader(config, source)
        arch = reader.get("model_type", str)
        if arch not in ARCHITECTURES:
            raise SpecError(f"{source}: model_type {arch!r} is not supported (expected one of {', '.join(ARCHITECTURES)})")
        hidden = reader.get("hidden_size", int)
        num_heads = reader.get("num_attention_heads", int)
        num_layers = reader.get("num_hidden_layers", int)
        layers = range(num_layers if 0 < num_layers <= MAX_LAYERS else 0)  # for the per-layer rules; validate() refuses other counts
        keys = dict(_HF_KEYS)
        head_dim = reader.get("head_dim", int, default=256 if arch == "qwen3_next" else None)  # Qwen3NextConfig's default
        if head_dim is None:  # validate() refuses num_attention_heads < 1 before it reads head_dim
            head_dim, keys["head_dim"] = (hidden // num_heads if num_heads > 0 else 0), "hidden_size / num_attention_heads"
        num_kv_heads = reader.get("num_key_value_heads", int, default=num_heads)
        # GLM-4 MoE rotates half of each head unless its config says otherwise
        rope_theta, partial = reader.rope(default_partial={"glm4_moe": 0.5, "qwen3_next": 0.25}.get(arch, 1.0))
        rotary_dim = int(head_dim * partial)
        common = dict(
            arch=arch,
            vocab_size=reader.get("vocab_size", int),
            hidden_size=hidden,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            rope_theta=rope_theta,
            rotary_dim=rotary_dim,
            rms_norm_eps=reader.get("rms_norm_eps", float, default=1e-6),
            tie_word_embeddings=reader.get("tie_word_embeddings", bool, default=False),
            max_position_embeddings=reader.get("max_position_embeddings", int, default=None),
        )
        act = reader.get("hidden_act", str, default="silu")
        if act != "silu":
            raise SpecError(f"{source}: hidden_act {act!r} is not supported (expected 'silu')")

        if arch == "qwen3_moe":
            keys["num_experts"], num_experts = reader.first(("num_experts", "num_local_experts"), int)
            moe_layers = _moe_layers(reader, layers, keys)
            window = reader.get("sliding_window", int, default=None) if reader.get("use_sliding_window", bool, default=False) else None
            return cls(
                **common,
                qk_norm=True,
                attention_bias=reader.get("attention_bias", bool, default=False),
                output_bias=reader.get("attention_bias", bool, default=False),
                sliding_window=window,
                dense_intermediate_size=reader.get("intermediate_size", int),
                num_experts=num_experts,
                top_k=reader.get("num_experts_per_tok", int),
                moe_intermediate_size=reader.get("moe_intermediate_size", int),
                router="softmax",
                norm_topk_prob=reader.get("norm_topk_prob", bool, default=False),
                routed_scaling_factor=1.0,
                n_group=1,
                topk_group=1,
                n_shared_experts=0,
                moe_layers=moe_layers,
            ).validate(source, keys)
        if arch == "qwen3_next":
            return ModelSpec(**_qwen3_next(reader, common, layers, keys)).validate(source, keys)
        if arch == "glm5_next":
            return ModelSpec(**_glm5_next(reader, common, layers, keys)).validate(source, keys)
        if arch == "glm4_moe":
            keys["num_experts"], num_experts = reader.first(("n_routed_experts", "num_local_experts", "num_experts"), int)
            first_dense = reader.get("first_k_dense_replace", int, default=0)
            if not 0 <= first_dense <= len(layers):
                raise SpecError(f"{source}: key 'first_k_dense_replace' is {first_dense} (expected an integer from 0 to num_hidden_layers)")
            keys["moe_layers"] = f"first_k_dense_replace {first_dense}"
            return cls(
                **common,
                qk_norm=reader.get("use_qk_norm", bool, default=False),
                attention_bias=reader.get("attention_bias", bool, default=False),
                output_bias=False,
                sliding_window=None,
                dense_intermediate_size=reader.get("intermediate_size", int),
                num_experts=num_experts,
                top_k=reader.get("num_experts_per_tok", int),
                moe_intermediate_size=reader.get("moe_intermediate_size", int),
                router="sigmoid",
                norm_topk_prob=reader.get("norm_topk_prob", bool, default=True),
                routed_scaling_factor=reader.get("routed_scaling_factor", float, default=1.0),
                n_group=reader.get("n_group", int, default=1),
                topk_group=reader.get("topk_group", int, default=1),
                n_shared_experts=reader.get("n_shared_experts", int, default=0),
                moe_layers=tuple(l for l in layers if l >= first_dense),
            ).validate(source, keys)
        # mixtral: every layer is MoE; top-k probabilities always renormalised
        intermediate = reader.get("intermediate_size", int)
        keys["num_experts"], num_experts = reader.first(("num_local_experts", "num_experts"), int)
        keys |= {"moe_intermediate_size": "intermediate_size", "moe_layers": "num_hidden_layers"}
        return cls(
            **common,
            qk_norm=False,
            attention_bias=False,
            output_bias=False,
            sliding_window=reader.get("sliding_window", int, default=None),
            dense_intermediate_size=intermediate,
            num_experts=num_experts,
            top_k=reader.get("num_experts_per_tok", int),
            moe_intermediate_size=intermediate,
            router="softmax",
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            n_shared_experts=0,
            moe_layers=tuple(layers),
        ).validate(source, keys)


# ModelSpec field -> the config.json key it is read from, where the two names differ (validate's messages name the key)
_HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads",
            "rotary_dim": "partial_rotary_factor", "dense_intermediate_size": "intermediate_size",
            "top_k": "num_experts_per_tok"}
