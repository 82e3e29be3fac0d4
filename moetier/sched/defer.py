"""Which layers' CPU-lane partials DEFER_CPU holds back: one rule for the engine and the simulator.

DEFER_CPU (DESIGN.md) adds layer l's CPU-lane partial to the residual after layer l+1's token mixer instead of
before layer l ends, so the lane overlaps the next layer's trunk. Mode 0 defers nothing, 1 the first part's
layers, 2 every part's. Never a part's last layer: nothing deferred crosses a part boundary or the final norm.
Never into a linear-attention layer either (its recurrent state would keep the missing partial for every later
token), unless `into_linear` opts in to the seed's semantics ([scheduler].defer_into_linear): the recurrence
then reads the hidden state without the partial, lossy like DEFER_CPU itself. Invariant: the engine
(moetier.engine.core) and the critical path (moetier.sim.critical_path) both defer exactly `deferred_layers`,
so a prediction defers where a run does.
"""

from __future__ import annotations

from typing import Collection, Sequence

DEFER_MODES = (0, 1, 2)


def deferred_layers(defer_cpu: int, parts: Sequence[Sequence[int]], linear_layers: Collection[int] = (),
                    into_linear: bool = False) -> frozenset[int]:
    """The layers whose lane partial lands after the next layer's mixer. parts: each part's layers, in order;
    linear_layers: the layers that mix tokens by a recurrence (ModelSpec.linear_layers)."""
    if defer_cpu not in DEFER_MODES:
        raise ValueError(f"defer_cpu is {defer_cpu} (expected 0, 1 or 2)")
    linear = frozenset(linear_layers)
    chosen: set[int] = set()
    for index, layers in enumerate(parts):
        if defer_cpu == 2 or (defer_cpu == 1 and index == 0):
            chosen.update(layer for layer in list(layers)[:-1] if into_linear or layer + 1 not in linear)
    return frozenset(chosen)


__all__ = ["DEFER_MODES", "deferred_layers"]
