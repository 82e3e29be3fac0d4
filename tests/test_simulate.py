"""The layout simulator: layout -> tier loads -> prediction on hand-checked cases, sweeps, the CLI, the seed.

`moetier simulate` runs as a real process, but for its refusals of bad input (in this process, cli_runs.moetier_here,
one of them as a real process).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import OrderedDict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from cli_runs import moetier, moetier_here, refused
from moetier.config import load_layout
from moetier.sched.cost import Calibration
from moetier.sim.layout_sim import (ModelShape, hit_rate_curves, inclusion_probabilities, load_trace,
                                    sample_trace, simulate, sweep, with_value)
from moetier.sim.replay import replay
from moetier.sim.traces import RoutingTrace, synthetic_trace

REPO = Path(__file__).resolve().parents[1]
CAL = Calibration(cpu_us_per_expert=100.0, cpu_us_per_token_expert=5.0, gpu_us_per_expert=20.0, gpu_us_per_token_expert=1.0,
                  attention_us_per_layer=100.0, head_us=50.0, dispatch_us_per_layer=10.0, cpu_lane_fixed_us=10.0)
SHAPE = ModelShape(2, (0, 1), 4, 2, 1000, 64, "hand")

LAYOUT = """
name = "hand"
[[hosts]]
name = "h"
[[devices]]
name = "gpu0"
host = "h"
kind = "cuda"
[[links]]
name = "pcie"
rtt_us = 10.0
gbps = 64.0
[[links]]
name = "lan"
rtt_us = 167.0
gbps = 2.5
[[parts]]
name = "all"
device = "gpu0"
layers = "0:"
[[tiers]]
name = "vram"
kind = "vram"
device = "gpu0"
slots = 2
policy = "{policy}"
{profile}
link = "pcie"
[[tiers]]
name = "cpu"
kind = "cpu"
host = "h"
{extra}
[scheduler]
budget_us = {budget}
tail_skip = {skip}
"""
REMOTE = '[[tiers]]\nname = "far"\nkind = "remote"\naddress = "tcp://far:5555"\nlink = "lan"\nexperts = "all"\n'


def make_layout(tmp_path, policy="static", budget=5000.0, skip=False, extra=""):
    np.save(tmp_path / "profile.npy", np.array([[9.0, 8.0, 1.0, 0.0]] * 2))  # experts 0 and 1 resident
    profile = 'profile = "profile.npy"' if policy == "static" else ""
    path = tmp_path / "layout.toml"
    path.write_text(LAYOUT.format(policy=policy, profile=profile, budget=budget, skip=str(skip).lower(), extra=extra))
    return load_layout(path)


def constant_trace(tokens=10, picks=(0, 2)):
    table = np.tile(np.array(picks), (tokens, 2, 1))  # [T, L, k]
    return RoutingTrace(picks=table, weights=np.full(table.shape, 0.5), num_experts=4, layer_ids=(0, 1))


def test_one_hit_one_miss_per_layer_by_hand(tmp_path):
    sim = simulate(make_layout(tmp_path), SHAPE, CAL, constant_trace())
    # per layer: attention 100, dispatch 10; lane 10 + 100 from there while the GPU computes its hit (20), then waits 90
    assert sim.prediction.pass_ms == pytest.approx((2 * 220 + 50) / 1e3)
    assert sim.prediction.ms_per_token == pytest.approx({"attention": 0.2, "dispatch": 0.02, "gpu experts": 0.04,
                                                         "cpu lane wait (part 0)": 0.18, "head": 0.05, "transfers": 0.0})
    assert sim.hit_rate == 0.5 and sim.served_per_token == {"vram": 2.0, "cpu": 2.0}
    assert sim.prediction.busy_ms_per_token == pytest.approx({"vram": 0.04, "cpu": 0.22})


def test_tail_skip_drops_the_miss_past_the_budget(tmp_path):
    sim = simulate(make_layout(tmp_path, budget=50.0, skip=True), SHAPE, CAL, constant_trace())
    assert sim.skipped_per_token == 2.0 and sim.served_per_token["cpu"] == 0.0
    assert sim.prediction.pass_ms == pytest.approx((2 * 130 + 50) / 1e3)


def test_a_verify_pass_shares_experts_across_its_rows(tmp_path):
    sim = simulate(make_layout(tmp_path), SHAPE, CAL, constant_trace(), rows_per_pass=2, tokens_per_pass=1.5)
    # each expert serves both rows: lane 10 + 100 + 5, GPU 20 + 1
    assert sim.prediction.pass_ms == pytest.approx((2 * (110 + 115) + 50) / 1e3)
    assert sim.tok_per_s == pytest.approx(1.5 / 0.5e-3)


def test_lru_hits_equal_a_straightforward_cache(tmp_path):
    trace = synthetic_trace(400, 2, 4, 2, seed=3)
    sim = simulate(make_layout(tmp_path, policy="lru"), SHAPE, CAL, trace)
    hits = 0
    for layer in range(2):
        cache: OrderedDict[int, None] = OrderedDict()
        for token in trace.picks[:, layer].tolist():
            hits += sum(e in cache for e in token)
            for e in token:  # picks are used together: refresh all, then evict the least recent others
                cache[e] = None
                cache.move_to_end(e)
            while len(cache) > 2:
                cache.popitem(last=False)
    assert sim.hit_rate == pytest.approx(hits / (400 * 2 * 2))
    assert sim.hit_rate == pytest.approx(replay(trace, "lru", 2).hit_rate)


def test_experts_rules_of_helper_and_remote_tiers():
    """One rule, read by both build_runtime and the simulator (TierConfig.held_experts)."""
    from moetier.config import TierConfig

    bright = np.array([0.1, 5.0, 3.0, 0.0, 2.0])
    held = lambda rule, brightness=bright: TierConfig("t", "helper", experts=rule).held_experts(2, 5, brightness)  # noqa: E731
    assert held("hot") == [1, 2] and held("cold") == [0, 3] and held("") == [1, 2]
    assert held("all") == [0, 1, 2, 3, 4] and held("1:3") == [1, 2] and held("3:") == [3, 4]
    assert held("hot", None) == [0, 1]  # without a profile: the lowest ids
    with pytest.raises(ValueError, match="expected hot, cold, all"):
        held("warm")


def test_remote_round_trips_slow_decode_as_rtt_grows(tmp_path):
    layout = make_layout(tmp_path, extra=REMOTE)
    trace = synthetic_trace(200, 2, 4, 2, seed=1)
    speeds = [s.tok_per_s for _, s in sweep(layout, SHAPE, CAL, trace, "rtt_us", [0, 100, 1000])]
    assert speeds[0] >= speeds[1] >= speeds[2]
    far = simulate(with_value(layout, "rtt_us", 0), SHAPE, CAL, trace)
    assert far.served_per_token["far"] > 0  # at no round trip the remote takes misses off the lane
    with pytest.raises(ValueError, match="no remote tier"):
        with_value(make_layout(tmp_path), "rtt_us", 10)


def test_slots_and_lambda_sweeps(tmp_path):
    layout = make_layout(tmp_path, policy="lru")
    trace = synthetic_trace(300, 2, 4, 2, seed=2)
    rates = [s.hit_rate for _, s in sweep(layout, SHAPE, CAL, trace, "slots", [2, 3, 4])]
    assert rates[0] < rates[1] < rates[2] == 1.0 - 4 * 2 / (300 * 2 * 2)  # all resident: only the first touches miss
    with pytest.raises(ValueError, match="probabilities"):
        sweep(layout, SHAPE, CAL, trace, "lambda", [0.5])
    probs = np.random.default_rng(0).random((300, 2, 4)).astype(np.float16)
    picks = np.argsort(-probs.astype(np.float32), axis=-1)[..., :2]
    scored = RoutingTrace(picks=picks, weights=np.full(picks.shape, 0.5), probs=probs, num_experts=4, layer_ids=(0, 1))
    plain, biased = (s.hit_rate for _, s in sweep(layout, SHAPE, CAL, scored, "lambda", [0.0, 1.0]))
    assert biased > plain


def test_hit_rate_curves_stay_under_belady():
    trace = synthetic_trace(300, 3, 16, 2, seed=4)
    curves = hit_rate_curves(trace, [2, 4, 8])
    assert set(curves) == {"static", "lru", "lfu", "xlayer", "belady"}
    for policy in ("static", "lru", "lfu"):  # xlayer prefetches: Belady with bypass does not bound it
        assert all(rate <= bound + 1e-12 for rate, bound in zip(curves[policy], curves["belady"]))


def test_sampled_traces_have_the_asked_inclusion_probabilities():
    shares = np.array([[10.0, 1, 1, 1, 1, 1], [3.0, 3, 2, 1, 1, 0]])
    q = inclusion_probabilities(shares, 2)
    assert q.sum(1) == pytest.approx([2, 2]) and q.max() <= 1 and q[0, 0] == 1.0
    trace = sample_trace(shares, 2, 20000, seed=1)
    assert (trace.picks[..., 0] != trace.picks[..., 1]).all()
    assert trace.counts() / 20000 == pytest.approx(q, abs=0.015)


def test_sampled_reuse_repeats_picks_at_the_asked_chance_and_keeps_each_tokens_marginal():
    """`sample_trace(reuse=rho)`: a token repeats the previous token's picks with chance rho. Its excess overlap
    (moetier.sim.reuse) is rho, each expert's inclusion stays the profile's, and a 4-row pass holds the distinct
    experts that 1 + Binomial(3, 1 - rho) independent tokens hold: sum_e 1 - (1 - q_e)^n."""
    from moetier.sim.reuse import distinct_per_window, excess_overlap

    shares = np.stack([(np.arange(1, 49) + 2.0) ** -1.2, np.exp(-np.arange(48) / 9.0)])  # [2, 48]
    q = inclusion_probabilities(shares, 4)  # [2, 48]
    tokens = 40000
    plain = sample_trace(shares, 4, tokens, seed=1)
    assert np.array_equal(sample_trace(shares, 4, tokens, seed=1, reuse=0.0).picks, plain.picks)  # the default is unchanged
    reused = sample_trace(shares, 4, tokens, seed=1, reuse=0.3)
    assert excess_overlap(plain) == pytest.approx([0.0, 0.0], abs=0.01)
    assert excess_overlap(reused) == pytest.approx([0.3, 0.3], abs=0.015)
    assert reused.counts() / tokens == pytest.approx(q, abs=0.015)
    independent = lambda n: (1 - (1 - q) ** n).sum(1).mean()  # noqa: E731  distinct experts of n independent tokens
    fresh = {n: p for n, p in zip(range(1, 5), [0.3 ** 3, 3 * 0.3 ** 2 * 0.7, 3 * 0.3 * 0.7 ** 2, 0.7 ** 3])}  # P(n fresh rows)
    assert distinct_per_window(plain, 4) == pytest.approx(independent(4), rel=0.005)
    assert distinct_per_window(reused, 4) == pytest.approx(sum(p * independent(n) for n, p in fresh.items()), rel=0.005)
    assert distinct_per_window(reused, 4) < distinct_per_window(plain, 4) - 1
    with pytest.raises(ValueError, match="reuse"):
        sample_trace(shares, 4, 10, reuse=1.0)


def test_run_traces_load_and_shapes_must_match(tmp_path):
    picks = np.array([[[0, 1], [2, 3]]] * 5, np.int16)
    meta = {"fingerprint": "f", "top_k": 2, "num_experts": 4, "layers": [0, 1], "tier_names": ["vram", "cpu"]}
    np.savez_compressed(tmp_path / "run.npz", picks=picks, weights=np.ones(picks.shape, np.float16),
                        probs=np.ones((5, 2, 4), np.float16), tiers=np.zeros(picks.shape, np.int8), metadata=np.array(json.dumps(meta)))
    trace = load_trace(tmp_path / "run.npz")
    assert trace.num_experts == 4 and trace.layer_ids == (0, 1) and trace.probs is not None
    with pytest.raises(ValueError, match="expected 2 x 8"):
        simulate(make_layout(tmp_path), replace(SHAPE, num_experts=8), CAL, trace)


def moetier_simulate(*args, run=moetier) -> subprocess.CompletedProcess:
    """`moetier simulate ARGS` from the repository root; run is moetier (a real process) or moetier_here."""
    return run("simulate", *args, cwd=REPO)


def test_cli_json_sweep_and_plots(tmp_path):
    layout = make_layout(tmp_path, policy="lru")
    synthetic_trace(200, 2, 4, 2, seed=5).save(tmp_path / "trace.npz")
    result = moetier_simulate("--layout", layout.path, "--trace", tmp_path / "trace.npz", "--expert-bytes", 1000, "--json",
                     "--sweep", "slots=2,3", "--plot", tmp_path / "plots")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["decode_tok_per_s"] > 0 and {"attention", "dispatch", "head"} <= set(report["ms_per_token"])
    assert [p["value"] for p in report["sweep"]["points"]] == [2, 3]
    assert {Path(p).name for p in report["plots"]} == {"hit_rate_vs_slots.png", "tok_s_vs_slots.png"}


def test_the_seeds_qwen_geometry_is_a_named_shape(tmp_path):
    """Qwen3-Next-80B-A3B as IQ3_S: 48 MoE layers x 512 experts, top-10, 1.35 MB an expert, replayed from a trace of
    that geometry (the synthetic Qwen3-Next-like generator's)."""
    layout = make_layout(tmp_path, policy="lru")
    synthetic_trace(120, 48, 512, 10, seed=2).save(tmp_path / "trace.npz")
    result = moetier_simulate("--layout", layout.path, "--trace", tmp_path / "trace.npz", "--shape", "qwen3-next-80b-a3b-iq3_s",
                              "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["decode_tok_per_s"] > 0
    assert sum(report["experts_served_per_token"].values()) == pytest.approx(48 * 10)


def test_defer_cpu_defers_into_linear_attention_layers_only_where_the_layout_opts_in(tmp_path):
    """The engine's rule on a hybrid shape (3 of 4 layers linear): DEFER_CPU=2 defers only into full-attention layers,
    a slower prediction than deferring into every layer; [scheduler].defer_into_linear (or --defer-into-linear)
    restores that one, which is the prediction of the shape without linear layers; DEFER_CPU=0 ignores it."""
    from moetier.sim.layout_sim import every_fourth_full

    # experts of 10 MB: a miss is cheaper on the lane (100 us) than fetched over PCIe, so the lane has work to defer
    hybrid = ModelShape(8, tuple(range(8)), 4, 2, 10_000_000, 64, "hybrid", linear_layers=every_fourth_full(8))
    layout, trace = make_layout(tmp_path, policy="lru", budget=5000.0), synthetic_trace(200, 8, 4, 2, seed=1)
    speed = lambda shape, **scheduler: simulate(layout.with_scheduler(**scheduler), shape, CAL, trace)  # noqa: E731
    engine_rule, seed_rule = speed(hybrid, defer_cpu=2), speed(hybrid, defer_cpu=2, defer_into_linear=True)
    everywhere = speed(replace(hybrid, linear_layers=()), defer_cpu=2)  # what the simulator predicted before
    assert seed_rule.prediction.pass_ms == everywhere.prediction.pass_ms < engine_rule.prediction.pass_ms
    assert speed(hybrid, defer_cpu=0).prediction == speed(hybrid, defer_cpu=0, defer_into_linear=True).prediction
    assert any("defers 2 of 8 MoE layers: not into linear" in note for note in engine_rule.notes), engine_rule.notes
    assert any("defers 7 of 8 MoE layers: into linear" in note for note in seed_rule.notes), seed_rule.notes


def test_named_hybrid_shapes_and_checkpoints_carry_their_linear_layers(tmp_path):
    """GLM-5.3-Flash (KDA) and Qwen3-Next (Gated DeltaNet): every 4th layer full attention, as their specs read the
    configs; a checkpoint's shape carries its spec's, plain MoE models none; so `moetier simulate --model` predicts
    a moetier run of a hybrid model by the engine's rule unless asked (--defer-into-linear)."""
    from moetier.model import open_checkpoint
    from moetier.model.synth import write_synthetic
    from moetier.sched.placement import ModelShape as PlacedShape
    from moetier.sim.layout_sim import SHAPES

    assert SHAPES["glm-5.3-flash-ud-iq3_xxs"].linear_layers == tuple(l for l in range(45) if l % 4 != 3)
    assert SHAPES["qwen3-next-80b-a3b-iq3_s"].linear_layers == tuple(l for l in range(48) if (l + 1) % 4)
    assert SHAPES["glm-4.5-air-q4k"].linear_layers == ()
    for arch in ("qwen3_next", "glm5_next", "qwen3_moe"):
        checkpoint = open_checkpoint(write_synthetic(tmp_path / arch, arch=arch, preset="tiny", seed=0))
        assert PlacedShape.from_checkpoint(checkpoint).linear_layers == checkpoint.spec.linear_layers
        assert bool(checkpoint.spec.linear_layers) == (arch != "qwen3_moe")
    spec = open_checkpoint(tmp_path / "qwen3_next").spec  # layers 0-2 linear, 3 full
    synthetic_trace(200, len(spec.moe_layers), spec.num_experts, spec.top_k, seed=1).save(tmp_path / "trace.npz")
    path = tmp_path / "defer.toml"
    path.write_text(make_layout(tmp_path, policy="lru").path.read_text().replace("tail_skip", "defer_cpu = 2\ntail_skip"))
    reports = [json.loads(moetier_simulate("--layout", path, "--trace", tmp_path / "trace.npz", "--model", tmp_path / "qwen3_next",
                                           "--json", *flag, run=moetier_here).stdout) for flag in ([], ["--defer-into-linear"])]
    assert [r["defer_into_linear"] for r in reports] == [False, True] and reports[0]["linear_layers"] == [0, 1, 2]
    assert reports[0]["decode_tok_per_s"] < reports[1]["decode_tok_per_s"]  # only layer 2 defers (into layer 3) by default


@pytest.mark.parametrize("args, message", [
    (["--trace", "missing.npz", "--expert-bytes", 1000], "missing.npz"),
    (["--shape", "qwen3-next-80b-a3b-iq3_s"], "expected 48 x 512"),
    (["--expert-bytes", 1000, "--sweep", "threads=2"], "--sweep"),
    (["--shape", "glm-4.5-air-q4k"], "expected 42 x 128"),
    (["--shape", "glm-5.3-flash-ud-iq3_xxs"], "expected 42 x 288"),
    ([], "no model shape"),
])
def test_cli_bad_input_is_one_line_and_exit_2(tmp_path, args, message):
    layout = make_layout(tmp_path)
    synthetic_trace(20, 2, 4, 2, seed=5).save(tmp_path / "trace.npz")
    base = ["--layout", layout.path] + ([] if "--trace" in args else ["--trace", tmp_path / "trace.npz"])
    run = moetier if message == "missing.npz" else moetier_here  # one as a real process: its exit status and stderr
    refused(moetier_simulate(*base, *[tmp_path / a if a == "missing.npz" else a for a in args], run=run), message)


def test_the_seed_example_loads():
    """GLM-5.3-Flash's geometry: 45 layers (3 dense), 42 MoE of 288 experts, UD-IQ3_XXS experts of 10.9 MB."""
    from moetier.sched.placement import place
    from moetier.sim.layout_sim import SHAPES

    layout = load_layout(REPO / "examples" / "i7-i5.toml")
    calibration = Calibration.load(layout.relative(layout.scheduler.calibration))
    shape = SHAPES["glm-5.3-flash-ud-iq3_xxs"]
    assert calibration.expert_bytes == shape.expert_bytes == 10_878_976 and [p.name for p in layout.parts] == ["first", "second"]
    assert (shape.num_layers, len(shape.moe_layers), shape.num_experts, shape.top_k) == (45, 42, 288, 8)
    placed = place(layout, shape)
    assert len(placed["vram0"].layers) + len(placed["vram1"].layers) == 42
    assert layout.scheduler.defer_into_linear  # the seed deferred into GLM-5.3's KDA layers too


def reproduce_seed() -> dict:
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "reproduce_seed.py"), "--json"], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_reproduce_seed_on_glm53_flash_with_fewer_parameters_than_figures():
    """The seed's figures from GLM-5.3-Flash's own geometry. The bar is every figure within 10%; with this geometry
    15 of 16 are, and DEFER_CPU=2 (+11.1%) is not (affinity + DEFER_CPU=2 is at -9.98%; docs/reproduction.md):
    the test holds what is met, and bounds the one that is not, so a change that makes it worse fails. Why it is not:
    the seed's figures need gpu0's MoE layers to carry 1.27x gpu1's CPU-lane work per layer at the baseline, where
    gpu0's larger cache gives them fewer misses (docs/reproduction.md, "Why DEFER_CPU=2 stays above 10%")."""
    started = time.perf_counter()
    summary = reproduce_seed()
    assert time.perf_counter() - started < 60
    assert summary["free_parameters"] < summary["figures"] == 16
    errors = {row["key"]: round(row["error"], 4) for row in summary["rows"]}
    missed = {key for key, e in errors.items() if abs(e) > 0.10}
    assert missed <= {"defer"}, errors
    assert abs(errors["defer"]) <= 0.115, errors
    model = {row["key"]: row["model"] for row in summary["rows"]}  # the seed's conclusions, not only its numbers
    assert model["helper"] < model["split"] and model["lan_speedup"] < 1.4 and model["lane_skip"] < model["lane"]
    assert model["defer"] > model["base"] and model["affinity_defer"] > model["affinity"] > model["base"] > model["plain"]
    assert abs(summary["checks"]["helper_hit_rate"] - 0.46) < 0.01 and abs(summary["checks"]["base_hit_rate"] - 0.845) < 0.01
    assert summary["checks"]["lane_ratio_needed"] == pytest.approx(1.272, abs=0.001)  # the seed's own arithmetic
    assert summary["checks"]["miss_ratio_modelled"] < 1  # gpu0's 57 slots a layer against gpu1's 52
    # the layouts defer into the KDA layers as the seed did (defer_into_linear = true); moetier's engine would not:
    # 9 of the 42 MoE layers defer, DEFER_CPU=2 19.2 tok/s (docs/reproduction.md, assumption 9)
    assert summary["checks"]["defer_engine_rule_tok_per_s"] == pytest.approx(19.2, abs=0.05)
    assert summary["checks"]["affinity_defer_engine_rule_tok_per_s"] < model["affinity_defer"]


