"""The tier interface: one place where experts live and are computed.

A tier holds some experts of each MoE layer (`holds`), says what serving a
batch of them would cost (`cost_us`, from the scheduler's cost model), and
computes them asynchronously: `submit(layer, x, work)` returns a future of the
gate-weighted partial sum [T, D] over the work's experts. Kinds: `vram` (an
expert cache on a device), `helper` (a second device), `cpu` (the CPU lane),
`remote` (a worker on another host). Tiers never call the scheduler; the
engine decides the order of a step.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import ClassVar, Sequence

import torch

from moetier.engine.router import ExpertJob  # noqa: F401  (tiers take their work in this form)


class Tier:
    kind: ClassVar[str]
    inline: ClassVar[bool] = False  # submit computes on the calling thread (the engine's own device)

    def __init__(self, name: str):
        self.name = name

    def holds(self, layer: int) -> frozenset[int]:
        """Experts of `layer` this tier can serve right now without fetching."""
        raise NotImplementedError(f"{type(self).__name__} does not implement holds")

    def cost_us(self, layer: int, experts: int, tokens: int) -> float:
        """Predicted microseconds to serve `experts` experts over `tokens` tokens (model, not measurement)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement cost_us")

    def submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        """x [T, D] -> future of the [T, D] sum over jobs of weights * ffn(x[rows]) scattered to rows."""
        if not jobs:
            done: Future[torch.Tensor] = Future()
            done.set_result(torch.zeros_like(x))
            return done
        return self._submit(layer, x, jobs)

    def close(self) -> None:
        """Release threads, sockets and device memory (idempotent)."""

    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        raise NotImplementedError(f"{type(self).__name__} does not implement _submit")
