"""Residency policies by name: static, lru, lfu (moetier.residency.policies) and moetier's own xlayer.

`make_policy(name, ...)` is how the VRAM tier and the simulator get a policy; one object covers
all layers of a cache (see ResidencyPolicy for the contract every policy keeps).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moetier.residency.policies import LfuPolicy, LruPolicy, ResidencyPolicy, StaticPolicy
from moetier.residency.cross_layer import CrossLayerPolicy

__all__ = ["POLICIES", "CrossLayerPolicy", "LfuPolicy", "LruPolicy", "ResidencyPolicy", "StaticPolicy", "make_policy"]


POLICIES: dict[str, type[ResidencyPolicy]] = {p.name: p for p in (StaticPolicy, LruPolicy, LfuPolicy, CrossLayerPolicy)}


def make_policy(name: str, num_layers: int, num_experts: int, capacity: int | Sequence[int],
                profile: np.ndarray | None = None, **options) -> ResidencyPolicy:
    """A policy by name (see POLICIES); `options` go to its constructor (e.g. xlayer's budget)."""
    if name not in POLICIES:
        raise ValueError(f"unknown residency policy {name!r}; expected one of {sorted(POLICIES)}")
    return POLICIES[name](num_layers, num_experts, capacity, profile, **options)
