"""The trunk's matrices in their stored format: a linear layer and an embedding table that never hold a float32 copy.

`StoredLinear` computes y [T, out] = x [T, in] W^T (+ b) for W held as the
checkpoint stores it, in row parts that may differ in format (a GGUF's q, k
and v projections are three tensors, often of two formats; consecutive parts
of one format are stacked into one). Each part is computed where x lives: on
the CPU by the native kernels (float32 rows in float32; otherwise the activations
converted once as llama.cpp's dot product for the part's format takes them,
then integer block dot products on every kernel thread:
DecodeKernel.linear), elsewhere — or without the kernels — by F.linear
(float32 rows) or by dequantizing
the part on the device and multiplying the same converted activations
(torch_dequant, torch_activations): the same products, summed in another
order. `float_acts` keeps activations float32 for F16 / BF16 weights (a HF
checkpoint, as transformers computes it). `StoredEmbedding` looks up rows
and dequantizes only those (exact: ggml's get_rows dequantizes the same way).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from moetier.backends import cpu_kernels
from moetier.backends.base import ExpertWork
from moetier.backends.torch_backend import swiglu
from moetier.backends.torch_activations import stored_product
from moetier.backends.torch_dequant import dequantize
from moetier.model.expert_weights import ExpertWeights
from moetier.model.formats import F32
from moetier.model.host_memory import host_cat, host_copy


def stored_matmul(x: torch.Tensor, data: torch.Tensor, qtype: int, float_acts: bool, kernel) -> torch.Tensor:
    """x [T, n] float32 times one stored matrix [rows, ...] of GGML type qtype -> [T, rows]: by the native kernels
    `kernel` when given (x on the CPU; float32 rows too: every kernel thread, each row read once for all T), else
    by torch on x's device."""
    if kernel is not None:
        return kernel.linear(x.contiguous(), data, qtype, float_acts)
    return stored_product(x, data, qtype, float_acts)


def stored_ffn(x: torch.Tensor, w: ExpertWeights, kernel) -> torch.Tensor:
    """A dense or shared SwiGLU MLP held as stored: x [T, D] -> [T, D]. A stored one on the CPU runs through the
    native kernels `kernel` (as a routed expert does); a float32 one, one elsewhere or without kernels through torch."""
    if kernel is None or w.float32 or x.device.type != "cpu" or not kernel.fits(w):
        return swiglu(x, w)
    rows = torch.arange(x.shape[0])
    return kernel.experts(x.contiguous(), [ExpertWork(w, rows, torch.ones(x.shape[0]))])


class StoredLinear:
    """y = x W^T + b, W the row-stack of `parts` (data, GGML type), each held as stored; see the module docstring."""

    def __init__(self, parts: Sequence[tuple[torch.Tensor, int]], bias: torch.Tensor | None, float_acts: bool,
                 device: torch.device):
        self.bias = None if bias is None else bias.to(device, copy=True)
        self.float_acts = float_acts
        self.device = torch.device(device)
        # consecutive parts of one format stacked into one matrix (one call; a row's bytes do not depend on its
        # neighbours), each a copy in memory the process owns (a part may be a view of the file mapping); on the
        # CPU in memory advised for huge pages (moetier.model.host_memory), as the resident experts
        merged: list[tuple[list[torch.Tensor], int]] = []
        for data, qtype in parts:
            if merged and merged[-1][1] == int(qtype):
                merged[-1][0].append(data)
            else:
                merged.append(([data], int(qtype)))
        self.parts = [(self._resident(group), qtype) for group, qtype in merged]
        # all float32: `dense`, the one [out, in] matrix F.linear reads off the CPU (and the CPU without kernels)
        self.dense = self.parts[0][0] if len(self.parts) == 1 and self.parts[0][1] == F32 else None
        self._kernel = cpu_kernels.decode_kernel() if self.device.type == "cpu" else None

    def _resident(self, group: list[torch.Tensor]) -> torch.Tensor:
        """The group's rows stacked in one matrix the process owns, on self.device."""
        if self.device.type == "cpu":
            return host_cat(group) if len(group) > 1 else host_copy(group[0])
        return torch.cat(group).to(self.device) if len(group) > 1 else group[0].contiguous().to(self.device, copy=True)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out]."""
        if self.dense is not None and self._kernel is None:
            return F.linear(x, self.dense, self.bias)
        outs = [stored_matmul(x, data, qtype, self.float_acts, self._kernel) for data, qtype in self.parts]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias


class StoredEmbedding:
    """Rows of an embedding table [V, D] held as stored; `rows(ids)` dequantizes only the rows asked for."""

    def __init__(self, data: torch.Tensor, qtype: int, device: torch.device):
        self.qtype = int(qtype)
        # [V, D] float, or uint8 [V, row bytes]: owned, not the mapping
        self.data = host_copy(data) if torch.device(device).type == "cpu" else data.to(device, copy=True)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] int64 -> [T, D] float32."""
        picked = self.data[ids.to(self.data.device)]
        return picked if self.qtype == F32 else dequantize(picked, self.qtype)
