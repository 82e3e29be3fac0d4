"""Agent-like token sessions drawn from a synthetic checkpoint's description (moetier_synth.json, which synth writes).

A session is a few phases (explore, edit, verify); each phase's tokens come in
runs from one family at a time, mostly the phase's own, and inside a family
follow a Zipf law over its frequency rank. Invariant: a session is a pure
function of (model description, phases, tokens_per_phase, seed, family_mix).
"""

from __future__ import annotations

import json
import pathlib
from collections.abc import Mapping, Sequence

import numpy as np

from moetier.model import synth_routing as design

SYNTH_META = "moetier_synth.json"
SYNTH_FORMAT_VERSION = 1
DEFAULT_FAMILY_MIX = design.SESSION_MIX
MEAN_RUN_TOKENS = 4.0     # mean length of a run of tokens from one family in a session
ZIPF_TOKEN = 1.0          # token frequency inside a family


def _read_meta(model_dir) -> dict:
    path = pathlib.Path(model_dir) / SYNTH_META
    meta = json.loads(path.read_text())
    if meta.get("format") != "moetier-synth" or meta.get("version") != SYNTH_FORMAT_VERSION:
        raise ValueError(f"{path}: not a moetier-synth v{SYNTH_FORMAT_VERSION} description")
    return meta


def token_families(model_dir) -> dict[str, np.ndarray]:
    """Family name -> token ids of that family (frequency-rank order), from moetier_synth.json."""
    return {k: np.asarray(v, dtype=np.int64) for k, v in _read_meta(model_dir)["families"].items()}


def sample_session(model_dir, phases: Sequence[str] = design.PHASE_FAMILIES, tokens_per_phase: int = 64,
                   seed: int = 0, family_mix: Mapping[str, float] = DEFAULT_FAMILY_MIX,
                   ) -> list[tuple[str, np.ndarray]]:
    """An agent-like session: per phase, runs of tokens from that phase's family mixed with others.

    family_mix maps a family name, or "phase" for the current phase's own family,
    to its share of the phase's tokens. Tokens inside a family follow a Zipf law
    over the family's rank order.
    """
    if tokens_per_phase < 1:
        raise ValueError(f"tokens_per_phase must be >= 1, got {tokens_per_phase}")
    families = token_families(model_dir)
    rng = np.random.default_rng([seed, 0x5E55])
    out = []
    for phase in phases:
        if phase not in families:
            raise ValueError(f"phase {phase!r} is not a token family; expected one of {tuple(families)}")
        names = [phase if k == "phase" else k for k in family_mix]
        unknown = [k for k in names if k not in families]
        if unknown:
            raise ValueError(f"family_mix names unknown families {unknown}; "
                             f"expected {tuple(families)} or 'phase'")
        weights = np.array(list(family_mix.values()), dtype=np.float64)
        weights /= weights.sum()
        ids: list[np.ndarray] = []
        count = 0
        while count < tokens_per_phase:
            fam = families[names[rng.choice(len(names), p=weights)]]
            run = int(rng.geometric(1.0 / MEAN_RUN_TOKENS))
            zipf = 1.0 / np.arange(1, len(fam) + 1) ** ZIPF_TOKEN
            ids.append(fam[rng.choice(len(fam), size=run, p=zipf / zipf.sum())])
            count += run
        out.append((phase, np.concatenate(ids)[:tokens_per_phase]))
    return out
