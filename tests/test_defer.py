"""DEFER_CPU's semantics: a layer's CPU-lane partial lands after the next layer's mixer, never across a part boundary,
into a linear-attention layer only where the layout opts in (defer_into_linear); lossy, measured by teacher-forced KL.

The rule is moetier.sched.defer's, which the simulator reads too (tests/test_simulate.py, tests/test_critical_path.py).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from cli_runs import moetier_here, refused
from moetier.engine import Engine, score
from moetier.engine.core import Partials
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.profile.kl import kl_per_position, stepwise_logits
from tier_layouts import CPU, HEAD, IDS, ONE_PART, TWO_PARTS, runtime_for, scheduler, vram


@pytest.fixture(scope="module")
def four_moe_layers(tmp_path_factory):
    """Two parts of two MoE layers each, so either part has something to defer."""
    checkpoint = open_checkpoint(write_synthetic(tmp_path_factory.mktemp("defer") / "m", arch="qwen3_moe", preset="small", seed=2))
    assert checkpoint.spec.moe_layers == (0, 1, 2, 3)
    return checkpoint


def defer_logits(model, tmp_path, body: str, defer: int) -> np.ndarray:
    runtime = runtime_for(tmp_path, model, body + scheduler(defer))
    try:
        return score(runtime.engine, IDS)
    finally:
        runtime.close()


def test_defer_modes_are_lossy_and_1_equals_2_with_one_part(four_moe_layers, tmp_path):
    model = four_moe_layers
    body = ONE_PART + vram("vram", "gpu0", 4, "lru") + CPU
    plain = defer_logits(model, tmp_path, body, 0)
    one, two = defer_logits(model, tmp_path, body, 1), defer_logits(model, tmp_path, body, 2)
    assert np.abs(one - plain).max() > 1e-4
    assert np.array_equal(one, two)


class LaneOnly:
    """Every expert on a synchronous 'CPU lane', so deferral is the only difference between runs."""

    def __init__(self, checkpoint):
        from moetier.engine.core import ResidentExperts

        self.inner = ResidentExperts(checkpoint, Engine(checkpoint).backend)

    def dispatch(self, layer, x, decision):
        from concurrent.futures import Future

        lane: Future = Future()
        lane.set_result(self.inner.dispatch(layer, x, decision).now)
        return Partials(torch.zeros_like(x), lane)


def reference_deferred(engine: Engine, ids: np.ndarray, boundaries: list[range], defer_parts: set[int]) -> np.ndarray:
    """DEFER_CPU written out plainly: a layer's lane partial joins after the next layer's attention,
    flushed at the end of each part. The engine's own pieces (its RMSNorm, attention, MoE), so the order of the
    additions is all that differs."""
    from moetier.engine.layers import attention_mask
    from moetier.backends.torch_backend import swiglu

    spec = engine.spec
    cache = engine.new_cache()
    tokens = torch.tensor(ids)
    h = engine.embed.rows(tokens)
    mask = attention_mask(0, len(ids), spec.sliding_window, h.device)
    for index, part in enumerate(boundaries):
        pending = None
        for layer in part:
            w = engine.layers[layer]
            h = h + engine._attention(layer, w, engine._norm(h, w.input_norm), cache, 0, mask)
            if pending is not None:
                h, pending = h + pending, None
            x = engine._norm(h, w.post_norm)
            if w.mlp is not None:
                h = h + swiglu(x, w.mlp)
                continue
            partials = engine._moe(layer, w, x)
            lane = partials.lane.result()
            if index in defer_parts and layer != part[-1]:
                h, pending = h + partials.now, lane
            else:
                h = h + (partials.now + lane)
        assert pending is None  # flushed inside the part
    return engine.lm_head(engine._norm(h, engine.final_norm)).numpy()


def test_nothing_deferred_crosses_a_part_boundary(four_moe_layers):
    model = four_moe_layers
    parts = [(range(0, 2), "cpu"), (range(2, model.spec.num_layers), "cpu")]
    results = {}
    for mode in (0, 1, 2):
        engine = Engine(model, executor=LaneOnly(model), parts=parts, defer_cpu=mode)
        results[mode] = score(engine, IDS)
    ranges = [r for r, _ in parts]
    engine = Engine(model, executor=LaneOnly(model), parts=parts)
    with torch.inference_mode():
        assert np.array_equal(results[1], reference_deferred(engine, IDS, ranges, {0}))
        assert np.array_equal(results[2], reference_deferred(engine, IDS, ranges, {0, 1}))
        # the same deferral without the flush at the boundary is a different model: the test can tell
        crossing = reference_deferred(engine, IDS, [range(0, model.spec.num_layers)], {0})
    assert not np.array_equal(results[2], crossing)
    assert not np.array_equal(results[1], results[2])
    assert np.abs(results[0] - score(Engine(model), IDS)).max() <= 1e-5


def qwen3_next_checkpoint(folder, layer_types: list[str]):
    """A small random Qwen3-Next written by transformers, its layers' mixers as given."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3NextConfig(
        vocab_size=320, hidden_size=32, intermediate_size=48, num_hidden_layers=len(layer_types), num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, moe_intermediate_size=16, shared_expert_intermediate_size=16, num_experts=6,
        num_experts_per_tok=2, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, layer_types=layer_types)
    torch.manual_seed(3)
    model = transformers.Qwen3NextForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.1)
    model.save_pretrained(folder)
    return open_checkpoint(folder)


