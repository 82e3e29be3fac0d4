"""The native kernels' thread pool: hand-off cost, decode GB/s and prefill speed, next to the read bandwidth of the same threads.

Regime: CPU, one process, float32 activations in host memory. Hand-off: one
layer's call on tiny experts (8 float32 experts of [64, 64] / [64, 32], 0.2 MB,
in cache), through ctypes with prepared records (`raw`), through
DecodeKernel.run (its checks included) and through the lane (submit then
result); back to back (helpers polling) and after 2 ms idle (helpers asleep
past spin_s: a futex wake). Decode: one moe_decode call on the pool's
threads, and the same call through the CPU lane as the CPU tier makes it
(submitted to a NativeLane, collected at once: the collecting thread joins
the pool's job, so a lane of one thread computes on two), records built once,
8 experts of [1536, 2048] gate_up / [2048, 768] down per call, picked in turn
from a set of >= 512 MB so every call reads DRAM, as GB/s of the stored bytes
read; the experts in host memory advised for huge pages, as the tier holds
them. Read bandwidth: the faster of torch.sum and the native read probe over
a 1 GiB float32 buffer in the same kind of memory with the same thread count
(moetier.calibrate.read_probes). The decode, the lane and the read are
sampled in turn, one sample of each a round, and each figure is its best
over max(--runs, 5) rounds: the read's best and the decode's come from the
same minutes. The machine may be shared: a sample during
which other processes used over 5% of a CPU (/proc/stat) is taken again, and a
format's block is measured while `second_cpu_free` holds before and after it
(else marked disturbed).
Prefill: T = 256 tokens, each routed to 8 of 64 experts (about 32 tokens per
expert), one DecodeKernel.experts call, best of --runs. Prints a table, then
one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
import time
from array import array
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from quant_blocks import F16_FIELDS, random_rows  # noqa: E402

from moetier.backends import ExpertWork, cpu_kernels, cpu_lane, cpu_streams  # noqa: E402
from moetier.calibrate import read_probes  # noqa: E402
from moetier.model import ExpertWeights  # noqa: E402
from moetier.model.formats import BY_NAME  # noqa: E402

DIM, INTER, K = 2048, 768, 8


def matrix(name: str, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    fmt = BY_NAME[name]
    if fmt.dtype is not None:
        return torch.from_numpy(rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).to(fmt.dtype)
    return torch.from_numpy(random_rows(fmt, rows, cols, rng, 0.001))


def expert_set(name: str, min_bytes: int, rng: np.random.Generator) -> list[ExpertWeights]:
    fmt = BY_NAME[name]
    one = fmt.row_bytes(DIM) * 2 * INTER + fmt.row_bytes(INTER) * DIM
    count = max(2 * K, -(-min_bytes // one) // K * K)
    # held as the CPU tier holds its experts: in memory advised for huge pages (moetier.model.host_memory), in the
    # layout the kernels read fastest (IQ3_XXS / IQ3_S as IQ3_XXS_T / IQ3_S_T: cpu_kernels.resident_layout)
    return [cpu_kernels.resident_layout(ExpertWeights(matrix(name, 2 * INTER, DIM, rng), matrix(name, DIM, INTER, rng),
                                                      True, fmt.id, fmt.id, False)) for _ in range(count)]


def _busy_s() -> float:
    """CPU seconds every process on this machine spent so far (/proc/stat: user, nice, system, irq, softirq, steal)."""
    with open("/proc/stat") as stat:
        fields = [int(v) for v in stat.readline().split()[1:9]]
    return (sum(fields) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def best_of(runs: int, fn, quiet: float = 0.05, tries: int = 60) -> float:
    """Best seconds of one fn() over `runs` samples taken while other processes used under `quiet` of one CPU
    (the machine is shared: a sample they disturbed is taken again, up to `tries` samples in all)."""
    best, best_disturbed, kept = float("inf"), float("inf"), 0
    for _ in range(tries):
        busy, mine, start = _busy_s(), time.process_time(), time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
        others = (_busy_s() - busy) - (time.process_time() - mine)
        if others <= quiet * max(seconds, 0.1):  # /proc/stat counts in 10 ms ticks
            best, kept = min(best, seconds), kept + 1
            if kept == runs:
                break
        best_disturbed = min(best_disturbed, seconds)
    if not kept:
        print(f"(no quiet sample in {tries}: the best disturbed one kept)", file=sys.stderr)
    return best if kept else best_disturbed


def read_samplers(threads: int) -> list:
    """One read sample per probe of moetier.calibrate.read_probes (torch.sum, the native kernels' two reductions) over a
    1 GiB float32 buffer on `threads` threads: (fn, bytes) pairs, each fn 8 reads; each probe run once here."""
    samplers = []
    for read in read_probes(threads).values():
        read()
        samplers.append((lambda read=read: [read() for _ in range(8)], 8 << 30))
    return samplers


def hand_off(kernel, threads: int) -> dict[str, float]:
    """Median microseconds of one tiny call: raw ctypes, DecodeKernel.run, the lane; back to back and after 2 ms idle."""
    k = kernel.with_threads(threads)
    experts = [ExpertWeights(torch.randn(64, 64) * 0.1, torch.randn(64, 32) * 0.1) for _ in range(K)]
    single = [ExpertWeights(torch.randn(16, 32) * 0.1, torch.randn(32, 8) * 0.1)]  # 3 KB: the call alone
    x, scales = torch.randn(1, 64), [0.125] * K
    records = b"".join(map(cpu_kernels.expert_record, experts))
    scale, out, floats = (ctypes.c_float * K)(*scales), torch.empty(1, 64), __import__("array").array("f", scales)
    lib, pool = k.library, k.pool.handle
    lane = cpu_lane.NativeLane(k, threads)
    one, x1 = cpu_kernels.expert_record(single[0]), torch.randn(1, 32)
    calls = {"raw_1x32": lambda: lib.moe_decode(pool, x1.data_ptr(), 32, 8, 1, one, scale, out.data_ptr()),
             "raw": lambda: lib.moe_decode(pool, x.data_ptr(), 64, 32, K, records, scale, out.data_ptr()),
             "run": lambda: k.run(x, experts, scales),
             "lane": lambda: lane.submit(x, records, floats, 32).result()}
    result = {}
    try:
        for name, call in calls.items():
            for idle_s, label in ((0.0, "hot"), (0.002, "idle")):
                times = []
                for i in range(2000 if idle_s == 0 else 300):
                    if idle_s:
                        time.sleep(idle_s)
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                result[f"{name}_{label}_us"] = float(np.median(times[100:])) * 1e6
    finally:
        lane.close()
    return result


class DecodeSampler:
    """Samples of the GB/s of stored weights a decode call reads: each sample SWEEPS sweeps over the set (K
    experts per call), the experts' records built once (as the CPU tier does). through_lane: each call submitted
    to a NativeLane of `threads` pool threads and collected at once, as the CPU tier makes it (the collecting
    thread joins the pool's job while it waits: a lane of one thread computes on two); else moe_decode on the
    pool's `threads` alone. close() stops the lane."""

    SWEEPS = 4  # ~0.1-0.3 s a sample

    def __init__(self, kernel, experts: list[ExpertWeights], threads: int, through_lane: bool):
        k = kernel.with_threads(threads)
        x, scales = torch.randn(1, DIM) * 0.1, array("f", [1.0 / K] * K)
        self.calls = [b"".join(map(cpu_kernels.expert_record, experts[i:i + K])) for i in range(0, len(experts), K)]
        out, scale = torch.empty(1, DIM), (ctypes.c_float * K)(*scales)
        self.lane = cpu_lane.NativeLane(k, threads) if through_lane else None
        if self.lane is not None:
            lane = self.lane
            self.call = lambda records: lane.submit(x, records, scales, INTER).result()  # noqa: E731
        else:
            self.call = lambda records: k.library.moe_decode(k.pool.handle, x.data_ptr(), DIM, INTER, K, records, scale,  # noqa: E731
                                                             out.data_ptr())
        self.nbytes = sum(w.nbytes for w in experts[:K]) * self.SWEEPS * len(self.calls)  # bytes a sample reads
        for records in self.calls[:2]:
            self.call(records)

    def sample(self) -> None:
        for _ in range(self.SWEEPS):
            for records in self.calls:
                self.call(records)

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()


def prefill_rate(kernel, experts: list[ExpertWeights], threads: int, runs: int, tokens: int = 256) -> float:
    """Tokens/s of one DecodeKernel.experts call: `tokens` rows, each routed to K of the first 64 experts."""
    k, g = kernel.with_threads(threads), torch.Generator().manual_seed(0)
    pool = experts[:64]
    picks = torch.stack([torch.randperm(len(pool), generator=g)[:K] for _ in range(tokens)])  # [T, K]
    work = []
    for e, w in enumerate(pool):
        rows = (picks == e).any(dim=1).nonzero().flatten()
        if rows.numel():
            work.append(ExpertWork(w, rows, torch.full((rows.numel(),), 1.0 / K)))
    x = torch.randn(tokens, DIM) * 0.1
    k.experts(x, work)
    return tokens / best_of(runs, lambda: k.experts(x, work))


def second_cpu_free(quiet: float = 0.05) -> bool:
    """Whether this machine's CPUs are free now: torch's 2-thread matmul at least 1.7x its 1-thread one and other
    processes under `quiet` of a CPU meanwhile (a host's neighbours, invisible in /proc/stat, show in the first)."""
    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    busy, mine, before = _busy_s(), time.process_time(), torch.get_num_threads()
    rates = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        rates.append(1 / best_of(1, lambda: [a @ b for _ in range(10)], quiet=1.0, tries=1))
    torch.set_num_threads(before)
    return rates[1] >= 1.7 * rates[0] and (_busy_s() - busy) - (time.process_time() - mine) < quiet


def measure(kernel, experts, threads: list[int], runs: int) -> dict:
    """Per thread count: the bare decode, the lane and the read probes sampled in turn, one sample of each a round
    over max(runs, 5) rounds, each figure its best quiet sample. Interleaved so that the read's best and the
    decode's come from the same minutes (the host's level moves from minute to minute). Then prefill. (On the Ice
    Lake host Q8_0's calls read more than the prefetched probe interleaved with them, 26.9 against 23.8 GB/s;
    the plain probe, eight streams, reads 27-30 there: docs/kernels.md.)"""
    result = {key: {} for key in ("decode_gb_per_s", "lane_gb_per_s", "read_gb_per_s", "prefill_tok_per_s")}
    for t in threads:
        bare, lane = DecodeSampler(kernel, experts, t, False), DecodeSampler(kernel, experts, t, True)
        samplers = {"decode_gb_per_s": [(bare.sample, bare.nbytes)], "lane_gb_per_s": [(lane.sample, lane.nbytes)],
                    "read_gb_per_s": read_samplers(t)}
        try:
            for key in samplers:
                result[key][t] = 0.0
            for _ in range(max(runs, 5)):
                for key, fns in samplers.items():
                    for fn, nbytes in fns:
                        result[key][t] = max(result[key][t], nbytes / best_of(1, fn) / 1e9)
        finally:
            lane.close()
        result["prefill_tok_per_s"][t] = prefill_rate(kernel, experts, t, runs)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default="F32,Q8_0,Q4_K")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--set-mb", type=int, default=512, help="each format's expert set, MB (beyond the LLC)")
    parser.add_argument("--gate-s", type=float, default=600,
                        help="wait up to this long for the CPUs to be free (`second_cpu_free`) before and after each format; 0: never wait")
    args = parser.parse_args()
    kernel = cpu_kernels.decode_kernel()
    if kernel is None:
        raise SystemExit(f"no native kernels: {cpu_kernels.status()}")
    threads = [int(t) for t in args.threads.split(",")]
    files = [name for name, fmt in BY_NAME.items() if fmt.dtype is not None or name in F16_FIELDS]  # a file's formats
    for name in args.formats.split(","):
        if name not in files:
            parser.error(f"--formats: {name!r} is not a stored format (expected some of {','.join(files)})")
    print(cpu_kernels.status())
    report = {"status": cpu_kernels.status(), "hand_off": {t: hand_off(kernel, t) for t in threads}, "formats": {}}
    rng = np.random.default_rng(0)
    for name in args.formats.split(","):
        experts = expert_set(name, args.set_mb << 20, rng)
        deadline, free = time.monotonic() + args.gate_s, False
        while True:
            while args.gate_s and not second_cpu_free() and time.monotonic() < deadline:
                time.sleep(2)
            result = measure(kernel, experts, threads, args.runs)
            free = not args.gate_s or second_cpu_free()
            if free or time.monotonic() >= deadline:
                break
        report["formats"][name] = {**result, "cpus_free": free}
        del experts
    print(f"{'hand-off (us, median)':<34}" + "".join(f"{t:>10} thr" for t in threads))
    for key in report["hand_off"][threads[0]]:
        print(f"  {key:<32}" + "".join(f"{report['hand_off'][t][key]:>14.1f}" for t in threads))
    for name, result in report["formats"].items():
        note = "" if result["cpus_free"] else "  (CPUs busy: disturbed)"
        print(f"{name + ' decode GB/s':<34}" + "".join(f"{result['decode_gb_per_s'][t]:>14.1f}" for t in threads) + note)
        print(f"{'  through the lane GB/s':<34}" + "".join(f"{result['lane_gb_per_s'][t]:>14.1f}" for t in threads))
        print(f"{'  read bandwidth GB/s':<34}" + "".join(f"{result['read_gb_per_s'][t]:>14.1f}" for t in threads))
        print(f"{'  prefill tok/s (T=256)':<34}" + "".join(f"{result['prefill_tok_per_s'][t]:>14.1f}" for t in threads))
    report["streams"] = cpu_streams.streams()  # chosen when the first pool opened
    print(f"float formats' one-token rows: {report['streams']}")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
