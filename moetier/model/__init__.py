"""Model specs and weights: HF config.json -> ModelSpec, safetensors -> lazily mapped Checkpoint."""

from moetier.model.checkpoint import Checkpoint, ExpertWeights, open_checkpoint
from moetier.model.safetensors_mmap import CheckpointError
from moetier.model.spec import ARCHITECTURES, ModelSpec, SpecError

__all__ = ["ARCHITECTURES", "Checkpoint", "CheckpointError", "ExpertWeights", "ModelSpec", "SpecError", "open_checkpoint"]
