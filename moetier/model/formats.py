"""The stored formats of expert weights: GGML tensor types by id, with their block geometry.

One table (`FORMATS`) says which formats moetier keeps experts in and how a
row of each is laid out: `block` values stored in `block_bytes` bytes, rows a
whole number of blocks. Float formats (F32, F16, BF16) are held as torch
tensors of that dtype [rows, cols]; the block formats as uint8 [rows,
row_bytes]. The ids and geometry are GGML's (tests check them against the
`gguf` package), so a GGUF tensor's type is its format. Beside them,
moetier's resident layouts (`IQ3_XXS_T`, id 118, and `IQ3_S_T`, id 121): a GGML format laid out for a
native library's loop, with its geometry, held in memory only
(`GGML_FORMATS` is what a file may hold).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Format:
    name: str
    id: int  # GGML type id
    block: int  # values per block
    block_bytes: int  # bytes per block
    dtype: torch.dtype | None = None  # the torch dtype of a float format; None for block formats

    def row_bytes(self, cols: int) -> int:
        if cols % self.block:
            raise ValueError(f"{self.name}: a row of {cols} values is not a whole number of {self.block}-value blocks")
        return cols // self.block * self.block_bytes

    def cols(self, data: torch.Tensor) -> int:
        """Values per row of data held in this format ([rows, cols] float, or uint8 [rows, row_bytes])."""
        return data.shape[-1] if self.dtype is not None else data.shape[-1] // self.block_bytes * self.block


_ALL = (
    Format("F32", 0, 1, 4, torch.float32), Format("F16", 1, 1, 2, torch.float16), Format("BF16", 30, 1, 2, torch.bfloat16),
    Format("Q4_0", 2, 32, 18), Format("Q4_1", 3, 32, 20), Format("Q5_0", 6, 32, 22), Format("Q5_1", 7, 32, 24),
    Format("Q8_0", 8, 32, 34), Format("Q2_K", 10, 256, 84), Format("Q3_K", 11, 256, 110), Format("Q4_K", 12, 256, 144),
    Format("Q5_K", 13, 256, 176), Format("Q6_K", 14, 256, 210), Format("IQ2_XXS", 16, 256, 66), Format("IQ2_XS", 17, 256, 74),
    Format("IQ3_XXS", 18, 256, 98), Format("IQ1_S", 19, 256, 50), Format("IQ4_NL", 20, 32, 18), Format("IQ3_S", 21, 256, 110),
    Format("IQ2_S", 22, 256, 82), Format("IQ4_XS", 23, 256, 136), Format("IQ1_M", 29, 256, 56), Format("MXFP4", 39, 32, 17),
)
# moetier's resident layouts of a GGML format, never in a file: where a native library reads a format faster laid
# out otherwise, the CPU backend holds it so (moetier.backends.cpu_kernels.resident_layout). IQ3_XXS_T and IQ3_S_T:
# IQ3_XXS and IQ3_S with each block's sign bits transposed (moetier/backends/cpu_iq3_t.h).
_RESIDENT = (Format("IQ3_XXS_T", 118, 256, 98), Format("IQ3_S_T", 121, 256, 110))
GGML_FORMATS: dict[int, Format] = {f.id: f for f in _ALL}  # GGML type id -> format: what a file may hold
FORMATS: dict[int, Format] = {f.id: f for f in _ALL + _RESIDENT}  # every layout moetier holds weights in
BY_NAME: dict[str, Format] = {f.name: f for f in _ALL + _RESIDENT}
F32, F16, BF16 = 0, 1, 30
BY_DTYPE: dict[torch.dtype, int] = {f.dtype: f.id for f in _ALL if f.dtype is not None}


def format_of(qtype: int) -> Format:
    try:
        return FORMATS[int(qtype)]
    except KeyError:
        raise ValueError(f"GGML type {qtype} is not a stored format moetier reads "
                         f"(expected one of {', '.join(f.name for f in _ALL)})") from None
