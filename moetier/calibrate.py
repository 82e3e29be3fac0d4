"""`moetier calibrate`: measure the cost model's rates on this machine, for one model.

Expert rates are measured by streaming distinct experts (cycling through every
MoE layer, so the caches hold none of them), the way decode touches them. With
a layout, everything else comes from timed decodes over that layout (five per
planning pass, each rate their median), in the runtime the run will use, with
its threads: the trunk (attention and router,
per layer), the head (with the step's time outside every category: sampling,
the Python loop), the GPU's time per expert it served, the dispatch overhead,
the CPU lane's cost per call and per expert (a line fitted to its calls, each
timed from submit to done; it replaces the streaming rate) and a remote call's
time beyond its link's round trip. These are rates under the layout's own contention (on a 2-core
machine the CPU lane slows the emulated GPU's trunk); what stays for the
simulator to predict is how they compose: hits, the lane, overlap, links.
Without a layout, trunk and head come from a plain engine's decode. A GPU's
per-expert rate without a layout is measured on the GPU when CUDA is here,
else it equals the CPU rate: an emulated GPU computes on the CPU.
"""

from __future__ import annotations

import platform
import time
from collections import defaultdict, deque
from dataclasses import replace
from pathlib import Path
from statistics import median
from typing import Callable

import numpy as np
import torch

from moetier.backends import ExpertWork
from moetier.backends.torch_backend import TorchBackend
from moetier.engine import Engine, generate
from moetier.engine.timing import StepTimes
from moetier.model import open_checkpoint
from moetier.model.host_memory import host_buffer
from moetier.model.output import check_output, new_file
from moetier.sched.cost import Calibration


