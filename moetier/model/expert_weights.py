"""One SwiGLU FFN's weights as the engine and every tier see them: gate and up stacked, down beside them.

Both checkpoint readers (HF safetensors in moetier.model.checkpoint, GGUF in
moetier.model.gguf_file) hand out experts, dense MLPs and shared experts as
this type, so neither reader imports the other. `NamedWeights` is what both
readers answer the same way once a tensor is found by its HF name: the router,
its correction bias, dense and shared MLPs.
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


DENSE_NAMES = ("gate_proj", "up_proj", "down_proj")


class NamedWeights:
    """The engine's structured reads over HF tensor names, for a reader with `tensor`, `load`, `has`, `spec`
    and `_mlp` (the MoE block's name: "mlp", or "block_sparse_moe" for Mixtral)."""

    _mlp: str

    def router_weight(self, layer: int) -> torch.Tensor:
        return self.tensor(f"model.layers.{layer}.{self._mlp}.gate.weight")  # [E, D]

    def router_bias(self, layer: int) -> torch.Tensor | None:
        name = f"model.layers.{layer}.{self._mlp}.gate.e_score_correction_bias"
        return self.tensor(name) if self.has(name) else None  # [E]

    def dense_mlp(self, layer: int) -> ExpertWeights:
        """The SwiGLU MLP of a dense (non-MoE) layer."""
        return self._ffn(f"model.layers.{layer}.mlp")

    def shared_experts(self, layer: int) -> ExpertWeights | None:
        """A GLM MoE layer's shared experts (always applied), or None."""
        prefix = f"model.layers.{layer}.mlp.shared_experts"
        return self._ffn(prefix) if self.has(f"{prefix}.gate_proj.weight") else None

    def _ffn(self, prefix: str, names: tuple[str, str, str] = DENSE_NAMES) -> ExpertWeights:
        gate, up, down = (f"{prefix}.{n}.weight" for n in names)
        # gate and up must be stacked, which copies them anyway: copy down too, so the result owns its
        # memory and a later resident() copies nothing a second time
        return ExpertWeights(torch.cat([self.tensor(gate), self.tensor(up)]), self.load(down))  # [2I, D], [D, I]
