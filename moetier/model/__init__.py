"""Models: the spec read from a checkpoint's config, its weights through a memory map, and synthetic checkpoints.

moetier.model.output stages what commands write (whole or not at all) and
refuses an output path that is one of the command's inputs.

Importing the package imports nothing heavy: `ModelSpec` and `SpecError` come
from moetier.model.spec (no torch); the weight side (`open_checkpoint`,
`Checkpoint`, `ExpertWeights`, `CheckpointError`) is imported on first use,
so a command that only reads a spec (`moetier simulate`) never imports torch.
"""

from __future__ import annotations

import importlib

from moetier.model.spec import ARCHITECTURES, ModelSpec, SpecError

_LAZY = {"Checkpoint": "moetier.model.checkpoint", "ExpertWeights": "moetier.model.expert_weights",
         "open_checkpoint": "moetier.model.checkpoint", "CheckpointError": "moetier.model.safetensors_mmap"}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'moetier.model' has no attribute {name!r}")


__all__ = ["ARCHITECTURES", "Checkpoint", "CheckpointError", "ExpertWeights", "ModelSpec", "SpecError", "open_checkpoint"]
