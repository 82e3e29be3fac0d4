"""NumPy backend: the reference implementation of expert math, on the CPU.

Plain float32 numpy (BLAS matmuls), written to be obviously right: the parity
tests hold every other backend to it. `place` keeps zero-copy numpy views of
the expert's resident copy.
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
    gate_up: np.ndarray  # [2I, D]
    down: np.ndarray  # [D, I]


def swiglu(x: np.ndarray, w: NumpyExpert) -> np.ndarray:
    """x [n, D] -> [n, D] = down(silu(gate x) * up x)."""
    gate, up = np.split(x @ w.gate_up.T, 2, axis=-1)  # [n, I] each
    return ((gate / (1.0 + np.exp(-gate))) * up) @ w.down.T


class NumpyBackend(Backend):
    name = "numpy"
    caps = BackendCaps(dtypes=("float32",))

    def __init__(self, device: str = "cpu"):
        if device != "cpu":
            raise ValueError(f"numpy backend: runs on the CPU only, not {device!r}")
        super().__init__(device)

    def synchronize(self) -> None:
        """numpy computes synchronously: nothing is ever queued, so there is nothing to wait for."""
        return None

    def _place(self, weights: ExpertWeights) -> NumpyExpert:
        resident = weights.resident()
        return NumpyExpert(resident.gate_up.numpy(), resident.down.numpy())

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        xs = x.detach().cpu().numpy()  # [T, D]
        out = np.zeros_like(xs)
        for item in work:
            rows = item.rows.numpy()
            # a scatter-add that counts a row given twice twice (a RUN may list it so; the router never does)
            np.add.at(out, rows, swiglu(xs[rows], item.expert) * item.weights.numpy()[:, None])
        return torch.from_numpy(out).to(x.device)
