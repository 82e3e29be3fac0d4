"""The backend interface: how expert FFN math runs on one device.

A backend is a short table of operations. `place` puts one expert's weights
where the backend computes, in memory it owns (a copy in RAM, an upload to a GPU),
in the stored format they come in, which must be one of the backend's
`caps.formats`;
`run_experts` computes a group of experts over the rows routed to each and
returns their gate-weighted sum as one [T, D] tensor — one call per layer's
group, so a backend is free to batch; `run_decode` is the same for one token
with the gate weights as plain floats (a decode step's shape, which a backend
may serve without building per-expert tensors). The public methods check their
arguments and call a private hook; a backend that lacks a hook fails loudly.
Backends never call tiers or the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, Sequence

import torch

from moetier.model.checkpoint import ExpertWeights
from moetier.model.formats import F32, FORMATS


@dataclass(frozen=True)
class BackendCaps:
    dtypes: tuple[str, ...]  # activation dtypes it computes in
    formats: frozenset[int] = frozenset({F32})  # the stored formats (GGML type ids, moetier.model.formats) of weights it reads


class ExpertWork(NamedTuple):  # a tuple: built per expert per layer on the hot path
    """One expert's share of a layer: which rows of x it serves, with which gate weights."""

    expert: Any  # what the backend's place() returned
    rows: torch.Tensor  # [n] int64 indices into x
    weights: torch.Tensor  # [n] float32 gate weights


def rows_on_host(items: Sequence[Any]) -> Sequence[Any]:
    """Work items (ExpertWork, the tiers' ExpertJob: named tuples with `rows` [n] and `weights` [n]) with their rows
    and weights in host memory, float32 weights, in one transfer of each: what a backend computing in host memory
    reads (run_experts) and what the remote tier sends, when the engine routed on a GPU. Items already on the host
    come back as they are."""
    if all(item.rows.is_cpu and item.weights.is_cpu for item in items):
        return items
    counts = [int(item.rows.numel()) for item in items]
    rows = torch.cat([item.rows for item in items]).cpu().split(counts)  # [n] each
    weights = torch.cat([item.weights.float() for item in items]).cpu().split(counts)  # [n] each
    return [item._replace(rows=r, weights=w) for item, r, w in zip(items, rows, weights)]


ROW0 = torch.zeros(1, dtype=torch.int64)  # [1]: the one row of a decode step's work, in host memory


def decode_weights(scales: Sequence[float]) -> tuple[torch.Tensor, ...]:
    """k gate weights -> k one-element float32 tensors [1] in host memory, one per expert."""
    return torch.tensor(scales, dtype=torch.float32).view(-1, 1).unbind(0)


class Backend:
    name: ClassVar[str]
    caps: ClassVar[BackendCaps]

    def __init__(self, device: str = "cpu"):
        self.device = device

    def place(self, weights: ExpertWeights) -> Any:
        for tensor, qtype in ((weights.gate_up, weights.gate_up_type), (weights.down, weights.down_type)):
            fmt = FORMATS.get(qtype)
            if qtype not in self.caps.formats or fmt is None:
                names = ", ".join(FORMATS[t].name for t in sorted(self.caps.formats))
                raise TypeError(f"{self.name} backend: expert weights held as {weights.formats} (it reads {names})")
            if tensor.dtype != (fmt.dtype or torch.uint8):
                raise TypeError(f"{self.name} backend: a {fmt.name} matrix held as {tensor.dtype} (expected {fmt.dtype or torch.uint8})")
        return self._place(weights)

    def run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        """x [T, D] float32 -> [T, D]: sum over work of weights * ffn(x[rows]) scattered to rows. With x in host
        memory the rows and weights come there too (rows_on_host: a GPU engine's jobs on a host tier)."""
        if x.dim() != 2:
            raise ValueError(f"{self.name} backend: x must be [T, D], got shape {list(x.shape)}")
        return self._run_experts(x, rows_on_host(work) if x.is_cpu else work)

    def run_decode(self, x: torch.Tensor, experts: Sequence[Any], scales: Sequence[float]) -> torch.Tensor:
        """x [1, D] -> [1, D]: sum over j of scales[j] * ffn_j(x), experts as place() returned them."""
        if x.dim() != 2 or x.shape[0] != 1 or len(experts) != len(scales):
            raise ValueError(f"{self.name} backend: run_decode takes x [1, D] and one scale per expert, got x "
                             f"{list(x.shape)}, {len(experts)} experts, {len(scales)} scales")
        return self._run_decode(x, experts, scales)

    def decode_kernel(self) -> Any:
        """The native DecodeKernel whose `run` this backend's one-row decode is, bit for bit; None if there is none."""
        return None

    def native_lane(self, threads: int) -> Any:
        """A NativeLane of `threads` C threads computing this backend's decode calls bit for bit; None if it has none."""
        return None

    def describe(self) -> str:
        """One line for reports: the backend, its device, and how it computes."""
        return f"{self.name} ({self.device})"

    def synchronize(self) -> None:
        """Wait for the device work this backend queued (a synchronous backend returns at once)."""
        raise NotImplementedError(f"{type(self).__name__} does not implement synchronize")

    def _place(self, weights: ExpertWeights) -> Any:
        raise NotImplementedError(f"{type(self).__name__} does not implement _place")

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement _run_experts")

    def _run_decode(self, x: torch.Tensor, experts: Sequence[Any], scales: Sequence[float]) -> torch.Tensor:
        return self._run_experts(x, list(map(ExpertWork, experts, (ROW0,) * len(experts), decode_weights(scales))))
