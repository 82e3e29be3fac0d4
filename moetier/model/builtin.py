"""The built-in model: moetier's synthetic `small` checkpoint, written once into $MOETIER_HOME/models.

Commands that take a model folder use it when none is given. The folder name
carries the generator's version, so a cache written by an older generator is
never mistaken for this one's output. The folder appears whole (a write cut
short leaves nothing the next one does not remove); when processes write it at
once, all use the copy that was renamed into place first.
"""

from __future__ import annotations

import sys
from pathlib import Path

from moetier.model.output import OutputError
from moetier.model.synth import synth_version, write_synthetic
from moetier.native import moetier_home

BUILTIN = {"arch": "qwen3_moe", "preset": "small", "seed": 0}


def cached_synthetic(arch: str, preset: str, seed: int = 0) -> Path:
    """A synthetic checkpoint in the cache folder, written the first time it is asked for."""
    folder = moetier_home() / "models" / f"{arch}-{preset}-seed{seed}-{synth_version(arch, preset)}"
    if not (folder / "config.json").exists():
        print(f"writing the synthetic {arch} {preset} model to {folder} (once)", file=sys.stderr, flush=True)
        try:
            write_synthetic(folder, arch=arch, preset=preset, seed=seed)
        except (OutputError, OSError):
            if not (folder / "config.json").exists():
                raise
            # another process wrote it first; its bytes are ours (a pure function of arch, preset, seed)
    return folder


def builtin_model() -> Path:
    """The built-in model: the synthetic `small` preset."""
    return cached_synthetic(**BUILTIN)
