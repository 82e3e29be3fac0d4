"""The native dot-product families (moetier/backends/cpu_dot.h): weight rows in their stored format times activations
in the format llama.cpp's dot product for that format takes.

Each family is one C file beside this module (cpu_dot32.c: F32, F16, BF16 and
the 32-value block formats; cpu_dotk.c: the K-quants and the IQ formats),
built by moetier.native into its own library. `dot_kernels()` returns the
`DotKernels` of this machine (None when no family builds: MOETIER_NATIVE=0,
no compiler), which answers for every format some family covers:
`act_type(wtype, float_acts)` (the activation format, as
moetier.backends.activations.act_type), `quantize(act, x)` (activations to
that format: the bytes llama.cpp's CPU backend writes) and `dot(wtype, act, w,
xq)` ([T, rows] float32). Every argument is checked here, before C sees it;
`entry(wtype)` gives the three C functions' addresses for the decode library,
which calls them directly. A family that exports `<family>_tables` (the IQ
formats' grids, signs and kvalues) gets them from the gguf package at load. `status()` says in one line which families are on.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from moetier.backends import activations
from moetier.backends.iq_tables import iq_tables
from moetier.model.formats import FORMATS, format_of
from moetier.model.host_memory import host_empty
from moetier.native import FAST_FLAGS, library

FAMILIES = ("dot32", "dotk")  # cpu_<family>.c, each exporting <family>_act_type, <family>_quantize, <family>_dot
HERE = Path(__file__).parent


class _Family:
    def __init__(self, name: str, lib: ctypes.CDLL, path: Path):
        self.name, self.path, self.lib = name, path, lib
        i64, p = ctypes.c_int64, ctypes.c_void_p
        self.act_type = getattr(lib, f"{name}_act_type")
        self.act_type.restype, self.act_type.argtypes = i64, [i64, i64]
        self.quantize = getattr(lib, f"{name}_quantize")
        self.quantize.restype, self.quantize.argtypes = None, [i64, p, p, i64]
        self.dot = getattr(lib, f"{name}_dot")
        self.dot.restype, self.dot.argtypes = None, [i64, i64, i64, p, i64, i64, p, i64, p, i64]
        self.types = frozenset(t for t in FORMATS if self.act_type(t, 0) >= 0)
        # optional: the layout the family reads a format in fastest, and the conversion to it (cpu_dotk.c)
        self.resident_type = getattr(lib, f"{name}_resident_type", None)
        if self.resident_type is not None:
            self.resident_type.restype, self.resident_type.argtypes = i64, [i64]
            self.repack = getattr(lib, f"{name}_repack")
            self.repack.restype, self.repack.argtypes = i64, [i64, i64, p, p, i64]


class DotKernels:
    """The families that built on this machine; thread-safe (no state), each call releases the GIL."""

    def __init__(self, families: list[_Family]):
        self.families = families
        self._by_type = {t: f for f in families for t in f.types}
        self._quantizer = {}  # activation format -> the family that converts to it
        for family in families:
            for t in family.types:
                for float_acts in (0, 1):
                    self._quantizer.setdefault(int(family.act_type(t, float_acts)), family)

    @property
    def types(self) -> frozenset[int]:
        """The weight formats some family computes."""
        return frozenset(self._by_type)

    def act_type(self, wtype: int, float_acts: bool = False) -> int:
        return int(self._family(wtype).act_type(wtype, int(float_acts)))

    def quantize(self, act: int, x: torch.Tensor) -> torch.Tensor:
        """x [T, n] float32 -> uint8 [T, activations.row_bytes(act, n)], row by row."""
        family = self._quantizer.get(int(act))
        if family is None:
            raise ValueError(f"activation format {act}: no native family converts to it here "
                             f"(on: {', '.join(f.name for f in self.families) or 'none'})")
        if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
            raise ValueError(f"activations must be float32 [T, n] in host memory, got {x.dtype} {list(x.shape)} on {x.device}")
        n = x.shape[1]
        block = {activations.ACT_Q8_0: 32, activations.ACT_Q8_1: 32, activations.ACT_Q8_K: 256}.get(int(act), 1)
        if n % block:
            raise ValueError(f"activation rows of {n} values are not whole {block}-value blocks (format {act})")
        x = x.contiguous()
        out = torch.empty(x.shape[0], activations.row_bytes(int(act), n), dtype=torch.uint8)
        for t in range(x.shape[0]):
            family.quantize(int(act), x[t].data_ptr(), out[t].data_ptr(), n)
        return out

    def dot(self, wtype: int, act: int, w: torch.Tensor, xq: torch.Tensor, n: int) -> torch.Tensor:
        """w: rows of n values in wtype as stored ([rows, n] float or uint8 [rows, row bytes]); xq: uint8 [T, act row
        bytes] from `quantize(act, ...)` -> float32 [T, rows] (each weight row read once for all T)."""
        fmt, family = format_of(wtype), self._family(wtype)
        if int(act) != self.act_type(wtype, False) and int(act) != self.act_type(wtype, True):
            raise ValueError(f"{fmt.name} weights dot with activations of format {self.act_type(wtype)}, not {act}")
        if w.dim() != 2 or w.device.type != "cpu" or not w.is_contiguous() or w.dtype != (fmt.dtype or torch.uint8):
            raise ValueError(f"{fmt.name} weights must be a contiguous host tensor [rows, ...] of {fmt.dtype or torch.uint8}, "
                             f"got {w.dtype} {list(w.shape)}")
        if fmt.cols(w) != n:
            raise ValueError(f"{fmt.name} weight rows hold {fmt.cols(w)} values, activations {n}")
        if xq.dim() != 2 or xq.dtype != torch.uint8 or xq.shape[1] != activations.row_bytes(int(act), n) or not xq.is_contiguous():
            raise ValueError(f"activations must be contiguous uint8 [T, {activations.row_bytes(int(act), n)}] of format {act}, "
                             f"got {xq.dtype} {list(xq.shape)}")
        rows, tokens = w.shape[0], xq.shape[0]
        y = torch.empty(tokens, rows, dtype=torch.float32)
        row_bytes = w.shape[1] * w.element_size()
        family.dot(int(wtype), int(act), n, w.data_ptr(), row_bytes, rows, xq.data_ptr(), tokens, y.data_ptr(), rows)
        return y

    def resident_type(self, wtype: int) -> int:
        """The layout (a type id of moetier.model.formats) in which the family computing wtype reads its matrices
        fastest: IQ3_XXS_T / IQ3_S_T for IQ3_XXS / IQ3_S where cpu_dotk.c's one-token AVX-512 loops run; else wtype."""
        family = self._by_type.get(int(wtype))
        return int(wtype) if family is None or family.resident_type is None else int(family.resident_type(int(wtype)))

    def repacked(self, data: torch.Tensor, wtype: int, to_type: int) -> torch.Tensor:
        """A uint8 [rows, row bytes] matrix of wtype as to_type (another layout of the same format, e.g. IQ3_S ->
        IQ3_S_T and back), a new tensor in memory advised for huge pages; data itself when the types are equal."""
        if int(wtype) == int(to_type):
            return data
        fmt, to = format_of(wtype), format_of(to_type)
        family = self._by_type.get(int(wtype))
        if family is None or family.resident_type is None or fmt.block_bytes != to.block_bytes or fmt.block != to.block:
            raise ValueError(f"{fmt.name} -> {to.name}: not two layouts of one format a native family converts")
        if data.dim() != 2 or data.dtype != torch.uint8 or data.device.type != "cpu" or data.shape[1] % fmt.block_bytes:
            raise ValueError(f"{fmt.name}: expected a host uint8 [rows, whole {fmt.block_bytes}-byte blocks] tensor, "
                             f"got {data.dtype} {list(data.shape)} on {data.device}")
        data = data.contiguous()
        out = host_empty(tuple(data.shape), torch.uint8)
        if family.repack(int(wtype), int(to_type), data.data_ptr(), out.data_ptr(), data.numel() // fmt.block_bytes):
            raise ValueError(f"{fmt.name} -> {to.name}: the {family.name} family does not convert these")
        return out

    def set_plain_streams(self, plain: bool) -> bool:
        """Whether the float formats read their one-token rows as eight plain streams rather than four prefetched
        ones (cpu_dot32.c's eight_streams; the same values either way): set for the process, -> the way in effect
        (False where the family has no eight-stream path: not AVX-512)."""
        family = next((f for f in self.families if f.name == "dot32"), None)
        if family is None:
            return False
        fn = family.lib.dot32_set_streams
        fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64]
        return bool(fn(int(plain)))

    def entry(self, wtype: int) -> tuple[int, int, int]:
        """(act_type, quantize, dot) C function addresses of the family computing wtype."""
        family = self._family(wtype)
        address = lambda fn: ctypes.cast(fn, ctypes.c_void_p).value  # noqa: E731
        return address(family.act_type), address(family.quantize), address(family.dot)

    def _family(self, wtype: int) -> _Family:
        family = self._by_type.get(int(wtype))
        if family is None:
            raise ValueError(f"{format_of(wtype).name}: no native dot-product family computes it here "
                             f"(on: {', '.join(f.name for f in self.families) or 'none'})")
        return family


@functools.cache
def _load() -> tuple[DotKernels | None, str]:
    families, why = [], []
    for name in FAMILIES:
        source = HERE / f"cpu_{name}.c"
        if not source.exists():
            why.append(f"{name}: not written")
            continue
        lib, path, reason = library(source, FAST_FLAGS)
        if lib is None:
            why.append(f"{name}: {reason}")
            continue
        tables = getattr(lib, f"{name}_tables", None)
        if tables is not None:  # the IQ formats' grids, signs and kvalues, from the gguf package (the reference)
            grids = iq_tables()
            if isinstance(grids, str):
                why.append(f"{name}: {grids}")
            else:
                tables.restype, tables.argtypes = ctypes.c_int64, [ctypes.c_char_p] * len(grids)
                refused = tables(*grids)
                if refused:
                    why.append(f"{name}: the IQ tables were refused ({refused}): IQ formats off")
        families.append(_Family(name, lib, path))
    if not families:
        return None, "; ".join(why) or "no families"
    on = ", ".join(f.name for f in families)
    return DotKernels(families), f"on ({on})" + (f"; {'; '.join(why)}" if why else "")


def dot_kernels() -> DotKernels | None:
    return _load()[0]


def status() -> str:
    return _load()[1]
