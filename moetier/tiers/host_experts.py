"""Host memory holding every routed expert of the layers a machine serves, in its stored bytes.

The CPU lane computes from it and the VRAM / helper tiers upload from it, so
each expert lives in RAM once, in the format the checkpoint stores it (a
Q4_K expert as its Q4_K blocks, a bf16 one as bf16: never a float32 copy).
Copies are made out of the checkpoint's file mapping (whose pages the OS may
drop) into process memory; with CUDA present they are pinned, so uploads run
at full PCIe rate and asynchronously. They are laid out as this machine's
native kernels read them fastest (IQ3_XXS / IQ3_S as moetier's IQ3_XXS_T /
IQ3_S_T, the same bytes per block: cpu_kernels.resident_layout), which every
reader takes: the CPU lane as they lie, the GPU tiers' dequantization
(torch_dequant) too.
"""

from __future__ import annotations

from typing import Sequence

import torch

from moetier.backends.cpu_kernels import resident_layout, resident_types
from moetier.model.checkpoint import Checkpoint, ExpertWeights


class HostExperts:
    def __init__(self, checkpoint: Checkpoint, layers: Sequence[int], pin: bool = False):
        self.spec = checkpoint.spec
        self.layers = tuple(layers)
        self.expert_bytes = checkpoint.expert_nbytes  # stored bytes of one expert (the largest layer's)
        self._weights: dict[int, list[ExpertWeights]] = {}
        for layer in self.layers:
            experts = [checkpoint.expert(layer, e) for e in range(self.spec.num_experts)]
            self._weights[layer] = [_pinned(w) if pin else resident_layout(w) for w in experts]

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self._weights[layer][expert]

    @property
    def nbytes(self) -> int:
        """Bytes of every expert held."""
        return sum(w.nbytes for experts in self._weights.values() for w in experts)


def _pinned(weights: ExpertWeights) -> ExpertWeights:
    """A pinned copy, laid out as resident_layout lays it out (so a CPU backend serving from it takes it as it is)."""
    if resident_types(weights) != (weights.gate_up_type, weights.down_type):
        weights = resident_layout(weights)
    gate_up = torch.empty(weights.gate_up.shape, dtype=weights.gate_up.dtype, pin_memory=True)
    down = torch.empty(weights.down.shape, dtype=weights.down.dtype, pin_memory=True)
    gate_up.copy_(weights.gate_up)
    down.copy_(weights.down)
    return weights.with_tensors(gate_up, down)
