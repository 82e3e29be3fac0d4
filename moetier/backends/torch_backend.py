"""Torch backend: expert FFNs with torch on the CPU or a CUDA device.

`place` copies each expert once into memory the process owns (host RAM on the
CPU, device memory on CUDA): a file mapping's pages can be dropped by the OS
and re-read from disk mid-decode. A layer's group runs expert by expert over
the rows routed to each (a grouped GEMM: one matmul per expert covering all
its tokens), so prefill does E_hit matmuls, not T x k. Decode touches each
picked float32 expert's weights exactly once, in place: gathering the k
experts into one stacked tensor for a single bmm would copy every weight byte
once more per token, and decode is bound by exactly those bytes. Stored
(quantized, F16, BF16) experts are the other way round: the torch path
dequantizes them anyway, in a dozen ops a matrix, so a decode step stacks the
stored bytes of the experts of one kind (a quarter of what dequantizing
writes) and dequantizes them together: ops per layer, not per expert, which
is what a GPU's batch-1 decode is bound by.

On the CPU, a layer's group runs through the native kernels
(moetier.backends.cpu_kernels: one C call per group, decode and prefill
alike, on a pool of `lanes` threads, default every CPU this process may run
on) when this machine could build them, and through torch ops otherwise: an
expert's matrices are small (0.25-0.5 MB on the medium model), so five
framework ops per expert cost as much as reading its bytes. The kernels'
result does not depend on the thread count.

Experts are held in their stored format (moetier.model.formats). The native
kernels read every format in place; the torch path (CUDA, a machine without
the kernels) dequantizes an expert's matrices to float32 on their own device
for each call (moetier.backends.torch_dequant), so VRAM holds stored bytes and
only a call's transient copy is float32.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from moetier.backends import cpu_kernels, cpu_lane
from moetier.backends.base import Backend, BackendCaps, ExpertWork
from moetier.backends.activations import act_type
from moetier.backends.torch_activations import as_dot_input, stored_product
from moetier.backends.torch_dequant import dequantize
from moetier.model import host_memory
from moetier.model.checkpoint import ExpertWeights
from moetier.model.formats import FORMATS


def glu(gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
    """silu(gate) * up, with GLM-5.3's clamps first where `limit` is given (gate <= limit, up in [-limit, limit])."""
    if limit is not None:
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, w: ExpertWeights) -> torch.Tensor:
    """x [n, D] -> [n, D] = down(silu(gate x) * up x), the torch path: each stored matrix dequantized on its device
    for this call and multiplied with the activations its format's dot product takes (torch_activations)."""
    gate, up = stored_product(x, w.gate_up, w.gate_up_type, w.float_acts).chunk(2, dim=-1)  # [n, I] each
    return stored_product(glu(gate, up, w.swiglu_limit), w.down, w.down_type, w.float_acts)


def _decode_stored(x: torch.Tensor, experts: Sequence[ExpertWeights], scales: Sequence[float]) -> torch.Tensor:
    """One token through experts of one stored kind (formats, shapes, activations, clamp), batched: x [1, D] -> sum of
    scale * ffn(x) [1, D]. Their stored bytes are stacked (a copy of k experts' stored bytes) and dequantized in one
    set of ops, x converted once: a fixed number of ops per layer, not per expert, which is what a GPU's decode of
    small matrices is bound by (each op a kernel launch). The same products as swiglu's, summed in another order."""
    w0 = experts[0]
    gate_up = dequantize(torch.stack([w.gate_up for w in experts]), w0.gate_up_type)  # [k, 2I, D]
    down = dequantize(torch.stack([w.down for w in experts]), w0.down_type)  # [k, D, I]
    xq = as_dot_input(x, act_type(w0.gate_up_type, w0.float_acts))[0]  # [D]
    gate, up = torch.matmul(gate_up, xq).chunk(2, dim=-1)  # [k, I] each
    hidden = as_dot_input(glu(gate, up, w0.swiglu_limit), act_type(w0.down_type, w0.float_acts))  # [k, I], row by row
    y = torch.matmul(down, hidden.unsqueeze(-1)).squeeze(-1)  # [k, D]
    weights = torch.tensor(scales, dtype=torch.float32).to(x.device, non_blocking=True)  # [k]
    return torch.matmul(weights, y).unsqueeze(0)  # [1, D]


def _stored_kind(w: ExpertWeights) -> tuple:
    return (w.gate_up_type, w.down_type, tuple(w.gate_up.shape), tuple(w.down.shape), w.float_acts, w.swiglu_limit)


