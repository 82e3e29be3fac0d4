"""The native decode kernel: same sums as the numpy reference and the torch ops, odd shapes
included; the same bits on any thread count and on the lane; built once and reused; a machine
that cannot build it falls back with one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from moetier.backends import ExpertWork, cpu_kernels, cpu_lane
from moetier.backends.numpy_backend import NumpyBackend
from moetier.backends.torch_backend import TorchBackend
from moetier.model import ExpertWeights

needs_kernel = pytest.mark.skipif(cpu_kernels.decode_kernel() is None, reason=f"native kernel {cpu_kernels.status()}")


def experts_of(dim: int, inter: int, count: int, seed: int) -> list[ExpertWeights]:
    g = torch.Generator().manual_seed(seed)
    return [ExpertWeights(torch.randn(2 * inter, dim, generator=g) * 0.2, torch.randn(dim, inter, generator=g) * 0.2)
            for _ in range(count)]


def decode(backend, experts, x, scales) -> torch.Tensor:
    row = torch.zeros(1, dtype=torch.int64)
    work = [ExpertWork(backend.place(w), row, torch.tensor([s])) for w, s in zip(experts, scales)]
    return backend.run_experts(x, work)


@needs_kernel
@pytest.mark.parametrize("dim, inter, k", [(40, 24, 1), (37, 13, 5), (64, 7, 10), (512, 128, 10), (9, 3, 3)])
def test_kernel_matches_reference_and_torch_ops(dim, inter, k):
    """Shapes that are not multiples of the kernel's 8-row blocks take its tail loop."""
    experts = experts_of(dim, inter, k, seed=dim + inter + k)
    g = torch.Generator().manual_seed(k)
    x, scales = torch.randn(1, dim, generator=g), torch.rand(k, generator=g).tolist()
    reference = decode(NumpyBackend(), experts, x, scales)
    kernel = decode(TorchBackend("cpu"), experts, x, scales)
    ops = decode(TorchBackend("cpu", native_kernel=False), experts, x, scales)
    scale = reference.abs().max().item()
    assert TorchBackend("cpu")._kernel is not None and TorchBackend("cpu", native_kernel=False)._kernel is None
    assert (kernel - reference).abs().max().item() <= 1e-5 * max(1.0, scale)
    assert (ops - reference).abs().max().item() <= 1e-5 * max(1.0, scale)


@needs_kernel
def test_kernel_reads_non_contiguous_experts_after_place():
    """place() hands the kernel contiguous copies when a checkpoint's tensors are strided views."""
    base = experts_of(24, 8, 2, seed=3)
    strided = [ExpertWeights(w.gate_up.t().contiguous().t(), w.down.t().contiguous().t()) for w in base]
    assert not strided[0].gate_up.is_contiguous()
    x = torch.randn(1, 24)
    assert torch.allclose(decode(TorchBackend("cpu"), strided, x, [0.3, 0.7]), decode(NumpyBackend(), base, x, [0.3, 0.7]), atol=1e-5)


@needs_kernel
def test_lanes_split_the_rows_and_give_the_same_bits():
    experts = experts_of(64, 16, 10, seed=5)
    x, scales = torch.randn(1, 64), torch.rand(10).tolist()
    one, two = TorchBackend("cpu", lanes=1), TorchBackend("cpu", lanes=2)
    assert one.decode_kernel().threads == 1 and two.decode_kernel().threads == 2
    assert torch.equal(decode(one, experts, x, scales), decode(two, experts, x, scales))


PROBE = """
import json, torch
from moetier.backends import cpu_kernels
from moetier.backends.torch_backend import TorchBackend
from moetier.backends.numpy_backend import NumpyBackend
from moetier.backends import ExpertWork
from moetier.model import ExpertWeights
w = ExpertWeights(torch.ones(6, 4) * 0.1, torch.ones(4, 3) * 0.1)
row = torch.zeros(1, dtype=torch.int64)
x = torch.ones(1, 4)
out = [b.run_experts(x, [ExpertWork(b.place(w), row, torch.tensor([0.5]))]) for b in (TorchBackend("cpu"), NumpyBackend())]
print(json.dumps({"status": cpu_kernels.status(), "on": cpu_kernels.decode_kernel() is not None,
                  "path": str(cpu_kernels.decode_kernel().path) if cpu_kernels.decode_kernel() else None,
                  "diff": (out[0] - out[1]).abs().max().item()}))
"""


