"""Experts stay in their stored format in every tier, and every path computes what the reference computes.

Files: a synthetic model whose expert rows are whole 256-value blocks (preset
"blocks"), written as F32 GGUF by moetier and copied with its experts stored
in each block format as random valid blocks (tests/gguf_blocks.py; the peer
suite uses files llama.cpp quantized), and as a bf16 safetensors folder.
Checked: experts are held in the stored bytes (host memory, VRAM arenas, a
remote worker); the torch path (native decode kernel, torch dequantization
for prefill) matches the reference (gguf's numpy dequantization, then float32
math) on every format; VRAM slots follow the stored bytes, the same in `layout
show`, placement and the runtime; layouts over a quantized file are lossless;
a remote worker serves it bit for bit as the local CPU lane; resident memory
is the stored bytes (bf16 file, 20 GB sparse GGUF).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_runs import moetier, refused
from gguf_blocks import restored
from layouts import REMOTE_TIER, cache_layout
from moetier.backends.cpu_kernels import resident_layout
from moetier.config import load_layout
from moetier.engine import Engine, generate, score
from moetier.engine.runtime import build_runtime
from moetier.model import CheckpointError, open_checkpoint
from moetier.model.formats import BY_NAME
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic
from moetier.sched.estimate import describe_layout
from moetier.sched.placement import ModelShape, place
from moetier.sim.traces import synthetic_trace
from moetier.tiers.host_experts import HostExperts
from quant_blocks import BLOCK_FORMATS

IDS = np.array([7, 19, 3, 250, 41, 8, 8, 90, 310, 12, 5, 77])
# every format the tests store experts in; Q4_K_M's shape (Q4_K gate/up, Q6_K down) as one of them
MIXES = {fmt.name: {"*_exps*": fmt.name} for fmt in BLOCK_FORMATS} | {"Q4_K/Q6_K": {"*ffn_down_exps*": "Q6_K", "*_exps*": "Q4_K"}}


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """name -> path: "hf" (float32 folder), "bf16" (its bf16 copy), "F32" (its GGUF) and one GGUF per MIXES entry."""
    root = tmp_path_factory.mktemp("stored")
    hf = write_synthetic(root / "hf", arch="qwen3_moe", preset="blocks", seed=3)
    out = {"hf": hf, "F32": write_gguf(hf, root / "f32.gguf")[0]}
    bf16 = root / "bf16"
    bf16.mkdir()
    (bf16 / "config.json").write_text((hf / "config.json").read_text())
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(hf / "model.safetensors").items()}, bf16 / "model.safetensors")
    out["bf16"] = bf16
    for i, (name, mix) in enumerate(MIXES.items()):
        out[name] = restored(out["F32"], root / f"{name.replace('/', '-')}.gguf", mix, seed=i)
    return out


def test_experts_are_held_in_their_stored_bytes(files):
    for name, expected in (("bf16", "BF16"), ("F32", "F32"), ("Q4_K", "Q4_K"), ("Q4_K/Q6_K", "Q4_K/Q6_K"), ("IQ3_S", "IQ3_S"),
                           ("IQ3_XXS", "IQ3_XXS")):
        checkpoint = open_checkpoint(files[name])
        s = checkpoint.spec
        weights = checkpoint.expert(s.moe_layers[-1], 3)
        assert weights.formats == expected
        host = HostExperts(checkpoint, s.moe_layers)  # the same bytes a block; IQ3 as IQ3_*_T where the kernels want it
        held = resident_layout(weights).formats
        assert held in (expected, expected + "_T") and host.get(s.moe_layers[0], 0).formats == held
        assert host.nbytes == checkpoint.expert_nbytes * s.num_experts * len(s.moe_layers)
        float32_bytes = 3 * s.hidden_size * s.moe_intermediate_size * 4
        ratio = {"bf16": 2.0, "F32": 1.0, "Q4_K": 4 / (144 / 256), "Q4_K/Q6_K": 3 * 4 / (2 * 144 / 256 + 210 / 256),
                 "IQ3_S": 4 / (110 / 256), "IQ3_XXS": 4 / (98 / 256)}[name]
        assert float32_bytes / checkpoint.expert_nbytes == pytest.approx(ratio)


@pytest.mark.parametrize("name", sorted(MIXES))
def test_torch_and_native_paths_match_the_reference_on_every_format(files, name):
    """Prefill (T = 12, torch dequantization) and decode (T = 1, the native kernel) against the numpy reference."""
    checkpoint = open_checkpoint(files[name])
    reference = score(Engine(checkpoint, backend="numpy"), IDS)
    for engine in (Engine(checkpoint), Engine(checkpoint, backend="torch")):
        got = score(engine, IDS)
        scale = float(np.abs(reference).max())
        assert np.abs(got - reference).max() <= 1e-5 * scale, name
    tokens = generate(Engine(checkpoint, backend="numpy"), [5, 9, 13], 6).ids
    assert generate(Engine(checkpoint), [5, 9, 13], 6).ids == tokens


def test_a_trunk_tensor_outside_the_stored_formats_is_held_as_its_float32_values(files, tmp_path):
    """A trunk tensor in a type the gguf package reads but moetier does not store (TQ2_0): its float32 values (the
    gguf package's dequantization, once at load), with which the model computes."""
    path = restored(files["F32"], tmp_path / "tq2_0.gguf", {"blk.1.attn_q.weight": "TQ2_0"})
    raw = next(t for t in gguf.GGUFReader(path).tensors if t.name == "blk.1.attn_q.weight")
    checkpoint = open_checkpoint(path)
    tensor, qtype = checkpoint.stored("model.layers.1.self_attn.q_proj.weight")
    assert qtype == BY_NAME["F32"].id and raw.tensor_type.name == "TQ2_0"
    assert np.array_equal(tensor.numpy().view(np.int32), gguf.quants.dequantize(raw.data, raw.tensor_type).view(np.int32))
    reference = score(Engine(checkpoint, backend="numpy"), IDS)
    got = score(Engine(checkpoint), IDS)
    assert np.abs(got - reference).max() <= 1e-5 * np.abs(reference).max()
    assert np.abs(got - score(Engine(open_checkpoint(files["F32"])), IDS)).max() > 1e-3 * np.abs(reference).max()  # read


def test_the_torch_ops_decode_batches_stored_experts_by_kind(files):
    """The torch path's decode step (CUDA's, and the CPU's without the kernels) stacks the experts of one stored kind
    and dequantizes them together: mixed kinds in one call, an expert twice and float32 experts beside them give the
    reference's sum."""
    from moetier.backends import get_backend
    from moetier.backends.numpy_backend import NumpyBackend

    picks = [(name, e) for name in ("Q8_0", "Q4_K/Q6_K", "IQ3_S", "F32") for e in (1, 4)] + [("Q8_0", 1)]
    checkpoints = {name: open_checkpoint(files[name]) for name in {name for name, _ in picks}}
    layer = checkpoints["F32"].spec.moe_layers[-1]
    experts = [checkpoints[name].expert(layer, e) for name, e in picks]
    scales = np.random.default_rng(4).uniform(0.1, 1.0, len(picks)).tolist()
    x = torch.from_numpy(np.random.default_rng(5).standard_normal((1, checkpoints["F32"].spec.hidden_size), np.float32))
    torch_ops, numpy = get_backend("torch", "cpu", native_kernel=False), NumpyBackend()
    got = torch_ops.run_decode(x, [torch_ops.place(w) for w in experts], scales)  # [1, D]
    reference = numpy.run_decode(x, [numpy.place(w) for w in experts], scales)  # [1, D]
    assert torch.allclose(got, reference, rtol=1e-5, atol=1e-5 * float(reference.abs().max()))


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["Q4_K/Q6_K", "IQ3_S", "Q8_0", "bf16"])
def test_the_cuda_path_matches_the_reference(files, name):
    """On a GPU the experts (and the trunk) are dequantized on the device each call: the reference's values."""
    checkpoint = open_checkpoint(files[name])
    reference = score(Engine(checkpoint, backend="numpy"), IDS)
    got = score(Engine(checkpoint, device="cuda"), IDS)
    assert np.abs(got - reference).max() <= 1e-4 * float(np.abs(reference).max()), name


