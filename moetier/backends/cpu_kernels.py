"""moetier's CPU kernels (cpu_kernels.c beside this file): expert decode, the lane's threads, the one-token router.

`decode_kernel()` returns a `DecodeKernel`, or None when this machine cannot
build one (no C compiler, a failed build, or MOETIER_NATIVE=0); `status()`
says which and why, in one line. moetier.native builds the library once per
machine (-O3 -march=native, content-hashed, atomic), and cpu_formats.c, the
row dequantizers, apart with strict IEEE flags. The router's C
(`DecodeKernel.route`, called by moetier.engine.router) lives in the same file
because it shares the expert kernels' vectorised gemv.

Guarantee: `DecodeKernel.run` computes what the torch decode path computes
(the gate-weighted sum of k SwiGLU experts over one token) in float32, with
sums in another order (differences of float32 rounding, ~1e-6 relative), for
experts held in any stored format of moetier.model.formats, read in place.
A stored format's values are gguf.quants.dequantize's bit for bit
(`DecodeKernel.dequantize` exposes them), and its result is bit for bit what
`run` gives on the same matrices dequantized to float32 (tests/test_native_formats.py).
`NativeLane` queues the same calls to the library's own threads, which never
take the GIL: the CPU lane's work then costs the engine's thread one ctypes
call to hand over and one to collect. With one part per call its result is
bit for bit `run`'s; with several, the same for any thread timing.
Every argument is checked here (`expert_record`); the C validates nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import weakref
from array import array
from pathlib import Path
from typing import Sequence

import torch

from moetier.model.checkpoint import ExpertWeights
from moetier.model.formats import FORMATS, Format, format_of
from moetier.native import FAST_FLAGS, STRICT_FLAGS, library

SOURCE = Path(__file__).with_suffix(".c")
FORMATS_SOURCE = Path(__file__).with_name("cpu_formats.c")
RECORD = struct.Struct("qqqq")  # one expert as moe_decode reads it: gate_up address, down address, their GGML types


def _width(fmt: Format, cols: int) -> int:
    """Elements per stored row of `cols` values: cols for a float format, bytes for a block format."""
    return cols if fmt.dtype is not None else fmt.row_bytes(cols)


def _matrix_error(what: str, t: torch.Tensor, qtype: int, rows: int, cols: int) -> str | None:
    """Why t cannot be read as `rows` rows of `cols` values of GGML type qtype in place, or None."""
    fmt = FORMATS.get(qtype)
    if fmt is None:
        return f"{what}: GGML type {qtype} is not a stored format (expected one of {', '.join(f.name for f in FORMATS.values())})"
    if fmt.block > 1 and cols % fmt.block:
        return f"{what}: {fmt.name} rows of {cols} values are not a whole number of {fmt.block}-value blocks"
    dtype = fmt.dtype or torch.uint8
    shape = (rows, _width(fmt, cols))
    if t.dtype != dtype or tuple(t.shape) != shape:
        return f"{what}: {fmt.name} [{rows}, {cols}] is {dtype} {list(shape)}, got {t.dtype} {list(t.shape)}"
    if t.device.type != "cpu" or not t.is_contiguous():
        return f"{what}: must be contiguous in host memory (got {t.device}, contiguous={t.is_contiguous()})"
    return None  # (`_readable` is the same test, for the hot path)


def _readable(t: torch.Tensor, qtype: int, rows: int, cols: int) -> bool:
    """The hot path's form of `_matrix_error(...) is None` (a decode call checks every expert it is given)."""
    fmt = FORMATS.get(qtype)
    return (fmt is not None and t.dtype is (fmt.dtype or torch.uint8) and t.is_cpu and t.is_contiguous()
            and cols % fmt.block == 0 and t.shape == (rows, cols if fmt.dtype is not None else cols // fmt.block * fmt.block_bytes))


def expert_record(weights: ExpertWeights, dim: int | None = None, inter: int | None = None) -> bytes:
    """One expert as the native kernel and lane read it: 32 bytes, RECORD (gate_up address, down address,
    gate_up type, down type). Raises ValueError (one line) unless both matrices are their formats' shapes
    ([2I, D] and [D, I] values; D and I, when given, those of the call), contiguous in host memory.
    The tensors must outlive every use of the record."""
    gate_up, down, gate_up_type, down_type = weights.gate_up, weights.down, weights.gate_up_type, weights.down_type
    dim = down.shape[0] if dim is None else dim
    inter = gate_up.shape[0] // 2 if inter is None else inter
    if not (_readable(gate_up, gate_up_type, 2 * inter, dim) and _readable(down, down_type, dim, inter)):
        raise ValueError(_matrix_error("expert gate_up", gate_up, gate_up_type, 2 * inter, dim)
                         or _matrix_error("expert down", down, down_type, dim, inter))
    return RECORD.pack(gate_up.data_ptr(), down.data_ptr(), gate_up_type, down_type)


class DecodeKernel:
    """The loaded library; thread-safe (no state of its own), releases the GIL while it runs."""

    def __init__(self, library: ctypes.CDLL, path: Path, formats: ctypes.CDLL):
        """library: cpu_kernels.c built; formats: cpu_formats.c built, its tables already given (`_load`)."""
        self.path = path
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn = library.moe_decode
        self._fn.restype, self._fn.argtypes = None, [p, i64, i64, i64, p, p, p, p]
        library.moe_scratch_floats.restype, library.moe_scratch_floats.argtypes = i64, [i64, i64]
        library.moe_decode_init.restype, library.moe_decode_init.argtypes = None, [p]
        library.moe_decode_init(ctypes.cast(formats.dequantize_row, p).value)
        formats.dequantize_rows.restype, formats.dequantize_rows.argtypes = None, [i64, p, i64, i64, p]
        self.library, self.formats = library, formats
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
        """Whether an expert can be read in place: both matrices in a format of moetier.model.formats,
        contiguous, in host memory (`expert_record` then checks their shapes)."""
        gate_up, down = weights.gate_up, weights.down
        return (weights.gate_up_type in FORMATS and weights.down_type in FORMATS
                and gate_up.is_cpu and down.is_cpu and gate_up.is_contiguous() and down.is_contiguous())

    def dequantize(self, data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
        """data: rows of `cols` values of GGML type qtype (float [rows, cols] of its dtype, or uint8
        [rows, row_bytes] of blocks), contiguous in host memory -> float32 [rows, cols], the values the
        kernel computes with (bit for bit gguf.quants.dequantize's)."""
        fmt = format_of(qtype)
        if data.dim() != 2:
            raise ValueError(f"{fmt.name}: expected a matrix [rows, row width], got {data.dim()} dimension(s) {list(data.shape)}")
        why = _matrix_error(fmt.name, data, fmt.id, data.shape[0], cols)
        if why is not None:
            raise ValueError(why)
        out = torch.empty(data.shape[0], cols)  # [rows, cols] float32
        if out.numel():
            self.formats.dequantize_rows(fmt.id, data.data_ptr(), data.shape[0], cols, out.data_ptr())
        return out

    def scratch_floats(self, dim: int, inter: int) -> int:
        """Floats of scratch one decode call (or one lane part) needs for widths D and I."""
        return self.library.moe_scratch_floats(dim, inter)

    def run(self, x: torch.Tensor, experts: Sequence[ExpertWeights], scales: Sequence[float]) -> torch.Tensor:
        """x [1, D] float32 -> [1, D] = sum_j scales[j] * ffn_j(x); every expert must `fit`, all of
        hidden size D and the first one's width I (checked: ValueError)."""
        k = len(experts)
        if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"decode kernel: x must be float32 [1, D] in host memory, got {x.dtype} {list(x.shape)} on {x.device}")
        if k == 0 or len(scales) != k:
            raise ValueError(f"decode kernel: {k} experts and {len(scales)} scales (expected as many, at least one)")
        dim, inter = x.shape[1], experts[0].inter
        records = b"".join([expert_record(w, dim, inter) for w in experts])  # [k] RECORDs, each checked against D and I
        x = x.contiguous()
        scale = (ctypes.c_float * k)(*scales)
        buffer = torch.empty(dim + self.scratch_floats(dim, inter), dtype=torch.float32)  # out [D], then scratch
        self._fn(x.data_ptr(), dim, inter, k, records, scale, buffer.data_ptr(), buffer.data_ptr() + 4 * dim)
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
        """x [1, D] float32 contiguous in host memory; addresses: k expert records joined (`expert_record`:
        32 bytes each, struct "qqqq", which checked them); scales: array("f") of k gate weights; inter: I,
        each expert's width."""
        k, dim = len(scales), x.shape[1]
        if self._forked:
            raise RuntimeError("native lane: used in a forked child process (its threads stayed in the parent); open a new one")
        if len(addresses) != RECORD.size * k or scales.itemsize != 4:
            raise ValueError(f"native lane: {len(addresses)} address bytes for {k} scales (expected {RECORD.size} per expert: "
                             "an expert_record; float32 scales)")
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


def _tables() -> tuple[bytes, bytes, bytes, bytes] | str:
    """The IQ lookup tables cpu_formats.c reads, from the gguf package (the reference): IQ3_XXS's and
    IQ3_S's grids as bytes [256, 4] and [512, 4], IQ2_XXS's 128 sign patterns, IQ4_NL's 16 kvalues as
    int8; or why the package's tables do not have that form."""
    import gguf.quants as q  # the grids' hex is decoded only once a kernel is loaded
    import numpy as np

    grids = []
    for cls, rows in ((q.IQ3_XXS, 256), (q.IQ3_S, 512)):
        cls.init_grid()
        grid = np.asarray(cls.grid, dtype=np.float32)
        if grid.size != 4 * rows or not np.array_equal(grid, grid.astype(np.uint8)):
            return f"gguf's {cls.__name__} grid is not [{rows}, 4] whole numbers in 0..255 (shape {grid.shape})"
        grids.append(grid.astype(np.uint8).tobytes())
    signs, kvalues = bytes(q.IQ2_XXS.ksigns), np.array(q.IQ4_NL.kvalues)
    if len(signs) != 128 or kvalues.shape != (16,) or not np.array_equal(kvalues, kvalues.astype(np.int8)):
        return f"gguf's IQ2_XXS signs ({len(signs)} bytes) or IQ4_NL kvalues (shape {kvalues.shape}) are not 128 bytes and 16 int8s"
    return grids[0], grids[1], signs, kvalues.astype(np.int8).tobytes()


def _open_formats(formats: ctypes.CDLL) -> str | None:
    """Check cpu_formats.c's block geometry against moetier.model.formats, give it its tables; None, or why not."""
    i64 = ctypes.c_int64
    formats.format_geometry.restype, formats.format_geometry.argtypes = i64, [i64, ctypes.POINTER(i64), ctypes.POINTER(i64)]
    formats.format_tables.restype, formats.format_tables.argtypes = None, [ctypes.c_char_p] * 4
    for fmt in FORMATS.values():
        block, nbytes = i64(), i64()
        if not formats.format_geometry(fmt.id, ctypes.byref(block), ctypes.byref(nbytes)) or (block.value, nbytes.value) != (fmt.block, fmt.block_bytes):
            return (f"cpu_formats.c reads {fmt.name} (type {fmt.id}) as {block.value} values in {nbytes.value} bytes, "
                    f"formats.py as {fmt.block} in {fmt.block_bytes}")
    tables = _tables()
    if isinstance(tables, str):
        return tables
    formats.format_tables(*tables)
    return None


@functools.cache
def _load() -> tuple[DecodeKernel | None, str]:
    formats, _, why = library(FORMATS_SOURCE, STRICT_FLAGS)
    if formats is None:
        return None, f"{why}: torch kernels"
    lib, path, why = library(SOURCE, FAST_FLAGS)
    if lib is None:
        return None, f"{why}: torch kernels"
    why = _open_formats(formats)
    if why is not None:
        return None, f"off: {why}: torch kernels"
    return DecodeKernel(lib, path, formats), f"on ({path})"


def decode_kernel() -> DecodeKernel | None:
    """The native kernel, built on first use; None when this machine has none (see status())."""
    return _load()[0]


def status() -> str:
    """One line: whether the native decode kernel is in use, and why not when it is not."""
    return _load()[1]
