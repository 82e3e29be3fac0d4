"""moetier's CPU kernels (cpu_kernels.c, cpu_pool.h, cpu_router.h beside this file): SwiGLU experts, a linear layer, the router.

(The same library holds the native decode step, cpu_step.h, which moetier.engine.native_step drives.)

`decode_kernel(threads)` returns a `DecodeKernel` over a pool of that many
native threads (default: the CPUs this process may run on; the calling
thread is one of them), or None when this machine cannot build the library
(no C compiler, a failed build, or MOETIER_NATIVE=0); `status()` says which
and why, in one line. moetier.native builds the library once per machine
(-O3 -march=native, content-hashed, atomic), and cpu_formats.c, the row
dequantizers, apart with strict IEEE flags.

Numerics: each matrix's dot products are those of the dot-product family
registered for its format (moetier.backends.dot_kernels: activations
converted once per row as llama.cpp converts them, `act_type`, then integer
block dot products), else of the fallback family in cpu_kernels.c (float32
activations; a stored row dequantized to gguf's values bit for bit, then a
float32 dot; float32 experts then give the bits moetier's decode gave before
the families). MOETIER_DOT_FAMILIES=0 keeps the fallback for every format.
Guarantee: `run`, `experts` and `linear` give the same bits whatever the
pool's thread count and timing (and so does the CPU lane, cpu_lane.py, which
queues `run`'s calls to the same pool); `experts` on T rows equals T calls of `run` up to float32 summation
order over the experts (tests/test_native_pool.py). Every argument is
checked here (`expert_record` and the methods; the token mixers' in cpu_mixers.py); the C validates nothing.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
import weakref
from array import array
from pathlib import Path
from typing import Sequence

import torch

from moetier.backends import activations, cpu_streams, dot_kernels
from moetier.backends.base import ExpertWork
from moetier.backends.cpu_mixers import MixerKernels, float_input
from moetier.backends.cpu_status import status_error
from moetier.backends.iq_tables import iq_tables
from moetier.model.checkpoint import ExpertWeights
from moetier.model.formats import FORMATS, Format, format_of
from moetier.model.host_memory import host_copy
from moetier.native import FAST_FLAGS, STRICT_FLAGS, library

SOURCE = Path(__file__).with_suffix(".c")
FORMATS_SOURCE = Path(__file__).with_name("cpu_formats.c")
# one expert as the C reads it: gate_up address, down address, their GGML types, flags (FLOAT_ACTS, CLAMP; with CLAMP
# the word's high 32 bits are the float32 SwiGLU limit)
RECORD = struct.Struct("qqqqq")
FLOAT_ACTS = 1  # flags: F16 / BF16 matrices multiply float32 activations (ExpertWeights.float_acts)
CLAMP = 2  # flags: a clamped SwiGLU (ExpertWeights.swiglu_limit: GLM-5.3's)
THREADS_MAX = 256  # POOL_THREADS_MAX in cpu_pool.h
ACT_BLOCK = {activations.ACT_F32: 1, activations.ACT_F16: 1, activations.ACT_BF16: 1, activations.ACT_Q8_0: 32,
             activations.ACT_Q8_1: 32, activations.ACT_Q8_K: 256}  # values per block of each activation format


def usable_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def default_threads() -> int:
    """$MOETIER_THREADS (what `--threads` sets), else the CPUs this process may run on."""
    asked = os.environ.get("MOETIER_THREADS", "")
    if asked.isdigit() and 1 <= int(asked) <= THREADS_MAX:
        return int(asked)
    return usable_cpus()


def resident_types(weights: ExpertWeights) -> tuple[int, int]:
    """(gate_up, down) type ids as this machine's native kernels read them fastest: a format they read faster laid
    out otherwise (IQ3_XXS / IQ3_S as IQ3_XXS_T / IQ3_S_T where cpu_dotk.c's one-token AVX-512 loops run), else
    the weights' own. Only formats the decode kernel reads with a native family (not with MOETIER_NATIVE=0 or
    MOETIER_DOT_FAMILIES=0); with MOETIER_REPACK=0 the weights' own."""
    types = (weights.gate_up_type, weights.down_type)
    native = _load()[0] if os.environ.get("MOETIER_REPACK", "1") != "0" and weights.gate_up.is_cpu else None
    on = native.native_types if native is not None else frozenset()
    if not on:
        return types
    dots = dot_kernels.dot_kernels()
    return tuple(held if t in on and (held := dots.resident_type(t)) in on else t for t in types)


