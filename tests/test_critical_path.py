"""The critical-path model: its arithmetic on hand-checked cases, and DEFER_CPU's overlap."""

from __future__ import annotations

import math

import pytest

from moetier.sched.cost import Calibration, TierCost
from moetier.sim.critical_path import PartSpec, TierLoad, predict_pass

CAL = Calibration(attention_us_per_layer=100.0, head_us=50.0, dispatch_us_per_layer=10.0)
COSTS = {
    "vram": TierCost("vram", "vram", 0.0, 20.0, 0.0, 0.0, 300.0, 1),
    "cpu": TierCost("cpu", "cpu", 0.0, 100.0, 0.0, 0.0, math.inf, 1),
    "lan": TierCost("lan", "remote", 167.0, 100.0, 0.0, 0.0, math.inf, 1),
}


def loads(layers, vram=4, cpu=2):
    return {l: {"vram": TierLoad(vram, vram), "cpu": TierLoad(cpu, cpu)} for l in layers}


def test_without_defer_the_gpu_waits_for_the_lane_every_layer():
    parts = [PartSpec("a", [0, 1, 2])]
    p = predict_pass(parts, [0, 1, 2], loads([0, 1, 2]), COSTS, CAL)
    # per layer: 100 attention + 10 dispatch; lane 200 from there, GPU busy 80 -> waits 120
    assert p.ms_per_token["gpu experts"] == pytest.approx(0.24)
    assert p.ms_per_token["cpu lane wait (part 0)"] == pytest.approx(0.36)
    assert p.pass_ms == pytest.approx((3 * (100 + 10 + 200) + 50) / 1e3)


def test_defer_overlaps_the_lane_with_the_next_attention_but_not_across_parts():
    one = predict_pass([PartSpec("a", [0, 1, 2, 3])], range(4), loads(range(4)), COSTS, CAL, defer_cpu=2)
    plain = predict_pass([PartSpec("a", [0, 1, 2, 3])], range(4), loads(range(4)), COSTS, CAL, defer_cpu=0)
    assert one.pass_ms < plain.pass_ms
    split = [PartSpec("a", [0, 1]), PartSpec("b", [2, 3])]
    both = predict_pass(split, range(4), loads(range(4)), COSTS, CAL, defer_cpu=2)
    first = predict_pass(split, range(4), loads(range(4)), COSTS, CAL, defer_cpu=1)
    assert one.pass_ms <= both.pass_ms < first.pass_ms <= plain.pass_ms


def test_remote_round_trips_add_per_layer_and_tokens_per_pass_divide():
    layers = range(42)
    lan = {l: {"vram": TierLoad(4, 4), "lan": TierLoad(1, 1)} for l in layers}
    p = predict_pass([PartSpec("a", list(layers))], layers, lan, COSTS, CAL)
    assert p.ms_per_token["remote"] == pytest.approx(42 * (167 + 100 - 80) / 1e3)
    two = predict_pass([PartSpec("a", list(layers))], layers, lan, COSTS, CAL, tokens_per_pass=2.0)
    assert two.token_ms == pytest.approx(p.token_ms / 2)


def test_defer_skips_linear_attention_layers_unless_the_layout_opts_in():
    """The engine's rule (moetier.sched.defer): a lane partial is deferred into a full-attention layer only; with
    defer_into_linear into every layer but a part's last, which is the prediction without linear layers."""
    parts, layers = [PartSpec("a", list(range(8)))], range(8)
    linear = [l for l in layers if l % 4 != 3]  # 3 of 4 linear, as GLM-5.3 and Qwen3-Next
    everywhere = predict_pass(parts, layers, loads(layers), COSTS, CAL, defer_cpu=2)
    engine = predict_pass(parts, layers, loads(layers), COSTS, CAL, defer_cpu=2, linear_layers=linear)
    seed = predict_pass(parts, layers, loads(layers), COSTS, CAL, defer_cpu=2, linear_layers=linear, defer_into_linear=True)
    plain = predict_pass(parts, layers, loads(layers), COSTS, CAL, defer_cpu=0, linear_layers=linear, defer_into_linear=True)
    assert seed.pass_ms == everywhere.pass_ms < engine.pass_ms < plain.pass_ms
    # every deferred layer hides the same wait here; the engine defers 2 (into layers 3 and 7) of the 7 (all but 7)
    waits = lambda p: p.ms_per_token["cpu lane wait (part 0)"]  # noqa: E731
    assert waits(plain) - waits(engine) == pytest.approx(2 * (waits(plain) - waits(everywhere)) / 7)
    assert predict_pass(parts, layers, loads(layers), COSTS, CAL, defer_cpu=0, linear_layers=linear).pass_ms == plain.pass_ms