def test_nothing_deferred_crosses_a_state_update(tmp_path):
    """DEFER_CPU holds a layer's lane partial back only when the next layer attends over a KV cache: into a
    linear-attention layer it is awaited (the recurrent state would keep the difference for every later token).
    A model of linear layers only defers nothing; with a full-attention layer after them, the layer before it defers.
    With defer_into_linear the linear-only model defers too (the seed's semantics)."""
    results = {}
    for kind, types in (("linear", ["linear_attention"] * 4), ("last-full", ["linear_attention"] * 3 + ["full_attention"])):
        model = qwen3_next_checkpoint(tmp_path / kind, types)
        results[kind] = [score(Engine(model, executor=LaneOnly(model), defer_cpu=mode), IDS) for mode in (0, 2)]
        results[kind].append(score(Engine(model, executor=LaneOnly(model), defer_cpu=2, defer_into_linear=True), IDS))
    assert np.array_equal(results["linear"][0], results["linear"][1])
    assert not np.array_equal(results["last-full"][0], results["last-full"][1])
    assert not np.array_equal(results["linear"][0], results["linear"][2])


def test_defer_cpu_2_over_two_parts_runs_glm5_next(tmp_path_factory, tmp_path):
    """GLM-5.3's seed layout: two parts with a VRAM cache each and a CPU lane, DEFER_CPU = 2. The lane's partials land
    a layer late (expanded into the hyper-connected streams by their own block's post weights): it runs, every tier
    serves, and it differs from the lossless DEFER_CPU = 0 run, which equals the all-resident engine."""
    folder = write_synthetic(tmp_path_factory.mktemp("glm5") / "m", arch="glm5_next", preset="tiny", seed=4)
    model = open_checkpoint(folder)
    assert model.spec.linear_layers == (0, 1, 2) and model.spec.moe_layers == (1, 2, 3)
    body = TWO_PARTS  # layers 0-1 | 2-3: layer 2's lane partial is deferred past layer 3's latent attention
    body += vram("v0", "gpu0", 3, "lru") + vram("v1", "gpu1", 3, "lfu") + CPU
    results = {}
    for defer in (0, 2):
        runtime = runtime_for(tmp_path, model, body + scheduler(defer))
        try:
            results[defer] = score(runtime.engine, IDS)
            served = {n: c.served for n, c in runtime.executor.counters.items()}
        finally:
            runtime.close()
        assert all(v > 0 for v in served.values()), served
    assert np.abs(results[0] - score(Engine(model), IDS)).max() <= 1e-5
    assert np.abs(results[2] - results[0]).max() > 1e-4 and np.isfinite(results[2]).all()


