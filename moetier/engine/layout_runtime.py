"""Build a runnable engine from a cluster.toml layout and a checkpoint.

Maps the layout onto this machine: parts to torch devices (a `cuda` device
without CUDA here runs on the CPU with its links emulated), one `HostExperts`
store shared by the CPU lane and the uploads, each tier with its policy,
link and cost, and the scheduler settings. The result runs the same model
as the plain engine; only where experts are computed changes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

from moetier.config import ConfigError, Layout, TierConfig
from moetier.engine.core import Engine
from moetier.engine.tiered import TieredExecutor
from moetier.model.checkpoint import Checkpoint
from moetier.sched.cost import Calibration, TierCost, tier_cost
from moetier.tiers.base import Tier
from moetier.tiers.cpu import CpuTier
from moetier.tiers.helper import HelperTier
from moetier.tiers.host import HostExperts
from moetier.tiers.link import Link
from moetier.tiers.vram import VramTier


@dataclass
class TieredRuntime:
    engine: Engine
    executor: TieredExecutor
    layout: Layout
    calibration: Calibration
    emulated: dict[str, bool]  # device name -> runs on the CPU with emulated links

    def close(self) -> None:
        self.executor.close()


def load_calibration(layout: Layout) -> Calibration:
    if not layout.scheduler.calibration:
        return Calibration()
    try:
        return Calibration.load(layout.relative(layout.scheduler.calibration))
    except ValueError as err:
        raise ConfigError(f"{layout.path}: [scheduler].calibration: {err}") from None


def load_profile(layout: Layout, tier: TierConfig, where: str) -> np.ndarray | None:
    """Per-MoE-layer expert counts or brightness [L, E] from a .npy file, or None."""
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


def build_runtime(layout: Layout, checkpoint: Checkpoint, calibration: Calibration | None = None) -> TieredRuntime:
    spec = checkpoint.spec
    layout.check_model(spec.num_layers, spec.num_experts)
    calibration = calibration or load_calibration(layout)
    cuda = torch.cuda.is_available()
    _check_devices(layout, torch.cuda.device_count() if cuda else 0)
    emulated = {d.name: d.torch_device(cuda) == "cpu" and d.kind == "cuda" for d in layout.devices}
    parts = [(p.layers(spec.num_layers), layout.device(p.device).torch_device(cuda)) for p in layout.parts]
    host = HostExperts(checkpoint, spec.moe_layers, pin=cuda)
    hidden_bytes = spec.hidden_size * 4
    tiers: list[Tier] = []
    serving: dict[int, list[Tier]] = {layer: [] for layer in spec.moe_layers}
    costs: dict[str, TierCost] = {}
    built: dict[str, Tier] = {}
    # CPU lanes first: a remote tier recomputes on one when its worker misses a deadline
    for i, config in sorted(enumerate(layout.tiers), key=lambda item: item[1].kind != "cpu"):
        where = f"[tiers.{i}]"
        link = Link(layout.link(config.link), emulated=emulated.get(config.device, True) or config.kind == "remote")
        if config.kind == "cpu":
            tier: Tier = CpuTier(config.name, host, config.backend, config.threads)
            layers = list(spec.moe_layers)
        elif config.kind == "vram":
            layers = [l for part in layout.parts if part.device == config.device
                      for l in part.layers(spec.num_layers) if spec.is_moe(l)]
            slots = _slots(config, host.expert_bytes, len(layers), spec.num_experts, layout, where)
            profile = _profile_rows(load_profile(layout, config, where), spec.moe_layers, layers, layout, where)
            from moetier.tiers.policies import make_policy

            if config.policy == "static" and profile is None:
                raise ConfigError(f"{layout.path}: {where}.profile: the static policy needs a profile (expert counts [moe_layers, experts] .npy)")
            policy = make_policy(config.policy, len(layers), spec.num_experts, slots, profile)
            tier = VramTier(config.name, host, layers, slots, policy, link, layout.device(config.device).torch_device(cuda))
        elif config.kind == "helper":
            layers = list(spec.moe_layers)
            slots = _slots(config, host.expert_bytes, len(layers), spec.num_experts, layout, where)
            profile = _profile_rows(load_profile(layout, config, where), spec.moe_layers, layers, layout, where)
            held = {l: _chosen(config, slots, spec.num_experts, None if profile is None else profile[j], layout, where)
                    for j, l in enumerate(layers)}
            tier = HelperTier(config.name, host, held, link, layout.device(config.device).torch_device(cuda))
        else:  # remote: a worker on another host (or on loopback), its own copy of the weights
            from moetier.tiers.remote import RemoteTier

            layers = list(spec.moe_layers)
            slots = config.slots or (config.capacity_bytes // (host.expert_bytes * len(layers)) if config.capacity_bytes else spec.num_experts)
            profile = _profile_rows(load_profile(layout, config, where), spec.moe_layers, layers, layout, where)
            held = {l: _chosen(replace(config, experts=config.experts or "all"), slots, spec.num_experts, None if profile is None else profile[j], layout, where)
                    for j, l in enumerate(layers)}
            lane = next(t for t in built.values() if t.kind == "cpu")
            link_config = layout.link(config.link)
            tier = RemoteTier(config.name, config.address, checkpoint, held, lane, layer_budget_us=layout.scheduler.budget_us,
                              keys=layout.relative(config.keys) if config.keys else None, link_gbps=link_config.gbps,
                              us_per_expert=calibration.cpu_us_per_expert)
        built[config.name] = tier
        tiers.append(tier)
        for layer in layers:
            serving[layer].append(tier)
        costs[config.name] = tier_cost(layout, config, calibration, host.expert_bytes, hidden_bytes)
    tiers = [built[config.name] for config in layout.tiers]  # the layout's order, for reports
    executor = TieredExecutor(tiers, serving, costs, layout.scheduler.budget_us, layout.scheduler.tail_skip, spec.num_experts)
    engine = Engine(checkpoint, executor=executor, parts=parts, defer_cpu=layout.scheduler.defer_cpu)
    _apply_router(layout, engine)
    return TieredRuntime(engine, executor, layout, calibration, emulated)


def _check_devices(layout: Layout, present: int) -> None:
    """A cuda device the layout names must exist here (or be emulated): one clear line if not."""
    for i, device in enumerate(layout.devices):
        if present and device.kind == "cuda" and not device.emulate and device.index >= present:
            raise ConfigError(f"{layout.path}: [devices.{i}] {device.name!r}: cuda:{device.index} does not exist here "
                              f"(this machine has {present} CUDA device(s)); set emulate = true to run it on the CPU")


def _apply_router(layout: Layout, engine: Engine) -> None:
    """cluster.toml's [router]: bias table, affinity, bias mode (all off by default: the reference router)."""
    from moetier.profile.bias import apply_router_options  # the profile package sits above the engine

    r = layout.router
    if not r.bias and not r.affinity:
        return
    try:
        apply_router_options(engine, layout.relative(r.bias) if r.bias else None, r.affinity, r.bias_mode, r.affinity_prefill)
    except ValueError as err:
        raise ConfigError(f"{layout.path}: [router]: {err}") from None


