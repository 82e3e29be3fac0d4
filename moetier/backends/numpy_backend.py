"""NumPy backend: the reference implementation of expert math, on the CPU.

Plain float32 numpy (BLAS matmuls), written to be obviously right: the parity
tests hold every other backend to it. `place` keeps zero-copy numpy views of
the checkpoint's mapped weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from moetier.backends.base import Backend, BackendCaps, ExpertWork
from moetier.model.checkpoint import ExpertWeights


@dataclass(frozen=True)
class NumpyExpert:
    gate: np.ndarray  # [I, D]
    up: np.ndarray  # [I, D]
    down: np.ndarray  # [D, I]


def swiglu(x: np.ndarray, w: NumpyExpert) -> np.ndarray:
    """x [n, D] -> [n, D] = down(silu(gate x) * up x)."""
    gate = x @ w.gate.T  # [n, I]
    return ((gate / (1.0 + np.exp(-gate))) * (x @ w.up.T)) @ w.down.T


class NumpyBackend(Backend):
    name = "numpy"
    caps = BackendCaps(device_kind="cpu", dtypes=("float32",), zero_copy_host=True)

    def __init__(self, device: str = "cpu"):
        if device != "cpu":
            raise ValueError(f"numpy backend: runs on the CPU only, not {device!r}")
        super().__init__(device)

    def _place(self, weights: ExpertWeights) -> NumpyExpert:
        return NumpyExpert(weights.gate.numpy(), weights.up.numpy(), weights.down.numpy())

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        xs = x.detach().cpu().numpy()  # [T, D]
        out = np.zeros_like(xs)
        for item in work:
            rows = item.rows.numpy()
            # a token picks an expert at most once, so rows are unique and += is a scatter-add
            out[rows] += swiglu(xs[rows], item.expert) * item.weights.numpy()[:, None]
        return torch.from_numpy(out).to(x.device)
