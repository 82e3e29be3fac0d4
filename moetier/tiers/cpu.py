"""The CPU lane: experts computed from host memory by a small thread pool.

Holds every expert of the layers it serves, computing straight from the
machine's `HostExperts` (placed by the backend without another copy).
`submit` runs off the engine's thread, so the engine can do attention or GPU
work meanwhile. A decode call (one token in host memory) goes to the
backend's native lane when it has one (the torch backend with the native
kernels): a C thread that never takes the GIL hands the call to the
backend's pool of `threads` native threads, which split every matrix's rows,
so handing work over and collecting it cost the engine one ctypes call each
and nothing in between. Other calls (prefill windows) run on Python lane
threads, through the same backend (with the native kernels, on the same
pool). Results are exactly the backend's `run_experts` over the same jobs,
bit for bit.
"""

from __future__ import annotations

import time
from array import array
from collections import deque
from typing import Sequence

import torch

from moetier.backends import Backend, get_backend
from moetier.backends.cpu_kernels import DecodeKernel, expert_record
from moetier.tiers.base import DecodeJobs, ExpertJob, Tier, job_experts, run_jobs
from moetier.tiers.host_experts import HostExperts
from moetier.tiers.lane_threads import LaneThreads


class CpuTier(Tier):
    kind = "cpu"
    deferrable = True

    def __init__(
        self,
        name: str,
        host: HostExperts,
        backend: str | Backend = "torch",
        threads: int = 1,
    ):
        super().__init__(name)
        if isinstance(backend, str):  # torch: its native kernels' pool has `threads` threads
            backend = get_backend(backend, "cpu", lanes=threads) if backend == "torch" else get_backend(backend, "cpu")
        self.backend = backend
        experts = range(host.spec.num_experts)
        self._all = frozenset(experts)
        self.placed = {l: [self.backend.place(host.get(l, e)) for e in experts] for l in host.layers}
        self.inter = host.spec.moe_intermediate_size
        # two calls may be in flight: a deferred layer's and the next layer's (DEFER_CPU)
        self._lane = LaneThreads(2, f"cpu-lane-{name}")
        self._native, self._addresses = self._open_native(threads)
        self.calls: deque[tuple[int, float]] | None = None  # a deque to record lane calls (experts, us from submit to done)

    def holds(self, layer: int) -> frozenset[int]:
        return self._all if layer in self.placed else frozenset()

    def compute(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> torch.Tensor:
        """The lane's math, synchronously on the caller's thread (also the lossless fallback of other tiers).

        x [T, D] may live on a GPU (a part's device), and the jobs' rows and weights with it: they come to host
        memory (the backend's run_experts brings the rows) and the partial goes back.
        """
        placed = self.placed[layer].__getitem__
        if x.device.type == "cpu":
            return run_jobs(self.backend, x, jobs, placed)
        return run_jobs(self.backend, x.cpu(), jobs, placed).to(x.device)

    def _open_native(self, threads: int):
        """The backend's native lane and, per layer, each expert's record (its matrices' addresses and
        formats, checked: `expert_record`); or (None, None)."""
        if not all(DecodeKernel.fits(w) for ws in self.placed.values() for w in ws):
            return None, None
        lane = self.backend.native_lane(threads)
        if lane is None:
            return None, None
        records = {layer: [expert_record(w, inter=self.inter) for w in placed]  # per expert, RECORD.size bytes
                   for layer, placed in self.placed.items()}
        return lane, records

    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]):
        if self._native is not None and x.shape[0] == 1 and x.is_cpu and x.dtype is torch.float32:
            if self.calls is None:
                return self._native_submit(layer, x, jobs)
            submitted = time.perf_counter()
            return _Timed(self._native_submit(layer, x, jobs), len(jobs), submitted, self.calls)
        if self.calls is None:
            return self._lane.submit(self.compute, layer, x, jobs)
        return self._lane.submit(self._timed_compute, layer, x, jobs, time.perf_counter())

    def _native_submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]):
        experts = job_experts(jobs)
        scales = jobs.scales if isinstance(jobs, DecodeJobs) else torch.cat([j.weights for j in jobs]).tolist()
        addresses = b"".join(map(self._addresses[layer].__getitem__, experts))
        return self._native.submit(x.contiguous(), addresses, array("f", scales), self.inter)

    def _timed_compute(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob], submitted: float) -> torch.Tensor:
        out = self.compute(layer, x, jobs)
        self.calls.append((len(jobs), (time.perf_counter() - submitted) * 1e6))  # what `moetier calibrate` fits
        return out

    def close(self) -> None:
        self._lane.shutdown()
        if self._native is not None:
            self._native.close()


class _Timed:
    """A native-lane ticket whose result() also records (experts, us from submit to done) for calibrate."""

    __slots__ = ("_ticket", "_experts", "_submitted", "_calls")

    def __init__(self, ticket, experts: int, submitted: float, calls: deque):
        self._ticket, self._experts, self._submitted, self._calls = ticket, experts, submitted, calls

    def result(self) -> torch.Tensor:
        out = self._ticket.result()
        if self._calls is not None:
            self._calls.append((self._experts, (self._ticket.done_s - self._submitted) * 1e6))
            self._calls = None
        return out