def probe(tmp_path, **env) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MOETIER_HOME": str(tmp_path), **env})
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@needs_kernel
def test_built_once_per_machine_then_reused(tmp_path):
    first = probe(tmp_path, MOETIER_DOT_FAMILIES="0")  # the dot families build apart (dot_kernels): not asked for here
    assert first["on"] and first["diff"] < 1e-6 and first["path"].startswith(str(tmp_path / "native"))
    built = os.stat(first["path"]).st_mtime_ns
    second = probe(tmp_path, MOETIER_DOT_FAMILIES="0")
    assert second["path"] == first["path"] and os.stat(second["path"]).st_mtime_ns == built
    built_names = sorted(p.name for p in (tmp_path / "native").iterdir())  # the kernel and its formats library, no temporaries
    assert len(built_names) == 2 and built_names[0].startswith("cpu_formats-") and built_names[1] == os.path.basename(first["path"])


@pytest.mark.parametrize("env, why", [({"MOETIER_NATIVE": "0"}, "MOETIER_NATIVE=0"),
                                      ({"CC": "/nonexistent/cc"}, "no C compiler"),
                                      ({"CC": "false"}, "false failed")])
def test_without_a_kernel_decode_falls_back_to_torch_ops(tmp_path, env, why):
    got = probe(tmp_path, **env)
    assert not got["on"] and why in got["status"] and "\n" not in got["status"] and got["diff"] < 1e-6
    assert not (tmp_path / "native").exists() or not any((tmp_path / "native").iterdir())


def lane_call(experts, scales):
    """The native lane's arguments for these experts: their records (addresses and formats) and float32 scales."""
    from array import array

    return b"".join(map(cpu_kernels.expert_record, experts)), array("f", scales)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_lane_computes_what_the_kernel_computes(threads):
    """Bit for bit the kernel's result on any thread count, identical from call to call whatever the threads' timing."""
    experts = experts_of(37, 13, 7, seed=threads)
    x, scales = torch.randn(1, 37), torch.rand(7).tolist()
    expected = cpu_kernels.decode_kernel().run(x, experts, scales)
    lane = cpu_lane.NativeLane(cpu_kernels.decode_kernel(), threads)
    try:
        addresses, floats = lane_call(experts, scales)
        results = [lane.submit(x, addresses, floats, 13) for _ in range(lane.SLOTS)]
        outs = [ticket.result() for ticket in results]
    finally:
        lane.close()
    assert all(torch.equal(out, expected) for out in outs)


