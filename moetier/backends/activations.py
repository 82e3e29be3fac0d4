"""Activations in the formats llama.cpp's dot products take them in: the numpy reference of each conversion.

llama.cpp multiplies a quantized weight matrix by converting each row of
activations, once, to the format the weight type's dot product reads (its
`vec_dot_type`: Q8_K for the K-quants and IQ formats, Q8_0 for Q4_0 / Q5_0 /
Q8_0 / IQ4_NL / MXFP4, Q8_1 for Q4_1 / Q5_1, F16 for F16, BF16 for BF16, F32 for
F32), then summing each block's integer dot product scaled in float32.
moetier's native kernels do the same (moetier/backends/cpu_dot.h); this
module is their judge: `quantize(act_type, x)` gives the bytes llama.cpp's
CPU backend writes on x86 (Q8_0 and Q8_1 as its AVX2 path computes them:
d = max|x| / 127, multiplier 127 / max|x|, round half to even; Q8_K as its
reference code: multiplier -127 / (the value of largest magnitude), round
half up by the float trick, clamped to 127, and d = 1 / multiplier; F16 by
IEEE round to nearest even; BF16 by ggml_compute_fp32_to_bf16), and
`dequantize(act_type, xq, n)` the float32 values those bytes stand for.
The float32 reference of a quantized dot product is then the dequantized
weight row times the dequantized activation row.
"""

from __future__ import annotations

import numpy as np

ACT_F32, ACT_F16, ACT_Q8_0, ACT_Q8_1, ACT_Q8_K, ACT_BF16 = 0, 1, 8, 9, 15, 30
# the activation format of each weight format's dot product (llama.cpp's type_traits_cpu[..].vec_dot_type)
ACT_TYPE = {0: ACT_F32, 1: ACT_F16, 30: ACT_BF16, 2: ACT_Q8_0, 6: ACT_Q8_0, 8: ACT_Q8_0, 20: ACT_Q8_0, 39: ACT_Q8_0, 3: ACT_Q8_1,
            7: ACT_Q8_1, 10: ACT_Q8_K, 11: ACT_Q8_K, 12: ACT_Q8_K, 13: ACT_Q8_K, 14: ACT_Q8_K, 16: ACT_Q8_K, 17: ACT_Q8_K,
            18: ACT_Q8_K, 19: ACT_Q8_K, 21: ACT_Q8_K, 22: ACT_Q8_K, 23: ACT_Q8_K, 29: ACT_Q8_K, 118: ACT_Q8_K,
            121: ACT_Q8_K}  # 118, 121: IQ3_XXS_T, IQ3_S_T (formats.py)
Q8_K_BLOCK = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])  # 292 bytes
Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", 32)])  # 34 bytes
Q8_1_BLOCK = np.dtype([("d", "<f2"), ("s", "<f2"), ("qs", "i1", 32)])  # 36 bytes


def act_type(weight_type: int, float_acts: bool = False) -> int:
    """The activation format weight_type's dot product reads (F32 for F16 / BF16 weights when float_acts)."""
    if float_acts and weight_type in (1, 30):
        return ACT_F32
    return ACT_TYPE[int(weight_type)]


