"""Model spec: the shape and routing rules of a MoE checkpoint, read from HF config.json.

One frozen `ModelSpec` describes every architecture moetier runs (qwen3_moe,
glm4_moe, mixtral). The engine reads only this spec, never the raw config, so
architecture differences live here and nowhere else. Invariant: a spec that
builds is complete — every field the engine needs has a concrete value — and
a config moetier cannot run exactly is refused with `SpecError`, never
approximated.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

ARCHITECTURES = ("qwen3_moe", "glm4_moe", "mixtral")

RouterKind = Literal["softmax", "sigmoid"]


class SpecError(ValueError):
    """A config.json moetier cannot run: names the file, the key and what was expected."""


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

    # -- derived ------------------------------------------------------------
    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def expert_bytes(self) -> int:
        """Bytes one routed expert (gate, up, down) takes in a tier: the float32 copy moetier.tiers.host_experts
        holds, whatever the checkpoint stores (a bf16 file's experts take twice their stored bytes there)."""
        return 3 * self.hidden_size * self.moe_intermediate_size * 4

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # -- construction ---------------------------------------------------------
    @classmethod
    def from_config_file(cls, path: str | Path) -> "ModelSpec":
        path = Path(path)
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise SpecError(f"{path}: no config.json (expected a HF model folder)") from None
        except json.JSONDecodeError as err:
            raise SpecError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
        if not isinstance(config, dict):
            raise SpecError(f"{path}: expected a JSON object at the top level")
        return cls.from_hf_config(config, source=str(path))

    @classmethod
    def from_hf_config(cls, config: dict[str, Any], source: str = "config.json") -> "ModelSpec":
        reader = _ConfigReader(config, source)
        arch = reader.get("model_type", str)
        if arch not in ARCHITECTURES:
            raise SpecError(f"{source}: model_type {arch!r} is not supported (expected one of {', '.join(ARCHITECTURES)})")
        hidden = reader.get("hidden_size", int)
        num_heads = reader.get("num_attention_heads", int)
        num_layers = reader.get("num_hidden_layers", int)
        head_dim = reader.get("head_dim", int, default=None) or hidden // num_heads
        num_kv_heads = reader.get("num_key_value_heads", int, default=num_heads)
        if num_heads % num_kv_heads:
            raise SpecError(f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        # GLM-4 MoE rotates half of each head unless its config says otherwise
        rope_theta, partial = reader.rope(default_partial=0.5 if arch == "glm4_moe" else 1.0)
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
            num_experts = reader.first(("num_experts", "num_local_experts"), int)
            step = reader.get("decoder_sparse_step", int, default=1)
            mlp_only = set(reader.get("mlp_only_layers", list, default=[]))
            moe_layers = tuple(
                l for l in range(num_layers) if l not in mlp_only and num_experts > 0 and (l + 1) % step == 0
            )
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
            )
        if arch == "glm4_moe":
            num_experts = reader.first(("n_routed_experts", "num_local_experts", "num_experts"), int)
            n_group = reader.get("n_group", int, default=1)
            if num_experts % n_group:
                raise SpecError(f"{source}: n_routed_experts {num_experts} is not a multiple of n_group {n_group}")
            first_dense = reader.get("first_k_dense_replace", int, default=0)
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
                n_group=n_group,
                topk_group=reader.get("topk_group", int, default=1),
                n_shared_experts=reader.get("n_shared_experts", int, default=0),
                moe_layers=tuple(range(first_dense, num_layers)),
            )
        # mixtral: every layer is MoE; top-k probabilities always renormalised
        intermediate = reader.get("intermediate_size", int)
        return cls(
            **common,
            qk_norm=False,
            attention_bias=False,
            output_bias=False,
            sliding_window=reader.get("sliding_window", int, default=None),
            dense_intermediate_size=intermediate,
            num_experts=reader.first(("num_local_experts", "num_experts"), int),
            top_k=reader.get("num_experts_per_tok", int),
            moe_intermediate_size=intermediate,
            router="softmax",
            norm_topk_prob=True,
            routed_scaling_factor=1.0,
            n_group=1,
            topk_group=1,
            n_shared_experts=0,
            moe_layers=tuple(range(num_layers)),
        )


class _ConfigReader:
    """Typed access to config keys; every failure names the file and the key."""

    def __init__(self, config: dict[str, Any], source: str):
        self.config, self.source = config, source

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if key not in self.config or self.config[key] is None:
            if default is ...:
                raise SpecError(f"{self.source}: missing key {key!r} (expected {kind.__name__})")
            return default
        value = self.config[key]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise SpecError(f"{self.source}: key {key!r} is {value!r} (expected {kind.__name__})")
        return value

    def first(self, keys: tuple[str, ...], kind: type) -> Any:
        """The first of several synonymous keys (transformers renamed some across versions)."""
        for key in keys:
            if self.config.get(key) is not None:
                return self.get(key, kind)
        raise SpecError(f"{self.source}: missing key {keys[0]!r} (expected {kind.__name__}; also looked for {', '.join(keys[1:])})")

    def rope(self, default_partial: float) -> tuple[float, float]:
        """(theta, partial_rotary_factor) from v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
        params = self.config.get("rope_parameters") or {}
        scaling = self.config.get("rope_scaling") or {}
        rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise SpecError(f"{self.source}: rope type {rope_type!r} is not supported (expected 'default')")
        theta = params.get("rope_theta", self.config.get("rope_theta", 10000.0))
        partial = params.get("partial_rotary_factor", self.config.get("partial_rotary_factor", default_partial))
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise SpecError(f"{self.source}: key 'rope_theta' is {theta!r} (expected a positive number)")
        if not isinstance(partial, (int, float)) or not 0 < partial <= 1:
            raise SpecError(f"{self.source}: key 'partial_rotary_factor' is {partial!r} (expected 0 < f <= 1)")
        return float(theta), float(partial)
