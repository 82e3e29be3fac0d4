"""Packaging and environment setup: pyproject.toml and scripts/setup_env.sh.

The fast tests read files only. The slow one runs setup_env.sh for real in a
copy of the repo's packaging files: a fresh .venv gets the CPU build of torch
2.13.0, and a second call is a quick no-op.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import tomllib
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SETUP_SCRIPT = REPO_ROOT / "scripts" / "setup_env.sh"
RUNTIME_DEPS = {"numpy", "torch", "pyzmq", "msgpack", "typer", "rich", "safetensors", "gguf", "matplotlib",  # matplotlib: sweep and simulate plots
                "tokenizers", "jinja2", "fastapi", "uvicorn", "pydantic"}  # text: tokenizers, chat templates, `moetier serve`


def _names(requirements: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9._-]+", r).group(0).lower() for r in requirements}


def _pyproject() -> dict:
    with open(REPO_ROOT / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_pyproject_entry_point_and_dependencies():
    project = _pyproject()["project"]
    assert project["scripts"]["moetier"] == "moetier.cli:main"
    assert _names(project["dependencies"]) == RUNTIME_DEPS
    extras = project["optional-dependencies"]
    assert {n.split("-")[0] for n in _names(extras["cuda"])} == {"cupy"}
    assert _names(extras["dev"]) == {"pytest", "pytest-timeout", "hypothesis", "transformers", "openai"}
    assert extras["peer"] == ["llama-cpp-python==0.3.36"]  # pinned: the oracle's numbers must not move under the tests


@pytest.mark.parametrize("script", ["scripts/setup_env.sh", "scripts/ab_bench.sh", ".ci/run"])
def test_shell_scripts_parse(script):
    result = subprocess.run(["bash", "-n", str(REPO_ROOT / script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _has_gpu() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return any(line.startswith("GPU ") for line in out.splitlines())


@pytest.mark.slow
def test_setup_env_installs_cpu_torch_and_second_call_is_a_noop(tmp_path):
    if _has_gpu():
        pytest.skip("a GPU is present: setup_env.sh would install a CUDA build of torch")
    repo = tmp_path / "repo"
    (repo / "moetier").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "pyproject.toml", repo)
    shutil.copytree(REPO_ROOT / "scripts", repo / "scripts")
    (repo / "moetier" / "__init__.py").write_text('"""stub"""\n')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("MOETIER_") and k not in ("VIRTUAL_ENV", "PYTHONPATH")}

    def setup() -> tuple[str, float]:
        t0 = time.perf_counter()
        result = subprocess.run(["bash", "scripts/setup_env.sh"], cwd=repo, env=env,
                                capture_output=True, text=True, timeout=1500)
        elapsed_s = time.perf_counter() - t0
        assert result.returncode == 0, result.stdout + result.stderr
        return result.stdout, elapsed_s

    first_out, _ = setup()
    assert "installing torch==2.13.0 (CPU build)" in first_out
    probe = "import torch, moetier; print(torch.__version__, torch.version.cuda)"
    out = subprocess.run([str(repo / ".venv/bin/python"), "-c", probe],
                         capture_output=True, text=True, check=True).stdout.split()
    assert out == ["2.13.0+cpu", "None"]

    stamp = (repo / ".venv" / ".moetier-setup").read_text()
    second_out, second_s = setup()
    assert "up to date" in second_out
    assert second_s < 5.0, f"second setup call took {second_s:.1f} s"
    assert (repo / ".venv" / ".moetier-setup").read_text() == stamp
