"""Build a runnable engine from a cluster.toml layout and a checkpoint.

Maps the layout onto this machine: parts to torch devices (a `cuda` device
without CUDA here runs on the CPU with its links emulated), one `HostExperts`
store shared by the CPU lane and the uploads, each tier with its policy,
link and cost, and the scheduler settings. The result runs the same model
as the plain engine; only where experts are computed changes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from moetier.config import ConfigError, Layout, TierConfig, thread_limit
from moetier.engine.core import Engine
from moetier.engine.router_bias import apply_router_options
from moetier.engine.tier_executor import TierExecutor
from moetier.model.checkpoint import Checkpoint
from moetier.residency import make_policy
from moetier.sched.cost import Calibration, TierCost, tier_cost
from moetier.sched.placement import ModelShape, TierPlacement, place
from moetier.tiers.base import Tier
from moetier.tiers.cpu import CpuTier
from moetier.tiers.helper import HelperTier
from moetier.tiers.host_experts import HostExperts
from moetier.tiers.link import Link
from moetier.tiers.vram import VramTier


@dataclass
class LayoutRuntime:
    engine: Engine
    executor: TierExecutor
    layout: Layout
    calibration: Calibration
    emulated: dict[str, bool]  # device name -> runs on the CPU with emulated links

    def close(self) -> None:
        self.executor.close()


def build_runtime(layout: Layout, checkpoint: Checkpoint, calibration: Calibration | None = None) -> LayoutRuntime:
    spec = checkpoint.spec
    layout.check_model(spec.num_layers, spec.num_experts)
    calibration = calibration or Calibration.for_layout(layout)
    cuda = torch.cuda.is_available()
    _check_devices(layout, torch.cuda.device_count() if cuda else 0)
    _check_threads(layout, thread_limit())
    emulated = {d.name: d.torch_device(cuda) == "cpu" and d.kind == "cuda" for d in layout.devices}
    parts = [(p.layers(spec.num_layers), layout.device(p.device).torch_device(cuda)) for p in layout.parts]
    shape = ModelShape.from_checkpoint(checkpoint)
    placement = place(layout, shape)
    build = _Build(layout, checkpoint, HostExperts(checkpoint, spec.moe_layers, pin=cuda), calibration, cuda, emulated)
    serving: dict[int, list[Tier]] = {layer: [] for layer in spec.moe_layers}
    costs: dict[str, TierCost] = {}
    built: dict[str, Tier] = {}
    try:
        # the CPU lane first: a remote tier recomputes on it when its worker misses a deadline
        for i, config in sorted(enumerate(layout.tiers), key=lambda item: item[1].kind != "cpu"):
            placed = placement[config.name]
            tier = built[config.name] = BUILDERS[config.kind](build, placed, f"[tiers.{i}]", built)
            for layer in placed.layers:
                serving[layer].append(tier)
            costs[config.name] = tier_cost(layout, config, calibration, shape.expert_bytes, shape.hidden_bytes)
        tiers = [built[config.name] for config in layout.tiers]  # the layout's order, for reports
        executor = TierExecutor(tiers, serving, costs, layout.scheduler.budget_us, layout.scheduler.tail_skip, spec.num_experts)
        engine = Engine(checkpoint, executor=executor, parts=parts, defer_cpu=layout.scheduler.defer_cpu,
                        defer_into_linear=layout.scheduler.defer_into_linear)
        _apply_router(layout, engine)
    except BaseException:  # a refused tier or router option: the tiers built so far stop their threads and sockets
        for tier in built.values():
            tier.close()
        raise
    return LayoutRuntime(engine, executor, layout, calibration, emulated)


@dataclass(frozen=True)
class _Build:
    """What every tier builder reads: the layout, the weights, the one host store of experts, the rates, this machine."""

    layout: Layout
    checkpoint: Checkpoint
    host: HostExperts
    calibration: Calibration
    cuda: bool
    emulated: dict[str, bool]

    def link(self, config: TierConfig) -> Link:
        """The tier's link: emulated for a remote tier and for a device this machine does not have."""
        return Link(self.layout.link(config.link), emulated=self.emulated.get(config.device, True) or config.kind == "remote")

    def device(self, config: TierConfig) -> str:
        return self.layout.device(config.device).torch_device(self.cuda)


