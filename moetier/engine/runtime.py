"""Build a runnable engine from a cluster.toml layout and a checkpoint.

Maps the layout onto this machine: parts to torch devices (a `cuda` device
without CUDA here runs on the CPU with its links emulated), one `HostExperts`
store shared by the CPU lane and the uploads, each tier with its policy,
link and cost, and the scheduler settings. The result runs the same model
as the plain engine; only where experts are computed changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.config import ConfigError, Layout
from moetier.engine.core import Engine
from moetier.engine.router_bias import apply_router_options
from moetier.engine.tier_executor import TieredExecutor
from moetier.model.checkpoint import Checkpoint
from moetier.residency import make_policy
from moetier.sched.cost import Calibration, TierCost, tier_cost
from moetier.sched.placement import ModelShape, place
from moetier.tiers.base import Tier
from moetier.tiers.cpu import CpuTier
from moetier.tiers.helper import HelperTier
from moetier.tiers.host_experts import HostExperts
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


def build_runtime(layout: Layout, checkpoint: Checkpoint, calibration: Calibration | None = None) -> TieredRuntime:
    spec = checkpoint.spec
    layout.check_model(spec.num_layers, spec.num_experts)
    calibration = calibration or Calibration.for_layout(layout)
    cuda = torch.cuda.is_available()
    _check_devices(layout, torch.cuda.device_count() if cuda else 0)
    emulated = {d.name: d.torch_device(cuda) == "cpu" and d.kind == "cuda" for d in layout.devices}
    parts = [(p.layers(spec.num_layers), layout.device(p.device).torch_device(cuda)) for p in layout.parts]
    shape = ModelShape.from_spec(spec)
    placement = place(layout, shape)
    host = HostExperts(checkpoint, spec.moe_layers, pin=cuda)
    tiers: list[Tier] = []
    serving: dict[int, list[Tier]] = {layer: [] for layer in spec.moe_layers}
    costs: dict[str, TierCost] = {}
    built: dict[str, Tier] = {}
    # the CPU lane first: a remote tier recomputes on it when its worker misses a deadline
    for i, config in sorted(enumerate(layout.tiers), key=lambda item: item[1].kind != "cpu"):
        where, placed = f"[tiers.{i}]", placement[config.name]
        link = Link(layout.link(config.link), emulated=emulated.get(config.device, True) or config.kind == "remote")
        if config.kind == "cpu":
            tier: Tier = CpuTier(config.name, host, config.backend_name, config.threads)
        elif config.kind == "vram":
            if config.policy == "static" and placed.profile is None:
                raise ConfigError(f"{layout.path}: {where}.profile: the static policy needs a profile (expert counts [moe_layers, experts] .npy)")
            policy = make_policy(config.policy, len(placed.layers), spec.num_experts, placed.slots, placed.profile)
            tier = VramTier(config.name, host, placed.layers, placed.slots, policy, link, layout.device(config.device).torch_device(cuda))
        elif config.kind == "helper":
            tier = HelperTier(config.name, host, placed.held, link, layout.device(config.device).torch_device(cuda))
        else:  # remote: a worker on another host (or on loopback), its own copy of the weights
            from moetier.tiers.remote import RemoteTier

            lane = built[next(t.name for t in layout.tiers if t.kind == "cpu")]
            tier = RemoteTier(config.name, config.address, checkpoint, placed.held, lane, layer_budget_us=layout.scheduler.budget_us,
                              keys=layout.relative(config.keys) if config.keys else None, link_gbps=layout.link(config.link).gbps)
        built[config.name] = tier
        tiers.append(tier)
        for layer in placed.layers:
            serving[layer].append(tier)
        costs[config.name] = tier_cost(layout, config, calibration, shape.expert_bytes, shape.hidden_bytes)
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
    r = layout.router
    if not r.bias and not r.affinity:
        return
    try:
        apply_router_options(engine, layout.relative(r.bias) if r.bias else None, r.affinity, r.bias_mode, r.affinity_prefill)
    except ValueError as err:
        raise ConfigError(f"{layout.path}: [router]: {err}") from None


__all__ = ["TieredRuntime", "build_runtime"]
