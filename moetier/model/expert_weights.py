"""One SwiGLU FFN's weights as the engine and every tier see them: gate and up stacked, down beside them.

Both checkpoint readers (HF safetensors in moetier.model.checkpoint, GGUF in
moetier.model.gguf_file) hand out experts, dense MLPs and shared experts as
this type, so neither reader imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class ExpertWeights:
    """One routed (or shared, or dense) SwiGLU FFN: down(silu(gate x) * up x).

    gate and up are stacked so one matmul computes both. `mapped` is True when
    the tensors alias the checkpoint's file mapping (whose pages the OS may drop
    and re-read at any time); `resident()` returns a copy in process memory.
    """

    gate_up: torch.Tensor  # [2I, D] gate rows, then up rows
    down: torch.Tensor  # [D, I]
    mapped: bool = False

    @property
    def gate(self) -> torch.Tensor:
        return self.gate_up[: self.down.shape[1]]  # [I, D]

    @property
    def up(self) -> torch.Tensor:
        return self.gate_up[self.down.shape[1] :]  # [I, D]

    @property
    def nbytes(self) -> int:
        return (self.gate_up.numel() + self.down.numel()) * self.gate_up.element_size()

    def resident(self) -> "ExpertWeights":
        if not self.mapped:
            return self
        return ExpertWeights(self.gate_up.clone(), self.down.clone())

    def to(self, device: torch.device | str) -> "ExpertWeights":
        return ExpertWeights(self.gate_up.to(device), self.down.to(device), self.mapped and torch.device(device).type == "cpu")
