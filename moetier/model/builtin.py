"""The built-in model: moetier's synthetic `small` checkpoint, written once into $MOETIER_HOME/models.

Commands that take a model folder use it when none is given. The folder name
carries the generator's version, so a cache written by an older generator is
never mistaken for this one's output.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moetier.model.synth import synth_version, write_synthetic
from moetier.native import moetier_home

BUILTIN = {"arch": "qwen3_moe", "preset": "small", "seed": 0}


def cached_synthetic(arch: str, preset: str, seed: int = 0) -> Path:
    """A synthetic checkpoint in the cache folder, written the first time it is asked for."""
    folder = moetier_home() / "models" / f"{arch}-{preset}-seed{seed}-{synth_version(arch, preset)}"
    if not (folder / "config.json").exists():
        print(f"writing the synthetic {arch} {preset} model to {folder} (once)", file=sys.stderr, flush=True)
        write_synthetic(folder, arch=arch, preset=preset, seed=seed)
    return folder


def builtin_model() -> Path:
    """The built-in model: the synthetic `small` preset."""
    return cached_synthetic(**BUILTIN)