def _slots(config: TierConfig, expert_bytes: int, layers: int, experts: int, layout: Layout, where: str) -> int:
    slots = config.slots or config.capacity_bytes // max(1, expert_bytes * max(layers, 1))
    if slots < 1:
        raise ConfigError(f"{layout.path}: {where}.capacity_bytes: {config.capacity_bytes} holds no expert of {expert_bytes} bytes per layer")
    return min(slots, experts)


def _profile_rows(profile: np.ndarray | None, moe_layers, layers, layout: Layout, where: str) -> np.ndarray | None:
    """The profile's rows for the layers a tier serves (a profile has one row per MoE layer of the model)."""
    if profile is None:
        return None
    if profile.shape[0] != len(moe_layers):
        raise ConfigError(f"{layout.path}: {where}.profile: {profile.shape[0]} rows (expected one per MoE layer: {len(moe_layers)})")
    index = {l: i for i, l in enumerate(moe_layers)}
    return profile[[index[l] for l in layers]]


def _chosen(config: TierConfig, slots: int, num_experts: int, brightness: np.ndarray | None, layout: Layout, where: str) -> list[int]:
    try:
        return config.held_experts(slots, num_experts, brightness)
    except ValueError as err:
        raise ConfigError(f"{layout.path}: {where}.{err}") from None


__all__ = ["TieredRuntime", "build_runtime", "load_calibration"]