def copy_bandwidth_bytes_per_s(nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Memory bandwidth of this machine as a copy measures it: bytes copied per second, best of `repeats`
    copies of an nbytes tensor (each byte counted once, as memcpy bandwidth is quoted; the bus carries
    twice that, a read and a write). Decode only reads weights, so this is the rate to compare it with."""
    source = torch.ones(nbytes // 4)
    target = torch.zeros_like(source)  # both touched first, so no page faults are timed
    best = float("inf")
    for _ in range(repeats):
        begin = time.perf_counter()
        target.copy_(source)
        best = min(best, time.perf_counter() - begin)
    return nbytes / best


def read_buffer(nbytes: int) -> torch.Tensor:
    """float32 [nbytes // 4] of ones, in the memory the resident weights are in (moetier.model.host_memory: advised
    for huge pages, which read faster than 4 KiB pages: a bound on the weights' reads must read such memory too),
    touched, so no page fault is timed."""
    return host_buffer(nbytes // 4 * 4).view(torch.float32).fill_(1.0)


def read_probes(threads: int, nbytes: int = 1 << 30, buffer: torch.Tensor | None = None) -> dict[str, Callable[[], object]]:
    """Readers of one nbytes float32 buffer (`read_buffer`, or the caller's) on `threads` threads, each a
    reduction that reads every byte once and writes nothing: "torch.sum", and where the kernels build their two
    read probes on their pool of `threads` (1 MiB granules into eight vector accumulators; cpu_kernels.c):
    "native", each granule as four software-prefetched streams (the fastest reader found on the Intel AMX host),
    and "native plain", as eight streams the hardware prefetchers alone fetch (the fastest on the Ice Lake host).
    buffer: a float32 tensor of nbytes // 4 values to read instead of a new one (a caller sampling the bandwidth
    again and again keeps one: allocating and touching gigabytes each time pushes other processes' file-backed
    pages, such as a memory-mapped model's, out of the page cache)."""
    from moetier.backends import cpu_kernels

    if buffer is None:
        buffer = read_buffer(nbytes)
    elif buffer.dtype != torch.float32 or buffer.numel() != nbytes // 4 or not buffer.is_contiguous():
        raise ValueError(f"read_probes: buffer must be {nbytes // 4} contiguous float32 values, got {buffer.dtype} x {buffer.numel()}")
    kernel = cpu_kernels.decode_kernel(threads)

    def torch_sum() -> float:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return float(buffer.sum())
        finally:
            torch.set_num_threads(before)

    probes: dict[str, Callable[[], object]] = {"torch.sum": torch_sum}
    if kernel is not None:
        probes["native"] = lambda: kernel.read_sum(buffer)
        probes["native plain"] = lambda: kernel.read_sum(buffer, plain=True)
    return probes


def read_bandwidth_bytes_per_s(threads: int, nbytes: int = 1 << 30, repeats: int = 5,
                               buffer: torch.Tensor | None = None) -> dict[str, float]:
    """Read bandwidth on `threads` threads: bytes per second of each of `read_probes` (over `buffer` if given), best
    of `repeats`, and "best", the fastest: a roofline is a bound, so it takes the highest read rate measured
    (torch.sum alone read slower than llama.cpp's decode did on the AVX-512 host, and slower at 2 threads than the
    native probes; of those, each was the slower on one of two hosts)."""
    rates = {}
    for name, read in read_probes(threads, nbytes, buffer).items():
        read()
        best = float("inf")
        for _ in range(repeats):
            begin = time.perf_counter()
            read()
            best = min(best, time.perf_counter() - begin)
        rates[name] = nbytes // 4 * 4 / best
    rates["best"] = max(rates.values())
    return rates


def expert_rate_us(checkpoint, backend: TorchBackend, tokens: int, rounds: int = 3) -> float:
    """Microseconds per expert at `tokens` rows, over distinct experts of every MoE layer."""
    spec = checkpoint.spec
    k = min(spec.top_k, spec.num_experts)
    placed = {l: [backend.place(checkpoint.expert(l, e).resident().to(backend.device)) for e in range(spec.num_experts)]
              for l in spec.moe_layers}
    x = torch.randn(tokens, spec.hidden_size, device=backend.device)
    rows = torch.arange(tokens)
    weights = torch.full((tokens,), 1.0 / k)
    samples = []
    for round_index in range(rounds + 1):
        begin = time.perf_counter()
        count = 0
        for layer in spec.moe_layers:
            for start in range(0, spec.num_experts - k + 1, k):
                backend.run_experts(x, [ExpertWork(placed[layer][e], rows, weights) for e in range(start, start + k)])
                count += k
        backend.synchronize()
        if round_index:  # the first round pages everything in
            samples.append((time.perf_counter() - begin) * 1e6 / count)
    return median(samples)


TIMED_REPEATS = 5  # timed decodes per calibration pass; each rate is their median


def timed_decode(engine: Engine, executor, base: Calibration, link_rtt_us: dict[str, float] | None = None,
                 steps: int = 96, streaming_us: float | None = None, repeats: int = TIMED_REPEATS) -> Calibration:
    """`base` with the trunk, head, dispatch and GPU rate of a timed decode of `engine` (over `executor`,
    a TierExecutor, when it has one): microseconds per step in each timing category, the head
    taking the step's time outside every category too (sampling, the Python loop); the CPU lane's
    call cost fitted to its calls; a remote call's time beyond its link's round trip (link_rtt_us,
    by tier name). Each rate is the median over `repeats` timed decodes of `steps` steps (one
    decode is a fraction of a second, and a busy machine slows some of them). A rate this decode
    gives no sample of (no remote call, say) keeps base's value. streaming_us: the CPU's streaming
    rate per expert that bounds the lane's fit (default base's)."""
    generate(engine, [1, 2, 3, 4], 16)  # untimed: first-call costs, caches and pools settle
    samples = [_timed_rates(engine, executor, base, link_rtt_us or {}, steps, streaming_us) for _ in range(repeats)]
    rates = {name: float(np.median([s[name] for s in samples if name in s])) for name in {n for s in samples for n in s}}
    return replace(base, **rates)


def _timed_rates(engine: Engine, executor, base: Calibration, link_rtt_us: dict[str, float], steps: int,
                 streaming_us: float | None) -> dict[str, float]:
    """One timed decode -> the rates it gives a sample of (see timed_decode)."""
    times = StepTimes()
    lanes = [t for t in executor.tiers if t.kind == "cpu"] if executor is not None else []
    remotes = [t for t in executor.tiers if t.kind == "remote"] if executor is not None else []

    def start() -> None:
        engine.times = times
        if executor is not None:
            executor.times = times
            executor.reset_counters()
            for tier in lanes:
                tier.calls = deque(maxlen=1 << 16)
            for tier in remotes:
                tier.round_trips_us.clear()

    result = generate(engine, [1, 2, 3, 4], steps + 1, before_decode=start)
    engine.times = None
    if executor is not None:
        executor.times = None
    spent = defaultdict(float, {name: seconds / times.steps * 1e6 for name, seconds in times.seconds.items()})
    untimed = max(0.0, result.decode_s / (len(result.ids) - 1) * 1e6 - sum(spent.values()))
    spec = engine.spec
    # every layer's token mixing (attention, or a hybrid model's linear attention) and router, per layer on average
    trunk = spent["attention"] + spent["linear attention"] + spent["router"]
    rates = {"attention_us_per_layer": trunk / spec.num_layers,
             "head_us": spent["head"] + untimed}
    if executor is not None:
        rates["dispatch_us_per_layer"] = spent["dispatch"] / max(len(spec.moe_layers), 1)
        served = sum(executor.counters[t.name].served for t in executor.tiers if t.kind in ("vram", "helper"))
        if served:  # the GPU's rate as this decode spent it, per expert served
            rates["gpu_us_per_expert"] = spent["gpu experts"] * times.steps / served
        calls = [call for tier in lanes for call in tier.calls]
        for tier in lanes:
            tier.calls = None
        if calls:
            rates["cpu_lane_fixed_us"], rates["cpu_us_per_expert"] = lane_fit(calls, streaming_us or base.cpu_us_per_expert)
        extra = [float(np.median(t.round_trips_us)) - link_rtt_us.get(t.name, 0.0) for t in remotes if t.round_trips_us]
        if extra:  # negative when a call takes less than the link's configured round trip (tier_cost keeps the sum >= 0)
            rates["remote_extra_us"] = float(np.mean(extra))
    return rates


CALIBRATION_PASSES = 4  # decodes timed at most, each planned with the rates of the one before
SHARE_TOLERANCE = 0.02  # two passes agree when each tier serves the same share of experts within this


def served_shares(executor) -> dict[str, float]:
    """Each tier's share of the experts served since the counters were last reset."""
    served = {name: c.served for name, c in executor.counters.items()}
    total = sum(served.values()) or 1
    return {name: n / total for name, n in served.items()}


def lane_fit(calls: list[tuple[int, float]], streaming_us: float) -> tuple[float, float]:
    """(fixed us per call, us per expert) of CPU-lane calls timed from submit to done: a least-squares
    line over experts per call when calls differ in size; else the streaming rate and the rest fixed.
    The slope stays within [0.5, 4] x the streaming rate (a handful of noisy calls cannot make it absurd)."""
    sizes = np.array([n for n, _ in calls], dtype=np.float64)
    us = np.array([t for _, t in calls], dtype=np.float64)
    per_expert = streaming_us
    if len(calls) >= 8 and sizes.std() > 0:
        per_expert = float(np.clip(np.polyfit(sizes, us, 1)[0], 0.5 * streaming_us, 4 * streaming_us))
    return max(0.0, float(np.median(us - per_expert * sizes))), per_expert


def measure(layout_path: Path | None, model: Path | None, out: Path | None, threads: int | None) -> tuple[Calibration, Path]:
    from moetier.config import load_layout
    from moetier.model.builtin import builtin_model

    if threads is not None:
        torch.set_num_threads(threads)
    layout = load_layout(layout_path) if layout_path is not None else None
    named = out is None and layout is not None and bool(layout.scheduler.calibration)  # the layout names the output
    target = out or (layout.relative(layout.scheduler.calibration) if named else Path("calibration.json"))
    folder = model or (layout.model_path() if layout is not None else None)
    check_output(target, f"{layout.path} [scheduler].calibration" if named else "--out",
                 [("--layout", layout_path), ("--model", folder)])
    checkpoint = open_checkpoint(folder or builtin_model())

    cpu = TorchBackend("cpu")
    cpu_one = expert_rate_us(checkpoint, cpu, 1)
    cpu_many = expert_rate_us(checkpoint, cpu, 16)
    gpu_one, gpu_many = cpu_one, cpu_many
    if torch.cuda.is_available():
        gpu = TorchBackend("cuda")
        gpu_one, gpu_many = expert_rate_us(checkpoint, gpu, 1), expert_rate_us(checkpoint, gpu, 16)

    machine = (f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads, "
               f"{'cuda ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}")
    streaming = Calibration(cpu_us_per_expert=cpu_one, cpu_us_per_token_expert=max(0.0, (cpu_many - cpu_one) / 15),
                            gpu_us_per_expert=gpu_one, gpu_us_per_token_expert=max(0.0, (gpu_many - gpu_one) / 15),
                            expert_bytes=checkpoint.expert_nbytes, machine=machine)
    if layout is None:
        calibration = timed_decode(Engine(checkpoint), None, streaming)
    else:
        # The plan decides what runs beside what (a hit may go to the CPU lane when the lane is
        # faster, a remote worker may or may not pay), so the decode is timed under the plan the
        # calibrated run will make: planned with the streaming rates first, then again with the
        # rates each decode measured (keeping those a pass had no sample of), until two passes
        # in a row serve the same shares per tier (a fixed point), at most CALIBRATION_PASSES.
        from moetier.engine.runtime import build_runtime

        link_rtt_us = {t.name: layout.link(t.link).rtt_us for t in layout.tiers if t.kind == "remote" and t.link}
        calibration, shares = streaming, None
        for _ in range(CALIBRATION_PASSES):
            runtime = build_runtime(layout, checkpoint, calibration)
            try:
                calibration = timed_decode(runtime.engine, runtime.executor, calibration, link_rtt_us,
                                           streaming_us=streaming.cpu_us_per_expert)
                previous, shares = shares, served_shares(runtime.executor)
            finally:
                runtime.close()
            if previous is not None and all(abs(shares[t] - previous[t]) <= SHARE_TOLERANCE for t in shares):
                break
    with new_file(target) as partial:  # whole file or nothing
        partial.write_text(calibration.to_json())
    return calibration, target
