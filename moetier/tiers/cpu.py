"""The CPU lane: experts computed from host memory by a small thread pool.

Holds every expert of the layers it serves, computing straight from the
machine's `HostExperts` (placed by the backend without another copy).
`submit` runs on the lane's own thread, so the engine's main thread can do
attention or GPU work meanwhile (torch releases the GIL inside kernels); with
the torch backend a call's experts are spread over `threads` lanes.
Results are exactly the backend's `run_experts` over the same jobs.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Sequence

import torch

from moetier.backends import Backend, ExpertWork, get_backend
from moetier.tiers.base import ExpertJob, Tier
from moetier.tiers.handoff import Handoff, LaneThreads
from moetier.tiers.host import HostExperts


class CpuTier(Tier):
    kind = "cpu"

    def __init__(
        self,
        name: str,
        host: HostExperts,
        backend: str | Backend = "torch",
        threads: int = 1,
        us_per_expert: float = 0.0,
    ):
        super().__init__(name)
        if isinstance(backend, str):  # torch spreads a call's experts over `threads` lanes
            backend = get_backend(backend, "cpu", lanes=threads) if backend == "torch" else get_backend(backend, "cpu")
        self.backend = backend
        experts = range(host.spec.num_experts)
        self._all = frozenset(experts)
        self.placed = {l: [self.backend.place(host.get(l, e)) for e in experts] for l in host.layers}
        self.us_per_expert = us_per_expert
        # two calls may be in flight: a deferred layer's and the next layer's (DEFER_CPU)
        self._lane = LaneThreads(2, f"cpu-lane-{name}")
        self.calls: deque[tuple[int, float]] | None = None  # a deque to record lane calls (experts, us from submit to done)

    def holds(self, layer: int) -> frozenset[int]:
        return self._all if layer in self.placed else frozenset()

    def cost_us(self, layer: int, experts: int, tokens: int) -> float:
        return self.us_per_expert * experts

    def compute(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> torch.Tensor:
        """The lane's math, synchronously on the caller's thread (also the lossless fallback of other tiers).

        x [T, D] may live on a GPU (a part's device): its rows come to host memory and the partial goes back.
        """
        placed = self.placed[layer]
        work = [ExpertWork(placed[j.expert], j.rows, j.weights) for j in jobs]
        if x.device.type == "cpu":
            return self.backend.run_experts(x, work)
        return self.backend.run_experts(x.cpu(), work).to(x.device)

    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> Handoff:
        if self.calls is None:
            return self._lane.submit(self.compute, layer, x, jobs)
        return self._lane.submit(self._timed_compute, layer, x, jobs, time.perf_counter())

    def _timed_compute(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob], submitted: float) -> torch.Tensor:
        out = self.compute(layer, x, jobs)
        self.calls.append((len(jobs), (time.perf_counter() - submitted) * 1e6))  # what `moetier calibrate` fits
        return out

    def close(self) -> None:
        self._lane.shutdown()
