"""Layouts run the same model: lossless with DEFER_CPU=0 and tail_skip off; DEFER_CPU's exact semantics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layouts import REMOTE_TIER
from moetier.config import load_layout
from moetier.engine import Engine, generate, score
from moetier.engine.core import Partials
from moetier.tiers.base import DecodeJobs
from moetier.engine.runtime import build_runtime
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic

# With CUDA these layouts run on the real devices; a machine with one GPU emulates the second.
SECOND_GPU_EMULATED = "emulate = true\n" if torch.cuda.device_count() < 2 else ""
HEAD = f"""
[[devices]]
name = "gpu0"
host = "local"
kind = "cuda"
[[devices]]
name = "gpu1"
host = "local"
kind = "cuda"
index = 1
{SECOND_GPU_EMULATED}[[links]]
name = "pcie"
rtt_us = 20.0
gbps = 64.0
"""
ONE_PART = '[[parts]]\nname = "all"\ndevice = "gpu0"\nlayers = "0:"\n'
TWO_PARTS = '[[parts]]\nname = "a"\ndevice = "gpu0"\nlayers = "0:2"\n[[parts]]\nname = "b"\ndevice = "gpu1"\nlayers = "2:"\n'
CPU = '[[tiers]]\nname = "cpu"\nkind = "cpu"\nthreads = 2\n'


def vram(name: str, device: str, slots: int, policy: str) -> str:
    return f'[[tiers]]\nname = "{name}"\nkind = "vram"\ndevice = "{device}"\nslots = {slots}\npolicy = "{policy}"\nlink = "pcie"\n'


HELPER = '[[tiers]]\nname = "helper"\nkind = "helper"\ndevice = "gpu1"\nslots = 5\nexperts = "3:8"\nlink = "pcie"\n'

LAYOUTS = {
    "cpu-only": ONE_PART + CPU,
    "vram-lru": ONE_PART + vram("vram", "gpu0", 6, "lru") + CPU,
    "vram-lfu-helper": ONE_PART + vram("vram", "gpu0", 4, "lfu") + HELPER + CPU,
    "two-parts-two-caches": TWO_PARTS + vram("v0", "gpu0", 5, "lru") + vram("v1", "gpu1", 7, "lfu") + CPU,
}


def scheduler(defer: int, tail_skip: bool = False, budget_us: float = 5000.0) -> str:
    return f"[scheduler]\nbudget_us = {budget_us}\ntail_skip = {str(tail_skip).lower()}\ndefer_cpu = {defer}\n"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_synthetic(tmp_path_factory.mktemp("tiers") / "m", arch="glm4_moe", preset="tiny", seed=5)
    checkpoint = open_checkpoint(folder)
    assert checkpoint.spec.num_layers >= 3  # the two-part layouts split at layer 2
    return checkpoint


def runtime_for(tmp_path, checkpoint, body: str):
    path = tmp_path / "layout.toml"
    path.write_text(HEAD + body)
    return build_runtime(load_layout(path), checkpoint)


IDS = np.array([7, 19, 3, 250, 41, 8, 8, 90, 310, 12, 5, 77, 200, 31, 64, 2, 99, 150, 11, 4])


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layouts_are_lossless(model, tmp_path, name):
    assert_lossless(model, tmp_path, LAYOUTS[name])


def assert_lossless(model, tmp_path, body: str) -> None:
    """The layout (DEFER_CPU=0) gives the all-resident engine's logits within 1e-5 and its greedy tokens, every
    tier serving."""
    expected = score(Engine(model), IDS)
    expected_tokens = generate(Engine(model), [5, 9, 13], 12).ids
    runtime = runtime_for(tmp_path, model, body + scheduler(defer=0))
    try:
        got = score(runtime.engine, IDS)
        tokens = generate(runtime.engine, [5, 9, 13], 12).ids
        served = {n: c.served for n, c in runtime.executor.counters.items()}
    finally:
        runtime.close()
    assert np.abs(got - expected).max() <= 1e-5
    assert tokens == expected_tokens
    assert sum(served.values()) > 0 and all(v > 0 for v in served.values()), served


def test_tail_skip_is_lossy_and_counted(model, tmp_path):
    runtime = runtime_for(tmp_path, model, ONE_PART + vram("vram", "gpu0", 4, "lru") + CPU + scheduler(0, tail_skip=True, budget_us=1.0))
    try:
        got = score(runtime.engine, IDS)
        skipped = runtime.executor.skipped
    finally:
        runtime.close()
    assert skipped > 0
    assert np.abs(got - score(Engine(model), IDS)).max() > 1e-5


def defer_logits(model, tmp_path, body: str, defer: int) -> np.ndarray:
    runtime = runtime_for(tmp_path, model, body + scheduler(defer))
    try:
        return score(runtime.engine, IDS)
    finally:
        runtime.close()


def test_defer_modes_are_lossy_and_1_equals_2_with_one_part(model, tmp_path):
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


@pytest.fixture(scope="module")
def four_moe_layers(tmp_path_factory):
    """Two parts of two MoE layers each, so either part has something to defer."""
    checkpoint = open_checkpoint(write_synthetic(tmp_path_factory.mktemp("defer") / "m", arch="qwen3_moe", preset="small", seed=2))
    assert checkpoint.spec.moe_layers == (0, 1, 2, 3)
    return checkpoint


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


def test_run_layout_report_json(model, tmp_path):
    import json
    import subprocess
    import sys

    path = tmp_path / "layout.toml"
    path.write_text(HEAD + LAYOUTS["vram-lfu-helper"] + scheduler(2))
    trace = tmp_path / "trace.npz"
    result = subprocess.run([sys.executable, "-m", "moetier.cli", "run", "--layout", str(path), "--model", str(model.folder),
                             "--max-new-tokens", "9", "--json", "--trace", str(trace)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert {"tiers", "parts", "decode_tok_per_s", "hit_rate", "ms_per_token"} <= set(report)
    assert [t["name"] for t in report["tiers"]] == ["vram", "helper", "cpu"]
    served = sum(t["experts_served"] for t in report["tiers"])
    spec = model.spec
    assert served == 8 * len(spec.moe_layers) * spec.top_k  # every pick of the 8 decode steps served once
    assert 0.0 <= report["hit_rate"] <= 1.0 and "attention" in report["ms_per_token"]
    saved = np.load(trace, allow_pickle=False)
    assert saved["picks"].shape == (8, len(spec.moe_layers), spec.top_k)
    assert (saved["tiers"] >= 0).all()


REMOTE = REMOTE_TIER


def test_a_remote_worker_layout_is_lossless(model, tmp_path):
    remote_worker_is_lossless(model, tmp_path)


def test_a_remote_worker_layout_is_lossless_on_hybrid_models(hybrid, tmp_path):
    remote_worker_is_lossless(hybrid, tmp_path)


def remote_worker_is_lossless(model, tmp_path):
    """A worker process holding the model's experts, over a real socket, beside a VRAM cache and a CPU lane."""
    from moetier.transport.launch import start_worker, worker_command

    worker = start_worker("w", worker_command(model.folder, "tcp://127.0.0.1:0", threads=1), log=tmp_path / "worker.log")
    try:
        runtime = runtime_for(tmp_path, model, ONE_PART + vram("vram", "gpu0", 4, "lru") + CPU
                              + REMOTE.format(address=worker.address) + scheduler(0, budget_us=200_000.0))
        try:
            got = score(runtime.engine, IDS)
            tokens = generate(runtime.engine, [5, 9, 13], 12).ids
            remote = runtime.executor.counters["i5"].served
        finally:
            runtime.close()
    finally:
        assert worker.stop() == 0  # SIGTERM: a clean exit
    assert remote > 0
    assert np.abs(got - score(Engine(model), IDS)).max() <= 1e-5
    assert tokens == generate(Engine(model), [5, 9, 13], 12).ids