def row_bytes(act: int, n: int) -> int:
    return {ACT_F32: 4 * n, ACT_F16: 2 * n, ACT_BF16: 2 * n, ACT_Q8_0: n // 32 * 34, ACT_Q8_1: n // 32 * 36,
            ACT_Q8_K: n // 256 * 292}[act]


def quantize(act: int, x: np.ndarray) -> np.ndarray:
    """x [..., n] float32 -> uint8 [..., row_bytes(act, n)]: each row as llama.cpp's CPU backend converts it."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    lead, n = x.shape[:-1], x.shape[-1]
    if act == ACT_F32:
        out = x.view(np.uint8)
    elif act == ACT_F16:
        out = x.astype(np.float16).view(np.uint8)
    elif act == ACT_BF16:
        out = _bf16_bits(x).view(np.uint8)
    elif act in (ACT_Q8_0, ACT_Q8_1):
        out = _q8_32(x.reshape(-1, 32), act).view(np.uint8)
    elif act == ACT_Q8_K:
        out = _q8_k(x.reshape(-1, 256)).view(np.uint8)
    else:
        raise ValueError(f"activation format {act} is not one llama.cpp's dot products take (expected 0, 1, 8, 9, 15 or 30)")
    return out.reshape(*lead, row_bytes(act, n))


def dequantize(act: int, xq: np.ndarray, n: int) -> np.ndarray:
    """uint8 [..., row_bytes(act, n)] -> float32 [..., n]: the values the activation bytes stand for."""
    xq = np.ascontiguousarray(xq, dtype=np.uint8)
    lead = xq.shape[:-1]
    if act == ACT_F32:
        values = xq.view(np.float32)
    elif act == ACT_F16:
        values = xq.view(np.float16).astype(np.float32)
    elif act == ACT_BF16:
        values = (xq.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif act in (ACT_Q8_0, ACT_Q8_1):
        blocks = xq.reshape(-1).view(Q8_0_BLOCK if act == ACT_Q8_0 else Q8_1_BLOCK)
        values = blocks["d"].astype(np.float32)[:, None] * blocks["qs"].astype(np.float32)
    elif act == ACT_Q8_K:
        blocks = xq.reshape(-1).view(Q8_K_BLOCK)
        values = blocks["d"][:, None] * blocks["qs"].astype(np.float32)
    else:
        raise ValueError(f"activation format {act} is not one llama.cpp's dot products take")
    return values.reshape(*lead, n)


def _bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml_compute_fp32_to_bf16: round to nearest even; NaN kept quiet."""
    u = x.view(np.uint32).astype(np.uint64)
    rounded = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), rounded)


def _q8_32(blocks: np.ndarray, act: int) -> np.ndarray:
    """Q8_0 / Q8_1 blocks of 32 as llama.cpp's x86 AVX2 quantize_row_q8_0 / q8_1 computes them."""
    amax = np.abs(blocks).max(axis=1)  # [B]
    d = amax / np.float32(127.0)
    with np.errstate(divide="ignore"):
        scale = np.where(amax != 0, np.float32(127.0) / amax, np.float32(0.0)).astype(np.float32)
    q = np.rint(blocks * scale[:, None]).astype(np.int32)  # round half to even (_MM_ROUND_NEAREST)
    out = np.zeros(len(blocks), Q8_0_BLOCK if act == ACT_Q8_0 else Q8_1_BLOCK)
    out["d"] = d.astype(np.float16)
    out["qs"] = q.astype(np.int8)
    if act == ACT_Q8_1:
        out["s"] = (d * q.sum(axis=1).astype(np.float32)).astype(np.float16)
    return out


def _q8_k(blocks: np.ndarray) -> np.ndarray:
    """Q8_K blocks of 256 as llama.cpp's quantize_row_q8_K_ref (what its x86 CPU backend calls)."""
    out = np.zeros(len(blocks), Q8_K_BLOCK)
    at = np.abs(blocks).argmax(axis=1)  # the first of the largest magnitudes, as its strict > loop keeps
    top = blocks[np.arange(len(blocks)), at]
    live = top != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(live, np.float32(-127.0) / np.where(live, top, np.float32(1.0)), np.float32(0.0)).astype(np.float32)
    # nearest_int: add 1.5 * 2**23 in float32 and read the low mantissa bits (round half to even)
    shifted = (blocks * iscale[:, None] + np.float32(12582912.0)).astype(np.float32)
    q = (shifted.view(np.int32) & 0x007FFFFF) - 0x00400000
    q = np.minimum(127, q)
    q[~live] = 0
    out["qs"] = q.astype(np.int8)
    out["bsums"] = q.reshape(len(blocks), 16, 16).sum(axis=2).astype(np.int16)
    with np.errstate(divide="ignore"):
        out["d"] = np.where(live, np.float32(1.0) / np.where(live, iscale, np.float32(1.0)), np.float32(0.0))
    return out
