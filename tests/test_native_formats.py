"""The native kernel on every stored format: its dequantizers are gguf's bit for bit."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch

from moetier.backends import cpu_kernels
from moetier.model.formats import BY_NAME, FORMATS, Format
from quant_blocks import BLOCK_FORMATS, random_float_rows, random_rows

kernel = cpu_kernels.decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"native kernel {cpu_kernels.status()}")
FLOAT_FORMATS = tuple(BY_NAME[name] for name in ("F32", "F16", "BF16"))


def stored(fmt: Format, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> torch.Tensor:
    """Random valid rows of `fmt`: uint8 [rows, row_bytes] of blocks, or [rows, cols] of its float dtype."""
    if fmt.dtype is not None:
        return random_float_rows(fmt, rows, cols, rng) * scale
    return torch.from_numpy(random_rows(fmt, rows, cols, rng, scale))


def reference(data: torch.Tensor, fmt: Format) -> np.ndarray:
    """gguf.quants.dequantize of data's stored bytes -> float32 [rows, cols]."""
    raw = data.contiguous().view(torch.uint8).numpy()  # [rows, row bytes], whatever the format
    return gguf.quants.dequantize(raw, fmt.id)


def test_formats_are_every_stored_format():
    assert set(FORMATS) == {f.id for f in BLOCK_FORMATS + FLOAT_FORMATS}


@pytest.mark.parametrize("fmt", BLOCK_FORMATS + FLOAT_FORMATS, ids=lambda f: f.name)
def test_dequantize_is_gguf_bit_for_bit(fmt):
    """One block, a row of three, and a matrix of 7 rows of five blocks (256-value blocks: fewer)."""
    rng = np.random.default_rng(fmt.id)
    blocks = (1, 3) if fmt.block == 256 else (1, 3, 5)
    for rows, per_row in [(1, b) for b in blocks] + [(7, blocks[-1])]:
        cols = fmt.block * per_row if fmt.block > 1 else 33 * per_row
        data = stored(fmt, rows, cols, rng)
        got = kernel.dequantize(data, fmt.id, cols)  # [rows, cols]
        assert got.dtype == torch.float32 and got.shape == (rows, cols)
        assert np.array_equal(got.numpy().view(np.uint32), reference(data, fmt).view(np.uint32)), (fmt.name, rows, cols)


@pytest.mark.parametrize("name, view", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_every_16_bit_pattern_converts_as_gguf_converts_it(name, view):
    """Subnormals, infinities and NaN payloads (signalling ones stay signalling, as numpy leaves them)."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(view).reshape(256, 256)  # [256, 256]
    got = kernel.dequantize(patterns, BY_NAME[name].id, 256)
    assert np.array_equal(got.numpy().view(np.uint32), reference(patterns, BY_NAME[name]).view(np.uint32))


def test_bad_input_is_refused_before_c_with_one_line():
    q4k, rng = BY_NAME["Q4_K"], np.random.default_rng(0)
    good = stored(q4k, 4, 512, rng)
    cases = [
        (lambda: kernel.dequantize(good, 99, 512), "GGML type 99 is not a stored format"),
        (lambda: kernel.dequantize(good, q4k.id, 256), r"Q4_K \[4, 256\] is torch.uint8 \[4, 144\], got torch.uint8 \[4, 288\]"),
        (lambda: kernel.dequantize(good, q4k.id, 500), "not a whole number of 256-value blocks"),
        (lambda: kernel.dequantize(good.float(), q4k.id, 512), "got torch.float32"),
        (lambda: kernel.dequantize(good[:, ::2], q4k.id, 256), "contiguous in host memory"),
        (lambda: kernel.dequantize(good.reshape(-1), q4k.id, 512), "expected a matrix"),
        (lambda: kernel.dequantize(torch.zeros(2, 8), BY_NAME["F16"].id, 8), "F16 \\[2, 8\\] is torch.float16"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