@pytest.mark.slow
def test_reproduce_seed_fit_never_ends_worse_than_it_started():
    """`--fit` (docs/reproduction.md): Nelder-Mead from the script's parameter set keeps the best point it saw."""
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "reproduce_seed.py"), "--fit", "--iterations", "2"],
                            capture_output=True, text=True, timeout=900, cwd=REPO)
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert set(summary["fitted"]) == set(reproduce_seed()["fitted"])
    assert summary["misfit"] <= summary["start_misfit"] and len(summary["errors"]) == 16
    worst = max(abs(np.log1p(e)) for e in summary["errors"].values())
    assert worst <= summary["misfit"] <= worst * 16 ** (1 / 16)  # the 16-norm of the log errors bounds the largest


def test_bf16_checkpoint_gets_the_same_slots_in_the_simulator_as_at_run_time(tmp_path):
    """The runtime once held experts as float32 copies while `calibrate` recorded the file's (bf16) bytes, and a
    simulation sized from that calibration got twice the runtime's slots. Every tier now holds the stored bf16
    bytes, and runtime, `layout show` and `simulate` read one placement."""
    import torch
    from safetensors.torch import load_file, save_file

    from layouts import cache_layout
    from moetier.engine.runtime import build_runtime
    from moetier.model import open_checkpoint
    from moetier.model.synth import write_synthetic

    source = write_synthetic(tmp_path / "f32", arch="qwen3_moe", preset="tiny", seed=0)
    folder = tmp_path / "bf16"
    folder.mkdir()
    for path in source.iterdir():
        if path.suffix == ".safetensors":
            save_file({n: t.to(torch.bfloat16) for n, t in load_file(path).items()}, folder / path.name, metadata={"format": "pt"})
        elif path.is_file():
            (folder / path.name).write_bytes(path.read_bytes())
    checkpoint = open_checkpoint(folder)
    spec = checkpoint.spec
    assert checkpoint.expert_nbytes == 3 * spec.hidden_size * spec.moe_intermediate_size * 2  # stored bf16, held so
    slots = 3
    layout_path = tmp_path / "layout.toml"
    layout_path.write_text(cache_layout().replace("slots = 4", f"capacity_bytes = {slots * checkpoint.expert_nbytes * len(spec.moe_layers)}"))
    calibration = tmp_path / "cal.json"
    done = moetier("calibrate", "--model", folder, "--out", calibration, "--threads", 1, cwd=REPO)
    assert done.returncode == 0, done.stderr
    trace = tmp_path / "trace.npz"
    synthetic_trace(64, len(spec.moe_layers), spec.num_experts, spec.top_k, seed=0).save(trace)

    simulated = json.loads(moetier_simulate("--layout", layout_path, "--trace", trace, "--calibration", calibration, "--json").stdout)
    shown = json.loads(moetier("layout", "show", layout_path, "--model", folder, "--json", cwd=REPO, timeout=120).stdout)
    runtime = build_runtime(load_layout(layout_path), checkpoint)
    try:
        at_run_time = next(t for t in runtime.executor.tiers if t.name == "vram").slots
    finally:
        runtime.close()
    assert at_run_time == slots
    assert next(t["slots_per_layer"] for t in shown["tiers"] if t["name"] == "vram") == slots
    assert next(t["slots_per_layer"] for t in simulated["tiers"] if t["name"] == "vram") == slots