@needs_kernel
def test_native_lane_slots_are_freed_by_dropped_tickets_and_uncollected_ones_say_so():
    experts = experts_of(16, 8, 3, seed=1)
    x, (addresses, floats) = torch.randn(1, 16), lane_call(experts, [1.0, 0.5, 0.25])
    lane = cpu_lane.NativeLane(cpu_kernels.decode_kernel(), 1)
    try:
        for _ in range(3 * lane.SLOTS):  # dropped at once: each slot is freed when its call is done
            lane.submit(x, addresses, floats, 8)
        held = [lane.submit(x, addresses, floats, 8) for _ in range(lane.SLOTS - 1)]
        last = lane.submit(x, addresses, floats, 8)
        expected = last.result()  # collected: its slot is free again
        held.append(lane.submit(x, addresses, floats, 8))
        with pytest.raises(RuntimeError, match="all 16 call slots hold results not collected"):
            lane.submit(x, addresses, floats, 8)  # waits for the queued calls, then says why it cannot
        assert all(torch.equal(ticket.result(), expected) for ticket in held)
        assert torch.equal(lane.submit(x, addresses, floats, 8).result(), expected)
        with pytest.raises(ValueError, match="120 address bytes for 2 scales"):
            lane.submit(x, addresses, floats[:2], 8)
    finally:
        lane.close()
        lane.close()  # idempotent
    forked = cpu_lane.NativeLane(cpu_kernels.decode_kernel(), 1)
    child = os.fork()
    if child == 0:  # the lane's threads stayed in the parent: queuing must refuse, not hang
        try:
            forked.submit(x, addresses, floats, 8)
        except RuntimeError as err:
            os._exit(0 if "forked child" in str(err) else 2)
        os._exit(1)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0
    assert torch.equal(forked.submit(x, addresses, floats, 8).result(), expected)  # the parent's lane still works
    forked.close()
    other = cpu_lane.NativeLane(cpu_kernels.decode_kernel(), 1)
    pending = other.submit(x, addresses, floats, 8)
    other.close()  # finishes the queued call, but its result went with the lane
    with pytest.raises(RuntimeError, match="closed before this call was collected"):
        pending.result()


@needs_kernel
def test_cpu_lane_decodes_on_the_native_lane_as_its_python_threads_would():
    """A decode call (DecodeJobs or ExpertJobs) takes the native lane; its result is the backend's."""
    from moetier.tiers.base import DecodeJobs, ExpertJob
    from moetier.model.synth import write_synthetic
    from moetier.model import open_checkpoint
    from moetier.tiers.cpu import CpuTier
    from moetier.tiers.host_experts import HostExperts

    import tempfile
    from collections import deque

    with tempfile.TemporaryDirectory() as folder:
        checkpoint = open_checkpoint(write_synthetic(folder + "/m", arch="qwen3_moe", preset="tiny", seed=2))
        spec = checkpoint.spec
        tier = CpuTier("cpu", HostExperts(checkpoint, spec.moe_layers), threads=2)
        try:
            assert tier._native is not None and tier._native.threads == 2
            layer, x = spec.moe_layers[0], torch.randn(1, spec.hidden_size)
            jobs = DecodeJobs([3, 0, 5], [0.5, 0.25, 0.125])
            as_tuples = [ExpertJob(e, torch.zeros(1, dtype=torch.int64), torch.tensor([s])) for e, s in zip(jobs.experts, jobs.scales)]
            assert [(j.expert, j.rows.tolist(), j.weights.tolist()) for j in jobs] == [(j.expert, j.rows.tolist(), j.weights.tolist()) for j in as_tuples]
            expected = tier.compute(layer, x, jobs)  # the backend on this thread
            tier.calls = deque()
            for work in (jobs, as_tuples):
                got = tier.submit(layer, x, work).result()
                assert torch.equal(got, expected)
            assert [experts for experts, _ in tier.calls] == [3, 3] and all(us > 0 for _, us in tier.calls)
        finally:
            tier.close()


def router_spec(router: str, experts: int, k: int, n_group: int = 1, topk_group: int = 1, norm: bool = True):
    from dataclasses import replace

    from moetier.model.spec import ModelSpec
    from moetier.model.synth import PRESETS, arch_preset
    from moetier.model.synth_config import _config

    arch = "glm4_moe" if router == "sigmoid" else "qwen3_moe"  # a real spec, then the router's fields
    base = ModelSpec.from_hf_config(_config(arch, arch_preset(arch, PRESETS["tiny"])))
    return replace(base, num_experts=experts, top_k=k,
                   router=router, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm,
                   routed_scaling_factor=2.5 if router == "sigmoid" else 1.0)


@needs_kernel
@pytest.mark.parametrize("router, experts, k, n_group, topk_group, norm, nudged", [
    ("softmax", 80, 10, 1, 1, True, False), ("softmax", 64, 8, 1, 1, False, True), ("softmax", 7, 7, 1, 1, True, False),
    ("sigmoid", 64, 8, 8, 4, True, False), ("sigmoid", 64, 8, 8, 4, True, True), ("sigmoid", 40, 6, 1, 1, False, True),
    ("sigmoid", 48, 4, 4, 1, True, False)])
