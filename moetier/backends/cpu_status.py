"""What a native kernel call's status means, for every caller of moetier's CPU library (kernels, lane, decode step).

A C entry point that can fail returns an int64 status: 0 on success, -2 when
it could not allocate its scratch memory. `status_error` turns -2 into one
MemoryError line naming the call, in one place, so the kernels
(cpu_kernels.py, cpu_mixers.py), the CPU lane and the native decode step
report it alike; a caller that gives other codes a meaning (the lane's -1, the
step's -3) checks those first.
"""

from __future__ import annotations


def status_error(what: str, status: int) -> None:
    """Raise for a C call's status: -2 is out of memory."""
    if status == -2:
        raise MemoryError(f"{what}: the native kernels ran out of memory")
