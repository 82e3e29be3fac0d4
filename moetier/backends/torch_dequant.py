"""GGML block formats dequantized with torch ops on the tensor's own device.

`dequantize(data, qtype)` turns an expert matrix held in its stored format
(moetier.model.formats: uint8 [rows, row_bytes] of blocks, or a float tensor)
into float32 [rows, cols] on data.device: a CUDA tensor never visits host
memory. Invariant: the result is bit for bit `gguf.quants.dequantize` (the
numpy reference), because each format repeats that code's float32 operations
in the same order, one elementwise kernel each (integer unpacking may differ:
it is exact either way). Lookup tables (IQ grids, signs, kvalues) come from
the gguf package at first use and are cached per device.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from moetier.model.formats import Format, format_of

Unpack = Callable[[torch.Tensor], torch.Tensor]  # uint8 blocks [n, block_bytes] -> float32 [n, block]


def dequantize(data: torch.Tensor, qtype: int, cols: int | None = None) -> torch.Tensor:
    """data [..., row_bytes] uint8 blocks of GGML type `qtype` (or [..., cols] F32/F16/BF16) -> float32 [..., cols]."""
    fmt = format_of(qtype)
    if not isinstance(data, torch.Tensor) or data.dim() == 0:
        raise ValueError(f"{fmt.name}: expected a torch tensor of at least one dimension, got {_describe(data)}")
    if fmt.dtype is not None:
        if data.dtype != fmt.dtype:
            raise ValueError(f"{fmt.name}: expected a {fmt.dtype} tensor, got {data.dtype}")
        _check_cols(fmt, data.shape[-1], cols, f"a row of {data.shape[-1]} values")
        return data if data.dtype == torch.float32 else data.float()
    if data.dtype != torch.uint8:
        raise ValueError(f"{fmt.name}: expected a uint8 tensor of {fmt.block_bytes}-byte blocks, got {data.dtype}")
    row_bytes = data.shape[-1]
    if row_bytes % fmt.block_bytes:
        raise ValueError(f"{fmt.name}: a row of {row_bytes} bytes is not a whole number of {fmt.block_bytes}-byte blocks")
    have = row_bytes // fmt.block_bytes * fmt.block
    _check_cols(fmt, have, cols, f"a row of {row_bytes} bytes holds {have} values")
    blocks = data.reshape(-1, fmt.block_bytes)  # [n, block_bytes]
    values = _UNPACK[fmt.name](blocks)  # [n, block]
    return values.reshape(*data.shape[:-1], have)  # [..., cols]


def _check_cols(fmt: Format, have: int, cols: int | None, what: str) -> None:
    if cols is not None and cols != have:
        raise ValueError(f"{fmt.name}: cols={cols} disagrees with the data ({what}; expected cols={have})")


def _describe(data: object) -> str:
    return "a 0-d tensor" if isinstance(data, torch.Tensor) else type(data).__name__


# ---- small pieces shared by the formats -------------------------------------------------------------

def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 field at byte `at` of each block, as float32 [n, 1]."""
    return blocks[:, at:at + 2].contiguous().view(torch.float16).float()  # [n, 1]


@functools.cache
def _shifts(device: torch.device, dtype: torch.dtype, width: int, count: int) -> torch.Tensor:
    return torch.arange(0, width * count, width, dtype=dtype, device=device)  # [count]


def _unpack(x: torch.Tensor, width: int, count: int, last: bool = False) -> torch.Tensor:
    """x integer [..., k] -> [..., count, k] (or [..., k, count] if last): field i is (x >> width*i) & (2^width - 1)."""
    shifts = _shifts(x.device, x.dtype, width, count)  # [count]
    mask = (1 << width) - 1
    if last:
        return (x.unsqueeze(-1) >> shifts).bitwise_and_(mask)  # [..., k, count]
    return (x.unsqueeze(-2) >> shifts.unsqueeze(-1)).bitwise_and_(mask)  # [..., count, k]


def _u32(x: torch.Tensor) -> torch.Tensor:
    """Little-endian uint32 words of uint8 x [n, 4w], as int64 [n, w] (torch's uint32 lacks shifts on CUDA)."""
    words = x.reshape(x.shape[0], -1, 4).long()  # [n, w, 4]
    return (words << _shifts(x.device, torch.int64, 8, 4)).sum(-1)  # [n, w]: disjoint bits, so sum is or


