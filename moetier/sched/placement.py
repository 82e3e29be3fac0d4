"""Where each tier's experts are at start: the layers it serves, its slots per layer, the experts it holds.

One answer for everything that needs it: the runtime (build_runtime), the
estimate (`layout show`), the simulator and the bias sweep read `place`, so a
layout gets the same slots and the same held experts whether it runs, is
estimated or is simulated. Rules: a VRAM tier serves the MoE layers of the
parts on its device, every other tier all MoE layers; slots are `slots`, else
`capacity_bytes` over the layers served, the same count per layer (in the
stored bytes an expert takes in a tier: a Q4_K expert about 1/7 of a float32
one; in a mixed-type file each layer's own), capped at the experts per layer;
the CPU lane holds every expert; helper and remote tiers hold a fixed set per
layer by their `experts` rule (helper default "hot", remote default "all"),
ranked by the tier's profile. A VRAM tier's initial residency is its policy's
(built from the same profile rows). Errors are ConfigErrors naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from moetier.config import ConfigError, Layout, TierConfig


@dataclass(frozen=True)
class ModelShape:
    """What placement, the cost model and the simulator need of a model: layers, routing width, bytes, and which
    layers mix tokens by linear attention (DEFER_CPU does not defer into them: moetier.sched.defer)."""

    num_layers: int
    moe_layers: tuple[int, ...]
    num_experts: int  # E
    top_k: int  # k
    expert_bytes: int  # one routed expert as the tiers hold it (its stored bytes; the largest layer's in a mixed file)
    hidden_bytes: int  # one token's hidden state as shipped to helper / remote tiers
    name: str = ""
    layer_bytes: tuple[int, ...] = ()  # per MoE layer (moe_layers' order) where layers differ; () = expert_bytes each
    linear_layers: tuple[int, ...] = ()  # layers with a recurrent state (ModelSpec.linear_layers); () = none

    @classmethod
    def from_checkpoint(cls, checkpoint, name: str = "") -> "ModelShape":
        """The shape the runtime has: experts in their stored bytes, layer by layer; float32 hidden states."""
        spec = checkpoint.spec
        per_layer = tuple(checkpoint.expert_nbytes_at(layer) for layer in spec.moe_layers)
        return cls(spec.num_layers, tuple(spec.moe_layers), spec.num_experts, spec.top_k, max(per_layer, default=0),
                   spec.hidden_size * 4, name, per_layer if len(set(per_layer)) > 1 else (), tuple(spec.linear_layers))

    def bytes_at(self, layer: int) -> int:
        """Stored bytes of one routed expert of MoE layer `layer`."""
        return self.layer_bytes[self.moe_layers.index(layer)] if self.layer_bytes else self.expert_bytes

    def layers_bytes(self, layers) -> int:
        """Stored bytes of one expert of each of `layers`: what one slot per layer takes."""
        return sum(self.bytes_at(layer) for layer in layers) if self.layer_bytes else self.expert_bytes * len(layers)


@dataclass(frozen=True)
class TierPlacement:
    config: TierConfig
    layers: tuple[int, ...]  # model MoE layers it serves
    slots: int  # experts it holds per layer (every expert for the CPU lane)
    profile: np.ndarray | None  # [len(layers), E] float64 brightness of its layers, or None
    held: dict[int, list[int]] | None  # helper / remote: the experts it holds per layer (fixed); None otherwise
    bytes: int  # at full residency: slots x the stored bytes of one expert of each layer served

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def kind(self) -> str:
        return self.config.kind


def place(layout: Layout, shape: ModelShape, profiles: Mapping[str, np.ndarray] | None = None) -> dict[str, TierPlacement]:
    """Tier name -> its placement, in the layout's order. `profiles`: tier name -> [its layers, E] rows that
    replace the tier's profile file (the simulator's stand-in for a static cache without one)."""
    layout.check_model(shape.num_layers, shape.num_experts)
    placed = {}
    for index, tier in enumerate(layout.tiers):
        where = f"[tiers.{index}]"
        layers = tuple(served_layers(layout, tier, shape))
        slots = _slots(layout, tier, shape, layers, where)
        if profiles and tier.name in profiles:
            profile = np.asarray(profiles[tier.name], np.float64)
        else:
            profile = _profile_rows(layout, tier, shape, layers, where)
        held = None
        if tier.kind in ("helper", "remote"):
            rule = replace(tier, experts=tier.experts or ("all" if tier.kind == "remote" else "hot"))
            held = {layer: _chosen(layout, rule, slots, shape.num_experts, None if profile is None else profile[j], where)
                    for j, layer in enumerate(layers)}
        placed[tier.name] = TierPlacement(tier, layers, slots, profile, held, slots * shape.layers_bytes(layers))
    return placed


def served_layers(layout: Layout, tier: TierConfig, shape: ModelShape) -> list[int]:
    """Model MoE layers a tier serves: a VRAM tier its device's parts, every other tier all of them."""
    if tier.kind != "vram":
        return list(shape.moe_layers)
    moe = set(shape.moe_layers)
    return [l for part in layout.parts if part.device == tier.device for l in part.layers(shape.num_layers) if l in moe]


def _slots(layout: Layout, tier: TierConfig, shape: ModelShape, layers: tuple[int, ...], where: str) -> int:
    if tier.kind == "cpu" or (tier.kind == "remote" and not tier.slots and not tier.capacity_bytes):
        return shape.num_experts
    per_slot = shape.layers_bytes(layers) if layers else shape.expert_bytes
    count = tier.slots or tier.capacity_bytes // max(1, per_slot)
    if count < 1:
        raise ConfigError(f"{layout.path}: {where}.capacity_bytes: {tier.capacity_bytes} holds no expert per layer "
                          f"(one per layer of its {len(layers)} takes {per_slot} bytes)")
    return min(int(count), shape.num_experts)


def load_profile(layout: Layout, tier: TierConfig, where: str) -> np.ndarray | None:
    """A tier's profile file: per-MoE-layer expert counts or brightness [L, E] (.npy), or None without one."""
    if not tier.profile:
        return None
    path = layout.relative(tier.profile)
    try:
        profile = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ConfigError(f"{layout.path}: {where}.profile: cannot read {path} ({err})") from None
    if profile.ndim != 2:
        raise ConfigError(f"{layout.path}: {where}.profile: {path} has shape {list(profile.shape)} (expected [moe_layers, experts])")
    return profile.astype(np.float64)


def _profile_rows(layout: Layout, tier: TierConfig, shape: ModelShape, layers, where: str) -> np.ndarray | None:
    """The profile's rows for the layers a tier serves (a profile has one row per MoE layer of the model)."""
    profile = load_profile(layout, tier, where)
    if profile is None:
        return None
    if profile.shape != (len(shape.moe_layers), shape.num_experts):
        raise ConfigError(f"{layout.path}: {where}.profile: shape {list(profile.shape)} (expected one row per MoE layer "
                          f"and a column per expert: [{len(shape.moe_layers)}, {shape.num_experts}])")
    index = {l: i for i, l in enumerate(shape.moe_layers)}
    return profile[[index[l] for l in layers]]


def _chosen(layout: Layout, tier: TierConfig, slots: int, num_experts: int, brightness, where: str) -> list[int]:
    try:
        return tier.held_experts(slots, num_experts, brightness)
    except ValueError as err:
        raise ConfigError(f"{layout.path}: {where}.{err}") from None


__all__ = ["ModelShape", "TierPlacement", "load_profile", "place", "served_layers"]
