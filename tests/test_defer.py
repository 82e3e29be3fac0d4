"""DEFER_CPU's semantics: a layer's CPU-lane partial lands after the next layer's mixer, never across a part boundary,
never into a linear-attention layer; lossy."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetier.engine import Engine, score
from moetier.engine.core import Partials
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
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
    flushed at the end of each part."""
    from moetier.engine.layers import attention_mask, rms_norm
    from moetier.backends.torch_backend import swiglu

    spec, eps = engine.spec, engine.spec.rms_norm_eps
    cache = engine.new_cache()
    tokens = torch.tensor(ids)
    h = engine.embed.rows(tokens)
    mask = attention_mask(0, len(ids), spec.sliding_window, h.device)
    for index, part in enumerate(boundaries):
        pending = None
        for layer in part:
            w = engine.layers[layer]
            h = h + engine._attention(layer, w, rms_norm(h, w.input_norm, eps), cache, 0, mask)
            if pending is not None:
                h, pending = h + pending, None
            x = rms_norm(h, w.post_norm, eps)
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
    return engine.lm_head(rms_norm(h, engine.final_norm, eps)).numpy()


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
    A model of linear layers only defers nothing; with a full-attention layer after them, the layer before it defers."""
    results = {}
    for kind, types in (("linear", ["linear_attention"] * 4), ("last-full", ["linear_attention"] * 3 + ["full_attention"])):
        model = qwen3_next_checkpoint(tmp_path / kind, types)
        results[kind] = [score(Engine(model, executor=LaneOnly(model), defer_cpu=mode), IDS) for mode in (0, 2)]
    assert np.array_equal(results["linear"][0], results["linear"][1])
    assert not np.array_equal(results["last-full"][0], results["last-full"][1])


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