@functools.cache
def _table(name: str, device: torch.device) -> torch.Tensor:
    """A gguf lookup table as a float32 torch tensor on `device` (built once per device)."""
    import gguf.quants as q  # the reference package, read only when an IQ format is first met

    if name in ("IQ3_XXS", "IQ3_S", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S"):
        cls = getattr(q, name)
        cls.init_grid()
        return torch.from_numpy(cls.grid.reshape(cls.grid_shape).copy()).to(device)  # [entries, 4 or 8]
    if name == "ksigns":  # 7-bit sign index -> 8 signs (+1/-1), as IQ3_XXS's numpy code expands them
        ksigns = torch.frombuffer(bytearray(q.IQ2_XXS.ksigns), dtype=torch.uint8)  # [128]
        bits = _unpack(ksigns, 1, 8, last=True)  # [128, 8]
        return (1 - 2 * bits.float()).to(device)  # [128, 8]
    if name == "ksigns_bytes":  # 7-bit sign index -> its byte of 8 sign bits
        return torch.frombuffer(bytearray(q.IQ2_XXS.ksigns), dtype=torch.uint8).to(device)  # [128]
    if name in ("kvalues", "kvalues_mxfp4"):
        return torch.tensor((q.IQ4_NL if name == "kvalues" else q.MXFP4).kvalues, dtype=torch.float32, device=device)  # [16]
    raise ValueError(f"no lookup table named {name!r} (expected an IQ1, IQ2 or IQ3 grid, ksigns or kvalues)")


# ---- the formats: each follows its gguf.quants dequantize_blocks, float ops in the same order -------
# The last float ops run in place on a fresh temporary: the same kernels, so the same bits, without
# a new multi-MB buffer per op (fresh pages cost the CPU path 2-13 ms per Q4_K matrix, in place 1.5 ms).

def _q4_0(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d = _f16(b, 0)  # [n, 1]
    q = _unpack(b[:, 2:], 4, 2).reshape(n, 32).to(torch.int8) - 8  # [n, 32]
    return q.float().mul_(d)


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)  # [n, 1] each
    q = _unpack(b[:, 4:], 4, 2).reshape(n, 32).float()  # [n, 32]
    return q.mul_(d).add_(m)


def _q5(b: torch.Tensor, at: int) -> torch.Tensor:
    """The 5-bit values (0..31) of Q5_0 / Q5_1 blocks whose qh starts at byte `at`: uint8 [n, 32]."""
    n = b.shape[0]
    qh = _unpack(b[:, at:at + 4], 1, 8, last=True).reshape(n, 32)  # [n, 32]: bit j of the uint32
    ql = _unpack(b[:, at + 4:], 4, 2).reshape(n, 32)  # [n, 32]
    return ql | (qh << 4)


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b, 2).to(torch.int8) - 16  # [n, 32]
    return q.float().mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _q5(b, 4).float()  # [n, 32]
    return q.mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    x = b[:, 2:].view(torch.int8).float()  # [n, 32]
    return x.mul_(_f16(b, 0))


def _q2_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, :16]  # [n, 16]
    d, dmin = _f16(b, 80), _f16(b, 82)  # [n, 1] each
    dl = (d * (scales & 0xF).float()).reshape(n, 16, 1)  # [n, 16, 1]
    ml = (dmin * (scales >> 4).float()).reshape(n, 16, 1)  # [n, 16, 1]
    q = _unpack(b[:, 16:80].reshape(n, 2, 32), 2, 4).reshape(n, 16, 16).float()  # [n, 16, 16]
    return q.mul_(dl).sub_(ml).reshape(n, 256)