def test_bf16_experts_compute_as_their_float32_values(files):
    """bf16 -> float32 is exact, so a bf16 folder's logits equal those of a float32 folder of the same values."""
    widened = files["bf16"].parent / "bf16-as-f32"
    widened.mkdir()
    (widened / "config.json").write_text((files["bf16"] / "config.json").read_text())
    save_file({k: v.float() for k, v in load_file(files["bf16"] / "model.safetensors").items()}, widened / "model.safetensors")
    got, expected = score(Engine(open_checkpoint(files["bf16"])), IDS), score(Engine(open_checkpoint(widened)), IDS)
    assert np.abs(got - expected).max() <= 1e-6 * float(np.abs(expected).max())


def test_vram_slots_follow_the_stored_bytes_in_show_placement_and_runtime(files, tmp_path):
    f32 = open_checkpoint(files["F32"])
    capacity = 6 * f32.expert_nbytes * len(f32.spec.moe_layers)  # six float32 experts per layer
    path = tmp_path / "layout.toml"
    path.write_text(cache_layout().replace("slots = 4", f"capacity_bytes = {capacity}"))
    layout = load_layout(path)
    seen = {}
    for name in ("F32", "bf16", "Q8_0", "Q4_K/Q6_K", "IQ3_XXS"):
        checkpoint = open_checkpoint(files[name])
        shape = ModelShape.from_checkpoint(checkpoint)
        placed = place(layout, shape)["vram"].slots
        shown = next(t for t in describe_layout(layout, files[name])["tiers"] if t["name"] == "vram")["slots_per_layer"]
        runtime = build_runtime(layout, checkpoint)
        try:
            tier = next(t for t in runtime.executor.tiers if t.name == "vram")
            arena = next(iter(tier.arenas.values()))
            held = arena.gate_up.nbytes + arena.down.nbytes
        finally:
            runtime.close()
        assert placed == shown == tier.slots, name
        if name == "Q4_K/Q6_K":  # and `moetier simulate`, which places the same way
            synthetic_trace(tokens=32, layers=2, experts=8, top_k=2, seed=0).save(tmp_path / "trace.npz")
            result = moetier("simulate", "--layout", path, "--model", files[name], "--trace", tmp_path / "trace.npz", "--json")
            assert result.returncode == 0, result.stderr
            assert json.loads(result.stdout)["slots_per_layer"]["vram"] == placed
        expected = min(capacity // shape.layers_bytes(shape.moe_layers), checkpoint.spec.num_experts)
        assert placed == expected
        assert held == placed * checkpoint.expert_nbytes_at(shape.moe_layers[0])  # the arena holds stored bytes
        seen[name] = placed
    assert seen["F32"] == 6 and seen["bf16"] == 8 and seen["IQ3_XXS"] == 8  # 8 = every expert of the layer
    assert seen["F32"] < seen["Q8_0"]


@pytest.mark.parametrize("name", ["Q4_K/Q6_K", "IQ3_S", "IQ3_XXS"])
def test_layouts_over_a_quantized_file_are_lossless(files, tmp_path, name):
    """A VRAM cache (emulated here: torch dequantization of what it uploads) and the CPU lane over the host's
    experts, the IQ3 formats' held as IQ3_*_T where the kernels want them, give the engine's logits."""
    checkpoint = open_checkpoint(files[name])
    expected = score(Engine(checkpoint), IDS)
    path = tmp_path / "layout.toml"
    path.write_text(cache_layout(slots=3, policy="lru", cpu_threads=2) + "[scheduler]\ndefer_cpu = 0\ntail_skip = false\n")
    runtime = build_runtime(load_layout(path), checkpoint)
    try:
        got = score(runtime.engine, IDS)
    finally:
        runtime.close()
    assert np.abs(got - expected).max() <= 1e-5 * float(np.abs(expected).max())


def test_a_remote_worker_serves_a_quantized_gguf_as_the_local_cpu_lane(files, tmp_path):
    from moetier.transport.launch import start_worker, worker_command

    checkpoint = open_checkpoint(files["Q4_K/Q6_K"])
    worker = start_worker("w", worker_command(files["Q4_K/Q6_K"], "tcp://127.0.0.1:0", threads=1), log=tmp_path / "worker.log")
    # no VRAM cache: both picks of a layer miss, and the plan splits them between the CPU lane and the worker
    cpu_only = cache_layout().split("[[tiers]]")[0] + '[[tiers]]\nname = "cpu"\nkind = "cpu"\n'
    body = cpu_only + REMOTE_TIER.format(address=worker.address).replace('"0:6"', '"0:8"')
    path = tmp_path / "layout.toml"
    path.write_text(body + "[scheduler]\nbudget_us = 200000.0\ndefer_cpu = 0\ntail_skip = false\n")
    try:
        runtime = build_runtime(load_layout(path), checkpoint)
        try:
            tokens = generate(runtime.engine, [5, 9, 13], 10).ids
            got = score(runtime.engine, IDS)
            served = runtime.executor.counters["i5"].served
        finally:
            runtime.close()
    finally:
        assert worker.stop() == 0
    assert served > 0
    assert tokens == generate(Engine(checkpoint), [5, 9, 13], 10).ids
    expected = score(Engine(checkpoint), IDS)
    assert np.abs(got - expected).max() <= 1e-5 * float(np.abs(expected).max())  # partial sums added in another order


def test_gate_and_up_of_different_formats_are_one_line_and_exit_2(files, tmp_path):
    odd = restored(files["F32"], tmp_path / "odd.gguf", {"blk.1.ffn_up_exps*": "Q8_0", "*_exps*": "Q4_K"})
    with pytest.raises(CheckpointError, match="ffn_gate_exps.weight' and 'blk.1.ffn_up_exps.weight' are Q4_K and Q8_0"):
        open_checkpoint(odd)
    refused(moetier("info", odd), "are Q4_K and Q8_0")


def test_info_and_run_say_the_formats_and_the_path(files):
    info = json.loads(moetier("info", files["Q4_K/Q6_K"], "--json").stdout)
    assert info["expert_formats"] == "Q4_K/Q6_K"
    assert info["bytes_per_expert"] == open_checkpoint(files["Q4_K/Q6_K"]).expert_nbytes
    assert 0 < info["trunk_bytes"] < info["total_bytes"]
    result = moetier("run", "--model", files["Q4_K"], "--max-new-tokens", 3, "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["experts"] == "Q4_K" and "native kernel" in report["backend"]


RSS = textwrap.dedent("""
    import json, sys
    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096
    import torch, numpy, gguf, moetier.engine, moetier.model.gguf_file  # the imports' memory is not the model's
    before = rss()
    from moetier.model import open_checkpoint
    checkpoint = open_checkpoint(sys.argv[1])
    if sys.argv[2] == "engine":
        from moetier.engine import Engine
        engine = Engine(checkpoint)
    else:
        weights = checkpoint.expert(*map(int, sys.argv[2].split(",")))
        assert int(weights.down.sum()) == 0  # its pages are read
    print(json.dumps({"rss_bytes": rss() - before, "experts_bytes": checkpoint.expert_nbytes * checkpoint.spec.num_experts
                      * len(checkpoint.spec.moe_layers), "trunk_bytes": checkpoint.trunk_bytes}))
""")


def _rss(*args) -> dict:
    result = subprocess.run([sys.executable, "-c", RSS, *map(str, args)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read resident memory")
def test_a_bf16_checkpoint_is_resident_once_in_its_own_bytes(tmp_path):
    """~300 MB of bf16 experts: the engine holds them in about their file size (a float32 copy would be twice)."""
    hf = tmp_path / "hf"
    hf.mkdir()
    config = json.loads((write_synthetic(tmp_path / "blocks", arch="qwen3_moe", preset="blocks", seed=0) / "config.json").read_text())
    config.update(num_hidden_layers=2, num_experts=32, moe_intermediate_size=1024, hidden_size=768, head_dim=64,
                  num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=4)
    (hf / "config.json").write_text(json.dumps(config))
    d, i, e, g = 768, 1024, 32, torch.Generator().manual_seed(0)
    tensors = {"model.embed_tokens.weight": torch.randn(512, d, generator=g), "lm_head.weight": torch.randn(512, d, generator=g),
               "model.norm.weight": torch.ones(d)}
    for layer in range(2):
        p = f"model.layers.{layer}."
        tensors |= {p + "self_attn.q_proj.weight": torch.randn(256, d, generator=g), p + "self_attn.k_proj.weight": torch.randn(128, d, generator=g),
                    p + "self_attn.v_proj.weight": torch.randn(128, d, generator=g), p + "self_attn.o_proj.weight": torch.randn(d, 256, generator=g),
                    p + "self_attn.q_norm.weight": torch.ones(64), p + "self_attn.k_norm.weight": torch.ones(64),
                    p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
                    p + "mlp.gate.weight": torch.randn(e, d, generator=g)}
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            tensors |= {q + "gate_proj.weight": torch.randn(i, d, generator=g) * 0.02, q + "up_proj.weight": torch.randn(i, d, generator=g) * 0.02,
                        q + "down_proj.weight": torch.randn(d, i, generator=g) * 0.02}
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, hf / "model.safetensors")
    del tensors
    seen = _rss(hf, "engine")
    print(f"bf16 engine: RSS +{seen['rss_bytes'] / 1e6:.0f} MB for {seen['experts_bytes'] / 1e6:.0f} MB of experts, "
          f"{seen['trunk_bytes'] / 1e6:.1f} MB of trunk")
    assert seen["experts_bytes"] > 290e6
    assert seen["rss_bytes"] < 1.25 * seen["experts_bytes"] + seen["trunk_bytes"] + 40e6  # float32 experts: +100%


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read resident memory")
def test_a_20_gb_gguf_opens_and_reads_an_expert_in_little_memory(tmp_path):
    """A sparse 20+ GB Q4_K GGUF (16 layers x 128 experts of 4096 x 1536): header, index and one expert."""
    import gguf

    path = tmp_path / "big.gguf"
    d, i, e, layers, vocab = 4096, 1536, 128, 16, 1024
    writer = gguf.GGUFWriter(path, "qwen3moe")
    for key, value in (("block_count", layers), ("context_length", 4096), ("embedding_length", d), ("feed_forward_length", 8192),
                       ("attention.head_count", 32), ("attention.head_count_kv", 4), ("attention.key_length", 128),
                       ("attention.value_length", 128), ("expert_count", e), ("expert_used_count", 8),
                       ("expert_feed_forward_length", i), ("vocab_size", vocab)):
        writer.add_uint32(f"qwen3moe.{key}", value)
    writer.add_float32("qwen3moe.rope.freq_base", 1e6)
    writer.add_float32("qwen3moe.attention.layer_norm_rms_epsilon", 1e-6)
    f32, q4k = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q4_K

    def info(name, shape, qtype=f32):  # shape in numpy order
        fmt = BY_NAME[qtype.name]
        nbytes = int(np.prod(shape[:-1])) * fmt.row_bytes(shape[-1])
        writer.add_tensor_info(name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
        return nbytes

    total = info("token_embd.weight", [vocab, d]) + info("output_norm.weight", [d]) + info("output.weight", [vocab, d])
    for b in (f"blk.{n}." for n in range(layers)):
        total += sum(info(b + name, shape, qtype) for name, shape, qtype in (
            ("attn_norm.weight", [d], f32), ("attn_q.weight", [4096, d], q4k), ("attn_k.weight", [512, d], q4k),
            ("attn_v.weight", [512, d], q4k), ("attn_output.weight", [d, 4096], q4k), ("attn_q_norm.weight", [128], f32),
            ("attn_k_norm.weight", [128], f32), ("ffn_norm.weight", [d], f32), ("ffn_gate_inp.weight", [e, d], f32),
            ("ffn_gate_exps.weight", [e, i, d], q4k), ("ffn_up_exps.weight", [e, i, d], q4k), ("ffn_down_exps.weight", [e, d, i], q4k)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()
    with open(path, "r+b") as handle:  # the data section as a hole: the tensors' offsets are aligned to 32 bytes
        handle.truncate(path.stat().st_size + total + 32 * 300)
    assert path.stat().st_size > 20e9
    seen = _rss(path, "7,100")
    print(f"20 GB GGUF: RSS +{seen['rss_bytes'] / 1e6:.0f} MB to open it and read one {seen['experts_bytes'] / e / layers / 1e6:.1f} MB expert")
    assert seen["rss_bytes"] < 300e6
