"""One core's one-token gemv per stored block format: moetier's dot kernels against llama.cpp's vec_dot.

Regime: one thread, pinned to one CPU for the whole run (both engines on the
same core), T = 1 (decode's matrix-vector product). Per format, a random
matrix of [rows, --cols] in the format's blocks (tests/quant_blocks.py: random
fields, finite scales) of --mb MB, several times a last-level cache, so every
pass reads DRAM; one token's activations quantized once to the format's
vec_dot_type (Q8_K or Q8_0, byte for byte as llama.cpp's quantize_row). moetier:
DotKernels.dot over the whole matrix in one call, the matrix in the layout its
kernels hold it in (`resident_type`: IQ3_S_T / IQ3_XXS_T where the AVX-512
loops read them). llama.cpp: the vec_dot of its CPU backend for the type
(ggml_get_type_traits_cpu in the libggml-cpu.so of llama-cpp-python), one call
a row from a C loop (benchmarks/vec_dot_rows.c, built once), as ggml's
mul_mat calls it for one token. Figures: GB/s of the stored bytes, best pass of
--runs rounds, the two engines alternated within each round; beside them one
thread's read bandwidth over a 1 GiB buffer (moetier.calibrate.read_probes),
sampled in the same rounds. The two engines' outputs are compared each
format: the largest |difference| over sum |w||x| of a row (float32 order
only: both sum exact integer products per block). Prints a table, then one
JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from quant_blocks import F16_FIELDS, NOT_STORED, random_rows  # noqa: E402

from moetier import native  # noqa: E402
from moetier.backends import activations as A  # noqa: E402
from moetier.backends import dot_kernels, torch_dequant  # noqa: E402
from moetier.calibrate import read_probes  # noqa: E402
from moetier.model.formats import BY_NAME  # noqa: E402

DEFAULT_FORMATS = "Q8_0,Q4_K,Q5_K,Q6_K,IQ4_XS,IQ3_S,IQ3_XXS,IQ2_S,IQ2_XS,IQ2_XXS,IQ1_M,IQ1_S"
NAME_OF = {fmt.id: name for name, fmt in BY_NAME.items()}  # type id -> name (the layout a matrix is held in)


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def llama_vec_dots(cpu_lib: str | None):
    """-> (type id -> (vec_dot pointer, its vec_dot_type)), the C row loop, llama-cpp-python's version; or exit.
    cpu_lib: another build of the same version's libggml-cpu.so (e.g. one for AVX2 only), else llama-cpp-python's."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("bench_kernels: llama-cpp-python is not installed (make .venv/.moetier-peer)") from None
    path = cpu_lib or os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so")
    try:
        cpu = ctypes.CDLL(path)
    except OSError as e:
        where = "--llama-cpu-lib" if cpu_lib else "llama-cpp-python's CPU library"
        raise SystemExit(f"bench_kernels: {where} {path}: cannot load it ({e})") from None
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_cpu_init()  # its float16 table: vec_dot reads scales through it

    def traits(type_id: int) -> tuple[int, int]:
        t = cpu.ggml_get_type_traits_cpu(type_id).contents
        return t.vec_dot, t.vec_dot_type

    loop, _, why = native.library(REPO / "benchmarks" / "vec_dot_rows.c", native.FAST_FLAGS)
    if loop is None:
        raise SystemExit(f"bench_kernels: the C row loop did not build: {why}")
    loop.vec_dot_rows.restype = None
    loop.vec_dot_rows.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                  ctypes.c_void_p, ctypes.c_void_p]
    return traits, loop.vec_dot_rows, llama_cpp.__version__


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(name: str, args, kernels, traits, rows_loop, read) -> dict:
    fmt = BY_NAME[name]
    rng = np.random.default_rng(0)
    rows = max(1, (args.mb << 20) // (args.cols // fmt.block * fmt.block_bytes))
    w = torch.from_numpy(random_rows(fmt, rows, args.cols, rng))
    x = rng.standard_normal((1, args.cols)).astype(np.float32)
    act = kernels.act_type(fmt.id)
    vec_dot, vec_dot_type = traits(fmt.id)
    if vec_dot_type != act:
        raise SystemExit(f"bench_kernels: {name}: llama.cpp dots it with activations of type {vec_dot_type}, moetier {act}")
    xq = torch.from_numpy(A.quantize(act, x))
    held = kernels.resident_type(fmt.id)
    wr = kernels.repacked(w, fmt.id, held)
    ours, theirs = torch.empty(rows, dtype=torch.float32), torch.empty(rows, dtype=torch.float32)
    row_bytes = w.shape[1]

    def moetier_pass():
        ours.copy_(kernels.dot(held, act, wr, xq, args.cols)[0])

    def llama_pass():
        rows_loop(vec_dot, args.cols, w.data_ptr(), row_bytes, rows, xq.data_ptr(), theirs.data_ptr())

    best = {"moetier": 0.0, "llama.cpp": 0.0, "read": 0.0}
    moetier_pass(), llama_pass()  # first touch, outside the timing
    for _ in range(args.runs):
        for engine, fn in (("moetier", moetier_pass), ("llama.cpp", llama_pass)):
            best[engine] = max(best[engine], w.numel() / timed(fn) / 1e9)
        best["read"] = max(best["read"], (1 << 30) / timed(read) / 1e9)
    scale = torch.from_numpy(np.abs(np.asarray(A.dequantize(act, xq.numpy(), args.cols)))).reshape(-1)
    sums = torch_dequant.dequantize(w[:64], fmt.id, args.cols).abs() @ scale  # sum |w||x| of the first 64 rows
    worst = float(((ours[:64] - theirs[:64]).abs() / sums.clamp_min(1e-30)).max())
    return {"rows": rows, "cols": args.cols, "mb": round(w.numel() / 1e6, 1), "held_as": NAME_OF[held],
            "moetier_gb_per_s": best["moetier"], "llama_cpp_gb_per_s": best["llama.cpp"], "read_gb_per_s": best["read"],
            "vs_llama_cpp": best["moetier"] / best["llama.cpp"], "max_diff_over_sum_abs": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=DEFAULT_FORMATS)
    parser.add_argument("--mb", type=int, default=256, help="each format's matrix, MB (several times the LLC)")
    parser.add_argument("--cols", type=int, default=2048, help="values a row (whole 256-value blocks)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpu", type=int, default=None, help="the CPU to pin to (default: the first this process may use)")
    parser.add_argument("--llama-cpu-lib", default=None, metavar="PATH",
                        help="another build of llama.cpp's libggml-cpu.so (the same version; e.g. built for AVX2 only) "
                             "in place of llama-cpp-python's")
    args = parser.parse_args()
    blocks = [name for name in F16_FIELDS if name not in NOT_STORED]
    for name in args.formats.split(","):
        if name not in blocks:
            parser.error(f"--formats: {name!r} is not a stored block format (expected some of {','.join(blocks)})")
    if args.cols <= 0 or args.cols % 256 or args.mb <= 0 or args.runs <= 0:
        parser.error(f"--cols must be a positive multiple of 256, --mb and --runs positive; got {args.cols}, {args.mb}, {args.runs}")
    kernels = dot_kernels.dot_kernels()
    if kernels is None:
        raise SystemExit(f"bench_kernels: no native dot kernels: {dot_kernels.status()}")
    cpu = args.cpu if args.cpu is not None else min(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    traits, rows_loop, llama_version = llama_vec_dots(args.llama_cpu_lib)
    probes = read_probes(1)
    read = max(probes.values(), key=lambda probe: 1 / timed(probe))  # the fastest reader on this host
    report = {"bench": "kernels", "cpu": cpu, "status": dot_kernels.status(), "llama_cpp_python": llama_version,
              "llama_cpu_lib": args.llama_cpu_lib or "llama-cpp-python's",
              "machine": {"cpu": _cpu_name(), "git_commit": _git("rev-parse", "HEAD"),
                          "date": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, "formats": {}}
    print(f"one core (CPU {cpu}), one token, [rows, {args.cols}] matrices of {args.mb} MB from DRAM, best of {args.runs} "
          f"alternated passes; {report['machine']['cpu']}, git {report['machine']['git_commit'][:10]}, "
          f"llama-cpp-python {llama_version}" + (f" ({args.llama_cpu_lib})" if args.llama_cpu_lib else ""))
    print(f"{'format':<8} {'held as':<10} {'moetier GB/s':>13} {'llama.cpp GB/s':>15} {'ratio':>7} {'read GB/s':>10} {'max diff':>9}")
    for name in args.formats.split(","):
        r = measure(name, args, kernels, traits, rows_loop, read)
        report["formats"][name] = r
        print(f"{name:<8} {r['held_as']:<10} {r['moetier_gb_per_s']:>13.1f} {r['llama_cpp_gb_per_s']:>15.1f} "
              f"{r['vs_llama_cpp']:>6.2f}x {r['read_gb_per_s']:>10.1f} {r['max_diff_over_sum_abs']:>9.1e}", flush=True)
    print("max diff: the largest |moetier - llama.cpp| over sum |w||x| of a row (first 64 rows)")
    print(json.dumps(report))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git(*cmd: str) -> str:
    done = subprocess.run(["git", *cmd], cwd=REPO, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


if __name__ == "__main__":
    main()