@pytest.fixture(scope="module", params=["qwen3_next", "glm5_next"])
def hybrid(request, tmp_path_factory):
    """Layers 0-2 linear attention (Gated DeltaNet / KDA), layer 3 full (glm5_next: latent) attention."""
    checkpoint = open_checkpoint(write_synthetic(tmp_path_factory.mktemp(request.param) / "m", arch=request.param,
                                                 preset="tiny", seed=4))
    assert checkpoint.spec.linear_layers == (0, 1, 2) and checkpoint.spec.num_layers == 4
    return checkpoint


def test_defer_into_linear_changes_nothing_without_defer_cpu(hybrid):
    """With DEFER_CPU=0 the opt-in has nothing to act on: the logits are bit-identical either way."""
    off, on = (score(Engine(hybrid, executor=LaneOnly(hybrid), defer_into_linear=flag), IDS) for flag in (False, True))
    assert np.array_equal(off, on)


def test_defer_into_linear_is_lossy_small_and_its_own_model(hybrid, tmp_path):
    """DEFER_CPU=2 over a VRAM cache of 3 slots (fewer than the 4 picks, so the lane has work) and a CPU lane: by
    the engine's rule only layer 2 defers (into layer 3's attention); with defer_into_linear the MoE layers before
    it too, the next layer's recurrence reading the hidden state without their partials. Teacher-forced KL against
    the lossless run: finite and small either way (~0.005-0.018 nats), larger with the opt-in, a different model."""
    reference = stepwise_logits(Engine(hybrid), IDS)[0]  # [T, V]
    kl, deferred = {}, {}
    for flag in (False, True):
        body = ONE_PART + vram("vram", "gpu0", 3, "lru") + CPU + scheduler(2) + f"defer_into_linear = {str(flag).lower()}\n"
        runtime = runtime_for(tmp_path, hybrid, body)
        try:
            deferred[flag] = sorted(layer for layer in runtime.engine.deferred if layer in hybrid.spec.moe_layers)
            kl[flag] = kl_per_position(reference, stepwise_logits(runtime.engine, IDS)[0])  # [T]
        finally:
            runtime.close()
    assert deferred[False] == [2] and deferred[True] == [l for l in (0, 1, 2) if l in hybrid.spec.moe_layers]
    assert all(np.isfinite(v).all() for v in kl.values())
    assert 0 < kl[False].mean() < kl[True].mean() < 0.05, {flag: float(v.mean()) for flag, v in kl.items()}


def test_run_flag_sets_defer_into_linear_over_the_layout(hybrid, tmp_path):
    """`moetier run --layout --defer-into-linear` over the layout's key (reported with the layers that defer);
    without --layout it is refused: nothing else defers."""
    path = tmp_path / "layout.toml"
    path.write_text(HEAD + ONE_PART + vram("vram", "gpu0", 6, "lru") + CPU + scheduler(2))
    common = ["run", "--layout", path, "--model", hybrid.folder, "--max-new-tokens", 3, "--prompt-ids", "1,2", "--json"]
    reports = [json.loads(moetier_here(*common, *flag).stdout) for flag in ([], ["--defer-into-linear"])]
    moe = [l for l in (0, 1, 2) if l in hybrid.spec.moe_layers]  # the MoE layers that defer (glm5_next's 0 is dense)
    assert [(r["defer_into_linear"], r["deferred_layers"]) for r in reports] == [(False, [2]), (True, moe)]
    refused(moetier_here("run", "--model", hybrid.folder, "--defer-into-linear"), "--defer-into-linear needs --layout")
