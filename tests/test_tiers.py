"""Layouts run the same model: lossless with DEFER_CPU=0 and tail_skip off (DEFER_CPU's semantics: test_defer.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cli_runs import moetier, moetier_here
from layouts import REMOTE_TIER
from tier_layouts import CPU, HEAD, IDS, ONE_PART, SECOND_GPU_EMULATED, TWO_PARTS, runtime_for, scheduler, vram
from moetier.config import load_layout
from moetier.engine import Engine, generate, score
from moetier.tiers.base import DecodeJobs
from moetier.engine.runtime import build_runtime
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic

HELPER = '[[tiers]]\nname = "helper"\nkind = "helper"\ndevice = "gpu1"\nslots = 5\nexperts = "3:8"\nlink = "pcie"\n'

LAYOUTS = {
    "cpu-only": ONE_PART + CPU,
    "vram-lru": ONE_PART + vram("vram", "gpu0", 6, "lru") + CPU,
    "vram-lfu-helper": ONE_PART + vram("vram", "gpu0", 4, "lfu") + HELPER + CPU,
    "two-parts-two-caches": TWO_PARTS + vram("v0", "gpu0", 5, "lru") + vram("v1", "gpu1", 7, "lfu") + CPU,
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_synthetic(tmp_path_factory.mktemp("tiers") / "m", arch="glm4_moe", preset="tiny", seed=5)
    checkpoint = open_checkpoint(folder)
    assert checkpoint.spec.num_layers >= 3  # the two-part layouts split at layer 2
    return checkpoint


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
    prompt = len(report["prompt_ids"])  # the prompt's rows first ("prefill"), then the 8 decoded tokens' ("decode")
    assert saved["picks"].shape == (prompt + 8, len(spec.moe_layers), spec.top_k)
    assert saved["phase"].tolist() == [0] * prompt + [1] * 8
    assert json.loads(str(saved["metadata"]))["phase_names"] == ["prefill", "decode"]
    assert (saved["tiers"] >= 0).all()


@pytest.mark.parametrize("name", ["vram-lru", "two-parts-two-caches"])
def test_simulate_replays_a_runs_trace_to_its_hit_rate(model, tmp_path, name):
    """`simulate` on the trace `run --layout --trace` wrote, with the same layout: its caches warmed by the prompt's
    rows (the trace's "prefill" phase) as the run's were, then the decoded tokens counted, so the replayed hit rate is
    the run's, per tier, exactly (LRU / LFU policies are deterministic). Without the warm-up it is not."""
    import json

    path, trace = tmp_path / "layout.toml", tmp_path / "trace.npz"
    path.write_text(HEAD + LAYOUTS[name])
    run = moetier("run", "--layout", path, "--model", model.folder, "--max-new-tokens", 24, "--json", "--trace", trace)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    simulated = moetier_here("simulate", "--layout", path, "--model", model.folder, "--trace", trace, "--json")
    assert simulated.returncode == 0, simulated.stderr
    replay = json.loads(simulated.stdout)
    assert replay["warmup_tokens"] == len(report["prompt_ids"])
    measured = {t["name"]: t["hit_rate"] for t in report["tiers"] if t["kind"] == "vram"}
    assert {t["name"]: t["hit_rate"] for t in replay["tiers"] if t["name"] in measured} == pytest.approx(measured, abs=1e-12)
    cold = json.loads(moetier_here("simulate", "--layout", path, "--model", model.folder, "--trace", trace, "--warmup", 0,
                                   "--json").stdout)
    assert cold["warmup_tokens"] == 0 and cold["hit_rate"] != replay["hit_rate"]


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
