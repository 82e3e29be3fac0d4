"""Scheduling overhead and CPU-lane bandwidth, on the synthetic `medium` checkpoint.

Regime: batch-1 decode over a layout with a VRAM cache (LRU, a quarter of each
layer's experts) and a CPU lane, on this machine (the GPU emulated when
absent). (1) Router + scheduler + dispatch time per MoE layer, excluding
expert math: the engine's `router` and the executor's `dispatch` categories
(policy lookups, the plan, job building, handing work to the lane's thread;
the residency policy's own share, the VRAM tiers' `access`, is shown apart),
per MoE layer, with every tier's backend replaced by one that returns zeros
and link emulation off, replaying recorded decode decisions one call at a
time (medians, which a busy machine inflates least); for a static (profile)
cache, LRU and xlayer. The VRAM tier's uploads keep their bookkeeping and the
hand-off to its link thread, but copy no bytes: on a GPU a DMA engine moves
them, and here the copy would take a core the measured thread needs. Target <= 50 us. (2) The CPU lane (1 and --threads lane threads) computing 8 distinct experts
of one layer at batch 1, cycling over layers so no expert is cached, as bytes
of expert weights per second against the copy bandwidth measured in the same
run (each the best of 5: this VM's bandwidth moves by tens of percent between
moments). Target >= 60%. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from array import array
from pathlib import Path
from statistics import median

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.backends import Backend, BackendCaps  # noqa: E402
from moetier.calibrate import copy_bandwidth_bytes_per_s  # noqa: E402
from moetier.model.builtin import cached_synthetic  # noqa: E402
from moetier.config import load_layout  # noqa: E402
from moetier.engine import generate  # noqa: E402
from moetier.engine.runtime import build_runtime  # noqa: E402
from moetier.engine.timing import StepTimes  # noqa: E402
from moetier.model import open_checkpoint  # noqa: E402
from moetier.tiers.base import ExpertJob  # noqa: E402
from moetier.tiers.cpu import CpuTier  # noqa: E402
from moetier.tiers.host_experts import HostExperts  # noqa: E402

LAYOUT = """
[[devices]]
name = "gpu0"
host = "local"
kind = "cuda"
[[links]]
name = "pcie"
rtt_us = 10.0
gbps = 64.0
[[parts]]
name = "all"
device = "gpu0"
layers = "0:"
[[tiers]]
name = "vram"
kind = "vram"
device = "gpu0"
slots = {slots}
policy = "{policy}"
profile = "{profile}"
link = "pcie"
[[tiers]]
name = "cpu"
kind = "cpu"
[scheduler]
budget_us = 5000.0
defer_cpu = 0
"""


class NullBackend(Backend):
    """Expert math removed: returns zeros at once, so only routing, planning and dispatch are timed."""

    name = "null"
    caps = BackendCaps(dtypes=("float32",))

    def _place(self, weights):
        return None

    def _run_experts(self, x, work):
        return torch.zeros_like(x)

    def synchronize(self) -> None:
        """Nothing is queued: the math was removed."""
        return None


def null_submit(submit):
    """A native lane's submit that queues the call with its experts dropped: everything but the math."""
    nothing = b"", array("f")
    return lambda x, addresses, scales, inter: submit(x, *nothing, inter)


