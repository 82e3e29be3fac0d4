"""moetier's C sources built on the user's machine, and where moetier keeps what it writes once per machine.

`library(source, flags, link)` compiles one C file that sits beside the
Python that binds it (backends/cpu_kernels.c, residency/residency.c,
transport/wire.c) with the machine's `cc` (or $CC) at -march=native into
$MOETIER_HOME/native/<name>-<key>.so, and loads it. The key hashes the
source, the headers beside it, the flags, the link arguments, the compiler's version, the machine
and its CPU's feature flags, so a changed source or compiler builds anew and
a home folder shared by hosts of different CPUs never loads another's build; a build is written to a
temporary name and renamed into place, so processes that race to build never
load half a file. MOETIER_ARCH replaces -march=native with other target flags (e.g.
"-march=x86-64-v3": the AVX2 + FMA paths on an AVX-512 host, or one build for a cluster's oldest CPU); a
build for them that fails is an error, not a fallback. MOETIER_NATIVE=0 turns every native path off. Each caller
keeps a Python twin of its C and says in one line why the C is off.
This module imports nothing heavier than the standard library.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shlex
import subprocess
import tempfile
from pathlib import Path

# Reassociation (not full -ffast-math: NaN and inf keep their meaning) lets the dot products vectorize.
FAST_FLAGS = ("-O3", "-fPIC", "-shared", "-pthread", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
              "-fno-trapping-math", "-ffp-contract=fast")
# IEEE arithmetic exactly as written (no reassociation, no fused multiply-add): for code whose
# results must equal a numpy path's bit for bit (residency.c). GCC contracts by default.
STRICT_FLAGS = ("-O3", "-fPIC", "-shared", "-ffp-contract=off")
ARCH_FLAGS = ("-march=native",)  # dropped if this compiler does not take it


def arch_flags() -> tuple[str, ...]:
    """The target flags builds use: $MOETIER_ARCH split as a shell would, else ARCH_FLAGS."""
    chosen = os.environ.get("MOETIER_ARCH", "").strip()
    return tuple(shlex.split(chosen)) if chosen else ARCH_FLAGS


@functools.cache
def _cpu_features() -> str:
    """What -march=native compiles for: the CPU's feature flags (a build for an AVX-512 host must not load on an
    AVX2 one, and a home folder may move between them, as a VM does between hosts)."""
    try:
        with open("/proc/cpuinfo") as info:
            lines = info.readlines()
    except OSError:  # no /proc (macOS, a sandbox): the processor's name is what is known
        return platform.processor()
    flags = next((line for line in lines if line.startswith(("flags", "Features"))), None)  # x86, arm64
    return " ".join(sorted(flags.split(":", 1)[1].split())) if flags else platform.processor()


def moetier_home() -> Path:
    """$MOETIER_HOME, else the user's cache folder (XDG_CACHE_HOME or ~/.cache) / moetier."""
    if os.environ.get("MOETIER_HOME"):
        return Path(os.environ["MOETIER_HOME"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "moetier"


def _compiler() -> str:
    return os.environ.get("CC", "cc")


def _version(compiler: str) -> str:
    try:
        return subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(compiler: str, source: Path, flags: tuple[str, ...], out: Path, link: tuple[str, ...] = ()) -> str | None:
    """Compile `source` into `out` (atomically), linking `link` after it; None on success, else why not (one line)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    last = ""
    chosen = arch_flags()
    for arch in ((chosen, ()) if chosen == ARCH_FLAGS else (chosen,)):
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            done = subprocess.run([compiler, *flags, *arch, str(source), "-o", tmp, *link, "-lm"],
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
def library(source: Path, flags: tuple[str, ...], link: tuple[str, ...] = ()) -> tuple[ctypes.CDLL | None, Path | None, str]:
    """The C file `source` built with `flags` and linked with `link` (once per machine), and loaded
    -> (library, its path, "") or (None, None, why not): MOETIER_NATIVE=0, no C compiler, a failed build or load.
    Link arguments go after the source: a Debian gcc links --as-needed, so a library named before
    the object that needs it is dropped."""
    if os.environ.get("MOETIER_NATIVE", "1") == "0":
        return None, None, "off (MOETIER_NATIVE=0)"
    compiler = _compiler()
    version = _version(compiler)
    if not version:
        return None, None, f"off: no C compiler ({compiler!r} did not run; set CC)"
    source = Path(source)
    headers = [h.read_text() for h in sorted(source.parent.glob("*.h"))]  # the local headers it may include
    key = hashlib.sha256("\0".join([source.read_text(), *headers, " ".join(flags + arch_flags() + link), version,
                                    platform.machine(), _cpu_features()]).encode()).hexdigest()[:16]
    path = moetier_home() / "native" / f"{source.stem}-{key}.so"
    if not path.exists():
        why = _build(compiler, source, flags, path, link)
        if why is not None:
            return None, None, f"off: {why}"
    try:
        return ctypes.CDLL(str(path)), path, ""
    except OSError as err:
        return None, None, f"off: {path} did not load ({err})"


__all__ = ["ARCH_FLAGS", "FAST_FLAGS", "STRICT_FLAGS", "arch_flags", "library", "moetier_home"]
