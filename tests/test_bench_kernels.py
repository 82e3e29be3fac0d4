"""benchmarks/bench_kernels.py runs end to end (marker `peer`: it calls llama.cpp's vec_dot).

Two formats, small matrices, one round: the JSON line has a figure for each
engine and format, and the two engines' outputs agree within float32 order
(both sum exact integer products per block). The point is that the script runs
and its comparison is of equal results, not the speed.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.peer  # the peer suite fails, never skips, without llama-cpp-python (conftest)


def test_bench_kernels_compares_equal_results(repo_root):
    formats = ("Q4_K", "IQ3_S", "IQ2_XXS", "IQ1_M")
    run = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "bench_kernels.py"), "--formats", ",".join(formats),
                          "--mb", "2", "--runs", "1"], check=False, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert last["bench"] == "kernels" and set(last["formats"]) == set(formats)
    for name, cell in last["formats"].items():
        assert cell["moetier_gb_per_s"] > 0 and cell["llama_cpp_gb_per_s"] > 0 and cell["read_gb_per_s"] > 0, name
        assert cell["max_diff_over_sum_abs"] <= 1e-6, (name, cell)


def test_bench_kernels_refuses_a_format_it_cannot_store(repo_root):
    run = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "bench_kernels.py"), "--formats", "Q4_K,F32"],
                         check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "--formats: 'F32' is not a stored block format" in run.stderr


def test_bench_kernels_refuses_a_library_it_cannot_load(repo_root, tmp_path):
    not_a_library = tmp_path / "libggml-cpu.so"
    not_a_library.write_text("not ELF")
    run = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "bench_kernels.py"), "--formats", "Q4_K",
                          "--llama-cpu-lib", str(not_a_library)], check=False, capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and f"--llama-cpu-lib {not_a_library}: cannot load it" in run.stderr
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr
