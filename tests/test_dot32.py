"""The dot32 family (moetier/backends/cpu_dot32.c): F32, F16, BF16 and the 32-value block formats.

Fast: activation bytes equal moetier.backends.activations (the numpy judge); every format's dot products
within 1e-5 of the float64 reference (gguf's dequantized weights times the dequantized activations) relative
to the row's sum of |w| |x|; T tokens at once are T calls of one (block formats bit for bit below the 16-row
tiles, within that bound from them); the AVX2 (with
and without AVX-VNNI) and scalar builds of the same file within the same bound where this machine builds
them; bad input one ValueError. Peer (marker `peer`): equal to llama.cpp's own vec_dot (libggml-cpu) within 2e-6 of the
same scale. `python tests/test_dot32.py` prints the largest relative errors seen per format.
"""

from __future__ import annotations

import ctypes
import os
import re

import gguf.quants
import numpy as np
import pytest
import torch
from quant_blocks import random_float_rows, random_rows

from moetier.backends import activations as A
from moetier.backends import cpu_streams
from moetier.backends import dot_kernels as D
from moetier.model.formats import BY_NAME, Format
from moetier.native import FAST_FLAGS, library

kernels = D.dot_kernels()
WIDE_FROM = 8  # cpu_dot32.c's: from this many tokens the block formats take the 16-row tiles (its AVX-512 path)


def _dot32_path() -> int:
    """dot32_path() of this machine's build: 2 AVX-512 (where the 16-row tiles are), 1 AVX2, 0 scalar, -1 none."""
    family = next((f for f in kernels.families if f.name == "dot32"), None) if kernels is not None else None
    if family is None:
        return -1
    family.lib.dot32_path.restype = ctypes.c_int64
    return family.lib.dot32_path()


WIDE_TILES = _dot32_path() == 2
pytestmark = pytest.mark.skipif(kernels is None or not any(f.name == "dot32" for f in kernels.families),
                                reason=f"dot32 family {D.status()}")
FAMILY = tuple(BY_NAME[name] for name in ("F32", "F16", "BF16", "Q4_0", "Q5_0", "Q8_0", "IQ4_NL", "MXFP4", "Q4_1", "Q5_1"))
SHAPES = [(T, n) for T in (1, 3, 8) for n in (256, 1024)] + [(5, 352)]  # 352: 11 blocks, an odd last pair
FORCED = {"avx512-no-gfni": ("-mno-gfni",), "avx2": ("-mno-avx512f", "-mno-avxvnni"), "avx2+vnni": ("-mno-avx512f",),
          "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx")}
FORCED_PATH = {"avx512-no-gfni": 2, "avx2": 1, "avx2+vnni": 1, "scalar": 0}  # dot32_path(): 2 AVX-512, 1 AVX2, 0 scalar


def acts_of(fmt: Format) -> tuple[int, ...]:
    return tuple(sorted({A.act_type(fmt.id), A.act_type(fmt.id, float_acts=True)}))


def weights(fmt: Format, rows: int, n: int, rng: np.random.Generator) -> torch.Tensor:
    if fmt.dtype is not None:
        return random_float_rows(fmt, rows, n, rng)
    return torch.from_numpy(random_rows(fmt, rows, n, rng))


def tokens(T: int, n: int, rng: np.random.Generator) -> np.ndarray:
    x = (rng.standard_normal((T, n)) * rng.uniform(0.1, 10, (T, 1))).astype(np.float32)
    x[0, :32] = 0  # a zero block
    return x


def reference(fmt: Format, w: torch.Tensor, act: int, xq: torch.Tensor, n: int, with_s: bool = True):
    """-> float64 [T, rows] dequantized weights times dequantized activations, and the scale sum |w| |x|.

    Q4_1 / Q5_1 (with_s): a block's m_w times Q8_1's stored s, as llama.cpp's q4_1_q8_1 takes it, not times
    d_x * sum(q_x): s is float16, and its rounding (up to 2**-11 of it) alone would be ~1.7e-5 of the scale."""
    raw = w.contiguous().view(torch.uint8).numpy()
    wf = gguf.quants.dequantize(raw, fmt.id).astype(np.float64)  # [rows, n]
    xf = A.dequantize(act, xq.numpy(), n).astype(np.float64)  # [T, n]
    dot = xf @ wf.T  # [T, rows]
    if act == A.ACT_Q8_1 and with_s:
        blocks = xq.numpy().reshape(-1).view(A.Q8_1_BLOCK).reshape(len(xf), -1)  # [T, n / 32]
        drift = blocks["s"].astype(np.float64) - blocks["d"].astype(np.float64) * blocks["qs"].sum(axis=-1)
        m = raw.reshape(len(wf), -1, fmt.block_bytes)[:, :, 2:4].copy().view(np.float16)[..., 0]  # [rows, n / 32]
        dot += drift @ m.astype(np.float64).T
    return dot, np.abs(xf) @ np.abs(wf).T


