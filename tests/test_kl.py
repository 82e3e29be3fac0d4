"""Teacher-forced KL and the sweep: the seed's orderings on the synthetic model, asserted as orderings."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.engine import Engine
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.profile.bias import build_table
from moetier.profile.brightness import profile_requests
from moetier.profile.kl import Candidate, kl_per_position, measure_kl, reference_logits
from moetier.profile.sessions import load_sessions, write_example_sessions
from moetier.profile.sweep import Arm, SweepResult, equal_kl_rows, hit_rate_at
from layouts import cache_layout


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_next", "glm5_next"])
def tiny(request, tmp_path_factory):
    """The synthetic tiny model of an arch: qwen3_next the softmax-router hybrid (its linear layers carrying state),
    glm5_next the sigmoid-router one (its bias in probability space: caps ~10x smaller)."""
    root = tmp_path_factory.mktemp("kl")
    folder = write_synthetic(root / "tiny", arch=request.param, preset="tiny", seed=0)
    sessions = write_example_sessions(folder, root / "s.jsonl", sessions=3, tokens_per_phase=64)
    checkpoint = open_checkpoint(folder)
    requests = load_sessions(sessions, folder, checkpoint.spec.vocab_size)
    return checkpoint, requests, profile_requests(Engine(checkpoint), requests), root, sessions


def test_kl_per_position_is_zero_on_itself_and_matches_the_definition():
    rng = np.random.default_rng(0)
    p, q = rng.normal(size=(5, 11)).astype(np.float32), rng.normal(size=(5, 11)).astype(np.float32)
    assert np.array_equal(kl_per_position(p, p), np.zeros(5))
    lp = p - np.log(np.exp(p.astype(np.float64)).sum(-1, keepdims=True))
    lq = q - np.log(np.exp(q.astype(np.float64)).sum(-1, keepdims=True))
    np.testing.assert_allclose(kl_per_position(p, q), (np.exp(lp) * (lp - lq)).sum(-1), rtol=1e-9)
    assert (kl_per_position(p, q) > 0).all()


def test_the_plain_candidate_costs_nothing_and_its_floor_is_zero(tiny):
    checkpoint, requests, _, _, _ = tiny
    result = measure_kl(checkpoint, requests[:2], Candidate())
    assert result.mean_kl == 0.0 and result.floor_kl == 0.0 and result.top1_agreement == 1.0


def test_the_seeds_kl_orderings_hold_on_the_synthetic_model(tiny):
    checkpoint, requests, profile, root, _ = tiny
    reference = reference_logits(checkpoint, requests)
    space = 0.1 if checkpoint.spec.router == "sigmoid" else 1.0  # probability-space caps for a sigmoid router

    def kl(kind: str, cap: float):
        path = build_table(profile, 6, kind, cap * space).save(root / f"{kind}{cap}.safetensors")
        return measure_kl(checkpoint, requests, Candidate(bias=path), floor=False, reference=reference)

    hard, graded_1, graded_05 = kl("hard", 0.0), kl("graded", -1.0), kl("graded", -0.5)
    assert hard.mean_kl > graded_1.mean_kl > graded_05.mean_kl > 0
    assert hard.top1_agreement < graded_05.top1_agreement
    weak, strong = kl("flat", -0.25), kl("flat", -1.0)
    assert 0 < weak.mean_kl < strong.mean_kl
    if checkpoint.spec.router == "sigmoid":  # tiny GLMs' cold family does not drift more than the mean (glm4_moe's
        return  # neither: 4.4e-4 against 1.2e-3 at graded -0.1); the sigmoid sweep test (small) covers them
    for result in (graded_1, graded_05, weak, strong, hard):  # the cold family drifts more than the pooled mean
        assert result.per_family["second_language"] > result.mean_kl


def test_kl_command_reports_phases_families_and_floor(tiny, tmp_path):
    checkpoint, _, profile, _, sessions = tiny
    table = build_table(profile, 6, "graded", -0.5).save(tmp_path / "t.safetensors")
    result = CliRunner().invoke(app, ["kl", "--model", str(checkpoint.folder), "--sessions", str(sessions), "--bias", str(table), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert set(report["per_phase"]) == {"explore", "edit", "verify", "second_language"}
    assert set(report["per_family"]) == {"common", "explore", "edit", "verify", "second_language"}
    assert report["floor_kl"] == 0.0 and report["mean_kl"] > 0 and report["positions"] == 10 * 64
    both = CliRunner().invoke(app, ["kl", "--model", str(checkpoint.folder), "--affinity", "0.25", "--sessions", str(sessions)])
    assert both.exit_code == 2 and "live expert cache" in both.stderr


def test_equal_kl_reads_each_curve_by_interpolation():
    arms = [Arm("plain", "plain", 0, kl=0.0, hit_rate=0.5), Arm("t", "table", -1, kl=0.02, hit_rate=0.6),
            Arm("a1", "affinity", 0.5, kl=0.01, hit_rate=0.6), Arm("a2", "affinity", 1, kl=0.03, hit_rate=0.8)]
    result = SweepResult("m", "l", "graded", 4, 10, 0.0, arms)
    assert hit_rate_at(result.curve("affinity"), 0.02) == pytest.approx(0.7)
    assert equal_kl_rows(result) == [{"kl": 0.02, "table_hit_rate": 0.6, "affinity_hit_rate": pytest.approx(0.7)}]


SWEEP_LAYOUT = cache_layout(slots=8, policy="lru", rtt_us=20.0, cpu_threads=2, scheduler="budget_us = 5000.0\ndefer_cpu = 0\n")


def test_sweep_hit_rate_rises_as_the_cap_falls_and_affinity_wins_at_equal_kl(tmp_path):
    """small: 48 experts, top-6, an LRU cache of 8 slots per layer; tables' hot set = the 8 slots."""
    folder = write_synthetic(tmp_path / "small", arch="qwen3_moe", preset="small", seed=0)
    sessions = write_example_sessions(folder, tmp_path / "s.jsonl", sessions=2, tokens_per_phase=24)
    (tmp_path / "layout.toml").write_text(SWEEP_LAYOUT)
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["sweep", "--model", str(folder), "--sessions", str(sessions), "--layout",
                                      str(tmp_path / "layout.toml"), "--caps=-0.25,-0.5,-1", "--lambdas", "0.25,0.5,1",
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    arms = {arm["name"]: arm for arm in report["arms"]}
    hit = [arms[name]["hit_rate"] for name in ("plain", "table graded cap -0.25", "table graded cap -0.5", "table graded cap -1")]
    assert hit == sorted(hit) and hit[0] < hit[-1], hit
    rows = report["equal_kl"]
    assert rows and all(r["affinity_hit_rate"] > r["table_hit_rate"] for r in rows), rows
    assert report["floor_kl"] < 1e-9 and report["hot"] == 8
    for name in ("sweep.md", "sweep.json", "kl_vs_hit_rate.png", "tok_s_vs_kl.png"):
        assert (out / name).stat().st_size > 0
    assert "| affinity 0.5 |" in (out / "sweep.md").read_text()
    assert len(list((out / "tables").glob("*.safetensors"))) == 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["glm4_moe", "glm5_next"])
def test_sweep_orderings_hold_for_a_sigmoid_router_with_probability_space_caps(tmp_path, arch):
    """A GLM small: the bias lives in probability space, so caps and lambdas are ~10x smaller (the defaults)."""
    from moetier.profile.sweep import run_sweep

    folder = write_synthetic(tmp_path / "glm", arch=arch, preset="small", seed=0)
    sessions = write_example_sessions(folder, tmp_path / "s.jsonl", sessions=2, tokens_per_phase=32)
    (tmp_path / "layout.toml").write_text(SWEEP_LAYOUT.replace("slots = 8", "slots = 12"))
    checkpoint = open_checkpoint(folder)
    requests = load_sessions(sessions, folder, checkpoint.spec.vocab_size)
    result = run_sweep(checkpoint, requests, tmp_path / "layout.toml", [-0.025, -0.05, -0.1], [0.025, 0.05, 0.1], tmp_path / "out")
    hit = [arm.hit_rate for arm in result.arms if arm.method in ("plain", "table")]  # plain, then caps falling
    assert hit == sorted(hit) and hit[0] < hit[-1], hit
    rows = equal_kl_rows(result)
    assert rows and all(r["affinity_hit_rate"] > r["table_hit_rate"] for r in rows), rows