def test_native_router_decides_as_the_torch_router(router, experts, k, n_group, topk_group, norm, nudged):
    """route_gate's one-call decision for one token against route(): the same picks (as a set), weights,
    probabilities and logits up to the gate's float32 summation order; over 50 random tokens."""
    from moetier.engine.router import route, route_gate

    spec = router_spec(router, experts, k, n_group, topk_group, norm)
    g = torch.Generator().manual_seed(experts + k + n_group)
    gate = torch.randn(experts, 96, generator=g) * 0.3
    correction = torch.randn(experts, generator=g) * 0.1 if router == "sigmoid" else None
    for _ in range(50):
        x = torch.randn(1, 96, generator=g)
        bias = torch.randn(experts, generator=g) * 0.5 if nudged else None
        affinity = (torch.rand(experts, generator=g) < 0.3).float() * 0.7 if nudged else None
        fast = route_gate(spec, x, gate, correction, bias, affinity)
        slow = route(spec, torch.nn.functional.linear(x, gate), correction, bias, affinity)
        assert sorted(fast.picks[0].tolist()) == sorted(slow.picks[0].tolist())
        order = [slow.picks[0].tolist().index(e) for e in fast.picks[0].tolist()]
        assert torch.allclose(fast.weights[0], slow.weights[0, order], atol=1e-6, rtol=1e-5)
        assert torch.allclose(fast.probs, slow.probs, atol=1e-6, rtol=1e-5)
        assert torch.allclose(fast.logits, slow.logits, atol=1e-5, rtol=1e-5)
        assert fast.picks.dtype == torch.int64 and fast.picks.shape == (1, k) and fast.weights.shape == (1, k)


@needs_kernel
@pytest.mark.parametrize("tokens", [1, 5])
def test_a_clamped_swiglu_is_the_references_on_the_kernel_and_the_lane(tokens):
    """GLM-5.3's clamped SwiGLU (gate <= limit, up within [-limit, limit]): the limit rides in the expert record, and
    the kernel (decode and grouped prefill) and the native lane compute what numpy and torch ops compute; a limit
    small enough to clamp often, so the test could tell."""
    import dataclasses

    experts = [dataclasses.replace(w, swiglu_limit=0.3) for w in experts_of(40, 16, 3, seed=7)]
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, 40, generator=g) * 3
    rows = torch.arange(tokens)
    work = lambda backend: [ExpertWork(backend.place(w), rows, torch.full((tokens,), s)) for w, s in zip(experts, (0.5, 0.3, 0.2))]  # noqa: E731
    reference = NumpyBackend().run_experts(x, work(NumpyBackend()))
    kernel = TorchBackend("cpu").run_experts(x, work(TorchBackend("cpu")))
    ops = TorchBackend("cpu", native_kernel=False).run_experts(x, work(TorchBackend("cpu", native_kernel=False)))
    plain = NumpyBackend().run_experts(x, [ExpertWork(NumpyBackend().place(dataclasses.replace(w, swiglu_limit=None)), rows,
                                                      torch.full((tokens,), s)) for w, s in zip(experts, (0.5, 0.3, 0.2))])
    assert (kernel - reference).abs().max() <= 1e-5 and (ops - reference).abs().max() <= 1e-5
    assert (plain - reference).abs().max() > 1e-2  # the clamp bites
    if tokens == 1:
        lane = cpu_lane.NativeLane(cpu_kernels.decode_kernel(), 2)
        try:
            addresses, floats = lane_call(experts, [0.5, 0.3, 0.2])
            assert torch.equal(lane.submit(x, addresses, floats, 16).result(), cpu_kernels.decode_kernel().run(x, experts, [0.5, 0.3, 0.2]))
        finally:
            lane.close()
