"""The dotk family (moetier/backends/cpu_dotk.c): K-quant and IQ weight rows times Q8_K activations.

Fast: every format, T in {1, 3, 8}, n in {256, 1024}, 37 rows x 11 tokens and 21 rows x 65 tokens (the
16-row tiles of AVX-512 and of AVX2, and their tails): the Q8_K bytes equal
moetier.backends.activations (llama.cpp's quantize_row_q8_K_ref); the dot
products are within 1e-5 of sum |w||x| of float64 on gguf's dequantized
weights and the activations' own values; T = 8 equals 8 single-token calls;
bad inputs are one ValueError before C. The same file built for its other
paths (AVX2 only: x86-64-v3, Zen 3's; no SIMD; AVX-512 without VNNI) gives
answers within the same bound.
Peer (marker `peer`): each dot product equals llama.cpp's own vec_dot on
this machine within 2e-6 of sum |w||x|.
"""

from __future__ import annotations

import ctypes
import os
import platform
import subprocess
from pathlib import Path

import gguf.quants
import numpy as np
import pytest
import torch

from moetier.backends import activations as A
from moetier.backends import dot_kernels as D
from moetier.backends.iq_tables import iq_tables
from moetier.model.formats import BY_NAME
from moetier.native import FAST_FLAGS, library
from tests.quant_blocks import random_rows

NAMES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS")
SOURCE = Path(D.__file__).parent / "cpu_dotk.c"
BOUND, PEER_BOUND = 1e-5, 2e-6  # of sum |w||x| over the row


def with_tables(lib: ctypes.CDLL, path: Path) -> D.DotKernels:
    tables = iq_tables()  # the gguf package's IQ grids, sign patterns and kvalues, as dotk_tables reads them
    assert not isinstance(tables, str), tables
    lib.dotk_tables.restype, lib.dotk_tables.argtypes = ctypes.c_int64, [ctypes.c_char_p] * len(tables)
    code = lib.dotk_tables(*tables)
    assert code == 0, f"dotk_tables refused gguf's tables ({'signs not the parity rule' if code == 1 else 'a grid value out of range'})"
    return D.DotKernels([D._Family("dotk", lib, path)])


@pytest.fixture(scope="module")
def kernels() -> D.DotKernels:
    found = D.dot_kernels()
    if found is None or "dotk" not in D.status():
        pytest.fail(f"the dotk family did not load: {D.status()}")
    if all(BY_NAME[name].id in found.types for name in NAMES):
        return found
    # dot_kernels.py does not yet hand dotk_tables its tables: give them to the same loaded library
    lib, path, why = library(SOURCE, FAST_FLAGS)
    assert lib is not None, why
    return with_tables(lib, path)


def activations(T: int, n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((T, n)) * rng.uniform(0.01, 10, (T, 1))).astype(np.float32)
    if T >= 3:
        x[1, :256] = 0  # a zero block
        x[2, 5] = -3 * np.abs(x[2]).max()  # the largest magnitude negative
    return x


