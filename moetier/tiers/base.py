"""The tier interface: one place where experts live and are computed.

A tier holds some experts of each MoE layer (`holds`) and computes them
asynchronously: `submit(layer, x, jobs)` returns a future of the
gate-weighted partial sum [T, D] over the jobs' experts. What else it can do
is declared, not probed: `residency` (what it holds moves as it serves, and
`access` moves it: the VRAM cache), `deferrable` (its partial may land after
the next layer's attention: the CPU lane, DEFER_CPU), `inline` (it computes on
the calling thread), and `wait_category` (where the engine's wait for it is
accounted). Kinds: `vram`, `helper` (a second device), `cpu` (the CPU lane),
`remote` (a worker on another host). What serving costs is the scheduler's
cost model (moetier.sched.cost), not the tier's. Tiers never call the
scheduler; the engine decides the order of a step. The step's value types
(ExpertJob, DecodeJobs) live here, with the interface that consumes them.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import torch

from moetier.backends import Backend, ExpertWork
from moetier.backends.base import ROW0, decode_weights


class ExpertJob(NamedTuple):  # a tuple: built per expert per layer on the hot path
    """One picked expert's share of a layer: the rows of x routed to it and their gate weights."""

    expert: int
    rows: torch.Tensor  # [n] int64 indices into x
    weights: torch.Tensor  # [n] float32


class DecodeJobs(Sequence[ExpertJob]):
    """One token's jobs for one tier, as plain lists: `experts` and their gate weights `scales`.

    A sequence of ExpertJob(expert, ROW0, weights [1]) like any other job list, but those tensors
    are made only if a tier iterates it; a tier that reads `experts` and `scales` (the native CPU
    lane, the remote client) never pays for k one-element tensors.
    """

    __slots__ = ("experts", "scales", "_jobs")

    def __init__(self, experts: list[int], scales: list[float]):
        self.experts, self.scales = experts, scales
        self._jobs: list[ExpertJob] | None = None

    def __len__(self) -> int:
        return len(self.experts)

    def __getitem__(self, index):
        return self.jobs()[index]

    def __iter__(self):
        return iter(self.jobs())

    def jobs(self) -> list[ExpertJob]:
        if self._jobs is None:
            self._jobs = list(map(ExpertJob, self.experts, (ROW0,) * len(self.experts), decode_weights(self.scales)))
        return self._jobs


def job_experts(jobs: Sequence[ExpertJob]) -> list[int]:
    """The experts of a tier's jobs, in order (without making a DecodeJobs' tensors)."""
    return jobs.experts if isinstance(jobs, DecodeJobs) else [job.expert for job in jobs]


def run_jobs(backend: Backend, x: torch.Tensor, jobs: Sequence[ExpertJob], placed: Callable[[int], Any]) -> torch.Tensor:
    """x [T, D] -> [T, D]: the backend's gate-weighted sum over a tier's jobs, each expert as `placed(expert)`
    gives it. A decode step's DecodeJobs go to run_decode (its weights stay floats), other jobs to run_experts."""
    if isinstance(jobs, DecodeJobs):
        return backend.run_decode(x, [placed(e) for e in jobs.experts], jobs.scales)
    return backend.run_experts(x, [ExpertWork(placed(j.expert), j.rows, j.weights) for j in jobs])


class Tier:
    kind: ClassVar[str]
    inline: ClassVar[bool] = False  # submit computes on the calling thread (the engine's own device)
    residency: ClassVar[bool] = False  # what it holds moves as it serves; `access` admits and evicts
    deferrable: ClassVar[bool] = False  # its partial may be added after the next layer's attention (DEFER_CPU)
    wait_category: ClassVar[str] = ""  # StepTimes category of the engine's wait for its partial

    def __init__(self, name: str):
        self.name = name

    def holds(self, layer: int) -> frozenset[int]:
        """Experts of `layer` this tier can serve right now without fetching."""
        raise NotImplementedError(f"{type(self).__name__} does not implement holds")

    def access(self, layer: int, picks: Sequence[int]) -> tuple[int, list[int]]:
        """A tier with `residency`: one token-step's picks through its policy -> (hits, experts admitted now)."""
        raise NotImplementedError(f"{type(self).__name__} has no residency to access")

    def submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        """x [T, D] -> future of the [T, D] sum over jobs of weights * ffn(x[rows]) scattered to rows."""
        if not jobs:
            done: Future[torch.Tensor] = Future()
            done.set_result(torch.zeros_like(x))
            return done
        return self._submit(layer, x, jobs)

    def close(self) -> None:
        """Release threads, sockets and device memory (idempotent)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement close")

    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        raise NotImplementedError(f"{type(self).__name__} does not implement _submit")
