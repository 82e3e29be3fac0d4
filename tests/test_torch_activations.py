"""The torch path's activation rounding equals the numpy reference's values bit for bit (CPU here; CUDA under gpu)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetier.backends import activations as A
from moetier.backends.torch_activations import as_dot_input
from test_activations import ACTS, rows


def reference(act: int, x: np.ndarray) -> np.ndarray:
    return A.dequantize(act, A.quantize(act, x), x.shape[-1])


@pytest.mark.parametrize("act", ACTS)
def test_equals_the_reference_bit_for_bit(act):
    for seed in range(3):
        x = rows(seed)
        got = as_dot_input(torch.from_numpy(x), act).numpy()
        assert np.array_equal(got.view(np.uint32), reference(act, x).view(np.uint32)), (act, seed)


def test_unknown_format_is_one_line():
    with pytest.raises(ValueError, match="activation format 3 is not one"):
        as_dot_input(torch.zeros(1, 32), 3)


@pytest.mark.gpu
@pytest.mark.parametrize("act", ACTS)
def test_cuda_equals_cpu(act):
    x = torch.from_numpy(rows(0))
    assert torch.equal(as_dot_input(x.cuda(), act).cpu(), as_dot_input(x, act))
