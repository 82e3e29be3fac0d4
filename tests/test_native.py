"""The native decode kernel: same sums as the numpy reference and the torch ops, odd shapes
included; built once and reused; a machine that cannot build it falls back with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moetier.backends import ExpertWork, native
from moetier.backends.numpy_backend import NumpyBackend
from moetier.backends.torch_backend import TorchBackend
from moetier.model import ExpertWeights

needs_kernel = pytest.mark.skipif(native.decode_kernel() is None, reason=f"native kernel {native.status()}")


def experts_of(dim: int, inter: int, count: int, seed: int) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ExpertWeights(torch.randn(2 * inter, dim, generator=g) * 0.2, torch.randn(dim, inter, generator=g) * 0.2)
            for _ in range(count)]


def decode(backend, experts, x, scales) -> torch.Tensor:
    row = torch.zeros(1, dtype=torch.int64)
    work = [ExpertWork(backend.place(w), row, torch.tensor([s])) for w, s in zip(experts, scales)]
    return backend.run_experts(x, work)


@needs_kernel
@pytest.mark.parametrize("dim, inter, k", [(40, 24, 1), (37, 13, 5), (64, 7, 10), (512, 128, 10), (9, 3, 3)])
def test_kernel_matches_reference_and_torch_ops(dim, inter, k):
    """Shapes that are not multiples of the kernel's 8-row blocks take its tail loop."""
    experts = experts_of(dim, inter, k, seed=dim + inter + k)
    g = torch.Generator().manual_seed(k)
    x, scales = torch.randn(1, dim, generator=g), torch.rand(k, generator=g).tolist()
    reference = decode(NumpyBackend(), experts, x, scales)
    kernel = decode(TorchBackend("cpu"), experts, x, scales)
    ops = decode(TorchBackend("cpu", native_kernel=False), experts, x, scales)
    scale = reference.abs().max().item()
    assert TorchBackend("cpu")._kernel is not None and TorchBackend("cpu", native_kernel=False)._kernel is None
    assert (kernel - reference).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert (ops - reference).abs().max().item() <= 1e-5 * max(1.0, scale)


@needs_kernel
def test_kernel_reads_non_contiguous_experts_after_place():
    """place() hands the kernel contiguous copies when a checkpoint's tensors are strided views."""
    base = experts_of(24, 8, 2, seed=3)
    strided = [ExpertWeights(w.gate_up.t().contiguous().t(), w.down.t().contiguous().t()) for w in base]
    assert not strided[0].gate_up.is_contiguous()
    x = torch.randn(1, 24)
    assert torch.allclose(decode(TorchBackend("cpu"), strided, x, [0.3, 0.7]), decode(NumpyBackend(), base, x, [0.3, 0.7]), atol=1e-5)


@needs_kernel
def test_lanes_split_the_group_and_sum_the_same():
    experts = experts_of(64, 16, 10, seed=5)
    x, scales = torch.randn(1, 64), torch.rand(10).tolist()
    one, two = TorchBackend("cpu"), TorchBackend("cpu", lanes=2)
    try:
        assert torch.allclose(decode(one, experts, x, scales), decode(two, experts, x, scales), atol=1e-5)
    finally:
        two.close()


PROBE = """
import json, torch
from moetier.backends import native
from moetier.backends.torch_backend import TorchBackend
from moetier.backends.numpy_backend import NumpyBackend
from moetier.backends import ExpertWork
from moetier.model import ExpertWeights
w = ExpertWeights(torch.ones(6, 4) * 0.1, torch.ones(4, 3) * 0.1)
row = torch.zeros(1, dtype=torch.int64)
x = torch.ones(1, 4)
out = [b.run_experts(x, [ExpertWork(b.place(w), row, torch.tensor([0.5]))]) for b in (TorchBackend("cpu"), NumpyBackend())]
print(json.dumps({"status": native.status(), "on": native.decode_kernel() is not None,
                  "path": str(native.decode_kernel().path) if native.decode_kernel() else None,
                  "diff": (out[0] - out[1]).abs().max().item()}))
"""


def probe(tmp_path, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MOETIER_HOME": str(tmp_path), **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_kernel
def test_built_once_per_machine_then_reused(tmp_path):
    first = probe(tmp_path)
    assert first["on"] and first["diff"] < 1e-6 and first["path"].startswith(str(tmp_path / "native"))
    built = os.stat(first["path"]).st_mtime_ns
    second = probe(tmp_path)
    assert second["path"] == first["path"] and os.stat(second["path"]).st_mtime_ns == built
    assert [p.name for p in (tmp_path / "native").iterdir()] == [os.path.basename(first["path"])]  # no temporaries left


@pytest.mark.parametrize("env, why", [({"MOETIER_NATIVE": "0"}, "MOETIER_NATIVE=0"),
                                      ({"CC": "/nonexistent/cc"}, "no C compiler"),
                                      ({"CC": "false"}, "false failed")])
def test_without_a_kernel_decode_falls_back_to_torch_ops(tmp_path, env, why):
    got = probe(tmp_path, **env)
    assert not got["on"] and why in got["status"] and "\n" not in got["status"] and got["diff"] < 1e-6
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").iterdir())
