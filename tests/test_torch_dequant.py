"""backends/torch_dequant: every stored format dequantized by torch equals gguf's numpy reference bit for bit."""

from __future__ import annotations

import gguf.quants
import numpy as np
import pytest
import torch
from quant_blocks import BLOCK_FORMATS, random_float_rows, random_rows

from moetier.backends import torch_dequant
from moetier.backends.torch_dequant import dequantize
from moetier.model.formats import BY_NAME, FORMATS

FLOAT_FORMATS = tuple(f for f in FORMATS.values() if f.dtype is not None)
ROWS, BLOCKS = 5, 3  # several rows of several blocks each


def _bits(x: np.ndarray) -> np.ndarray:
    assert x.dtype == np.float32
    return x.view(np.uint32)


def test_every_block_format_has_an_unpacker():
    assert set(torch_dequant._UNPACK) == {f.name for f in FORMATS.values() if f.dtype is None}
    assert {f.name for f in BLOCK_FORMATS} | {"IQ3_XXS_T", "IQ3_S_T"} == set(torch_dequant._UNPACK)  # and as moetier holds them


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_block_format_matches_gguf_bit_for_bit(fmt):
    rng = np.random.default_rng(fmt.id)
    cols = BLOCKS * fmt.block
    rows = random_rows(fmt, ROWS, cols, rng)  # uint8 [ROWS, row_bytes]
    ours = dequantize(torch.from_numpy(rows), fmt.id, cols)  # [ROWS, cols]
    want = gguf.quants.dequantize(rows, fmt.id)  # [ROWS, cols]
    assert ours.dtype == torch.float32 and ours.shape == (ROWS, cols)
    assert np.isfinite(want).all()
    np.testing.assert_array_equal(_bits(ours.numpy()), _bits(want))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS, ids=lambda f: f.name)
def test_leading_dims_are_kept(fmt):
    rows = random_rows(fmt, 6, 2 * fmt.block, np.random.default_rng(1))  # [6, row_bytes]
    flat = dequantize(torch.from_numpy(rows), fmt.id)  # [6, cols]
    stacked = dequantize(torch.from_numpy(rows).reshape(2, 3, -1), fmt.id)  # [2, 3, cols]
    assert stacked.shape == (2, 3, 2 * fmt.block)
    assert torch.equal(stacked.reshape(6, -1), flat)


@pytest.mark.parametrize("fmt", FLOAT_FORMATS, ids=lambda f: f.name)
def test_float_format_matches_gguf_bit_for_bit(fmt):
    data = random_float_rows(fmt, ROWS, 48, np.random.default_rng(fmt.id))  # [ROWS, 48] of fmt.dtype
    ours = dequantize(data, fmt.id, 48)  # [ROWS, 48]
    raw = data.view(torch.uint8).numpy()  # gguf reads a float tensor's bytes
    want = gguf.quants.dequantize(raw if fmt.name == "BF16" else raw.view(data.numpy().dtype), fmt.id)
    np.testing.assert_array_equal(_bits(ours.numpy()), _bits(np.asarray(want, dtype=np.float32)))
    if fmt.name == "F32":
        assert ours is data


@pytest.mark.parametrize("data, qtype, cols, message", [
    (torch.zeros(2, 18, dtype=torch.uint8), 35, None, "GGML type 35 is not a stored format"),
    (torch.zeros(2, 145, dtype=torch.uint8), BY_NAME["Q4_K"].id, None, "145 bytes is not a whole number of 144-byte blocks"),
    (torch.zeros(2, 36, dtype=torch.int8), BY_NAME["Q8_0"].id, None, "expected a uint8 tensor"),
    (torch.zeros(2, 144, dtype=torch.uint8), BY_NAME["Q4_K"].id, 512, "cols=512 disagrees"),
    (torch.zeros(2, 8, dtype=torch.float32), BY_NAME["F16"].id, None, "expected a torch.float16 tensor"),
    (torch.zeros(2, 8, dtype=torch.float16), BY_NAME["F16"].id, 16, "cols=16 disagrees"),
    (torch.tensor(1, dtype=torch.uint8), BY_NAME["Q8_0"].id, None, "at least one dimension"),
], ids=["unknown-type", "partial-block", "not-uint8", "cols-blocks", "float-dtype", "cols-float", "0-d"])
def test_bad_input_is_one_clear_value_error(data, qtype, cols, message):
    with pytest.raises(ValueError, match=message) as err:
        dequantize(data, qtype, cols)
    assert "\n" not in str(err.value)


@pytest.mark.gpu
def test_cuda_equals_cpu_bit_for_bit():
    for fmt in BLOCK_FORMATS:
        rows = torch.from_numpy(random_rows(fmt, 64, 4 * fmt.block, np.random.default_rng(fmt.id)))  # [64, row_bytes]
        on_cuda = dequantize(rows.cuda(), fmt.id)  # [64, cols] on the device
        assert on_cuda.is_cuda, fmt.name
        cpu = dequantize(rows, fmt.id)  # [64, cols]
        assert torch.equal(on_cuda.cpu().view(torch.int32), cpu.view(torch.int32)), fmt.name
    for fmt in FLOAT_FORMATS:
        data = random_float_rows(fmt, 64, 96, np.random.default_rng(fmt.id))  # [64, 96]
        on_cuda = dequantize(data.cuda(), fmt.id)  # [64, 96]
        assert torch.equal(on_cuda.cpu().view(torch.int32), dequantize(data, fmt.id).view(torch.int32)), fmt.name