def test_launch_starts_the_layouts_workers_and_stops_them(model, tmp_path):
    import signal
    import socket
    import subprocess
    import sys

    with socket.socket() as probe:  # a free loopback port for the layout's address
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    path = tmp_path / "layout.toml"
    path.write_text(HEAD + ONE_PART + CPU + REMOTE.format(address=f"tcp://127.0.0.1:{port}"))
    launcher = subprocess.Popen([sys.executable, "-m", "moetier.cli", "launch", str(path), "--model", str(model.folder)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        while not any("answered HELLO" in line for line in lines):
            line = launcher.stdout.readline()
            assert line, f"launch ended early: {launcher.stderr.read()}"
            lines.append(line)
        assert any(f"listening on tcp://127.0.0.1:{port}" in line for line in lines)
        launcher.send_signal(signal.SIGINT)
        rest, _ = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0
    assert "worker i5 stopped (exit 0)" in rest


def test_calibrate_times_the_layouts_own_decode(model, tmp_path):
    calibrate_times_the_layouts_own_decode(model, tmp_path)


def test_calibrate_times_a_hybrid_models_decode(hybrid, tmp_path):
    calibrate_times_the_layouts_own_decode(hybrid, tmp_path)


def calibrate_times_the_layouts_own_decode(model, tmp_path):
    """`moetier calibrate --layout` measures the trunk, head, GPU rate and dispatch in the layout's decode."""
    import json
    import subprocess
    import sys

    path = tmp_path / "layout.toml"
    path.write_text(HEAD + LAYOUTS["vram-lru"] + scheduler(0) + 'calibration = "rates.json"\n')
    done = subprocess.run([sys.executable, "-m", "moetier.cli", "calibrate", "--layout", str(path), "--model", str(model.folder),
                           "--threads", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("rates")] == ["rates.json"]  # nothing half-written left
    rates = json.loads((tmp_path / "rates.json").read_text())
    assert rates["expert_bytes"] == model.expert_nbytes
    for key in ("cpu_us_per_expert", "gpu_us_per_expert", "attention_us_per_layer", "head_us", "dispatch_us_per_layer"):
        assert 0.0 < rates[key] < 1e5, (key, rates[key])
    assert rates["gpu_us_per_expert"] != rates["cpu_us_per_expert"]  # from the layout's GPU, not the streaming rate
    assert "x1 threads" in rates["machine"]


def test_xlayer_prefetches_are_uploaded_a_layer_early_and_stay_lossless(model, tmp_path):
    """xlayer admits into layer l+1 during layer l's access: the arena holds those experts before l+1 runs."""
    runtime = runtime_for(tmp_path, model, ONE_PART + vram("vram", "gpu0", 4, "xlayer") + CPU + scheduler(0))
    tier = next(t for t in runtime.executor.tiers if t.kind == "vram")
    ahead = []  # after each MoE layer's dispatch: does the next layer's arena hold what the policy holds there?
    original = runtime.executor.dispatch

    def dispatch(layer, x, decision):
        partials = original(layer, x, decision)
        nxt = tier.index[layer] + 1
        if nxt < len(tier.index):
            following = tier._layer_at[nxt]
            ahead.append(tier.holds(following) == frozenset(tier.policy.resident(nxt).tolist()))
        return partials

    runtime.executor.dispatch = dispatch
    try:
        logits = score(runtime.engine, IDS)
        generated = generate(runtime.engine, IDS[:6].tolist(), 12).ids
    finally:
        runtime.close()
    assert ahead and all(ahead)
    assert tier.prefetch_uploads > 0
    assert np.abs(logits - score(Engine(model), IDS)).max() <= 1e-5
    assert generated == generate(Engine(model), IDS[:6].tolist(), 12).ids


@pytest.mark.gpu
def test_on_cuda_the_cache_lives_in_device_memory_and_the_lane_takes_device_rows(model, tmp_path):
    """Real CUDA: the VRAM arenas are device memory, host experts are pinned, the CPU lane takes a
    part's rows from the GPU and hands its partial back there; logits match the all-resident engine."""
    runtime = runtime_for(tmp_path, model, ONE_PART + vram("vram", "gpu0", 4, "lru") + CPU + scheduler(0))
    try:
        tier = next(t for t in runtime.executor.tiers if t.kind == "vram")
        lane = next(t for t in runtime.executor.tiers if t.kind == "cpu")
        assert all(arena.gate_up.is_cuda and arena.down.is_cuda for arena in tier.arenas.values())
        assert tier.host.get(model.spec.moe_layers[0], 0).gate_up.is_pinned()
        got = score(runtime.engine, IDS)
        tokens = generate(runtime.engine, [5, 9, 13], 12).ids
        served = {n: c.served for n, c in runtime.executor.counters.items()}
    finally:
        runtime.close()
    assert served[lane.name] > 0 and served[tier.name] > 0, served
    on_device = Engine(model, device="cuda:0")
    assert np.abs(got - score(on_device, IDS)).max() <= 1e-5
    assert np.abs(got - score(Engine(model), IDS)).max() <= 1e-4  # GPU against CPU float32 arithmetic
    assert tokens == generate(on_device, [5, 9, 13], 12).ids


def test_a_cuda_device_this_machine_lacks_is_one_clear_error(model, tmp_path, monkeypatch):
    from moetier.config import ConfigError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    path = tmp_path / "layout.toml"
    path.write_text(HEAD.replace(SECOND_GPU_EMULATED, "") + TWO_PARTS + CPU)
    with pytest.raises(ConfigError, match=r"\[devices.1\] 'gpu1': cuda:1 does not exist here .*1 CUDA device"):
        build_runtime(load_layout(path), model)


def test_a_failed_upload_raises_where_its_experts_are_needed(model, tmp_path):
    """The link thread's copy fails: the layer waiting for those experts raises it, nothing hangs, and
    the link thread keeps serving the uploads queued after it."""
    runtime = runtime_for(tmp_path, model, ONE_PART + vram("vram", "gpu0", 4, "lru") + CPU + scheduler(0))
    tier = next(t for t in runtime.executor.tiers if t.kind == "vram")
    layer = next(iter(tier.index))
    real_get, broken = tier.host.get, {"on": True}

    def get(l, expert):
        if broken["on"]:
            raise OSError("the link went away")
        return real_get(l, expert)

    tier.host.get = get
    try:
        missing = [e for e in range(tier.host.spec.num_experts) if e not in tier.holds(layer)][:2]
        hits, uploaded = tier.access(layer, missing)
        assert hits == 0 and uploaded == missing
        x = torch.randn(1, tier.host.spec.hidden_size)
        with pytest.raises(RuntimeError, match="an expert upload failed: OSError"):
            tier.submit(layer, x, DecodeJobs(missing, [0.5, 0.5])).result()
        broken["on"] = False
        others = [e for e in range(tier.host.spec.num_experts) if e not in tier.holds(layer)][:2]
        tier.access(layer, others)
        assert tier.submit(layer, x, DecodeJobs(others, [0.5, 0.5])).result().shape == x.shape
    finally:
        runtime.close()


@pytest.fixture(scope="module", params=["qwen3_next", "glm5_next"])
def hybrid(request, tmp_path_factory):
    """A synthetic hybrid model: linear-attention layers whose recurrent states a layout must carry like the KV cache
    (glm5_next: hyper-connected streams and latent attention too)."""
    return open_checkpoint(write_synthetic(tmp_path_factory.mktemp(request.param) / "m", arch=request.param, preset="tiny", seed=4))


@pytest.mark.parametrize("name", ["vram-lru", "two-parts-two-caches"])
def test_layouts_are_lossless_on_hybrid_models(hybrid, tmp_path, name):
    """A VRAM cache and a CPU lane (one part, or two parts with a cache each) carry the states losslessly."""
    assert_lossless(hybrid, tmp_path, LAYOUTS[name])


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
