"""Shared pytest fixtures for moetier's tests.

The repo lives beside a read-only `shared/` folder (design notes, routing
traces); fixtures that need it skip with a reason when it is absent. Tests
marked `gpu` are skipped unless torch sees a CUDA device; torch is imported
only when such a test is about to run. torch's thread count is left as is.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """`../shared` beside the repo (it may not exist outside CI and the workspace)."""
    return REPO_ROOT.parent / "shared"


@pytest.fixture(scope="session")
def traces_dir(shared_dir: Path) -> Path:
    path = shared_dir / "traces"
    if not path.is_dir():
        pytest.skip(f"routing traces not found: {path} is absent (shared/ is not beside the repo)")
    return path


@pytest.fixture(scope="session")
def synth_models(tmp_path_factory):
    """(arch, preset, fused) -> model dir, each written once per session."""
    from moetier.model.synth import write_synthetic

    root = tmp_path_factory.mktemp("synth")
    cache = {}

    def get(arch, preset="tiny", fused=False):
        key = (arch, preset, fused)
        if key not in cache:
            out = root / f"{arch}-{preset}-{int(fused)}"
            cache[key] = write_synthetic(out, arch, preset, seed=0, fused=fused)
        return cache[key]

    return get


@functools.cache
def _cuda_available() -> bool:
    import torch  # lazily: collecting tests must not pay for (or need) torch

    return torch.cuda.is_available()


@pytest.fixture(autouse=True)
def _peer_tests_need_llama_cpp(request: pytest.FixtureRequest) -> None:
    """A peer test without llama.cpp fails (it is never skipped: the comparison would silently not happen)."""
    if request.node.get_closest_marker("peer") is not None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError as err:
            pytest.fail(f"peer test without llama-cpp-python ({err}); run `make test-peer`, which installs it", pytrace=False)


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None and not _cuda_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