def worst_error(fmt: Format, family=None, shapes=SHAPES, rows: int = 13, seed: int = 0, with_s: bool = True) -> float:
    """The largest |dot - reference| / (sum |w| |x|) over shapes and activation formats."""
    family = family or kernels
    rng, worst = np.random.default_rng(seed + fmt.id), 0.0
    for T, n in shapes:
        n = n if fmt.block > 1 else n + 7  # float rows of any length: the vector tails
        w = weights(fmt, rows, n, rng)
        x = tokens(T, n, rng)
        for act in acts_of(fmt):
            xq = torch.from_numpy(A.quantize(act, x))
            got = family.dot(fmt.id, act, w, xq, n).numpy().astype(np.float64)  # [T, rows]
            want, scale = reference(fmt, w, act, xq, n, with_s)
            assert np.isfinite(got).all(), (fmt.name, act, T, n)
            worst = max(worst, float((np.abs(got - want) / scale).max()))
    return worst


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # the reference's, on the 7e4 row
@pytest.mark.parametrize("act", (A.ACT_F32, A.ACT_F16, A.ACT_BF16, A.ACT_Q8_0, A.ACT_Q8_1))
def test_quantize_writes_the_reference_bytes(act):
    rng = np.random.default_rng(act)
    x = tokens(8, 1024, rng) * 3
    x[1, 7] = -2 * np.abs(x[1]).max()  # the largest magnitude negative
    x[2, :32] = np.arange(32, dtype=np.float32) - 15.5  # ties at every step of the multiplier
    x[3, 40:72] = 1e-6  # tiny scales: subnormal float16 d
    x[4, 100:132] = 7e4  # past float16's largest: inf in F16 (and in a Q8 d only beyond 127 * 65504)
    for T, n in SHAPES:
        rows = x[:T, :n] if n <= 1024 else tokens(T, n, rng)
        got = kernels.quantize(act, torch.from_numpy(np.ascontiguousarray(rows)))
        assert np.array_equal(got.numpy(), A.quantize(act, rows)), (act, T, n)


@pytest.mark.parametrize("fmt", FAMILY, ids=lambda f: f.name)
def test_dot_is_the_float64_reference_within_float32_rounding(fmt):
    assert kernels.act_type(fmt.id) == A.act_type(fmt.id) and kernels.act_type(fmt.id, True) == A.act_type(fmt.id, True)
    assert worst_error(fmt) <= 1e-5, fmt.name


def assert_same_tokens(fmt: Format, together: torch.Tensor, alone: torch.Tensor, scale: np.ndarray):
    """Block formats below WIDE_FROM tokens: bit for bit. From it, AVX-512 takes the 16-row tiles, which add the
    blocks' terms in another order; float formats sum in four accumulators at T = 1 and one per (row, token) in the
    T > 1 tiles (cpu_dot32.c): within the reference's bound."""
    if fmt.dtype is None and (together.shape[0] < WIDE_FROM or not WIDE_TILES):
        assert torch.equal(together, alone), fmt.name
    else:
        assert (np.abs(together.numpy() - alone.numpy()) / scale).max() <= 1e-5, fmt.name


@pytest.mark.parametrize("fmt", FAMILY, ids=lambda f: f.name)
def test_tokens_at_once_are_one_at_a_time(fmt):
    rng = np.random.default_rng(fmt.id)
    n = 1024 if fmt.block > 1 else 1000
    w, x = weights(fmt, 9, n, rng), tokens(8, n, rng)
    for act in acts_of(fmt):
        xq = torch.from_numpy(A.quantize(act, x))
        together = kernels.dot(fmt.id, act, w, xq, n)  # [8, 9]
        alone = torch.cat([kernels.dot(fmt.id, act, w, xq[t:t + 1], n) for t in range(8)])
        assert_same_tokens(fmt, together, alone, reference(fmt, w, act, xq, n)[1])
        rows = torch.cat([kernels.dot(fmt.id, act, w[r:r + 1], xq, n) for r in range(9)], dim=1)
        assert torch.equal(together, rows), (fmt.name, act)  # a row's sum never depends on the rows beside it


