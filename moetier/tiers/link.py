"""A link between tiers: real copies where the hardware exists, emulated time where it does not.

`Link.transfer(nbytes)` blocks for the link's cost (half a round trip plus bytes
at the link rate) when the link is emulated, and returns at once otherwise
(the real copy then costs what it costs). Transfers on one link are serialised
by a lock, as on a wire. Emulation makes every layout runnable on a machine
without the GPU or the second host it describes, with the layout's timings.
"""

from __future__ import annotations

import threading
import time

from moetier.config import LinkConfig


class Link:
    def __init__(self, config: LinkConfig | None, emulated: bool):
        self.config = config
        self.emulated = emulated and config is not None
        self._lock = threading.Lock()
        self.busy_us = 0.0  # total time spent transferring (emulated or measured)
        self.bytes_moved = 0

    def cost_us(self, nbytes: int) -> float:
        return self.config.transfer_us(nbytes) if self.config is not None else 0.0

    def transfer(self, nbytes: int) -> None:
        with self._lock:
            begin = time.perf_counter()
            if self.emulated:
                time.sleep(self.cost_us(nbytes) / 1e6)
            self.busy_us += (time.perf_counter() - begin) * 1e6
            self.bytes_moved += nbytes
