"""IQ3_XXS_T and IQ3_S_T, moetier's resident IQ3_XXS and IQ3_S (moetier/backends/cpu_iq3_t.h): the repack is exact
both ways and is the layout by its definition, and every reader — the native dot at one token (the AVX-512 loops
that read the signs as masks) and at many (the row loops and tiles), cpu_formats.c's rows, torch_dequant — gives
the file format's bits on the same blocks; a backend holds IQ3 experts so where this machine's kernels read them
fastest, with the same outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_blocks import random_rows

from moetier.backends import activations, dot_kernels, torch_dequant
from moetier.backends.cpu_kernels import decode_kernel, resident_layout
from moetier.model.expert_weights import ExpertWeights
from moetier.model.formats import BY_NAME, GGML_FORMATS

PAIRS = [(BY_NAME["IQ3_XXS"], BY_NAME["IQ3_XXS_T"]), (BY_NAME["IQ3_S"], BY_NAME["IQ3_S_T"])]
IDS = [file.name for file, _ in PAIRS]
dots = dot_kernels.dot_kernels()
pytestmark = pytest.mark.skipif(dots is None or not all(f.id in dots.types for f, _ in PAIRS),
                                reason=f"native dots {dot_kernels.status()}")


def rows_of(fmt, rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_rows(fmt, rows, cols, np.random.default_rng(seed)))


def natural_signs(fmt, block: np.ndarray) -> np.ndarray:
    """A file block's 256 sign bits (1: minus), bit 4p + j the sign of value j of group p: IQ3_S's as they lie,
    IQ3_XXS's from its 7-bit fields (the 8th of 8 values' signs makes their count of minus signs even)."""
    if fmt.name == "IQ3_S":
        return np.unpackbits(block[74:106], bitorder="little")
    words = block[66:98].view("<u4")  # [8]
    fields = (words[:, None] >> (7 * np.arange(4, dtype=np.uint32))) & 127  # [8, 4]
    seven = np.unpackbits(fields.astype(np.uint8).reshape(32, 1), axis=1, bitorder="little")[:, :7]  # [32, 7]
    return np.concatenate([seven, seven.sum(1, keepdims=True) & 1], 1).reshape(256).astype(np.uint8)


def transposed_by_definition(fmt, block: np.ndarray) -> np.ndarray:
    """The resident block of a file block, from the layouts' words (cpu_iq3_t.h): qword j's bit p = natural bit
    4p + j; IQ3_XXS_T: qwords 0..2, then value 3's bits of the even groups, then the 8 scales as nibbles."""
    by_vector = natural_signs(fmt, block).reshape(64, 4).T  # [4, 64]: vector j, group p
    out = block.copy()
    if fmt.name == "IQ3_S":
        out[74:106] = np.packbits(by_vector.reshape(256), bitorder="little")
        return out
    scales = block[66:98].view("<u4") >> 28  # [8]
    out[66:90] = np.packbits(by_vector[:3].reshape(192), bitorder="little")
    out[90:94] = np.packbits(by_vector[3, 0::2], bitorder="little")
    out[94:98] = (scales[0::2] | scales[1::2] << 4).astype(np.uint8)
    return out


@pytest.mark.parametrize("file, held", PAIRS, ids=IDS)
def test_the_repack_is_the_layout_and_round_trips(file, held):
    data = rows_of(file, 6, 512, seed=1)
    there = dots.repacked(data, file.id, held.id)
    back = dots.repacked(there, held.id, file.id)
    assert torch.equal(back, data) and not torch.equal(there, data)
    blocks, moved = data.numpy().reshape(-1, file.block_bytes), there.numpy().reshape(-1, file.block_bytes)
    for block, mine in zip(blocks, moved):
        assert np.array_equal(mine, transposed_by_definition(file, block))
    assert held.id not in GGML_FORMATS  # never written to or read from a file


def test_every_iq3_xxs_t_block_is_an_iq3_xxs_block():
    """IQ3_XXS_T holds as many bits as IQ3_XXS: arbitrary bytes put back and transposed again are themselves."""
    file, held = PAIRS[0]
    anything = torch.from_numpy(np.random.default_rng(7).integers(0, 256, (8, 4 * 98), dtype=np.uint8))
    assert torch.equal(dots.repacked(dots.repacked(anything, held.id, file.id), file.id, held.id), anything)


@pytest.mark.parametrize("file, held", PAIRS, ids=IDS)
def test_bad_repacks_are_refused_before_c(file, held):
    data = rows_of(file, 2, 256, seed=2)
    with pytest.raises(ValueError, match="not two layouts"):
        dots.repacked(data, BY_NAME["Q4_K"].id, held.id)
    with pytest.raises(ValueError, match="not two layouts"):
        dots.repacked(data, file.id, (BY_NAME["IQ3_S_T"] if held.name == "IQ3_XXS_T" else BY_NAME["IQ3_XXS_T"]).id)
    with pytest.raises(ValueError, match=f"whole {file.block_bytes}-byte blocks"):
        dots.repacked(data[:, :50], file.id, held.id)
    assert dots.repacked(data, file.id, file.id) is data


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 70])
@pytest.mark.parametrize("file, held", PAIRS, ids=IDS)
def test_the_dot_gives_the_file_formats_bits_at_every_token_count(file, held, tokens):
    """One token takes the AVX-512 loop (when built), 2-3 the row loop, 4 and more the tiles."""
    data = rows_of(file, 45, 1024, seed=3)
    there = dots.repacked(data, file.id, held.id)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((tokens, 1024)).astype(np.float32))
    act = dots.act_type(file.id)
    assert dots.act_type(held.id) == act == activations.ACT_Q8_K
    xq = dots.quantize(act, x)
    assert torch.equal(dots.dot(held.id, act, there, xq, 1024), dots.dot(file.id, act, data, xq, 1024))


@pytest.mark.parametrize("file, held", PAIRS, ids=IDS)
def test_dequantized_rows_are_the_file_formats_values(file, held):
    data = rows_of(file, 4, 512, seed=5)
    there = dots.repacked(data, file.id, held.id)
    want = torch_dequant.dequantize(data, file.id)
    assert torch.equal(torch_dequant.dequantize(there, held.id), want)
    kernel = decode_kernel()
    if kernel is not None:
        assert torch.equal(kernel.dequantize(there, held.id, 512), want)


@pytest.mark.parametrize("file, held", PAIRS, ids=IDS)
def test_a_backend_holds_iq3_experts_as_its_kernels_read_them_with_the_same_outputs(file, held):
    kernel = decode_kernel()
    if kernel is None:
        pytest.skip("no native decode kernel")
    experts = [ExpertWeights(rows_of(file, 512, 256, seed=10 + e), rows_of(file, 256, 256, seed=20 + e), True, file.id, file.id)
               for e in range(4)]
    held_experts = [resident_layout(w) for w in experts]
    want = dots.resident_type(file.id)
    assert want in (file.id, held.id)
    assert all(h.gate_up_type == h.down_type == want and not h.mapped for h in held_experts)
    assert resident_layout(held_experts[0]) is held_experts[0]  # already held so: no second copy
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((1, 256)).astype(np.float32)) * 0.1
    scales = [0.4, 0.3, 0.2, 0.1]
    assert torch.equal(kernel.run(x, held_experts, scales), kernel.run(x, experts, scales))
