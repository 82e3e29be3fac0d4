"""Torch backend: expert FFNs with torch on the CPU or a CUDA device.

`place` copies each expert once into memory the process owns (host RAM on the
CPU, device memory on CUDA): a file mapping's pages can be dropped by the OS
and re-read from disk mid-decode. A layer's group runs expert by expert over
the rows routed to each (a grouped GEMM: one matmul per expert covering all
its tokens), so prefill does E_hit matmuls, not T x k. Decode touches each
picked expert's weights exactly once, in place: gathering the k experts into
one stacked tensor for a single bmm would copy every weight byte once more
per token, and decode is bound by exactly those bytes.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from moetier.backends.base import Backend, BackendCaps, ExpertWork
from moetier.model.checkpoint import ExpertWeights


def swiglu(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """x [n, D] -> [n, D] = down(silu(gate x) * up x)."""
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w.down)


class TorchBackend(Backend):
    name = "torch"
    caps = BackendCaps(device_kind="cpu", dtypes=("float32",))

    def __init__(self, device: str = "cpu"):
        super().__init__(device)
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"torch backend: device {device!r} asked for but CUDA is not available")
            self.caps = BackendCaps(device_kind="cuda", dtypes=("float32",))

    def _place(self, weights: ExpertWeights) -> ExpertWeights:
        if self.torch_device.type == "cpu":
            return weights.resident()
        return weights.to(self.torch_device)

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        out = torch.zeros_like(x)  # [T, D]
        if x.shape[0] == 1 and work:  # decode: every expert serves the one row
            scales = torch.cat([item.weights for item in work]).tolist()  # one host read, not one per expert
            for item, scale in zip(work, scales):
                w = item.expert
                gate_up = F.linear(x, w.gate_up)  # [1, 2I]
                inter = w.down.shape[1]
                hidden = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # [1, I]
                out.addmm_(hidden, w.down.t(), alpha=scale)  # out += scale * hidden @ down^T, one kernel
            return out
        for item in work:
            rows = item.rows.to(x.device)
            y = swiglu(x.index_select(0, rows), item.expert)  # [n, D]
            out.index_add_(0, rows, y * item.weights.to(x.device)[:, None])
        return out

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
