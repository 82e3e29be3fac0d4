"""`moetier calibrate`: measure the cost model's rates on this machine, for one model.

Expert rates are measured by streaming distinct experts (cycling through every
MoE layer, so the caches hold none of them), the way decode touches them;
trunk and head times come from timed decode steps of the engine; the
dispatch overhead from a run over the layout when one is given. A GPU's rate
is measured on the GPU when CUDA is here, else it equals the CPU rate: an
emulated GPU computes on the CPU.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

from moetier.backends import ExpertWork
from moetier.backends.torch_backend import TorchBackend
from moetier.engine import Engine, generate
from moetier.engine.timing import StepTimes
from moetier.model import open_checkpoint
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


def measure(layout_path: Path | None, model: Path | None, out: Path | None, threads: int | None) -> tuple[Calibration, Path]:
    from moetier.cli import builtin_model
    from moetier.config import load_layout

    if threads is not None:
        torch.set_num_threads(threads)
    layout = load_layout(layout_path) if layout_path is not None else None
    folder = model or (layout.relative(layout.model) if layout is not None and layout.model else builtin_model())
    checkpoint = open_checkpoint(folder)
    spec = checkpoint.spec

    cpu = TorchBackend("cpu")
    cpu_one = expert_rate_us(checkpoint, cpu, 1)
    cpu_many = expert_rate_us(checkpoint, cpu, 16)
    gpu_one, gpu_many = cpu_one, cpu_many
    if torch.cuda.is_available():
        gpu = TorchBackend("cuda")
        gpu_one, gpu_many = expert_rate_us(checkpoint, gpu, 1), expert_rate_us(checkpoint, gpu, 16)

    engine = Engine(checkpoint)
    engine.warm_up()
    times = StepTimes()
    steps = 24

    def start() -> None:
        engine.times = times

    generate(engine, [1, 2, 3, 4], steps + 1, before_decode=start)
    engine.times = None
    attention_us = times.seconds["attention"] / times.steps / spec.num_layers * 1e6
    x = torch.randn(1, spec.hidden_size)
    head = []
    for _ in range(20):
        begin = time.perf_counter()
        F.linear(F.rms_norm(x, engine.final_norm.shape, engine.final_norm, spec.rms_norm_eps), engine.lm_head)
        head.append((time.perf_counter() - begin) * 1e6)

    dispatch_us = Calibration.dispatch_us_per_layer
    if layout is not None:
        from moetier.engine.layout_runtime import build_runtime

        runtime = build_runtime(layout, checkpoint, Calibration())
        run_times = StepTimes()

        def start_tiered() -> None:
            runtime.engine.times = runtime.executor.times = run_times

        try:
            generate(runtime.engine, [1, 2, 3, 4], steps + 1, before_decode=start_tiered)
        finally:
            runtime.close()
        dispatch_us = run_times.seconds["dispatch"] / run_times.steps / max(len(spec.moe_layers), 1) * 1e6

    calibration = Calibration(
        cpu_us_per_expert=cpu_one,
        cpu_us_per_token_expert=max(0.0, (cpu_many - cpu_one) / 15),
        gpu_us_per_expert=gpu_one,
        gpu_us_per_token_expert=max(0.0, (gpu_many - gpu_one) / 15),
        attention_us_per_layer=attention_us,
        head_us=median(head),
        dispatch_us_per_layer=dispatch_us,
        expert_bytes=checkpoint.expert_nbytes,
        machine=f"{platform.processor() or platform.machine()} x{torch.get_num_threads()} threads, "
                f"{'cuda ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}",
    )
    target = out or (layout.relative(layout.scheduler.calibration) if layout is not None and layout.scheduler.calibration
                     else Path("calibration.json"))
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    partial.write_text(calibration.to_json())
    partial.replace(target)
    return calibration, target
