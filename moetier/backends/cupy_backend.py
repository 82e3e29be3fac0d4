"""CuPy backend (extra `cuda`): expert FFNs as CuPy matmuls on a CUDA device.

Weights are uploaded once per expert by `place`, float32 experts only (a
stored format is refused by `place`: the torch backend reads those); activations cross between
torch and CuPy through DLPack without copies. Imported only when asked for,
so a machine without CUDA never imports cupy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import cupy as cp
import torch

from moetier.backends.base import Backend, BackendCaps, ExpertWork
from moetier.model.checkpoint import ExpertWeights


@dataclass(frozen=True)
class CupyExpert:
    gate_up: Any  # cupy [2I, D]
    down: Any  # cupy [D, I]


class CupyBackend(Backend):
    name = "cupy"
    caps = BackendCaps(dtypes=("float32",))

    def __init__(self, device: str = "cuda"):
        super().__init__(device)
        index = torch.device(device).index or 0
        if cp.cuda.runtime.getDeviceCount() <= index:
            raise RuntimeError(f"cupy backend: no CUDA device {device!r}")
        self.cuda_device = cp.cuda.Device(index)

    def _place(self, weights: ExpertWeights) -> CupyExpert:
        with self.cuda_device:
            return CupyExpert(cp.asarray(weights.gate_up.numpy()), cp.asarray(weights.down.numpy()))

    def _run_experts(self, x: torch.Tensor, work: Sequence[ExpertWork]) -> torch.Tensor:
        with self.cuda_device:
            here = torch.device(f"cuda:{self.cuda_device.id}")
            on_device = lambda t: cp.from_dlpack(t.detach().to(here).contiguous())  # noqa: E731 (host or device)
            xs = on_device(x)  # [T, D]
            out = cp.zeros_like(xs)
            for item in work:
                rows = on_device(item.rows)  # [n]
                sub = xs[rows]  # [n, D]
                gate, up = cp.split(sub @ item.expert.gate_up.T, 2, axis=-1)  # [n, I] each
                h = (gate / (1.0 + cp.exp(-gate))) * up
                # an expert may hold a row twice (two gate weights): an unbuffered add counts both
                cp.add.at(out, rows, (h @ item.expert.down.T) * on_device(item.weights.float())[:, None])
            return torch.from_dlpack(out).to(x.device)

    def synchronize(self) -> None:
        self.cuda_device.synchronize()
