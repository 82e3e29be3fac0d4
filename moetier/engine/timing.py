"""Where a token's time goes: wall time per category (and per part), accumulated over decode steps.

Categories are the ones `moetier run --layout` prints and the simulator
predicts: attention (the trunk: norms, attention, router, dense MLPs), gpu
experts (waiting for VRAM / helper partials), cpu lane wait (per part),
transfers (waiting for uploads still on the link), remote (waiting for remote
workers), router, dispatch (scheduler + bookkeeping), head (final norm and lm
head). Only waits on the
engine's main thread are counted, so the categories add up to the step time.
"""

from __future__ import annotations

from collections import defaultdict


class StepTimes:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    def add(self, category: str, seconds: float) -> None:
        self.seconds[category] += seconds

    def reset(self) -> None:
        self.seconds.clear()
        self.steps = 0

    def ms_per_token(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        return {name: 1e3 * value / steps for name, value in sorted(self.seconds.items())}
