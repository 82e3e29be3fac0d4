"""Every available backend against the numpy reference, on every expert kernel; the registry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from moetier.backends import Backend, BackendError, ExpertWork, available, get_backend
from moetier.backends.numpy_backend import NumpyBackend
from moetier.engine import group_by_expert
from moetier.model import ExpertWeights

D, I, E = 40, 24, 10


def random_experts(seed: int = 0) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ExpertWeights(torch.randn(2 * I, D, generator=g) * 0.3, torch.randn(D, I, generator=g) * 0.3) for _ in range(E)]


def backends_here() -> list[tuple[str, str]]:
    found = [("torch", "cpu")]
    if torch.cuda.is_available():
        found.append(("torch", "cuda"))
        try:
            import cupy  # noqa: F401

            found.append(("cupy", "cuda"))
        except ImportError:
            pass
    return found


def run(backend: Backend, experts, x, picks, weights) -> torch.Tensor:
    placed = [backend.place(w) for w in experts]
    work = [ExpertWork(placed[e], rows, w) for e, rows, w in group_by_expert(picks, weights)]
    out = backend.run_experts(x.to(backend.device), work)
    backend.synchronize()
    return out.cpu()


@pytest.mark.parametrize("name, device", backends_here())
@pytest.mark.parametrize("tokens, k", [(1, 1), (1, 4), (7, 2), (33, 5)])
def test_backend_matches_numpy_reference(name, device, tokens, k):
    g = torch.Generator().manual_seed(tokens * 10 + k)
    experts = random_experts()
    x = torch.randn(tokens, D, generator=g)
    picks = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(tokens)])  # [T, k] distinct per token
    weights = torch.rand(tokens, k, generator=g)
    reference = run(NumpyBackend(), experts, x, picks, weights)
    got = run(get_backend(name, device), experts, x, picks, weights)
    assert torch.allclose(got, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, device", backends_here() + [("numpy", "cpu")])
def test_run_decode_is_run_experts_for_one_token(name, device):
    """run_decode (floats, no per-expert tensors) against run_experts on the same decode step."""
    g = torch.Generator().manual_seed(7)
    experts, x = random_experts(2), torch.randn(1, D, generator=g)
    picks, weights = torch.randperm(E, generator=g)[:4].view(1, 4), torch.rand(1, 4, generator=g)
    backend = get_backend(name, device)
    placed = [backend.place(experts[e]) for e in picks[0].tolist()]
    got = backend.run_decode(x.to(backend.device), placed, weights[0].tolist())
    backend.synchronize()
    assert torch.allclose(got.cpu(), run(NumpyBackend(), experts, x, picks, weights), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="run_decode takes x \\[1, D\\] and one scale per expert"):
        backend.run_decode(x.to(backend.device), placed, [1.0])


@pytest.mark.parametrize("name, device", backends_here() + [("numpy", "cpu")])
def test_one_row_given_to_an_expert_twice_or_not_at_all(name, device):
    """A one-token step whose work lists an expert with the row twice (two weights) and one with no row."""
    g = torch.Generator().manual_seed(3)
    experts, x = random_experts(4), torch.randn(1, D, generator=g)
    backend, numpy = get_backend(name, device), NumpyBackend()
    work = lambda b: [ExpertWork(b.place(experts[1]), torch.tensor([0, 0]), torch.tensor([0.5, 0.25])),  # noqa: E731
                      ExpertWork(b.place(experts[2]), torch.tensor([], dtype=torch.int64), torch.tensor([])),
                      ExpertWork(b.place(experts[3]), torch.tensor([0]), torch.tensor([0.125]))]
    got = backend.run_experts(x.to(backend.device), work(backend))
    backend.synchronize()
    single = [ExpertWork(numpy.place(experts[e]), torch.tensor([0]), torch.tensor([w])) for e, w in ((1, 0.75), (3, 0.125))]
    assert torch.allclose(got.cpu(), numpy.run_experts(x, single), atol=1e-5, rtol=1e-5)


def test_numpy_reference_is_the_plain_formula():
    """The reference itself, against a per-token loop written from the definition."""
    experts = random_experts(1)
    g = torch.Generator().manual_seed(3)
    x, picks, weights = torch.randn(5, D, generator=g), torch.randint(0, E, (5, 1), generator=g), torch.rand(5, 1, generator=g)
    expected = torch.zeros(5, D)
    for t in range(5):
        w = experts[int(picks[t, 0])]
        h = torch.nn.functional.silu(w.gate @ x[t]) * (w.up @ x[t])
        expected[t] = weights[t, 0] * (w.down @ h)
    assert torch.allclose(run(NumpyBackend(), experts, x, picks, weights), expected, atol=1e-5)


def test_group_by_expert_covers_every_pick_once():
    g = torch.Generator().manual_seed(4)
    picks = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(9)])
    weights = torch.rand(9, 3, generator=g)
    seen = {}
    for expert, rows, w in group_by_expert(picks, weights):
        for row, weight in zip(rows.tolist(), w.tolist()):
            seen[(row, expert)] = weight
    expected = {(t, int(picks[t, j])): float(weights[t, j]) for t in range(9) for j in range(3)}
    assert seen == pytest.approx(expected)


def test_registry_names_and_errors():
    assert {"torch", "numpy", "cupy"} <= set(available())
    with pytest.raises(BackendError, match="unknown"):
        get_backend("no-such-backend")


def test_a_backend_without_hooks_fails_loudly():
    class Incomplete(Backend):
        name = "incomplete"

    with pytest.raises(NotImplementedError, match="_run_experts"):
        Incomplete().run_experts(torch.zeros(1, D), [])


def test_placing_non_float32_weights_is_refused():
    with pytest.raises(TypeError, match="float32"):
        NumpyBackend().place(ExpertWeights(torch.zeros(2 * I, D, dtype=torch.float16), torch.zeros(D, I)))


def test_import_moetier_imports_no_backend_module():
    code = "import sys, moetier, moetier.engine, moetier.backends; print(sorted(m for m in sys.modules if m.startswith('cupy') or m.endswith('numpy_backend')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def test_entry_point_backends_are_found(monkeypatch):
    import moetier.backends as registry

    class Point:
        name, value = "third", "moetier.backends.numpy_backend:NumpyBackend"

    monkeypatch.setattr(registry, "entry_points", lambda group: [Point()] if group == "moetier.backends" else [])
    assert registry.available()["third"] == Point.value
    assert isinstance(registry.get_backend("third"), NumpyBackend)


@pytest.mark.gpu
def test_cuda_torch_backend_runs_on_the_device():
    backend = get_backend("torch", "cuda")
    placed = backend.place(random_experts()[0])
    assert placed.gate_up.is_cuda