def _q3_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    hmask, qs, scales = b[:, :32], b[:, 32:96], b[:, 96:108]
    low = _unpack(scales[:, :8], 4, 2).reshape(n, 16)  # [n, 16]
    high = _unpack(scales[:, 8:], 2, 4).reshape(n, 16)  # [n, 16]
    s = ((low | (high << 4)).to(torch.int8) - 32).float()  # [n, 16]
    dl = (_f16(b, 108) * s).reshape(n, 16, 1)  # [n, 16, 1]
    ql = _unpack(qs.reshape(n, 2, 32), 2, 4).reshape(n, 16, 16)  # [n, 16, 16]
    qh = _unpack(hmask, 1, 8).reshape(n, 16, 16) ^ 1  # [n, 16, 16]: the offset is zero when the bit is set
    q = (ql.to(torch.int8) - (qh << 2).to(torch.int8)).float()  # [n, 16, 16]
    return q.mul_(dl).reshape(n, 256)


def _scale_min_k4(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 6-bit scales and mins of Q4_K / Q5_K (bytes 4..15): two float32 [n, 8]."""
    s = b[:, 4:16].reshape(-1, 3, 4)  # [n, 3, 4]
    d, m, md = s[:, 0], s[:, 1], s[:, 2]  # [n, 4] each
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # [n, 8]
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)  # [n, 8]
    return sc.float(), mn.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b)  # [n, 8] each
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)  # [n, 8, 1]
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)  # [n, 8, 1]
    q = _unpack(b[:, 16:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32).float()  # [n, 8, 32]
    return q.mul_(d).sub_(dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b)  # [n, 8] each
    d = (_f16(b, 0) * sc).reshape(n, 8, 1)  # [n, 8, 1]
    dm = (_f16(b, 2) * mn).reshape(n, 8, 1)  # [n, 8, 1]
    ql = _unpack(b[:, 48:].reshape(n, 4, 32), 4, 2).reshape(n, 8, 32)  # [n, 8, 32]
    qh = _unpack(b[:, 16:48], 1, 8)  # [n, 8, 32]
    q = (ql | (qh << 4)).float()  # [n, 8, 32]
    return q.mul_(d).sub_(dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].view(torch.int8).float()  # [n, 16]
    d = (_f16(b, 208) * scales).reshape(n, 16, 1)  # [n, 16, 1]
    ql = _unpack(b[:, :128].reshape(n, 2, 64), 4, 2).reshape(n, 8, 32)  # [n, 8, 32]
    qh = _unpack(b[:, 128:192].reshape(n, 2, 32), 2, 4).reshape(n, 8, 32)  # [n, 8, 32]
    q = ((ql | (qh << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()  # [n, 16, 16]
    return q.mul_(d).reshape(n, 256)


def _iq3_xxs(b: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """IQ3_XXS blocks; transposed: IQ3_XXS_T's (moetier's resident IQ3_XXS: bit p of sign qword j is value j of group
    p for j < 3, value 3's signs of the even groups packed, each odd group's the parity of its other 7, scales as
    nibbles)."""
    n = b.shape[0]
    if transposed:
        scales = _unpack(b[:, 94:98], 4, 2, last=True).reshape(n, 8)  # [n, 8]
        bits = _unpack(b[:, 66:94], 1, 8, last=True).reshape(n, 224)  # [n, 224]
        first = bits[:, :192].reshape(n, 3, 64).transpose(1, 2)  # [n, 64, 3]: group p, values 0..2
        even = bits[:, 192:].reshape(n, 32, 1)  # [n, 32, 1]: value 3 of group 2g
        pairs = first.reshape(n, 32, 6)  # [n, 32, 6]: groups 2g and 2g + 1, values 0..2 each
        odd = (pairs.sum(-1, keepdim=True) + even) & 1  # [n, 32, 1]: the 8 signs' count of minus signs is even
        last = torch.cat([even, odd], -1).reshape(n, 64, 1)  # [n, 64, 1]
        signs = 1 - 2 * torch.cat([first, last], -1).reshape(n, 8, 4, 8).float()  # [n, 8, 4, 8]: +1 or -1
    else:
        words = _u32(b[:, 66:98])  # [n, 8]: a 4-bit scale and four 7-bit sign indices per 32 values
        scales = words >> 28  # [n, 8]
        signs = _table("ksigns", b.device)[_unpack(words, 7, 4, last=True)]  # [n, 8, 4, 8]
    db = (_f16(b, 0) * (0.5 + scales.float()) * 0.5).reshape(n, 8, 1, 1)  # [n, 8, 1, 1]
    grid = _table("IQ3_XXS", b.device)[b[:, 2:66].long()].reshape(n, 8, 4, 8)  # [n, 8, 4, 8]
    return grid.mul_(db).mul_(signs).reshape(n, 256)


def _iq3_s(b: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """IQ3_S blocks; transposed: IQ3_S_T's (moetier's resident IQ3_S: bit p of sign qword j is value j of group p)."""
    n = b.shape[0]
    scales = _unpack(b[:, 106:110], 4, 2, last=True).reshape(n, 8)  # [n, 8]
    db = (_f16(b, 0) * (1 + 2 * scales).float()).reshape(n, 8, 1, 1)  # [n, 8, 1, 1]
    bits = _unpack(b[:, 74:106], 1, 8, last=True).reshape(n, 256)  # [n, 256]: bit 4p + j (IQ3_S), 64j + p (IQ3_S_T)
    if transposed:
        bits = bits.reshape(n, 4, 64).transpose(1, 2)  # [n, 64, 4]: group p, value j
    signs = 1 - 2 * bits.reshape(n, 8, 4, 8).float()  # [n, 8, 4, 8]: +1 or -1, exact
    qh = _unpack(b[:, 66:74], 1, 8, last=True).reshape(n, 64).long()  # [n, 64]
    index = b[:, 2:66].long() | (qh << 8)  # [n, 64]: 9-bit grid rows
    grid = _table("IQ3_S", b.device)[index].reshape(n, 8, 4, 8)  # [n, 8, 4, 8]
    return grid.mul_(db).mul_(signs).reshape(n, 256)


def _iq2(b: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, signs: torch.Tensor, grid: str) -> torch.Tensor:
    """The IQ2 formats' shared tail: scales [n, g] (4-bit, per 256/g values), index [n, 32] grid rows, signs [n, 32]
    sign bytes (bit i set: value i of the row negated) -> ((d * (0.5 + s)) * 0.25) * grid * sign, [n, 256]."""
    n, g = scales.shape
    db = (_f16(b, 0) * (0.5 + scales.float()) * 0.25).reshape(n, g, 1, 1)  # [n, g, 1, 1]
    sign = 1 - 2 * _unpack(signs, 1, 8, last=True).reshape(n, g, -1, 8).float()  # [n, g, 32 / g, 8]
    rows = _table(grid, b.device)[index.long()].reshape(n, g, -1, 8)  # [n, g, 32 / g, 8]
    return db.mul(rows).mul_(sign).reshape(n, 256)


def _iq2_xxs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    groups = b[:, 2:].reshape(n, 8, 8)  # [n, 8, 8]: 4 index bytes, a uint32 of 4 sign indices and the scale
    aux = _u32(groups[:, :, 4:].reshape(n, 32))  # [n, 8]
    sign_index = _unpack(aux, 7, 4, last=True).reshape(n, 32)  # [n, 32]
    signs = _table("ksigns_bytes", b.device)[sign_index]  # [n, 32]
    return _iq2(b, aux >> 28, groups[:, :, :4].reshape(n, 32), signs, "IQ2_XXS")


def _iq2_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = b[:, 2:66].reshape(n, 32, 2).long()  # [n, 32, 2]
    q = q[:, :, 0] | (q[:, :, 1] << 8)  # [n, 32]: 9-bit grid row | 7-bit sign index << 9
    scales = _unpack(b[:, 66:74], 4, 2, last=True).reshape(n, 16)  # [n, 16]
    return _iq2(b, scales, q & 511, _table("ksigns_bytes", b.device)[q >> 9], "IQ2_XS")


def _iq2_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = _unpack(b[:, 66:74], 2, 4, last=True).reshape(n, 32).long()  # [n, 32]
    index = b[:, 2:34].long() | (qh << 8)  # [n, 32]: 10-bit grid rows
    scales = _unpack(b[:, 74:82], 4, 2, last=True).reshape(n, 16)  # [n, 16]
    return _iq2(b, scales, index, b[:, 34:66], "IQ2_S")


def _iq1(d: torch.Tensor, scales: torch.Tensor, index: torch.Tensor, negative: torch.Tensor) -> torch.Tensor:
    """The IQ1 formats' shared tail: d [n, 1], scales [n, g] (3-bit, per 256/g values), index [n, 32] grid rows,
    negative [n, r] (r = 8 or 32: each 32 or 8 values' delta is -0.125) -> (d * (2s + 1)) * (grid + delta), [n, 256]."""
    n, g = scales.shape
    dl = (d * (2 * scales + 1).float()).reshape(n, g, 1, 1)  # [n, g, 1, 1]
    delta = torch.where(negative.bool(), -0.125, 0.125).float().reshape(n, g, -1, 1)  # [n, g, 1 or 2, 1]
    rows = _table("IQ1_S", index.device)[index.long()].reshape(n, g, -1, 8)  # [n, g, 32 / g, 8]
    return dl.mul(rows.add_(delta)).reshape(n, 256)


def _iq1_s(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    qh = b[:, 34:50].reshape(n, 8, 2).long()  # [n, 8, 2]
    qh = qh[:, :, 0] | (qh[:, :, 1] << 8)  # [n, 8]: uint16 per 32 values
    index = b[:, 2:34].long() | ((_unpack(qh, 3, 4, last=True) << 8).reshape(n, 32))  # [n, 32]: 11-bit grid rows
    return _iq1(_f16(b, 0), (qh >> 12) & 7, index, qh >> 15)


def _iq1_m(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc = b[:, 48:56].reshape(n, 4, 2).long()  # [n, 4, 2]
    sc = sc[:, :, 0] | (sc[:, :, 1] << 8)  # [n, 4]: uint16
    bits = ((sc >> 12) << _shifts(b.device, torch.int64, 4, 4)).sum(-1, keepdim=True)  # [n, 1]: d's bits, 4 from each
    d = (bits - ((bits >> 15) << 16)).to(torch.int16).view(torch.float16).float()  # [n, 1]
    nibbles = _unpack(b[:, 32:48], 4, 2, last=True).reshape(n, 32).long()  # [n, 32]: a row's high bits and delta
    index = b[:, :32].long() | ((nibbles & 7) << 8)  # [n, 32]
    return _iq1(d, _unpack(sc, 3, 4, last=True).reshape(n, 16), index, nibbles >> 3)


def _mxfp4(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    e = b[:, :1].long()  # [n, 1]: the E8M0 scale byte, taken halved (ggml_e8m0_to_fp32_half)
    bits = torch.where(e < 2, 0x00200000 << e, (e - 1) << 23).to(torch.int32)  # [n, 1]
    q = _unpack(b[:, 1:], 4, 2).reshape(n, 32)  # [n, 32]
    return _table("kvalues_mxfp4", b.device)[q.long()].mul_(bits.view(torch.float32))


def _iq4_nl(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    q = _unpack(b[:, 2:], 4, 2).reshape(n, 32)  # [n, 32]
    return _table("kvalues", b.device)[q.long()].mul_(_f16(b, 0))


def _iq4_xs(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    high = _unpack(b[:, 2:4], 2, 4, last=True).reshape(n, 8)  # [n, 8]: the uint16's 2-bit fields in order
    low = _unpack(b[:, 4:8], 4, 2, last=True).reshape(n, 8)  # [n, 8]
    s = ((low | (high << 4)).to(torch.int8) - 32).float()  # [n, 8]
    dl = (_f16(b, 0) * s).reshape(n, 8, 1)  # [n, 8, 1]
    q = _unpack(b[:, 8:].reshape(n, 8, 16), 4, 2).reshape(n, 8, 32)  # [n, 8, 32]
    return _table("kvalues", b.device)[q.long()].mul_(dl).reshape(n, 256)


_UNPACK: dict[str, Unpack] = {
    "Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
    "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
    "MXFP4": _mxfp4, "IQ1_S": _iq1_s, "IQ1_M": _iq1_m, "IQ2_XXS": _iq2_xxs, "IQ2_XS": _iq2_xs, "IQ2_S": _iq2_s,
    "IQ3_XXS": _iq3_xxs, "IQ4_NL": _iq4_nl, "IQ3_S": _iq3_s, "IQ4_XS": _iq4_xs,
    "IQ3_XXS_T": lambda b: _iq3_xxs(b, transposed=True), "IQ3_S_T": lambda b: _iq3_s(b, transposed=True),
}  # every block format in moetier.model.formats.FORMATS (a test checks the two agree)
