"""How the float formats read their weight rows at one token: four software-prefetched streams or eight plain ones.

cpu_dot32.c reads F32, F16 and BF16 rows at one token on AVX-512 either way (`eight_streams`); a row's value
is the same either way, so this is a choice of speed alone, and hosts differ in which is faster (on the Intel
Ice Lake host eight plain streams, on others untested; docs/kernels.md). `choose` makes it when the kernels'
first pool opens: the kernels' two read probes (moe_read_sum, prefetched and plain) over PROBE_BYTES on that
pool's threads, best of 3 each, interleaved; plain where it reads 3% faster. The rates are kept in
moetier_home()/native per CPU feature set and thread count, so a host measures once (0.5 s);
$MOETIER_STREAMS = plain or prefetched decides instead. `streams()` says what was chosen and why.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time

import torch

from moetier.backends import dot_kernels
from moetier.backends.cpu_status import status_error

PROBE_BYTES = 512 << 20  # what the choice reads: many times most last-level caches
_CHOICE: dict = {"plain": None, "why": "not chosen yet (no pool opened)"}


def chosen() -> bool:
    return _CHOICE["plain"] is not None


def plain() -> bool:
    """Whether this process's float formats read eight plain streams (False until chosen)."""
    return bool(_CHOICE["plain"])


def streams() -> str:
    """How the float formats read their rows at one token in this process, and why."""
    return _CHOICE["why"]


def choose(pool, native_types: frozenset[int]) -> None:
    """Choose for the process, on `pool` (a cpu_kernels.NativePool); native_types: the formats a dot family
    computes (none: the fallback dots everywhere, nothing to choose)."""
    from moetier.model.host_memory import host_buffer
    from moetier.native import _cpu_features, moetier_home

    asked = os.environ.get("MOETIER_STREAMS", "").strip()
    if asked not in ("", "plain", "prefetched"):
        raise ValueError(f"MOETIER_STREAMS must be plain or prefetched, got {asked!r}")
    if not native_types:  # no family built for this: nothing to tell
        _CHOICE.update(plain=False, why="prefetched (no dot families in use)")
        return
    dots = dot_kernels.dot_kernels()
    if asked:
        _CHOICE.update(plain=dots.set_plain_streams(asked == "plain"), why=f"{asked} ($MOETIER_STREAMS)")
        return
    key = hashlib.sha256(f"{_cpu_features()}|{pool.threads}".encode()).hexdigest()[:16]
    path = moetier_home() / "native" / f"streams-{key}.json"
    try:
        rates = json.loads(path.read_text())
        rates = {"prefetched": float(rates["prefetched"]), "plain": float(rates["plain"])}
    except (OSError, ValueError, KeyError, TypeError):
        rates = _measure(pool, host_buffer(PROBE_BYTES).view(torch.float32).fill_(1.0))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            scratch = path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(rates))
            scratch.replace(path)
        except OSError:
            pass  # a read-only home: measured again next time
    on = dots.set_plain_streams(rates["plain"] > 1.03 * rates["prefetched"])
    _CHOICE.update(plain=on, why=f"{'plain' if on else 'prefetched'} (read {rates['plain'] / 1e9:.1f} GB/s as eight "
                                 f"plain streams, {rates['prefetched'] / 1e9:.1f} as four prefetched; {pool.threads} threads)")


def _measure(pool, x: torch.Tensor) -> dict[str, float]:
    """Bytes per second of each read probe over x on the pool, best of 3, the two in turn."""
    total, best = ctypes.c_double(), {"prefetched": 0.0, "plain": 0.0}
    for _ in range(3):
        for name in best:
            begin = time.perf_counter()
            status_error("read_sum", pool._lib.moe_read_sum(pool.handle, x.data_ptr(), x.numel(), int(name == "plain"),
                                                            ctypes.byref(total)))
            best[name] = max(best[name], x.numel() * 4 / (time.perf_counter() - begin))
    return best
