"""Activations rounded as llama.cpp's dot products take them, with torch ops on the tensor's own device.

The torch path (CUDA, or a CPU without the native kernels) computes a stored
matrix by dequantizing it (moetier.backends.torch_dequant) and multiplying in
float32 (`stored_product`); `as_dot_input(x, act)` first replaces each row of x by the values of
its conversion to activation format `act` (Q8_K, Q8_0, Q8_1, F16, BF16: what
llama.cpp quantizes x to for that weight format, moetier.backends.activations
is the reference), so the torch path computes the same products as the
native integer kernels, up to float32 summation order. Bit for bit:
`as_dot_input(x, act)` equals activations.dequantize(act, activations.quantize(act, x))
(tests/test_torch_activations.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moetier.backends.activations import ACT_BF16, ACT_F16, ACT_F32, ACT_Q8_0, ACT_Q8_1, ACT_Q8_K, act_type
from moetier.backends.torch_dequant import dequantize
from moetier.model.formats import F32


def stored_product(x: torch.Tensor, data: torch.Tensor, qtype: int, float_acts: bool) -> torch.Tensor:
    """x [T, n] float32 times a stored matrix [rows, ...] of GGML type qtype, the torch path: the matrix dequantized
    on its device for this call, x converted as the format's dot product takes it -> [T, rows]."""
    if qtype == F32:  # float32 weights: the plain product
        return F.linear(x, data)
    return F.linear(as_dot_input(x, act_type(qtype, float_acts)), dequantize(data, qtype))


def as_dot_input(x: torch.Tensor, act: int) -> torch.Tensor:
    """x [..., n] float32 -> the float32 values of x converted to activation format `act`, row by row."""
    if act == ACT_F32:
        return x
    if act == ACT_F16:
        return x.to(torch.float16).float()
    if act == ACT_BF16:
        return _bf16(x)
    if act in (ACT_Q8_0, ACT_Q8_1):
        return _q8_32(x)
    if act == ACT_Q8_K:
        return _q8_k(x)
    raise ValueError(f"activation format {act} is not one llama.cpp's dot products take (expected 0, 1, 8, 9, 15 or 30)")


def _bf16(x: torch.Tensor) -> torch.Tensor:
    """ggml_compute_fp32_to_bf16 (round to nearest even, NaN kept quiet), back to float32."""
    bits = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    half = torch.where(nan, (bits >> 16) | 64, rounded) & 0xFFFF
    return (half << 16).to(torch.int32).view(torch.float32).reshape(x.shape)


def _q8_32(x: torch.Tensor) -> torch.Tensor:
    """Q8_0 / Q8_1 (the same values: Q8_1 only adds a sum): d = max|x| / 127 stored as float16, multiplier
    127 / max|x| in float32, round half to even."""
    blocks = x.reshape(-1, 32)
    amax = blocks.abs().amax(dim=1)  # [B]
    d = (amax / 127.0).to(torch.float16).float()
    scale = torch.where(amax != 0, _over(127.0, torch.where(amax != 0, amax, torch.ones_like(amax))), torch.zeros_like(amax))
    q = torch.round(blocks * scale[:, None]) + 0.0  # half to even; + 0.0: an integer, so no -0.0
    return (d[:, None] * q).reshape(x.shape)


def _q8_k(x: torch.Tensor) -> torch.Tensor:
    """Q8_K: multiplier -127 / (the value of largest magnitude, the first of them), round half to even, at most
    127; d = 1 / multiplier in float32."""
    blocks = x.reshape(-1, 256)
    at = blocks.abs().argmax(dim=1, keepdim=True)  # the first maximum, as the reference's strict > loop keeps
    top = blocks.gather(1, at).squeeze(1)  # [B]
    live = top != 0
    iscale = torch.where(live, _over(-127.0, torch.where(live, top, torch.ones_like(top))), torch.zeros_like(top))
    q = torch.round(blocks * iscale[:, None]).clamp(max=127.0) + 0.0  # half to even; no -0.0 (an integer)
    d = torch.where(live, _over(1.0, torch.where(live, iscale, torch.ones_like(iscale))), torch.zeros_like(iscale))
    return (d[:, None] * q).reshape(x.shape)


def _over(numerator: float, t: torch.Tensor) -> torch.Tensor:
    """numerator / t, one correctly rounded division (a scalar over a tensor is reciprocal-then-multiply in torch)."""
    return torch.div(torch.full_like(t, numerator), t)