def reference(name: str, w: np.ndarray, xq: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 dot products of gguf's weights and the activations' values, and sum |w||x| -> [T, rows] each."""
    wf = gguf.quants.dequantize(w, BY_NAME[name].id).astype(np.float64).reshape(len(w), n)
    xf = A.dequantize(A.ACT_Q8_K, xq, n).astype(np.float64)
    return xf @ wf.T, np.abs(xf) @ np.abs(wf).T


def case(name: str, T: int, n: int, seed: int, rows: int = 13):  # 13: the C walks rows 4 at a time
    rng = np.random.default_rng(seed)
    w = random_rows(BY_NAME[name], rows, n, rng)
    return w, activations(T, n, seed + 100)


@pytest.mark.parametrize("n", (256, 1024))
@pytest.mark.parametrize("T", (1, 3, 8))
def test_quantize_bytes_equal_the_reference(kernels, T, n):
    x = activations(T, n, seed=T * n)
    ours = kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x)).numpy()
    assert np.array_equal(ours, A.quantize(A.ACT_Q8_K, x))


def test_quantize_ties_and_extremes(kernels):
    x = np.zeros((4, 512), np.float32)
    x[0, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves at every step
    x[1] = np.linspace(-1, 1, 512, dtype=np.float32)
    x[1, 300] = -1.0  # two values of the largest magnitude: the first is kept
    x[2, 256:] = 1e-30
    x[3] = np.float32(3e38) * np.sign(np.random.default_rng(0).standard_normal(512)).astype(np.float32)
    assert np.array_equal(kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x)).numpy(), A.quantize(A.ACT_Q8_K, x))


def worst_error(kernels: D.DotKernels, name: str) -> float:
    """The largest |ours - float64| / sum |w||x| over every case of this format."""
    worst = 0.0
    for n in (256, 1024):
        for T in (1, 3, 8):
            w, x = case(name, T, n, seed=T + n)
            xq = kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x))
            y = kernels.dot(BY_NAME[name].id, A.ACT_Q8_K, torch.from_numpy(w), xq, n).numpy()
            exact, scale = reference(name, w, xq.numpy(), n)
            assert y.shape == (T, len(w)) and np.isfinite(y).all()
            worst = max(worst, float((np.abs(y - exact) / np.maximum(scale, 1e-30)).max()))
    return worst


@pytest.mark.parametrize("name", NAMES)
def test_dot_is_the_float64_reference_within_float32_rounding(kernels, name):
    worst = worst_error(kernels, name)
    print(f"{name}: max |ours - float64| / sum|w||x| = {worst:.2e}")
    assert worst <= BOUND, (name, worst)


def together_and_apart(kernels, name: str, w: np.ndarray, x: np.ndarray, n: int):
    """The T tokens of x dotted in one call and one at a time -> (together, apart [T, rows], their Q8_K bytes)."""
    fmt, wt = BY_NAME[name], torch.from_numpy(w)
    xq = kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x))
    together = kernels.dot(fmt.id, A.ACT_Q8_K, wt, xq, n).numpy()
    apart = np.stack([kernels.dot(fmt.id, A.ACT_Q8_K, wt, xq[t:t + 1].contiguous(), n).numpy()[0] for t in range(len(x))])
    return together, apart, xq.numpy()


@pytest.mark.parametrize("name", NAMES)
def test_eight_tokens_at_once_equal_eight_single_calls(kernels, name):
    n = 1024
    w, x = case(name, 8, n, seed=7)
    together, apart, xq = together_and_apart(kernels, name, w, x, n)
    _, scale = reference(name, w, xq, n)
    assert np.all(np.abs(together - apart) <= BOUND * scale), name


# (T, n, rows, seed): T = 11 takes the AVX-512 VNNI tiles (from 4 or 8 tokens) as a pass of 8 and one of 3, 37 rows
# as two tiles and 5; T = 65 the AVX2 tiles (from 12 to 64 tokens by format) as a pass of 64 and one token, 21 rows
TILE_CASES = {"avx512": (11, 768, 37, 17), "avx2": (65, 512, 21, 23)}


@pytest.mark.parametrize("tiles", sorted(TILE_CASES))
@pytest.mark.parametrize("name", NAMES)
def test_row_tiles_with_tails(kernels, name, tiles):
    """The 16-row tiles and their tails: within the bound of the float64 reference, and of one token at a time
    (the row loop)."""
    T, n, rows, seed = TILE_CASES[tiles]
    w, x = case(name, T, n, seed=seed, rows=rows)
    together, apart, xq = together_and_apart(kernels, name, w, x, n)
    exact, scale = reference(name, w, xq, n)
    assert np.all(np.abs(together - exact) <= BOUND * scale), (name, tiles)
    assert np.all(np.abs(together - apart) <= BOUND * scale), (name, tiles)


def streams_mismatch(kernels, name: str, exact: bool = True, n: int = 512) -> list[int]:
    """One token over the first `rows` rows of 70 in one call against each row dotted alone -> the row counts
    whose values differ in any bit (exact), or beyond float32 rounding (BOUND). One token reads a call's rows as
    four interleaved streams (cpu_dotk.c four_streams), each row's blocks in order into its own sum: with
    intrinsics the same bits; the portable loop, which the compiler may reassociate, within rounding. 1, 3, 5,
    17, 56 and 70 rows leave the quarters empty, uneven or even."""
    w, x = case(name, 1, n, seed=21, rows=70)
    fmt, xq = BY_NAME[name], kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x))
    alone = np.concatenate([kernels.dot(fmt.id, A.ACT_Q8_K, torch.from_numpy(w[r:r + 1]), xq, n).numpy()[0] for r in range(70)])
    scale = reference(name, w, xq.numpy(), n)[1][0]
    wrong = []
    for rows in (1, 3, 5, 17, 56, 70):
        got = kernels.dot(fmt.id, A.ACT_Q8_K, torch.from_numpy(w[:rows]), xq, n).numpy()[0]
        if not (np.array_equal(got, alone[:rows]) if exact else np.all(np.abs(got - alone[:rows]) <= BOUND * scale[:rows])):
            wrong.append(rows)
    return wrong


@pytest.mark.parametrize("name", NAMES)
def test_one_token_rows_read_as_streams_equal_each_row_alone(kernels, name):
    assert streams_mismatch(kernels, name) == [], name


def test_many_tokens_cross_the_activation_tile(kernels):
    """T = 70: more activation rows than one tile (64) of the C loop."""
    n, fmt = 512, BY_NAME["Q4_K"]
    w, x = case("Q4_K", 70, n, seed=3, rows=5)
    xq = kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x))
    y = kernels.dot(fmt.id, A.ACT_Q8_K, torch.from_numpy(w), xq, n).numpy()
    exact, scale = reference("Q4_K", w, xq.numpy(), n)
    assert np.all(np.abs(y - exact) <= BOUND * scale)


@pytest.mark.parametrize("name", ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ4_XS"))
def test_one_token_on_rows_longer_than_the_stack_copy(kernels, name):
    """T = 1, 65 blocks a row: the AVX-512 gemvs with activations in an order of their own (Q2_K..Q5_K, the IQ formats)
    copy them to the heap past 64 blocks."""
    n, fmt = 65 * 256, BY_NAME[name]
    w, x = case(name, 1, n, seed=11, rows=3)
    xq = kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x))
    y = kernels.dot(fmt.id, A.ACT_Q8_K, torch.from_numpy(w), xq, n).numpy()
    exact, scale = reference(name, w, xq.numpy(), n)
    assert np.all(np.abs(y - exact) <= BOUND * scale)


def test_bad_inputs_raise_value_error(kernels):
    n, q4k = 512, BY_NAME["Q4_K"]
    w = torch.from_numpy(random_rows(q4k, 4, n, np.random.default_rng(0)))
    xq = kernels.quantize(A.ACT_Q8_K, torch.randn(2, n))
    bad = [
        lambda: kernels.quantize(A.ACT_Q8_K, torch.randn(2, 300)),  # not whole 256-value blocks
        lambda: kernels.quantize(A.ACT_Q8_K, torch.randn(2, n, dtype=torch.float64)),
        lambda: kernels.quantize(A.ACT_Q8_K, torch.randn(n)),
        lambda: kernels.dot(q4k.id, A.ACT_Q8_0, w, xq, n),  # not Q4_K's activation format
        lambda: kernels.dot(q4k.id, A.ACT_Q8_K, w, xq, 256),  # rows hold 512 values
        lambda: kernels.dot(q4k.id, A.ACT_Q8_K, w[:, :100].contiguous(), xq, n),
        lambda: kernels.dot(q4k.id, A.ACT_Q8_K, w.float(), xq, n),
        lambda: kernels.dot(q4k.id, A.ACT_Q8_K, w, xq[:, :-1].contiguous(), n),
        lambda: kernels.dot(q4k.id, A.ACT_Q8_K, w, xq.view(torch.int8), n),
        lambda: kernels.dot(99, A.ACT_Q8_K, w, xq, n),  # no such format
    ]
    for call in bad:
        with pytest.raises(ValueError):
            call()


def test_act_type_names_q8_k_for_this_family_only(kernels):
    family = next(f for f in kernels.families if f.name == "dotk")
    assert all(family.act_type(BY_NAME[name].id, float_acts) == A.ACT_Q8_K for name in NAMES for float_acts in (0, 1))
    held = {BY_NAME[name].id for name in ("IQ3_XXS_T", "IQ3_S_T")}  # and the IQ3 formats as moetier holds them
    assert family.types == frozenset(BY_NAME[name].id for name in NAMES) | held


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as info:
            return next((set(line.split(":", 1)[1].split()) for line in info if line.startswith("flags")), set())
    except OSError:
        return set()


def build(tmp_path: Path, *arch: str) -> D.DotKernels:
    out = tmp_path / "cpu_dotk-other.so"
    done = subprocess.run([os.environ.get("CC", "cc"), *FAST_FLAGS, *arch, str(SOURCE), "-o", str(out), "-lm"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return with_tables(ctypes.CDLL(str(out)), out)


# the other paths of the same file this host can run: AVX2 + FMA (Zen 3's), none (the portable one), AVX-512 without VNNI
OTHER_PATHS = {"avx2": (("-march=x86-64-v3",), {"avx2", "fma", "f16c", "bmi2"}), "scalar": (("-march=x86-64",), set()),
               "avx512-no-vnni": (("-march=native", "-mno-avx512vnni"), {"avx512vbmi", "avx512bw", "avx512vl"})}


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the x86 builds of the same file")
@pytest.mark.parametrize("path", sorted(OTHER_PATHS))
def test_other_paths_of_the_same_file(kernels, tmp_path, path):
    arch, needs = OTHER_PATHS[path]
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_flags())}")
    other = build(tmp_path, *arch)
    for T in (1, 5, 65):  # 65: the AVX2 tiles
        x = activations(T, 1024, seed=5)
        xq = other.quantize(A.ACT_Q8_K, torch.from_numpy(x))
        assert np.array_equal(xq.numpy(), A.quantize(A.ACT_Q8_K, x)), path
        for name in NAMES:
            w, _ = case(name, T, 1024, seed=11)
            y = other.dot(BY_NAME[name].id, A.ACT_Q8_K, torch.from_numpy(w), xq, 1024).numpy()
            exact, scale = reference(name, w, xq.numpy(), 1024)
            assert np.all(np.abs(y - exact) <= BOUND * scale), (path, name, T)
    for name in NAMES:
        assert streams_mismatch(other, name, exact=path != "scalar") == [], (path, name)


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.POINTER(ctypes.c_float), ctypes.c_size_t, ctypes.c_void_p,
                           ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


@pytest.mark.peer
def test_dot_equals_llama_cpp_s_vec_dot(kernels):
    import llama_cpp

    cpu = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_cpu_init()  # its float16 table: vec_dot reads scales through it (from_float does not)
    for name in NAMES:
        fmt, worst = BY_NAME[name], 0.0
        traits = cpu.ggml_get_type_traits_cpu(fmt.id).contents
        assert traits.vec_dot_type == A.ACT_Q8_K, name
        vec_dot = VEC_DOT(traits.vec_dot)
        for n in (256, 1024):
            for T in (1, 3, 8):
                w, x = case(name, T, n, seed=T + n + 1)
                xq = kernels.quantize(A.ACT_Q8_K, torch.from_numpy(x))
                ours = kernels.dot(fmt.id, A.ACT_Q8_K, torch.from_numpy(w), xq, n).numpy()
                theirs, out = np.zeros_like(ours), ctypes.c_float()
                xq_np = xq.numpy()
                for t in range(T):
                    for r in range(len(w)):
                        vec_dot(n, ctypes.byref(out), 0, w[r].ctypes.data, 0, xq_np[t].ctypes.data, 0, 1)
                        theirs[t, r] = out.value
                _, scale = reference(name, w, xq_np, n)
                worst = max(worst, float((np.abs(ours - theirs) / np.maximum(scale, 1e-30)).max()))
        print(f"{name}: max |ours - llama.cpp| / sum|w||x| = {worst:.2e}")
        assert worst <= PEER_BOUND, (name, worst)
