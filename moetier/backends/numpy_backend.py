"""NumPy backend: the reference implementation of expert math, on the CPU.

Plain float32 numpy (BLAS matmuls), written to be obviously right: the parity
tests hold every other backend to it. `place` keeps zero-copy numpy views of
the expert's resident copy, in its stored format; each call dequantizes the
matrices it computes with to float32 through the `gguf` package (llama.cpp's
own numpy dequantization: the reference for every stored format), converts
the activations of each product as llama.cpp's dot product for the matrix's
format takes them (Q8_K, Q8_0, Q8_1, F16, BF16; float32 for F32 matrices and
for a HF checkpoint's F16 / BF16: moetier.backends.activations), then
computes in float32.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import gguf
import numpy as np
import torch

from moetier.backends import activations
from moetier.backends.base import Backend, BackendCaps, ExpertWork
from moetier.model.checkpoint import ExpertWeights
from moetier.model.formats import BF16, F32, GGML_FORMATS


@dataclass(frozen=True)
class NumpyExpert:
    gate_up: np.ndarray  # [2I, D] float, or uint8 [2I, row bytes] of gate_up_type's blocks
    down: np.ndarray  # [D, I] float, or uint8 [D, row bytes]
    gate_up_type: int = F32
    down_type: int = F32
    float_acts: bool = True
    swiglu_limit: float | None = None


def reference_float32(data: np.ndarray, qtype: int) -> np.ndarray:
    """A stored matrix as float32 values [rows, cols]: gguf.quants' dequantization (the reference)."""
    if qtype == F32:
        return data
    return gguf.quants.dequantize(data.view(np.uint8) if qtype == BF16 else data, qtype)


def dot_input(x: np.ndarray, qtype: int, float_acts: bool) -> np.ndarray:
    """x [n, K] float32 as the dot product of a qtype matrix takes it: converted to the activation format llama.cpp
    quantizes x to for that format (moetier.backends.activations) and back; x itself for float32 activations."""
    act = activations.act_type(qtype, float_acts)
    return x if act == activations.ACT_F32 else activations.dequantize(act, activations.quantize(act, x), x.shape[-1])


def swiglu(x: np.ndarray, w: NumpyExpert) -> np.ndarray:
    """x [n, D] -> [n, D] = down(silu(gate x) * up x), each product with the activations its format takes."""
    gate_up = dot_input(x, w.gate_up_type, w.float_acts) @ reference_float32(w.gate_up, w.gate_up_type).T
    gate, up = np.split(gate_up, 2, axis=-1)  # [n, I] each
    if w.swiglu_limit is not None:  # GLM-5.3's clamps
        gate, up = np.minimum(gate, np.float32(w.swiglu_limit)), np.clip(up, np.float32(-w.swiglu_limit), np.float32(w.swiglu_limit))
    hidden = ((gate / (1.0 + np.exp(-gate))) * up).astype(np.float32)
    return dot_input(hidden, w.down_type, w.float_acts) @ reference_float32(w.down, w.down_type).T


class NumpyBackend(Backend):
    name = "numpy"
    caps = BackendCaps(dtypes=("float32",), formats=frozenset(GGML_FORMATS))

    def __init__(self, device: str = "cpu"):
        if device != "cpu":
            raise ValueError(f"numpy backend: runs on the CPU only, not {device!r}")
        super().__init__(device)

    def synchronize(self) -> None:
        """numpy computes synchronously: nothing is ever queued, so there is nothing to wait for."""
        return None

    def _place(self, weights: ExpertWeights) -> NumpyExpert:
        resident = weights.resident()
        return NumpyExpert(_numpy(resident.gate_up), _numpy(resident.down), weights.gate_up_type, weights.down_type,
                           weights.float_acts, weights.swiglu_limit)

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        xs = x.detach().cpu().numpy()  # [T, D]
        out = np.zeros_like(xs)
        for item in work:
            rows = item.rows.numpy()
            # a scatter-add that counts a row given twice twice (a RUN may list it so; the router never does)
            np.add.at(out, rows, swiglu(xs[rows], item.expert) * item.weights.numpy()[:, None])
        return torch.from_numpy(out).to(x.device)


def _numpy(tensor: torch.Tensor) -> np.ndarray:
    """A zero-copy numpy view (bfloat16, which numpy lacks, as its raw uint16 bits)."""
    return tensor.view(torch.uint16).numpy() if tensor.dtype == torch.bfloat16 else tensor.numpy()
