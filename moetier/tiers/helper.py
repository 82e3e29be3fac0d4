"""The helper tier: a second device holding a fixed set of experts; hidden states are shipped to it.

Unlike the VRAM cache nothing moves after start-up: the experts it holds per
layer are chosen once (e.g. the next-hottest after the first GPU's cache).
Each call ships the token rows there and the partial sum back over its link
(emulated time without a second GPU) and computes with torch on its device.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Mapping, Sequence

import torch

from moetier.backends.torch_backend import TorchBackend
from moetier.tiers.base import DecodeJobs, ExpertJob, Tier, run_jobs
from moetier.tiers.host_experts import HostExperts
from moetier.tiers.link import Link


class HelperTier(Tier):
    kind = "helper"
    wait_category = "gpu experts"

    def __init__(self, name: str, host: HostExperts, experts: Mapping[int, Sequence[int]], link: Link,
                 device: str = "cpu"):
        super().__init__(name)
        self.link = link
        self.device = torch.device(device)
        self.backend = TorchBackend(device)
        self._held = {layer: frozenset(int(e) for e in chosen) for layer, chosen in experts.items()}
        self.placed = {layer: {e: self.backend.place(host.get(layer, e).to(self.device)) for e in chosen}
                       for layer, chosen in self._held.items()}
        self._compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"helper-{name}")

    def holds(self, layer: int) -> frozenset[int]:
        return self._held.get(layer, frozenset())

    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        return self._compute.submit(self._run, layer, x, jobs)

    def _run(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> torch.Tensor:
        rows = 1 if isinstance(jobs, DecodeJobs) else torch.unique(torch.cat([j.rows for j in jobs])).numel()  # one token: one row
        payload = rows * x.shape[1] * x.element_size()
        self.link.transfer(payload)  # the token rows go there
        out = run_jobs(self.backend, x.to(self.device), jobs, self.placed[layer].__getitem__)
        self.backend.synchronize()
        self.link.transfer(payload)  # the partial sums come back
        return out.to(x.device)

    def close(self) -> None:
        self._compute.shutdown(wait=True)