def overhead_us_per_layer(checkpoint, tokens: int, policy: str) -> dict[str, float]:
    """Median router and dispatch time per MoE layer, with every tier's expert math (and the emulated
    link's time) removed. Decode decisions are recorded from a real run, then replayed through
    `route` and `TierExecutor.dispatch` one call at a time (its `dispatch` category: everything
    before the inline tier's expert math)."""
    from moetier.engine.router import route_gate

    spec = checkpoint.spec
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "layout.toml"
        path.write_text(LAYOUT.format(slots=max(1, spec.num_experts // 4), policy=policy, profile=folder + "/profile.npy"))
        np.save(Path(folder) / "profile.npy", np.random.default_rng(0).random((len(spec.moe_layers), spec.num_experts)))
        runtime = build_runtime(load_layout(path), checkpoint)
    for tier in runtime.executor.tiers:
        tier.backend = NullBackend()
        native = getattr(tier, "_native", None)
        if native is not None:  # the native lane: the same hand-off and collect, a call of no experts
            native.submit = null_submit(native.submit)
        if hasattr(tier, "link"):
            tier.link.emulated = False
        if tier.kind == "vram":  # the upload's bytes (a DMA on a real GPU) dropped; its bookkeeping and hand-off stay
            tier._copy = lambda layer, experts, slots, timed: None
    engine, executor = runtime.engine, runtime.executor
    in_policy = [0.0]  # seconds this layer's dispatch spent in the VRAM tiers' residency policy (access)
    for tier in executor.tiers:
        if tier.kind == "vram":
            tier.access = timed_into(in_policy, tier.access)
    recorded = []
    engine.observer = lambda layer, decision: recorded.append((layer, decision))
    try:
        generate(engine, [1, 2, 3, 4], tokens + 1)
        engine.observer = None
        decode = [(l, d) for l, d in recorded if d.picks.shape[0] == 1]
        x = torch.randn(1, spec.hidden_size)
        router, dispatch, policy_s = [], [], []
        for layer, decision in decode:
            w = engine.layers[layer]
            begin = time.perf_counter()
            route_gate(spec, x, w.router, w.correction_bias)  # as the engine routes
            router.append(time.perf_counter() - begin)
            executor.times = StepTimes()  # its "dispatch" ends where the inline tier's expert math begins
            in_policy[0] = 0.0
            partials = executor.dispatch(layer, x, decision)
            dispatch.append(executor.times.seconds["dispatch"])
            policy_s.append(in_policy[0])
            if partials.lane is not None:
                partials.lane.result()
    finally:
        runtime.close()
    return {"router_us": median(router) * 1e6, "dispatch_us": median(dispatch) * 1e6, "policy_us": median(policy_s) * 1e6,
            "layers_timed": len(decode)}


def timed_into(total: list[float], fn):
    """fn, adding the seconds each call takes to total[0]."""
    def timed(*args):
        begin = time.perf_counter()
        try:
            return fn(*args)
        finally:
            total[0] += time.perf_counter() - begin
    return timed


def lane_bandwidth(checkpoint, threads: int, experts: int = 8, rounds: int = 5) -> float:
    """Bytes of expert weights per second the CPU lane streams computing `experts` experts per call (best of `rounds`)."""
    spec = checkpoint.spec
    host = HostExperts(checkpoint, spec.moe_layers)
    lane = CpuTier("cpu", host, threads=threads)
    x = torch.randn(1, spec.hidden_size)
    rows, weight = torch.zeros(1, dtype=torch.int64), torch.full((1,), 0.125)
    calls = [(layer, list(range(start, start + experts))) for layer in spec.moe_layers
             for start in range(0, spec.num_experts - experts + 1, experts)]
    samples = []
    for round_index in range(rounds + 1):
        begin = time.perf_counter()
        for layer, chosen in calls:
            lane.compute(layer, x, [ExpertJob(e, rows, weight) for e in chosen])
        if round_index:
            samples.append(len(calls) * experts * host.expert_bytes / (time.perf_counter() - begin))
    lane.close()
    return max(samples)  # best round, as the copy bandwidth it is compared with is the best copy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="HF model folder (default: synthetic medium, written once)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip-lane", action="store_true", help="time the overhead only (no CPU-lane bandwidth)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    checkpoint = open_checkpoint(args.model or cached_synthetic("qwen3_moe", "medium"))
    bandwidth = copy_bandwidth_bytes_per_s()
    lanes = {} if args.skip_lane else {threads: lane_bandwidth(checkpoint, threads) for threads in sorted({1, args.threads})}
    overheads = {policy: overhead_us_per_layer(checkpoint, args.tokens, policy) for policy in ("static", "lru", "xlayer")}
    for policy, overhead in overheads.items():
        total = overhead["router_us"] + overhead["dispatch_us"]
        print(f"{'router + scheduler + dispatch per MoE layer, ' + policy:52}{total:8.1f} us  (router {overhead['router_us']:.1f}, "
              f"dispatch {overhead['dispatch_us']:.1f}, of which the residency policy {overhead['policy_us']:.1f}; target <= 50)")
    result = {"model": str(checkpoint.folder), "threads": args.threads, "top_k": checkpoint.spec.top_k,
              "overhead_us_per_moe_layer": {p: o["router_us"] + o["dispatch_us"] for p, o in overheads.items()},
              "overhead_parts_us": overheads, "overhead_target_us": 50.0,
              "copy_bandwidth_gb_per_s": bandwidth / 1e9,
              "cpu_lane_gb_per_s": {t: v / 1e9 for t, v in lanes.items()},
              "cpu_lane_bandwidth_share": {t: v / bandwidth for t, v in lanes.items()}, "bandwidth_target_share": 0.6}
    for threads, lane in lanes.items():
        print(f"{f'CPU lane, 8 experts per call, {threads} lane thread(s)':52}{lane / 1e9:8.2f} GB/s = {lane / bandwidth:.0%} "
              f"of copy bandwidth {bandwidth / 1e9:.2f} GB/s (target >= 60%)")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
