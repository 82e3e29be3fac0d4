"""IQ3_S_T, moetier's resident IQ3_S (moetier/backends/cpu_iq3s_t.h): the repack is exact both ways, and every
reader — the native dot at one token (the AVX-512 loop that reads the signs as masks) and at many (the row loops and
tiles), cpu_formats.c's rows, torch_dequant — gives IQ3_S's bits on the same blocks; a backend holds IQ3_S experts
so where this machine's kernels read IQ3_S_T fastest, with the same outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from quant_blocks import random_rows

from moetier.backends import activations, dot_kernels, torch_dequant
from moetier.backends.cpu_kernels import decode_kernel, resident_layout
from moetier.model.expert_weights import ExpertWeights
from moetier.model.formats import BY_NAME, GGML_FORMATS

IQ3_S, IQ3_S_T = BY_NAME["IQ3_S"], BY_NAME["IQ3_S_T"]
dots = dot_kernels.dot_kernels()
pytestmark = pytest.mark.skipif(dots is None or IQ3_S.id not in dots.types, reason=f"native dots {dot_kernels.status()}")


def rows_of(rows: int, cols: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(random_rows(IQ3_S, rows, cols, np.random.default_rng(seed)))


def signs_transposed_by_definition(block: np.ndarray) -> np.ndarray:
    """IQ3_S_T's 32 sign bytes of one IQ3_S block, from the layout's words: bit p of qword j = IQ3_S's bit 4p + j."""
    bits = np.unpackbits(block[74:106], bitorder="little")  # [256]: bit 4p + j
    return np.packbits(bits.reshape(64, 4).T.reshape(256), bitorder="little")


def test_the_repack_is_the_layout_and_round_trips():
    data = rows_of(6, 512, seed=1)
    there = dots.repacked(data, IQ3_S.id, IQ3_S_T.id)
    back = dots.repacked(there, IQ3_S_T.id, IQ3_S.id)
    assert torch.equal(back, data) and not torch.equal(there, data)
    blocks, moved = data.numpy().reshape(-1, 110), there.numpy().reshape(-1, 110)
    for block, mine in zip(blocks, moved):
        assert np.array_equal(mine[:74], block[:74]) and np.array_equal(mine[106:], block[106:])
        assert np.array_equal(mine[74:106], signs_transposed_by_definition(block))
    assert IQ3_S_T.id not in GGML_FORMATS  # never written to or read from a file


def test_bad_repacks_are_refused_before_c():
    data = rows_of(2, 256, seed=2)
    with pytest.raises(ValueError, match="not two layouts"):
        dots.repacked(data, BY_NAME["Q4_K"].id, IQ3_S_T.id)
    with pytest.raises(ValueError, match="whole 110-byte blocks"):
        dots.repacked(data[:, :100], IQ3_S.id, IQ3_S_T.id)
    assert dots.repacked(data, IQ3_S.id, IQ3_S.id) is data


@pytest.mark.parametrize("tokens", [1, 2, 3, 5, 8, 70])
def test_the_dot_gives_iq3_s_bits_at_every_token_count(tokens):
    """One token takes the AVX-512 loop (when built), 2-3 the row loop, 4 and more the tiles."""
    data = rows_of(45, 1024, seed=3)
    there = dots.repacked(data, IQ3_S.id, IQ3_S_T.id)
    x = torch.from_numpy(np.random.default_rng(4).standard_normal((tokens, 1024)).astype(np.float32))
    act = dots.act_type(IQ3_S.id)
    assert dots.act_type(IQ3_S_T.id) == act == activations.ACT_Q8_K
    xq = dots.quantize(act, x)
    assert torch.equal(dots.dot(IQ3_S_T.id, act, there, xq, 1024), dots.dot(IQ3_S.id, act, data, xq, 1024))


def test_dequantized_rows_are_iq3_s_values():
    data = rows_of(4, 512, seed=5)
    there = dots.repacked(data, IQ3_S.id, IQ3_S_T.id)
    want = torch_dequant.dequantize(data, IQ3_S.id)
    assert torch.equal(torch_dequant.dequantize(there, IQ3_S_T.id), want)
    kernel = decode_kernel()
    if kernel is not None:
        assert torch.equal(kernel.dequantize(there, IQ3_S_T.id, 512), want)


def test_a_backend_holds_iq3_s_experts_as_its_kernels_read_them_with_the_same_outputs():
    kernel = decode_kernel()
    if kernel is None:
        pytest.skip("no native decode kernel")
    experts = [ExpertWeights(rows_of(512, 256, seed=10 + e), rows_of(256, 256, seed=20 + e), True, IQ3_S.id, IQ3_S.id)
               for e in range(4)]
    held = [resident_layout(w) for w in experts]
    want = dots.resident_type(IQ3_S.id)
    assert all(h.gate_up_type == h.down_type == want and not h.mapped for h in held)
    assert resident_layout(held[0]) is held[0]  # already held so: no second copy
    x = torch.from_numpy(np.random.default_rng(6).standard_normal((1, 256)).astype(np.float32)) * 0.1
    scales = [0.4, 0.3, 0.2, 0.1]
    assert torch.equal(kernel.run(x, held, scales), kernel.run(x, experts, scales))
