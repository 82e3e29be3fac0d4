"""The native CPU lane (cpu_pool.h): decode calls queued from the engine's thread, computed by a kernel pool.

`NativeLane.submit` copies a call (x, the experts' records, their gate
weights) into one of 16 slots and returns a `LaneTicket` at once; the lane's
own C thread, which never takes the GIL, runs queued calls in order on the
pool of `threads` (cpu_kernels.DecodeKernel's, shared with direct calls for
that thread count), so the engine runs on meanwhile and every call uses all
the pool's threads. Guarantee: a call's result is bit for bit
`DecodeKernel.run`'s on the same arguments. Every argument is checked here.
"""

from __future__ import annotations

import ctypes
import os
import weakref
from array import array

import torch

from moetier.backends.cpu_kernels import RECORD, DecodeKernel, usable_cpus
from moetier.backends.cpu_status import status_error


class NativeLane:
    """Decode calls queued by `submit` and computed by the pool of `threads` on the lane's own native thread
    (one of the pool's participants), which never takes the GIL: the engine's thread runs on meanwhile, and
    each call uses every pool thread. The result is bit for bit `DecodeKernel.run`'s on the same arguments.

    The expert weights whose addresses are passed must outlive `close()`; everything else a call needs is
    copied at `submit`.
    """

    SLOTS = 16  # calls queued or done-but-uncollected at once (LANE_SLOTS in cpu_pool.h)

    def __init__(self, kernel: DecodeKernel, threads: int = 1, spin_us: float | None = None, joins: bool | None = None):
        """spin_us: how long the idle lane thread, or a caller waiting for a result, polls before it
        sleeps (default $MOETIER_LANE_SPIN_US, else 200; 0 sleeps at once). joins: whether a caller waiting
        for a result computes the pool's open job meanwhile (default: where the pool leaves it a CPU)."""
        self._kernel = kernel.with_threads(threads)
        self._lib = self._kernel.library
        if spin_us is None:
            spin_us = float(os.environ.get("MOETIER_LANE_SPIN_US", "200"))
        # a caller collecting a result joins the pool's job while it waits, where the pool leaves it a CPU
        if joins is None:
            joins = self._kernel.pool.threads < usable_cpus()
        self._handle = self._lib.lane_open(self._kernel.pool.handle, spin_us * 1e-6, int(joins))
        if not self._handle:
            raise RuntimeError("native lane: could not start its thread")
        self.threads = self._kernel.pool.threads
        self._forked = False  # set in a forked child, which inherits the lane but not its threads
        _LANES.add(self)

    def submit(self, x: torch.Tensor, addresses: bytes, scales: array, inter: int) -> "LaneTicket":
        """x [1, D] float32 contiguous in host memory; addresses: k expert records joined (`expert_record`:
        40 bytes each, RECORD, which checked them); scales: array("f") of k gate weights; inter: I,
        each expert's width."""
        k, dim = len(scales), x.shape[1]
        if self._forked:
            raise RuntimeError("native lane: used in a forked child process (its threads stayed in the parent); open a new one")
        if len(addresses) != RECORD.size * k or scales.itemsize != 4 or k == 0:
            raise ValueError(f"native lane: {len(addresses)} address bytes for {k} scales (expected {RECORD.size} per expert: "
                             "an expert_record; float32 scales; at least one)")
        if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or dim < 1:
            raise ValueError(f"native lane: x must be float32 [1, D] contiguous in host memory, got {x.dtype} {list(x.shape)}")
        if inter < 1:
            raise ValueError(f"native lane: expert width {inter} (expected at least 1)")
        ticket = self._lib.lane_submit(self._handle, x.data_ptr(), dim, inter, k, addresses, scales.buffer_info()[0])
        if ticket < 0:
            why = f"all {self.SLOTS} call slots hold results not collected" if ticket == -1 else "out of memory"
            raise RuntimeError(f"native lane: cannot queue a call ({why})")
        return LaneTicket(self, ticket, dim)

    def close(self) -> None:
        """Finish queued calls and stop the lane's thread (idempotent; the pool stays)."""
        if self._handle:
            handle, self._handle = self._handle, None
            self._lib.lane_close(handle)


_LANES: "weakref.WeakSet[NativeLane]" = weakref.WeakSet()


def _mark_forked() -> None:
    for lane in _LANES:
        lane._forked = True


os.register_at_fork(after_in_child=_mark_forked)


class LaneTicket:
    """One queued call: `result()` waits for it (the GIL released) and returns out [1, D];
    then `done_s` is when it finished, on time.perf_counter's clock. A ticket dropped
    uncollected frees its slot once its call is done."""

    __slots__ = ("_lane", "_ticket", "_dim", "_out", "done_s")

    def __init__(self, lane: NativeLane, ticket: int, dim: int):
        self._lane, self._ticket, self._dim = lane, ticket, dim
        self._out: torch.Tensor | None = None
        self.done_s = 0.0

    def result(self) -> torch.Tensor:
        if self._out is None:
            lane = self._lane
            if not lane._handle:
                raise RuntimeError("native lane: closed before this call was collected")
            out, done = torch.empty(1, self._dim), ctypes.c_double()
            status = lane._lib.lane_collect(lane._handle, self._ticket, out.data_ptr(), ctypes.byref(done))
            if status == -1:
                raise RuntimeError(f"native lane: call {self._ticket} is not pending")
            status_error("native lane", status)
            self._out, self.done_s = out, done.value
        return self._out

    def __del__(self):
        if self._out is None and self._lane._handle:
            self._lane._lib.lane_release(self._lane._handle, self._ticket)
