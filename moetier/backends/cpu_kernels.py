"""moetier's CPU kernels (cpu_kernels.c beside this file): expert decode, the lane's threads, the one-token router.

`decode_kernel()` returns a `DecodeKernel`, or None when this machine cannot
build one (no C compiler, a failed build, or MOETIER_NATIVE=0); `status()`
says which and why, in one line. moetier.native builds the library once per
machine (-O3 -march=native, content-hashed, atomic). The router's C
(`DecodeKernel.route`, called by moetier.engine.router) lives in the same file
because it shares the expert kernels' vectorised gemv.

Guarantee: `DecodeKernel.run` computes what the torch decode path computes
(the gate-weighted sum of k SwiGLU experts over one token) in float32, with
sums in another order (differences of float32 rounding, ~1e-6 relative).
`NativeLane` queues the same calls to the library's own threads, which never
take the GIL: the CPU lane's work then costs the engine's thread one ctypes
call to hand over and one to collect. With one part per call its result is
bit for bit `run`'s; with several, the same for any thread timing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import weakref
from array import array
from pathlib import Path
from typing import Sequence

import torch

from moetier.model.checkpoint import ExpertWeights
from moetier.native import FAST_FLAGS, library

SOURCE = Path(__file__).with_suffix(".c")


class DecodeKernel:
    """The loaded library; thread-safe (no state of its own), releases the GIL while it runs."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fn = library.moe_decode_f32
        self._fn.restype = None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, i64, i64, i64, p, p, p, p]
        self.library = library
        library.lane_open.restype, library.lane_open.argtypes = p, [i64, ctypes.c_double]
        library.lane_threads.restype, library.lane_threads.argtypes = i64, [p]
        library.lane_submit.restype, library.lane_submit.argtypes = i64, [p, p, i64, i64, i64, p, p, i64]
        library.lane_collect.restype, library.lane_collect.argtypes = i64, [p, i64, p, p]
        library.lane_release.restype, library.lane_release.argtypes = None, [p, i64]
        library.lane_close.restype, library.lane_close.argtypes = None, [p]
        library.route_softmax_f32.restype = library.route_sigmoid_f32.restype = None
        library.route_softmax_f32.argtypes = [p, p, i64, i64, i64, p, i64, p, p, p, p, p]
        library.route_sigmoid_f32.argtypes = [p, p, i64, i64, i64, p, p, i64, i64, i64, ctypes.c_float, p, p, p, p, p]

    def route(self, spec, gate: torch.Tensor, x: torch.Tensor, correction: torch.Tensor | None,
              nudge: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One token's router (moetier.engine.router.route's arithmetic, not damped): gate [E, D] and
        x [1, D], correction and nudge [E] or None, all float32 contiguous in host memory
        -> logits [1, E], probs (scores) [1, E], picks [1, k] int64, weights [1, k]."""
        (experts, dim), k = gate.shape, spec.top_k
        buffer = torch.empty(1, 3 * experts + k + spec.n_group)  # logits, probs, weights, scratch
        logits, probs, weights, _ = buffer.split_with_sizes([experts, experts, k, experts + spec.n_group], dim=1)
        picks = torch.empty(1, k, dtype=torch.int64)
        base, at = buffer.data_ptr(), 4 * experts  # float32 offsets into buffer
        if spec.router == "softmax":
            self.library.route_softmax_f32(gate.data_ptr(), x.data_ptr(), experts, dim, k, nudge.data_ptr() if nudge is not None else None,
                                           int(spec.norm_topk_prob), base, base + at, picks.data_ptr(), base + 2 * at, base + 2 * at + 4 * k)
        else:
            self.library.route_sigmoid_f32(gate.data_ptr(), x.data_ptr(), experts, dim, k,
                                           correction.data_ptr() if correction is not None else None,
                                           nudge.data_ptr() if nudge is not None else None, spec.n_group, spec.topk_group,
                                           int(spec.norm_topk_prob), spec.routed_scaling_factor,
                                           base, base + at, picks.data_ptr(), base + 2 * at, base + 2 * at + 4 * k)
        return logits, probs, picks, weights

    @staticmethod
    def fits(weights: ExpertWeights) -> bool:
        """Whether an expert can be read in place: float32, contiguous, in host memory."""
        return all(t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
                   for t in (weights.gate_up, weights.down))

    def run(self, x: torch.Tensor, experts: Sequence[ExpertWeights], scales: Sequence[float]) -> torch.Tensor:
        """x [1, D] float32 -> [1, D] = sum_j scales[j] * ffn_j(x); every expert must `fit`."""
        k = len(experts)
        dim, inter = x.shape[1], experts[0].down.shape[1]
        x = x.contiguous()
        addresses = (ctypes.c_int64 * (2 * k))()
        for j, w in enumerate(experts):
            addresses[2 * j] = w.gate_up.data_ptr()
            addresses[2 * j + 1] = w.down.data_ptr()
        scale = (ctypes.c_float * k)(*scales)
        buffer = torch.empty(2 * dim + 3 * inter, dtype=torch.float32)  # out [D], then scratch [3I + D]
        self._fn(x.data_ptr(), dim, inter, k, addresses, scale, buffer.data_ptr(), buffer.data_ptr() + 4 * dim)
        return buffer[:dim].view(1, dim)


class NativeLane:
    """`threads` native threads that compute decode calls queued by `submit` (module docstring).

    Each call is split into min(threads, k) parts. The expert weights whose addresses are passed
    must outlive `close()`; everything else a call needs is copied at `submit`.
    """

    SLOTS = 16  # calls queued or done-but-uncollected at once (LANE_SLOTS in the C source)

    def __init__(self, kernel: DecodeKernel, threads: int = 1, spin_us: float | None = None):
        """spin_us: how long an idle lane thread, or a caller waiting for a result, polls before it
        sleeps (default $MOETIER_LANE_SPIN_US, else 200; 0 sleeps at once)."""
        self._lib = kernel.library
        if spin_us is None:
            spin_us = float(os.environ.get("MOETIER_LANE_SPIN_US", "200"))
        self._handle = self._lib.lane_open(threads, spin_us * 1e-6)
        if not self._handle:
            raise RuntimeError(f"native lane: could not start {threads} thread(s)")
        self.threads = self._lib.lane_threads(self._handle)
        self._forked = False  # set in a forked child, which inherits the lane but not its threads
        _LANES.add(self)
        if self.threads < threads:
            self.close()
            raise RuntimeError(f"native lane: started {self.threads} of {threads} threads")

    def submit(self, x: torch.Tensor, addresses: bytes, scales: array, inter: int) -> "LaneTicket":
        """x [1, D] float32 contiguous in host memory; addresses: 2k native int64 (gate_up, down)
        addresses, packed (struct "qq" per expert); scales: array("f") of k gate weights; inter: I,
        each expert's width."""
        k, dim = len(scales), x.shape[1]
        if self._forked:
            raise RuntimeError("native lane: used in a forked child process (its threads stayed in the parent); open a new one")
        if len(addresses) != 16 * k or scales.itemsize != 4:
            raise ValueError(f"native lane: {len(addresses)} address bytes for {k} scales (expected 16 per expert: "
                             "two native int64s; float32 scales)")
        ticket = self._lib.lane_submit(self._handle, x.data_ptr(), dim, inter, k, addresses,
                                       scales.buffer_info()[0], self.threads)
        if ticket < 0:
            why = f"all {self.SLOTS} call slots hold results not collected" if ticket == -1 else "out of memory"
            raise RuntimeError(f"native lane: cannot queue a call ({why})")
        return LaneTicket(self, ticket, dim)

    def close(self) -> None:
        """Finish queued calls and stop the threads (idempotent)."""
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
            if lane._lib.lane_collect(lane._handle, self._ticket, out.data_ptr(), ctypes.byref(done)) != 0:
                raise RuntimeError(f"native lane: call {self._ticket} is not pending")
            self._out, self.done_s = out, done.value
        return self._out

    def __del__(self):
        if self._out is None and self._lane._handle:
            self._lane._lib.lane_release(self._lane._handle, self._ticket)


@functools.cache
def _load() -> tuple[DecodeKernel | None, str]:
    lib, path, why = library(SOURCE, FAST_FLAGS)
    if lib is None:
        return None, f"{why}: torch kernels"
    return DecodeKernel(lib, path), f"on ({path})"


def decode_kernel() -> DecodeKernel | None:
    """The native kernel, built on first use; None when this machine has none (see status())."""
    return _load()[0]


def status() -> str:
    """One line: whether the native decode kernel is in use, and why not when it is not."""
    return _load()[1]
