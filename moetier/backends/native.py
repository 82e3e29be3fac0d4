"""The native decode kernel (csrc/moe_decode.c): built once per machine, called through ctypes.

`decode_kernel()` returns a `DecodeKernel`, or None when this machine cannot
build one (no C compiler, a failed build, or MOETIER_NATIVE=0); `status()`
says which and why, in one line. The shared library is compiled with the
machine's `cc` (or $CC) at -O3 -march=native into
$MOETIER_HOME/native/moe_decode-<key>.so, where the key hashes the source, the
flags and the compiler's version: a changed kernel or compiler builds anew,
and a build is written to a temporary name and renamed into place, so
processes that race to build never load half a file.

Guarantee: `DecodeKernel.run` computes what the torch decode path computes
(the gate-weighted sum of k SwiGLU experts over one token) in float32, with
sums in another order (differences of float32 rounding, ~1e-6 relative).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path
from typing import Sequence

import torch

from moetier.model.checkpoint import ExpertWeights
from moetier.paths import moetier_home

SOURCE = Path(__file__).with_name("csrc") / "moe_decode.c"
# Reassociation (not full -ffast-math: NaN and inf keep their meaning) lets the dot products vectorize.
FLAGS = ["-O3", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
         "-fno-trapping-math", "-ffp-contract=fast"]
ARCH_FLAGS = ["-march=native"]  # dropped if this compiler does not take it


class DecodeKernel:
    """The loaded library; thread-safe (no state of its own), releases the GIL while it runs."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        self._fn = library.moe_decode_f32
        self._fn.restype = None
        p, i64 = ctypes.c_void_p, ctypes.c_int64
        self._fn.argtypes = [p, i64, i64, i64, p, p, p, p]

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


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(compiler: str, out: Path) -> str | None:
    """Compile SOURCE into `out` (atomically); None on success, else why not (one line)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    last = ""
    for arch in (ARCH_FLAGS, []):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *FLAGS, *arch, str(SOURCE), "-o", tmp, "-lm"],
                                  capture_output=True, text=True, timeout=120)
            if done.returncode == 0:
                os.replace(tmp, out)
                return None
            last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        except (OSError, subprocess.SubprocessError) as err:
            last = str(err)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return f"{compiler} failed: {last}"


@functools.cache
def _load() -> tuple[DecodeKernel | None, str]:
    if os.environ.get("MOETIER_NATIVE", "1") == "0":
        return None, "off (MOETIER_NATIVE=0): torch kernels"
    compiler = _compiler()
    version = _version(compiler)
    if not version:
        return None, f"off: no C compiler ({compiler!r} did not run; set CC): torch kernels"
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS + ARCH_FLAGS), version,
                                    platform.machine()]).encode()).hexdigest()[:16]
    path = moetier_home() / "native" / f"moe_decode-{key}.so"
    if not path.exists():
        why = _build(compiler, path)
        if why is not None:
            return None, f"off: {why}: torch kernels"
    try:
        return DecodeKernel(ctypes.CDLL(str(path)), path), f"on ({path})"
    except OSError as err:
        return None, f"off: {path} did not load ({err}): torch kernels"


def decode_kernel() -> DecodeKernel | None:
    """The native kernel, built on first use; None when this machine has none (see status())."""
    return _load()[0]


def status() -> str:
    """One line: whether the native decode kernel is in use, and why not when it is not."""
    return _load()[1]