def one_token_rows_apart(family, fmt: Format) -> list[int]:
    """One token over the first `rows` of 70 rows in one call against each row alone -> the row counts whose
    values differ in any bit. Q8_0 and the float formats at one token read a call's rows as four streams
    (cpu_dot32.c four_streams): 1, 3, 5, 17, 56 and 70 rows leave its quarters empty, uneven or even."""
    rng = np.random.default_rng(fmt.id + 70)
    n = 768
    w, x = weights(fmt, 70, n, rng), tokens(1, n, rng)
    wrong = []
    for act in acts_of(fmt):
        xq = torch.from_numpy(A.quantize(act, x))
        alone = torch.cat([family.dot(fmt.id, act, w[r:r + 1], xq, n) for r in range(70)], dim=1)
        wrong += [rows for rows in (1, 3, 5, 17, 56, 70) if not torch.equal(family.dot(fmt.id, act, w[:rows], xq, n), alone[:, :rows])]
    return wrong


@pytest.mark.parametrize("fmt", FAMILY, ids=lambda f: f.name)
def test_one_token_rows_are_each_row_alone(fmt):
    assert one_token_rows_apart(kernels, fmt) == [], fmt.name


@pytest.mark.parametrize("fmt", [f for f in FAMILY if f.dtype is not None], ids=lambda f: f.name)
def test_plain_and_prefetched_streams_give_the_same_bits(fmt):
    """The float formats at one token read their rows as four prefetched streams or eight plain ones
    (cpu_dot32.c eight_streams, chosen per host by speed): each row's value the same both ways, and each row
    alone; 1 to 70 rows leave the eighths empty, uneven or even. Where the build has no eight-stream path (not
    AVX-512) asking for it gives the prefetched one."""
    rng = np.random.default_rng(fmt.id + 80)
    n = 1000  # 31 steps of 32 values, then a masked 8
    w, x = weights(fmt, 70, n, rng), tokens(1, n, rng)
    before = kernels.set_plain_streams(False)
    assert before is False
    try:
        for act in acts_of(fmt):
            xq = torch.from_numpy(A.quantize(act, x))
            prefetched = kernels.dot(fmt.id, act, w, xq, n)
            assert kernels.set_plain_streams(True) is (_dot32_path() == 2)
            assert one_token_rows_apart(kernels, fmt) == [], fmt.name
            for rows in (1, 7, 8, 9, 15, 17, 63, 70):
                assert torch.equal(kernels.dot(fmt.id, act, w[:rows], xq, n), prefetched[:, :rows]), (fmt.name, act, rows)
            kernels.set_plain_streams(False)
    finally:
        kernels.set_plain_streams(cpu_streams.plain())  # the way this process chose


@pytest.mark.parametrize("fmt", [f for f in FAMILY if f.dtype is None], ids=lambda f: f.name)
def test_row_tiles_with_tails(fmt):
    """From WIDE_FROM tokens the block formats take 16-row tiles (AVX-512): 37 rows (two tiles and 5), 75 tokens
    (a chunk of 64, then a pass of 8 and a tail of 3), 7 blocks a row (three pairs and a lone block), and a 4-token
    call below them: within the float64 reference's bound, and of one token at a time (the row loop)."""
    rng = np.random.default_rng(fmt.id + 40)
    n = 7 * 32
    w = weights(fmt, 37, n, rng)
    for tokens_ in (75, 4):
        x = tokens(tokens_, n, rng)
        for act in acts_of(fmt):
            xq = torch.from_numpy(A.quantize(act, x))
            together = kernels.dot(fmt.id, act, w, xq, n)  # [T, 37]
            want, scale = reference(fmt, w, act, xq, n)
            assert (np.abs(together.numpy() - want) / scale).max() <= 1e-5, (fmt.name, act, tokens_)
            alone = torch.cat([kernels.dot(fmt.id, act, w, xq[t:t + 1], n) for t in range(tokens_)])
            assert_same_tokens(fmt, together, alone, scale)