def _cpu_tier(b: _Build, placed: TierPlacement, where: str, built: dict[str, Tier]) -> Tier:
    return CpuTier(placed.name, b.host, placed.config.backend_name, placed.config.threads)


def _vram_tier(b: _Build, placed: TierPlacement, where: str, built: dict[str, Tier]) -> Tier:
    config = placed.config
    if config.policy == "static" and placed.profile is None:
        raise ConfigError(f"{b.layout.path}: {where}.profile: the static policy needs a profile (expert counts [moe_layers, experts] .npy)")
    policy = make_policy(config.policy, len(placed.layers), b.checkpoint.spec.num_experts, placed.slots, placed.profile)
    return VramTier(config.name, b.host, placed.layers, placed.slots, policy, b.link(config), b.device(config))


def _helper_tier(b: _Build, placed: TierPlacement, where: str, built: dict[str, Tier]) -> Tier:
    return HelperTier(placed.name, b.host, placed.held, b.link(placed.config), b.device(placed.config))


def _remote_tier(b: _Build, placed: TierPlacement, where: str, built: dict[str, Tier]) -> Tier:
    """A worker on another host (or on loopback) with its own copy of the weights; the CPU lane is its fallback.
    A worker that is not there at start (down, hung: no HELLO within the client's connect timeout, 5 s) refuses
    the layout in one line naming it, the tier and the address; one that goes away later is the fallback's."""
    from moetier.tiers.remote import RemoteTier  # pyzmq only for layouts that have one
    from moetier.transport.client import TransportError

    config, lane = placed.config, next(t for t in built.values() if t.deferrable)
    try:
        return RemoteTier(config.name, config.address, b.checkpoint, placed.held, lane, layer_budget_us=b.layout.scheduler.budget_us,
                          keys=b.layout.relative(config.keys) if config.keys else None, link_gbps=b.layout.link(config.link).gbps,
                          us_per_expert=b.calibration.cpu_us_per_expert)
    except (TransportError, ValueError) as err:
        at = "" if config.address in str(err) else f" at {config.address}"  # most messages name the address already
        raise ConfigError(f"{b.layout.path}: {where} remote tier {config.name!r}{at}: {err}") from None


# The one place a tier kind of cluster.toml becomes a Tier.
BUILDERS = {"cpu": _cpu_tier, "vram": _vram_tier, "helper": _helper_tier, "remote": _remote_tier}


def _check_devices(layout: Layout, present: int) -> None:
    """A cuda device the layout names must exist here (or be emulated): one clear line if not."""
    for i, device in enumerate(layout.devices):
        if present and device.kind == "cuda" and not device.emulate and device.index >= present:
            raise ConfigError(f"{layout.path}: [devices.{i}] {device.name!r}: cuda:{device.index} does not exist here "
                              f"(this machine has {present} CUDA device(s)); set emulate = true to run it on the CPU")


def _check_threads(layout: Layout, limit: int) -> None:
    """The CPU lane runs here, so its threads must be ones this machine can start (a remote tier's run on its host)."""
    for i, tier in enumerate(layout.tiers):
        if tier.kind == "cpu" and tier.threads > limit:
            raise ConfigError(f"{layout.path}: [tiers.{i}].threads: is {tier.threads} (expected <= {limit} on this machine, "
                              f"which has {os.cpu_count()} CPUs)")


def _apply_router(layout: Layout, engine: Engine) -> None:
    """cluster.toml's [router]: bias table, affinity, bias mode (all off by default: the reference router)."""
    r = layout.router
    if not r.bias and not r.affinity:
        return
    try:
        apply_router_options(engine, layout.relative(r.bias) if r.bias else None, r.affinity, r.bias_mode, r.affinity_prefill)
    except ValueError as err:
        raise ConfigError(f"{layout.path}: [router]: {err}") from None


__all__ = ["LayoutRuntime", "build_runtime"]
