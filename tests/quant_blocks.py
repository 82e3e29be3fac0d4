"""Random, valid rows of every block format in moetier.model.formats, for kernel tests.

Any byte pattern is a valid block except in its float16 fields (scales), where
a random pattern may be inf or NaN; `random_rows` fills those with finite
scales of a realistic size, so a dequantized row is finite and comparisons
can be bit for bit.
"""

from __future__ import annotations

import numpy as np

from moetier.model.formats import BY_NAME, Format

# a GGML format outside moetier's stored formats: the gguf package dequantizes it, moetier holds it as float32 values
NOT_STORED = {"TQ2_0": Format("TQ2_0", 35, 256, 66)}
# byte offsets of the float16 fields in one block, per format (GGML's block structs)
F16_FIELDS = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "IQ4_NL": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ2_XXS": (0,), "IQ2_XS": (0,), "IQ2_S": (0,), "IQ3_XXS": (0,), "IQ3_S": (0,), "IQ4_XS": (0,), "IQ1_S": (0,),
    "IQ1_M": (), "MXFP4": (), "TQ2_0": (64,),
}
BLOCK_FORMATS = tuple(BY_NAME[name] for name in F16_FIELDS if name not in NOT_STORED)


def random_rows(fmt: Format, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> np.ndarray:
    """uint8 [rows, row_bytes]: `rows` rows of `cols` values in format `fmt` (a block format), random but finite."""
    blocks = rows * cols // fmt.block
    data = rng.integers(0, 256, size=(blocks, fmt.block_bytes), dtype=np.uint8)
    for at in F16_FIELDS[fmt.name]:
        values = (rng.standard_normal(blocks) * scale).astype(np.float16)
        data[:, at:at + 2] = values.view(np.uint8).reshape(blocks, 2)
    if fmt.name == "MXFP4":  # its scale: an E8M0 byte, 2^(e - 128), about `scale`
        data[:, 0] = np.clip(np.round(np.log2(scale)) + 128 + rng.integers(-2, 3, size=blocks), 2, 254).astype(np.uint8)
    if fmt.name == "IQ1_M":  # its float16 d is the top nibbles of the four uint16 scale fields (bytes 48..55)
        d = (rng.standard_normal(blocks) * scale).astype(np.float16).view(np.uint16)
        top = np.stack([(d >> (4 * j)) & 15 for j in range(4)], axis=1).astype(np.uint16)  # [blocks, 4]
        fields = data[:, 48:56].copy().view(np.uint16)  # [blocks, 4]
        data[:, 48:56] = ((fields & 0x0FFF) | (top << 12)).view(np.uint8)
    return data.reshape(rows, fmt.row_bytes(cols))


def random_float_rows(fmt: Format, rows: int, cols: int, rng: np.random.Generator):
    """torch [rows, cols] of float format `fmt` (F32, F16, BF16)."""
    import torch

    return torch.from_numpy(rng.standard_normal((rows, cols)).astype(np.float32)).to(fmt.dtype)