@pytest.mark.parametrize("n", (231, 1024))
def test_float32_outer_products_with_tails(n):
    """F32 weights from OUTER_FROM (16) tokens take the outer-product tiles (AVX-512): 8 rows x 48 tokens, each
    (row, token) summed in k order. 37 rows (four tiles and 5 alone), token counts at and around the tile's 16-token
    vectors, n with a tail past 16: within the float64 reference's bound, the same as one token at a time within
    it, and each token's values the same whatever tokens share its call (the order depends on n only)."""
    fmt, rng = BY_NAME["F32"], np.random.default_rng(n)
    w = weights(fmt, 37, n, rng)
    x = tokens(75, n, rng)
    xq = torch.from_numpy(A.quantize(A.ACT_F32, x))
    first = None
    for T in (16, 17, 33, 48, 75):
        together = kernels.dot(fmt.id, A.ACT_F32, w, xq[:T], n)  # [T, 37]
        want, scale = reference(fmt, w, A.ACT_F32, xq[:T], n)
        assert (np.abs(together.numpy() - want) / scale).max() <= 1e-5, T
        first = together[:16] if first is None else first
        assert torch.equal(together[:16], first), T
    alone = torch.cat([kernels.dot(fmt.id, A.ACT_F32, w, xq[t:t + 1], n) for t in range(75)])
    assert_same_tokens(fmt, together, alone, scale)


@pytest.mark.parametrize("name", ("Q4_0", "Q4_1", "Q8_0", "F16", "BF16"))
def test_scratch_beyond_the_stack_buffer(name):
    """T x n whose unpacked activations outgrow the kernel's 32 KB stack buffer (malloc'd scratch): one token at a
    time's result, and the reference's bound."""
    fmt, rng = BY_NAME[name], np.random.default_rng(7)
    w, x = weights(fmt, 6, 4096, rng), tokens(9, 4096, rng)
    act = A.act_type(fmt.id)
    xq = torch.from_numpy(A.quantize(act, x))
    together = kernels.dot(fmt.id, act, w, xq, 4096)  # [9, 6]
    want, scale = reference(fmt, w, act, xq, 4096)
    assert_same_tokens(fmt, together, torch.cat([kernels.dot(fmt.id, act, w, xq[t:t + 1], 4096) for t in range(9)]), scale)
    assert (np.abs(together.numpy() - want) / scale).max() <= 1e-5


def test_iq4_nl_and_mxfp4_kvalues_are_gguf_s():
    source = (D.HERE / "cpu_dot32.c").read_text()
    for name, cls in (("KVALUES", gguf.quants.IQ4_NL), ("KVALUES_MXFP4", gguf.quants.MXFP4)):
        table = re.search(rf"{name}\[16\] = \{{([^}}]*)\}}", source).group(1)
        assert tuple(int(v) for v in table.split(",")) == tuple(cls.kvalues), name


@pytest.mark.parametrize("path", FORCED)
def test_every_simd_path_keeps_the_bound(path):
    """The same file built as for AVX-512 without GFNI, an AVX2-only machine (Zen 3: no AVX-VNNI), AVX-VNNI, and no
    SIMD at all (skipped where this machine or compiler cannot build or run one)."""
    lib, where, why = library(D.HERE / "cpu_dot32.c", FAST_FLAGS + FORCED[path])
    if lib is None:
        pytest.skip(f"{path} build: {why}")
    family = D.DotKernels([D._Family("dot32", lib, where)])
    lib.dot32_path.restype = ctypes.c_int64
    if lib.dot32_path() != FORCED_PATH[path]:
        pytest.skip(f"{path} build: this machine's -march=native lacks it (path {lib.dot32_path()})")
    for fmt in FAMILY:
        assert worst_error(fmt, family, shapes=[(1, 256), (5, 352), (9, 224)], rows=6) <= 1e-5, (path, fmt.name)
    if path != "scalar":  # the portable loop may be reassociated by the compiler
        for name in ("Q8_0", "F32", "BF16"):
            assert one_token_rows_apart(family, BY_NAME[name]) == [], (path, name)
    # the float16 conversions without F16C (scalar): subnormal halves, ties, overflow to inf, every exponent
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 1024)) * 10.0 ** rng.uniform(-9, 5.5, (4, 1024))).astype(np.float32)
    x[0, :64] = (np.arange(64, dtype=np.float32) + 0.5) * np.float32(2.0 ** -24)  # halfway between subnormal halves
    x[1, :8] = [65504, 65519.99, 65520, -65520, 6.1035156e-05, 6.1035152e-05, 2.0 ** -25, -(2.0 ** -26)]
    with np.errstate(over="ignore"):
        for act in (A.ACT_F16, A.ACT_BF16, A.ACT_Q8_0, A.ACT_Q8_1):
            got = family.quantize(act, torch.from_numpy(x)).numpy()
            assert np.array_equal(got, A.quantize(act, x)), (path, act)


def test_bad_inputs_are_one_value_error():
    rng = np.random.default_rng(0)
    q4 = weights(BY_NAME["Q4_0"], 4, 256, rng)
    x = torch.from_numpy(tokens(2, 256, rng))
    xq = kernels.quantize(A.ACT_Q8_0, x)
    with pytest.raises(ValueError, match="activations of format"):
        kernels.dot(BY_NAME["Q4_0"].id, A.ACT_Q8_1, q4, kernels.quantize(A.ACT_Q8_1, x), 256)
    with pytest.raises(ValueError, match="hold 224 values"):
        kernels.dot(BY_NAME["Q4_0"].id, A.ACT_Q8_0, q4[:, :-18].contiguous(), xq, 256)
    with pytest.raises(ValueError, match="activations must be"):
        kernels.dot(BY_NAME["Q4_0"].id, A.ACT_Q8_0, q4, xq[:, :-34].contiguous(), 256)
    with pytest.raises(ValueError, match="weights must be"):
        kernels.dot(BY_NAME["F16"].id, A.ACT_F16, q4, xq, 256)
    with pytest.raises(ValueError, match="not whole 32-value blocks"):
        kernels.quantize(A.ACT_Q8_0, x[:, :100])
    with pytest.raises(ValueError, match="no native family"):
        kernels.quantize(77, x)


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


def llama_vec_dot():
    """type -> llama.cpp's vec_dot(n, s, bs, vx, bx, vy, by, nrc) from its CPU backend"""
    import llama_cpp

    cpu = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_cpu_init()  # fills the float16 table its scalar conversions read: without it every d reads as 0
    signature = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                                 ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    return lambda wtype: signature(cpu.ggml_get_type_traits_cpu(wtype).contents.vec_dot)


def worst_peer_error(fmt: Format, vec_dot, rows: int = 16) -> float:
    rng, worst = np.random.default_rng(100 + fmt.id), 0.0
    theirs_fn = vec_dot(fmt.id)
    for T, n in ((3, 256), (2, 1024), (2, 352)):
        w, x = weights(fmt, rows, n, rng), tokens(T, n, rng)
        act = A.act_type(fmt.id)
        xq = torch.from_numpy(A.quantize(act, x))
        ours = kernels.dot(fmt.id, act, w, xq, n).numpy().astype(np.float64)  # [T, rows]
        theirs = np.zeros((T, rows), np.float32)
        out = ctypes.c_float()
        for t in range(T):
            for r in range(rows):
                theirs_fn(n, ctypes.addressof(out), 0, w[r].data_ptr(), 0, xq[t].data_ptr(), 0, 1)
                theirs[t, r] = out.value
        _, scale = reference(fmt, w, act, xq, n)
        worst = max(worst, float((np.abs(ours - theirs) / scale).max()))
    return worst


@pytest.mark.peer
@pytest.mark.parametrize("fmt", FAMILY, ids=lambda f: f.name)
def test_dot_is_llama_cpp_s_vec_dot(fmt):
    assert worst_peer_error(fmt, llama_vec_dot()) <= 2e-6, fmt.name


if __name__ == "__main__":
    try:
        peer = llama_vec_dot()
    except (ImportError, OSError):
        peer = None
    print(f"{'format':8} {'vs float64':>12} {'(s as d*sum q)':>15} {'vs llama.cpp':>14}")
    for fmt in FAMILY:
        theirs = f"{worst_peer_error(fmt, peer):14.2e}" if peer else f"{'-':>14}"
        plain = f"{worst_error(fmt, with_s=False):15.2e}" if A.act_type(fmt.id) == A.ACT_Q8_1 else f"{'':15}"
        print(f"{fmt.name:8} {worst_error(fmt):12.2e} {plain} {theirs}")
