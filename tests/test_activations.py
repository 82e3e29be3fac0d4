"""The activation formats of llama.cpp's dot products (moetier.backends.activations), against llama.cpp itself.

Fast: round trips and the properties each format promises. Peer (marker
`peer`): the bytes equal what llama.cpp's own CPU backend writes on this
machine (ggml_get_type_traits_cpu(type)->from_float, from its libggml-cpu),
for rows with zero blocks, a negative largest value and ties.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import pytest

from moetier.backends import activations as A
from moetier.model.formats import BY_NAME

FILE_FORMAT_OF = {BY_NAME[f"{name}_T"].id: BY_NAME[name].id for name in ("IQ3_XXS", "IQ3_S")}  # moetier's resident layouts

ACTS = (A.ACT_F32, A.ACT_F16, A.ACT_BF16, A.ACT_Q8_0, A.ACT_Q8_1, A.ACT_Q8_K)


def rows(seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((16, 1024)) * rng.uniform(0.01, 10, (16, 1))).astype(np.float32)
    x[3, :256] = 0  # a zero block
    x[5, 7] = -2 * np.abs(x[5]).max()  # the largest magnitude negative
    x[6, :32] = np.arange(32, dtype=np.float32) - 15.5  # halves: ties at every multiplier step
    return x


@pytest.mark.parametrize("act", ACTS)
def test_round_trip_is_within_the_format_s_step(act):
    x = rows()
    xq = A.quantize(act, x)
    assert xq.shape == (16, A.row_bytes(act, 1024)) and xq.dtype == np.uint8
    back = A.dequantize(act, xq, 1024)
    block = {A.ACT_Q8_0: 32, A.ACT_Q8_1: 32, A.ACT_Q8_K: 256}.get(act, 1)
    amax = np.abs(x.reshape(16, -1, block)).max(axis=2, keepdims=True)
    # half a step of the format; Q8_0 / Q8_1 keep their scale in float16, off by up to 2**-11 of it at 127 steps
    step = {A.ACT_F32: 0.0, A.ACT_F16: 2.0 ** -11, A.ACT_BF16: 2.0 ** -8, A.ACT_Q8_K: 0.5 / 127}.get(act, 0.5 / 127 + 2.0 ** -11)
    err = np.abs(back - x).reshape(16, -1, block)
    bound = step * (amax if block > 1 else np.abs(x.reshape(16, -1, 1))) * 1.001 + 1e-30
    assert (err <= bound).all(), act
    assert np.all(back[3, :256] == 0)


def test_q8_k_block_sums_and_scale():
    x = rows()
    blocks = A.quantize(A.ACT_Q8_K, x).reshape(-1).view(A.Q8_K_BLOCK)
    assert np.array_equal(blocks["bsums"], blocks["qs"].astype(np.int32).reshape(-1, 16, 16).sum(axis=2))
    assert blocks["qs"].max() <= 127 and blocks["qs"].min() >= -127


def test_every_stored_format_has_its_activation_format():
    from moetier.model.formats import FORMATS

    assert set(A.ACT_TYPE) == set(FORMATS)
    assert A.act_type(30, float_acts=True) == A.ACT_F32 and A.act_type(30) == A.ACT_BF16


class _Traits(ctypes.Structure):  # ggml-cpu.h: struct ggml_type_traits_cpu
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


@pytest.mark.peer
def test_bytes_equal_llama_cpp_s_cpu_backend():
    import llama_cpp

    cpu = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-cpu.so"))
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_Traits)
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    convert = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
    for seed in range(4):
        x = rows(seed)
        for act in (A.ACT_F16, A.ACT_BF16, A.ACT_Q8_0, A.ACT_Q8_1, A.ACT_Q8_K):
            from_float = convert(cpu.ggml_get_type_traits_cpu(act).contents.from_float)
            theirs = np.zeros((16, A.row_bytes(act, 1024)), np.uint8)
            for r in range(16):
                from_float(x[r].ctypes.data, theirs[r].ctypes.data, 1024)
            assert np.array_equal(A.quantize(act, x), theirs), (seed, act)
    for weight_type, act in A.ACT_TYPE.items():  # GGML's types; moetier's IQ3_*_T dot as their file formats
        ggml_type = FILE_FORMAT_OF.get(weight_type, weight_type)
        assert cpu.ggml_get_type_traits_cpu(ggml_type).contents.vec_dot_type == act, weight_type