def resident_layout(weights: ExpertWeights) -> ExpertWeights:
    """weights in host memory in resident_types' layouts: a matrix of another layout repacked, the rest as
    ExpertWeights.resident keeps them; each matrix copied once at most."""
    types, held = (weights.gate_up_type, weights.down_type), resident_types(weights)
    if held == types:
        return weights.resident()
    dots = dot_kernels.dot_kernels()
    gate_up, down = (dots.repacked(m, t, h) if h != t else (host_copy(m) if weights.mapped else m)
                     for m, t, h in zip((weights.gate_up, weights.down), types, held))
    return ExpertWeights(gate_up, down, False, held[0], held[1], weights.float_acts, weights.swiglu_limit)


def _width(fmt: Format, cols: int) -> int:
    """Elements per stored row of `cols` values: cols for a float format, bytes for a block format."""
    return cols if fmt.dtype is not None else fmt.row_bytes(cols)


def matrix_error(what: str, t: torch.Tensor, qtype: int, rows: int, cols: int) -> str | None:
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
    """The hot path's form of `matrix_error(...) is None` (a decode call checks every expert it is given)."""
    fmt = FORMATS.get(qtype)
    return (fmt is not None and t.dtype is (fmt.dtype or torch.uint8) and t.is_cpu and t.is_contiguous()
            and cols % fmt.block == 0 and t.shape == (rows, cols if fmt.dtype is not None else cols // fmt.block * fmt.block_bytes))


def expert_record(weights: ExpertWeights, dim: int | None = None, inter: int | None = None) -> bytes:
    """One expert as the native kernels and lane read it: 40 bytes, RECORD (gate_up address, down address,
    gate_up type, down type, flags). Raises ValueError (one line) unless both matrices are their formats' shapes
    ([2I, D] and [D, I] values; D and I, when given, those of the call), contiguous in host memory.
    The tensors must outlive every use of the record."""
    gate_up, down, gate_up_type, down_type = weights.gate_up, weights.down, weights.gate_up_type, weights.down_type
    dim = down.shape[0] if dim is None else dim
    inter = gate_up.shape[0] // 2 if inter is None else inter
    if dim < 1 or inter < 1:
        raise ValueError(f"expert: hidden size {dim} and width {inter} (expected at least 1 each)")
    if not (_readable(gate_up, gate_up_type, 2 * inter, dim) and _readable(down, down_type, dim, inter)):
        raise ValueError(matrix_error("expert gate_up", gate_up, gate_up_type, 2 * inter, dim)
                         or matrix_error("expert down", down, down_type, dim, inter))
    flags = FLOAT_ACTS if weights.float_acts else 0
    if weights.swiglu_limit is not None:
        flags |= CLAMP | struct.unpack("<I", struct.pack("<f", weights.swiglu_limit))[0] << 32
        flags -= 1 << 64 if flags >= 1 << 63 else 0  # the word is a signed int64
    return RECORD.pack(gate_up.data_ptr(), down.data_ptr(), gate_up_type, down_type, flags)


class NativePool:
    """`threads` native threads for the kernels' calls (cpu_pool.h); the calling thread is one of them."""

    def __init__(self, lib: ctypes.CDLL, threads: int, spin_us: float):
        self._lib = lib
        self.handle = lib.pool_open(threads, spin_us * 1e-6)
        if not self.handle:
            raise RuntimeError(f"native pool: could not open {threads} thread(s)")
        self.threads = lib.pool_threads(self.handle)
        if self.threads < threads:
            lib.pool_close(self.handle)
            raise RuntimeError(f"native pool: started {self.threads - 1} of {threads - 1} helper threads")
        _POOLS.add(self)


_POOLS: "weakref.WeakSet[NativePool]" = weakref.WeakSet()


class DecodeKernel(MixerKernels):
    """The loaded library with a pool of `threads`; thread-safe (calls on one pool take turns), releases the GIL.
    The token mixers (deltanet_mix, kda_mix, hyper_weights) come from MixerKernels (cpu_mixers.py)."""

    def __init__(self, native: "_Native", threads: int):
        self.library, self.formats, self.path, self.threads = native.library, native.formats, native.path, threads
        self._pool: NativePool | None = None

    @property
    def pool(self) -> NativePool:
        """The pool, started on first use (the router alone needs none)."""
        if self._pool is None:
            self._pool = _pool(self.threads)
        return self._pool

    def with_threads(self, threads: int) -> "DecodeKernel":
        """The kernel over a pool of `threads` (the same object for the same count)."""
        return _kernel(threads)

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
        contiguous, in host memory (`expert_record` then checks their shapes), a clamped SwiGLU's limit a positive
        float32."""
        gate_up, down = weights.gate_up, weights.down
        limit = weights.swiglu_limit
        return ((limit is None or 0 < limit < 3.4e38) and weights.gate_up_type in FORMATS and weights.down_type in FORMATS
                and gate_up.is_cpu and down.is_cpu and gate_up.is_contiguous() and down.is_contiguous())

    def act_type(self, wtype: int, float_acts: bool = False) -> int:
        """The activation format (moetier.backends.activations) a matrix of GGML type wtype is multiplied with here."""
        return self.library.moe_act_type(format_of(wtype).id, int(float_acts))

    def dequantize(self, data: torch.Tensor, qtype: int, cols: int) -> torch.Tensor:
        """data: rows of `cols` values of GGML type qtype (float [rows, cols] of its dtype, or uint8
        [rows, row_bytes] of blocks), contiguous in host memory -> float32 [rows, cols], bit for bit
        gguf.quants.dequantize's values (the fallback family's)."""
        fmt = format_of(qtype)
        if data.dim() != 2:
            raise ValueError(f"{fmt.name}: expected a matrix [rows, row width], got {data.dim()} dimension(s) {list(data.shape)}")
        why = matrix_error(fmt.name, data, fmt.id, data.shape[0], cols)
        if why is not None:
            raise ValueError(why)
        out = torch.empty(data.shape[0], cols)  # [rows, cols] float32
        if out.numel():
            self.formats.dequantize_rows(fmt.id, data.data_ptr(), data.shape[0], cols, out.data_ptr())
        return out

    def run(self, x: torch.Tensor, experts: Sequence[ExpertWeights], scales: Sequence[float]) -> torch.Tensor:
        """x [1, D] float32 -> [1, D] = sum_j scales[j] * ffn_j(x), summed in the order given; every expert must
        `fit`, all of hidden size D and the first one's width I (checked: ValueError)."""
        k = len(experts)
        if x.dim() != 2 or x.shape[0] != 1 or x.dtype != torch.float32 or not x.is_cpu:
            raise ValueError(f"decode kernel: x must be float32 [1, D] in host memory, got {x.dtype} {list(x.shape)} on {x.device}")
        if k == 0 or len(scales) != k:
            raise ValueError(f"decode kernel: {k} experts and {len(scales)} scales (expected as many, at least one)")
        dim, inter = x.shape[1], experts[0].inter
        records = b"".join([expert_record(w, dim, inter) for w in experts])  # [k] RECORDs, each checked against D and I
        x = x.contiguous()
        scale = (ctypes.c_float * k)(*scales)
        out = torch.empty(1, dim)
        status_error("decode", self.library.moe_decode(self.pool.handle, x.data_ptr(), dim, inter, k, records, scale, out.data_ptr()))
        return out

    def experts(self, x: torch.Tensor, groups: Sequence[ExpertWork]) -> torch.Tensor:
        """x [T, D] float32 in host memory -> out [T, D]: row t is the sum, over the groups whose rows hold t (in
        the order given), of that weight times the expert's SwiGLU of x[t]. groups: per expert (an ExpertWeights
        that `fits`, all of hidden size D and the first one's width I), rows [n] int64 in [0, T) and weights [n]
        float32, in host memory; a group of no rows is skipped. Each expert's rows are converted once and its
        weights read once for all of them."""
        x = float_input("experts", x)
        tokens, dim = x.shape
        groups = [g for g in groups if g.rows.numel()]
        if not groups or not tokens:
            return torch.zeros(tokens, dim)
        inter = groups[0].expert.inter
        records = b"".join([expert_record(g.expert, dim, inter) for g in groups])
        for g in groups:
            if (g.rows.dtype != torch.int64 or g.weights.dtype != torch.float32 or g.rows.dim() != 1
                    or g.weights.shape != g.rows.shape or not g.rows.is_cpu or not g.weights.is_cpu):
                raise ValueError(f"experts: a group's rows must be int64 [n] and its weights float32 [n] in host memory, got "
                                 f"{g.rows.dtype} {list(g.rows.shape)} on {g.rows.device}, {g.weights.dtype} {list(g.weights.shape)}")
        rows, weights = torch.cat([g.rows for g in groups]), torch.cat([g.weights for g in groups])  # [pairs]
        low, high = torch.aminmax(rows)
        if low.item() < 0 or high.item() >= tokens:
            raise ValueError(f"experts: rows must lie in [0, {tokens}), got {low.item()}..{high.item()}")
        offsets = array("q", [0])
        for g in groups:
            offsets.append(offsets[-1] + g.rows.numel())
        out = torch.empty(tokens, dim)
        status_error("experts", self.library.moe_experts(self.pool.handle, x.data_ptr(), tokens, dim, inter, len(groups), records,
                                                          offsets.buffer_info()[0], rows.data_ptr(), weights.data_ptr(), out.data_ptr()))
        return out

    def linear(self, x: torch.Tensor, w: torch.Tensor, wtype: int, float_acts: bool) -> torch.Tensor:
        """y [T, rows] float32 = x [T, n] W^T, on every pool thread (rows split; each weight row read once for all T).

        x: float32 [T, n] in host memory. w: W [rows, n] as stored in GGML type wtype, contiguous in host memory
        (float [rows, n] of the format's dtype, or uint8 [rows, row bytes] of blocks). float_acts: float32
        activations for F16 / BF16 weights (a HF checkpoint); else x is converted as llama.cpp converts it for
        wtype's dot product (`act_type`). Bad arguments: ValueError, one line."""
        x = float_input("linear", x)
        if x.shape[1] < 1:
            raise ValueError(f"linear: x must have at least one column, got {list(x.shape)}")
        fmt = FORMATS.get(wtype)
        if fmt is None:
            raise ValueError(f"linear: GGML type {wtype} is not a stored format")
        if w.dim() != 2:
            raise ValueError(f"linear: weights must be a matrix [rows, row width], got {list(w.shape)}")
        tokens, cols = x.shape
        why = matrix_error("linear weights", w, fmt.id, w.shape[0], cols)
        if why is not None:
            raise ValueError(why)
        y = torch.empty(tokens, w.shape[0])
        if y.numel():
            status_error("linear", self.library.moe_linear(self.pool.handle, x.data_ptr(), tokens, cols, w.data_ptr(), fmt.id,
                                                            int(bool(float_acts)), w.shape[0], y.data_ptr()))
        return y


    def read_sum(self, x: torch.Tensor, plain: bool = False) -> float:
        """The sum of x (float32, contiguous, in host memory) read on every pool thread: the read-bandwidth probes
        (moetier.calibrate.read_bandwidth_bytes_per_s), summed in float32 per 1 MiB granule, then in float64. Each
        granule is read as four software-prefetched streams, or (plain) as eight streams the hardware prefetchers
        alone fetch: machines differ in which reads faster (cpu_kernels.c)."""
        if x.dtype != torch.float32 or not x.is_contiguous() or x.device.type != "cpu":
            raise ValueError(f"read_sum: x must be float32, contiguous, in host memory, got {x.dtype} on {x.device}")
        total = ctypes.c_double()
        status_error("read_sum", self.library.moe_read_sum(self.pool.handle, x.data_ptr(), x.numel(), int(plain), ctypes.byref(total)))
        return total.value


def _mark_forked() -> None:
    for pool in _POOLS:  # the helpers stayed in the parent: the caller computes alone, to the same bits
        pool._lib.pool_forked(pool.handle)


os.register_at_fork(after_in_child=_mark_forked)


def _open_formats(formats: ctypes.CDLL) -> str | None:
    """Check cpu_formats.c's block geometry against moetier.model.formats, give it its tables; None, or why not."""
    i64 = ctypes.c_int64
    formats.format_geometry.restype, formats.format_geometry.argtypes = i64, [i64, ctypes.POINTER(i64), ctypes.POINTER(i64)]
    for fmt in FORMATS.values():
        block, nbytes = i64(), i64()
        if not formats.format_geometry(fmt.id, ctypes.byref(block), ctypes.byref(nbytes)) or (block.value, nbytes.value) != (fmt.block, fmt.block_bytes):
            return (f"cpu_formats.c reads {fmt.name} (type {fmt.id}) as {block.value} values in {nbytes.value} bytes, "
                    f"formats.py as {fmt.block} in {fmt.block_bytes}")
    tables = iq_tables()
    if isinstance(tables, str):
        return tables
    formats.format_tables.restype, formats.format_tables.argtypes = None, [ctypes.c_char_p] * len(tables)
    formats.format_tables(*tables)
    return None


def _declare(lib: ctypes.CDLL, formats: ctypes.CDLL) -> None:
    p, i64, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
    signatures = {
        "moe_decode_init": (None, [p, p]),
        "moe_dot_register": (i64, [i64, p, p, p]),
        "moe_act_type": (i64, [i64, i64]),
        "moe_decode": (i64, [p, p, i64, i64, i64, p, p, p]),
        "moe_experts": (i64, [p, p, i64, i64, i64, i64, p, p, p, p, p]),
        "moe_linear": (i64, [p, p, i64, i64, p, i64, i64, i64, p]),
        "moe_read_sum": (i64, [p, p, i64, i64, p]),
        "moe_rms_norm": (i64, [p, p, p, i64, i64, ctypes.c_double, p]),
        "moe_rotary": (i64, [p, p, i64, i64, i64, i64, p, p, i64, p]),
        "moe_attention": (i64, [p, p, p, p, i64, i64, i64, i64, i64, i64, i64, p]),
        "moe_deltanet_mix": (i64, [p, p, p, p, p, p, p, p, i64, i64, i64, i64, i64, dbl, p]),
        "moe_hyper_weights": (None, [p, p, p, i64, i64, i64, ctypes.c_float, p, p, p]),
        "moe_kda_mix": (i64, [p, p, p, p, p, p, p, p, p, p, p, i64, i64, i64, dbl, dbl, i64, p]),
        "pool_open": (p, [i64, dbl]),
        "pool_threads": (i64, [p]),
        "pool_close": (None, [p]),
        "pool_forked": (None, [p]),
        "lane_open": (p, [p, dbl, i64]),
        "lane_submit": (i64, [p, p, i64, i64, i64, p, p]),
        "lane_collect": (i64, [p, i64, p, p]),
        "lane_release": (None, [p, i64]),
        "lane_close": (None, [p]),
        "route_softmax_f32": (None, [p, p, i64, i64, i64, p, i64, p, p, p, p, p]),
        "route_sigmoid_f32": (None, [p, p, i64, i64, i64, p, p, i64, i64, i64, ctypes.c_float, p, p, p, p, p]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    formats.dequantize_rows.restype, formats.dequantize_rows.argtypes = None, [i64, p, i64, i64, p]


def _address(fn) -> int:
    return ctypes.cast(fn, ctypes.c_void_p).value


def _act_error(lib: ctypes.CDLL, fmt: Format) -> str | None:
    """Why the activation formats registered for fmt cannot serve every row of fmt's blocks, or None."""
    for float_acts in (0, 1):
        act = lib.moe_act_type(fmt.id, float_acts)
        block = ACT_BLOCK.get(act)  # values per activation block
        if block is None or fmt.block % block:
            return f"{fmt.name} is given activation format {act} (float_acts={float_acts})"
    return None


def _register(lib: ctypes.CDLL) -> tuple[str, frozenset[int]]:
    """The fallback family for every format, then each native family's formats over it; -> which, in words, and
    the formats a native family computes."""
    fallback = (_address(lib.fallback_act_type), _address(lib.fallback_quantize), _address(lib.fallback_dot))
    for fmt in FORMATS.values():
        if lib.moe_dot_register(fmt.id, *fallback):
            raise RuntimeError(f"{SOURCE.name} refused type id {fmt.id} ({fmt.name}): its TYPES must exceed every id")
    if os.environ.get("MOETIER_DOT_FAMILIES", "1") == "0":
        return "fallback dots for every format (MOETIER_DOT_FAMILIES=0)", frozenset()
    dots = dot_kernels.dot_kernels()
    if dots is None:
        return f"fallback dots for every format (families {dot_kernels.status()})", frozenset()
    refused, native = [], set()
    for wtype in sorted(dots.types & FORMATS.keys()):
        lib.moe_dot_register(wtype, *dots.entry(wtype))
        why = _act_error(lib, FORMATS[wtype])
        if why is None:
            native.add(wtype)
        else:  # a family that answers nonsense leaves its format on the fallback
            lib.moe_dot_register(wtype, *fallback)
            refused.append(why)
    rest = [f.name for f in FORMATS.values() if f.id not in native]
    return (f"dots {dot_kernels.status()}" + (f", fallback for {', '.join(rest)}" if rest else "")
            + (f"; refused: {'; '.join(refused)}" if refused else "")), frozenset(native)


class _Native:
    """The built libraries, declared, given their tables and dot families (once per process)."""

    def __init__(self, lib: ctypes.CDLL, path: Path, formats: ctypes.CDLL):
        self.library, self.path, self.formats = lib, path, formats
        _declare(lib, formats)
        lib.moe_decode_init(_address(formats.dequantize_row), _address(formats.format_geometry))
        self.dots, self.native_types = _register(lib)


@functools.cache
def _load() -> tuple[_Native | None, str]:
    formats, _, why = library(FORMATS_SOURCE, STRICT_FLAGS)
    if formats is None:
        return None, f"{why}: torch kernels"
    lib, path, why = library(SOURCE, FAST_FLAGS)
    if lib is None:
        return None, f"{why}: torch kernels"
    why = _open_formats(formats)
    if why is not None:
        return None, f"off: {why}: torch kernels"
    native = _Native(lib, path, formats)
    return native, f"on ({path}; {native.dots})"


@functools.cache
def _kernel(threads: int) -> DecodeKernel:
    if not 1 <= threads <= THREADS_MAX:
        raise ValueError(f"native kernels: threads must be 1..{THREADS_MAX}, got {threads}")
    return DecodeKernel(_load()[0], threads)


_POOL_LOCK = threading.Lock()


def _pool(threads: int) -> NativePool:
    """One pool per thread count, for the process's life (kernels and lanes asking for that count share it)."""
    with _POOL_LOCK:  # two threads' first calls must not start two pools
        return _pool_open(threads)


@functools.cache
def _pool_open(threads: int) -> NativePool:
    pool = NativePool(_load()[0].library, threads, float(os.environ.get("MOETIER_POOL_SPIN_US", "200")))
    if not cpu_streams.chosen():  # the first pool chooses how the float formats stream, for the process
        cpu_streams.choose(pool, _load()[0].native_types)
    return pool


def decode_kernel(threads: int | None = None) -> DecodeKernel | None:
    """The native kernels over a pool of `threads` (default `default_threads()`), built on first use; None when
    this machine has none (see status())."""
    if _load()[0] is None:
        return None
    return _kernel(default_threads() if threads is None else int(threads))


def status() -> str:
    """One line: whether the native kernels are in use (and their dot families), and why not when they are not."""
    return _load()[1]
