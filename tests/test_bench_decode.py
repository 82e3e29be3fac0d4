"""benchmarks/bench_decode.py runs end to end (marker `peer`: it runs llama.cpp, `make test-peer` installs it).

The tiny preset, F32 and Q8_0, 4 tokens, 1 run, no waiting for a quiet
machine: the JSON line names every engine x format cell (numbers, or an error
string), and every measured cell's share of the read roofline is a number in
(0, 10]. The point is that the script runs and says what it measured, not the
speed.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

pytestmark = pytest.mark.peer  # the peer suite fails, never skips, without llama-cpp-python (conftest)
ENGINES = ("moetier", "llama.cpp", "transformers")
FORMATS = ("F32", "Q8_0")


def test_bench_decode_runs_on_the_tiny_preset(repo_root, tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "bench_decode.py"), "--preset", "tiny",
                          "--formats", ",".join(FORMATS), "--tokens", "4", "--runs", "1", "--threads", "2",
                          "--quiet-wait", "0", "--retries", "0", "--models", str(tmp_path / "models"), "--json", str(out)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    last = json.loads(run.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text()) == last
    assert {"cpu", "flags", "threads", "date", "git_commit"} <= set(last["machine"])
    assert set(last["machine"]["flags"]) == {"avx2", "avx512", "vnni", "amx"}
    assert last["llama_model_params"] == {"use_extra_bufts": False}
    assert all(v > 0 for v in last["read_bandwidth"]["bytes_per_s"].values())
    for samples in last["read_bandwidth"]["samples_bytes_per_s"].values():  # the roofline: the faster reader
        assert all(set(s) == {"torch.sum", "native", "native plain", "best"}
                   and s["best"] == max(v for name, v in s.items() if name != "best") for s in samples)
    for engine in ENGINES:
        for fmt in FORMATS:
            cell = last["cells"][engine][fmt]
            if "decode_tok_per_s" not in cell:
                assert isinstance(cell["error"], str) and cell["error"], (engine, fmt, cell)
                continue
            for key in ("decode_tok_per_s", "prefill_tok_per_s"):
                assert math.isfinite(cell[key]) and cell[key] > 0, (engine, fmt, key, cell[key])
            assert 0 < cell["roofline_share"] <= 10, (engine, fmt, cell["roofline_share"])
            # every pass between two bandwidth samples (the one before it, the one after), its share against them
            best = last["read_bandwidth"]["bytes_per_s"]["2"]
            assert len(cell["bandwidth_beside_runs"]) == len(cell["decode_runs"]) == len(cell["local_roofline_share_runs"])
            assert all(0 < b <= best for pair in cell["bandwidth_beside_runs"] for b in pair)
            assert min(cell["local_roofline_share_runs"]) >= cell["roofline_share"] * min(cell["decode_runs"]) / cell["decode_tok_per_s"] * (1 - 1e-9)
            top, usual = cell["top_level"], cell["usual_level"]
            median = last["read_bandwidth"]["usual_bytes_per_s"]
            assert top["passes"] == sum(min(pair) >= 0.85 * best for pair in cell["bandwidth_beside_runs"])
            assert usual["passes"] == sum(all(abs(b / median - 1) <= 0.15 for b in pair) for pair in cell["bandwidth_beside_runs"])
            for level in (top, usual):
                assert (level["decode_tok_per_s"] is None) == (level["passes"] == 0)
                assert (level["decode_tok_per_s"] or 0) <= cell["decode_tok_per_s"]
    assert last["cells"]["transformers"]["F32"].get("decode_tok_per_s"), "transformers on the HF float32 checkpoint did not run"
    samples = [s["best"] for s in last["read_bandwidth"]["samples_bytes_per_s"]["2"]]
    assert sorted(samples)[(len(samples) - 1) // 2] <= last["read_bandwidth"]["usual_bytes_per_s"] <= sorted(samples)[len(samples) // 2]
    assert "read roofline" in run.stdout and "use_extra_bufts" in run.stdout and "at the top bandwidth level" in run.stdout
    assert "at the usual bandwidth level" in run.stdout


def test_bench_decode_runs_a_checkpoint_of_ones_own(repo_root, tmp_path):
    """--checkpoint: a transformers-written Qwen3-MoE folder (no tokenizer, no moetier metadata; written by
    scripts/make_qwen3moe_checkpoint.py, small) is converted, run by all three engines, and named in the JSON by
    its config's model_type and its folder."""
    folder = tmp_path / "mine"
    subprocess.run([sys.executable, str(repo_root / "scripts" / "make_qwen3moe_checkpoint.py"), str(folder), "--layers", "2",
                    "--experts", "8", "--top-k", "2", "--hidden", "64", "--width", "32", "--heads", "4", "--kv-heads", "2",
                    "--vocab", "512"], check=True, capture_output=True, timeout=300)
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "bench_decode.py"), "--checkpoint", str(folder),
                          "--formats", "F32", "--tokens", "4", "--runs", "1", "--threads", "2", "--quiet-wait", "0",
                          "--retries", "0", "--models", str(tmp_path / "models"), "--json", str(out)],
                         check=False, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    last = json.loads(out.read_text())
    assert (last["arch"], last["preset"]) == ("qwen3_moe", "mine")
    for engine in ENGINES:
        assert last["cells"][engine]["F32"]["decode_tok_per_s"] > 0, (engine, last["cells"][engine]["F32"])
    assert last["cells"]["moetier"]["F32"]["same_greedy_tokens_as_transformers"] == 5  # the prefill's token and 4 steps


@pytest.mark.parametrize("config, why", [(None, "no readable config.json"), ({"model_type": "qwen3_moe", "vocab_size": 8}, "no *.safetensors")])
def test_bench_decode_refuses_a_folder_that_is_no_checkpoint(repo_root, tmp_path, config, why):
    if config is not None:
        (tmp_path / "config.json").write_text(json.dumps(config))
    run = subprocess.run([sys.executable, str(repo_root / "benchmarks" / "bench_decode.py"), "--checkpoint", str(tmp_path)],
                         check=False, capture_output=True, text=True, timeout=120)
    last = run.stderr.strip().splitlines()[-1]  # argparse's usage, then one line: what, where, what was expected
    assert run.returncode == 2 and last.startswith("bench_decode.py: error: --checkpoint") and why in last, run.stderr
