"""transformers as the reference for moetier's synthetic checkpoints (tests/test_synth.py, test_synth_routing.py):
the class each arch loads as, its loading info less what is expected, and a model's logits.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

try:
    import transformers
    transformers.logging.set_verbosity_error()
except ImportError:     # a dev extra; the numpy-only tests still run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers (pip install -e '.[dev]')")
MODEL_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "glm5_next": "Glm5NextForConditionalGeneration"}
VISION = "model.visual."    # glm5_next's vision tower: never written (moetier never reads it), transformers initialises it


def load_reference(model_dir):
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    cls = getattr(transformers, MODEL_CLASSES[config["model_type"]])
    model, info = cls.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


def loading_problems(info) -> dict:
    """transformers' loading info less what is expected: the missing keys of glm5_next's vision tower, and only those."""
    info = dict(info, missing_keys={k for k in info["missing_keys"] if not k.startswith(VISION)})
    return {k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info[k]}


def reference_logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits
