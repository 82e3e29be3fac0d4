"""Torch backend: expert FFNs with torch on the CPU or a CUDA device.

`place` copies each expert once into memory the process owns (host RAM on the
CPU, device memory on CUDA): a file mapping's pages can be dropped by the OS
and re-read from disk mid-decode. A layer's group runs expert by expert over
the rows routed to each (a grouped GEMM: one matmul per expert covering all
its tokens), so prefill does E_hit matmuls, not T x k. Decode touches each
picked expert's weights exactly once, in place: gathering the k experts into
one stacked tensor for a single bmm would copy every weight byte once more
per token, and decode is bound by exactly those bytes.

With `lanes > 1` (default 1) a CPU decode group is split over that many
threads, each streaming its share of the experts with single-threaded kernels
into its own partial sum, added in lane order: an expert's matrices are too
small for intra-op threads to help (a microbenchmark here: one lane ~11 GB/s
with 1 or 2 intra-op threads, two lanes ~20 GB/s). In the engine the gain on
this 2-core machine is bimodal (50-69 tok/s on the medium model against a
steady 56 with one lane), so it is opt-in.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch
import torch.nn.functional as F

from moetier.backends.base import Backend, BackendCaps, ExpertWork
from moetier.model.checkpoint import ExpertWeights


def swiglu(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """x [n, D] -> [n, D] = down(silu(gate x) * up x)."""
    gate, up = F.linear(x, w.gate_up).chunk(2, dim=-1)  # [n, I] each
    return F.linear(F.silu(gate) * up, w.down)


def _decode_experts(x: torch.Tensor, work: Sequence[ExpertWork], scales: Sequence[float]) -> torch.Tensor:
    """One token through some experts: x [1, D] -> sum of scale * ffn(x) [1, D]."""
    out = torch.zeros_like(x)
    for item, scale in zip(work, scales):
        w = item.expert
        gate_up = F.linear(x, w.gate_up)  # [1, 2I]
        inter = w.down.shape[1]
        hidden = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # [1, I]
        out.addmm_(hidden, w.down.t(), alpha=scale)  # out += scale * hidden @ down^T, one kernel
    return out


class TorchBackend(Backend):
    name = "torch"
    caps = BackendCaps(device_kind="cpu", dtypes=("float32",))

    def __init__(self, device: str = "cpu", lanes: int | None = None):
        super().__init__(device)
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"torch backend: device {device!r} asked for but CUDA is not available")
            self.caps = BackendCaps(device_kind="cuda", dtypes=("float32",))
        cpu = self.torch_device.type == "cpu"
        self.lanes = max(1, lanes if lanes is not None else 1)
        self._pool = None
        if cpu and self.lanes > 1:  # the lane threads' kernels are single-threaded (set once per thread)
            self._pool = ThreadPoolExecutor(self.lanes, thread_name_prefix="expert-lane",
                                            initializer=torch.set_num_threads, initargs=(1,))

    def _place(self, weights: ExpertWeights) -> ExpertWeights:
        if self.torch_device.type == "cpu":
            return weights.resident()
        return weights.to(self.torch_device)

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        if x.shape[0] == 1 and work:  # decode: every expert serves the one row
            scales = torch.cat([item.weights for item in work]).tolist()  # one host read, not one per expert
            if self._pool is None or len(work) < 2:
                return _decode_experts(x, work, scales)
            lanes = min(self.lanes, len(work))
            futures = [self._pool.submit(_decode_experts, x, work[i::lanes], scales[i::lanes]) for i in range(lanes)]
            out = futures[0].result()
            for future in futures[1:]:
                out += future.result()
            return out
        out = torch.zeros_like(x)  # [T, D]
        for item in work:
            rows = item.rows.to(x.device)
            y = swiglu(x.index_select(0, rows), item.expert)  # [n, D]
            out.index_add_(0, rows, y * item.weights.to(x.device)[:, None])
        return out

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