def _decode_experts(x: torch.Tensor, experts: Sequence[ExpertWeights], scales: Sequence[float]) -> torch.Tensor:
    """One token through some experts with torch ops: x [1, D] -> sum of scale * ffn(x) [1, D]. Stored (not float32)
    experts go in batches of one kind (_decode_stored), float32 ones one by one (three kernels each, in place)."""
    out = torch.zeros_like(x)
    kinds: dict[tuple, tuple[list[ExpertWeights], list[float]]] = {}
    for w, scale in zip(experts, scales):
        if not w.float32:
            group = kinds.setdefault(_stored_kind(w), ([], []))
            group[0].append(w)
            group[1].append(scale)
            continue
        if w.swiglu_limit is not None:
            out.add_(swiglu(x, w), alpha=scale)
            continue
        gate_up = F.linear(x, w.gate_up)  # [1, 2I]
        inter = w.down.shape[1]
        hidden = F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])  # [1, I]
        out.addmm_(hidden, w.down.t(), alpha=scale)  # out += scale * hidden @ down^T, one kernel
    for group, group_scales in kinds.values():
        out.add_(_decode_stored(x, group, group_scales))
    return out


class TorchBackend(Backend):
    name = "torch"
    caps = BackendCaps(dtypes=("float32",), formats=frozenset(FORMATS))

    def __init__(self, device: str = "cpu", lanes: int | None = None, native_kernel: bool = True):
        """lanes: the native kernels' CPU threads (default: every CPU this process may run on); native_kernel:
        False keeps CPU experts on torch ops."""
        super().__init__(device)
        self.torch_device = torch.device(device)
        if self.torch_device.type == "cuda":
            if not torch.cuda.is_available():
                raise RuntimeError(f"torch backend: device {device!r} asked for but CUDA is not available")
        cpu = self.torch_device.type == "cpu"
        self.lanes = max(1, lanes if lanes is not None else cpu_kernels.default_threads())
        self._native_asked = native_kernel
        self._kernel = cpu_kernels.decode_kernel(self.lanes) if cpu and native_kernel else None
        self._decode = _decode_experts if self._kernel is None else self._kernel.run

    def _place(self, weights: ExpertWeights) -> ExpertWeights:
        if self.torch_device.type == "cpu":  # as the native kernels read it fastest (IQ3 as IQ3_*_T), else resident
            weights = cpu_kernels.resident_layout(weights) if self._kernel is not None else weights.resident()
            if self._kernel is not None and not self._kernel.fits(weights):  # read in place by the kernel
                weights = weights.with_tensors(weights.gate_up.contiguous(), weights.down.contiguous())
            return weights
        return weights.to(self.torch_device)

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        if x.shape[0] == 1 and work:  # decode: every expert serves the one row
            scales = torch.cat([item.weights for item in work]).tolist()  # one host read, not one per expert
            experts = [item.expert for item in work for _ in range(item.weights.shape[0])]  # one per weight: a RUN may
            return self._run_decode(x, experts, scales)  # give an expert the row twice, or not at all
        if self._kernel is not None and x.is_cpu and all(self._kernel.fits(item.expert) for item in work):
            return self._kernel.experts(x, work)  # each expert's rows converted once, its weights read once
        out = torch.zeros_like(x)  # [T, D]
        for item in work:
            rows = item.rows.to(x.device)
            y = swiglu(x.index_select(0, rows), item.expert)  # [n, D]
            out.index_add_(0, rows, y * item.weights.to(x.device)[:, None])
        return out

    def _run_decode(self, x: torch.Tensor, experts: Sequence[ExpertWeights], scales: Sequence[float]) -> torch.Tensor:
        if self._kernel is not None and not all(map(self._kernel.fits, experts)):  # a clamped SwiGLU: torch's
            return _decode_experts(x, experts, scales)
        return self._decode(x, experts, scales)

    def decode_kernel(self) -> "cpu_kernels.DecodeKernel | None":
        return self._kernel

    def native_lane(self, threads: int) -> "cpu_lane.NativeLane | None":
        """A native lane of `threads` threads over this backend's kernel (None without the kernel)."""
        return cpu_lane.NativeLane(self._kernel, threads) if self._kernel is not None else None

    def describe(self) -> str:
        if self.torch_device.type != "cpu":
            return super().describe()
        if self._kernel is not None:
            experts = f"native kernels on {self.lanes} thread(s) (every stored format read in place; held in {host_memory.describe()})"
        else:
            experts = f"torch ops; native kernels {cpu_kernels.status() if self._native_asked else 'not asked for'}"
        return f"{super().describe()}, experts: {experts}"

    def synchronize(self) -> None:
        if self.torch_device.type == "cuda":
            torch.cuda.synchronize(self.torch_device)
