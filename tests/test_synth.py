"""Synthetic checkpoints: transformers loads them, they carry each arch's features, bytes are deterministic and
writes atomic. Their routing over sampled sessions: tests/test_synth_routing.py.
"""
from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from moetier.model import synth, synth_config
from moetier.model.synth import (
    ARCHES,
    PRESETS,
    sample_session,
    write_synthetic,
)
from synth_reference import VISION, load_reference, loading_problems, needs_transformers, reference_logits

TOKENS_PER_PHASE = 64


def layer_prefix(arch: str, layer: int) -> str:
    """Where a decoder layer's tensors are named in the file: glm5_next's text model is model.language_model."""
    return f"model.{'language_model.' if arch == 'glm5_next' else ''}layers.{layer}."


def _tree_digest(folder: pathlib.Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def _header(path: pathlib.Path) -> dict:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))


# --- loading and layout -----------------------------------------------------------

@needs_transformers
@pytest.mark.parametrize("preset", ["tiny", "small"])
@pytest.mark.parametrize("arch", ARCHES)
def test_transformers_loads_without_missing_or_unexpected_keys(synth_models, arch, preset):
    model, info = load_reference(synth_models(arch, preset))
    assert not loading_problems(info), loading_problems(info)
    if arch == "glm5_next":
        assert info["missing_keys"] and all(k.startswith(VISION) for k in info["missing_keys"])
    dims = synth.arch_preset(arch, PRESETS[preset])
    assert model.config.get_text_config().num_hidden_layers == dims.num_layers
    ids = torch.randint(3, dims.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits                                           # [2, 48, V]
    assert torch.isfinite(logits).all()
    assert 1.0 < logits.abs().max() < 30.0


@needs_transformers
@pytest.mark.parametrize("arch", ARCHES)
def test_fused_layout_gives_the_same_logits(synth_models, arch):
    fused = synth_models(arch, fused=True)
    moe = layer_prefix(arch, 1) + ("block_sparse_moe" if arch == "mixtral" else "mlp")   # a MoE layer in every arch
    header = _header(fused / "model.safetensors")
    dims = synth.arch_preset(arch, PRESETS["tiny"])
    E, I, D = dims.num_experts, dims.moe_intermediate_size, dims.hidden_size
    assert header[f"{moe}.experts.gate_up_proj"]["shape"] == [E, 2 * I, D]
    assert header[f"{moe}.experts.down_proj"]["shape"] == [E, D, I]
    assert not any(".experts.0." in k for k in header)
    per_expert_model, fused_model = load_reference(synth_models(arch))[0], load_reference(fused)[0]
    fused_state = fused_model.state_dict()
    assert all(torch.equal(v, fused_state[k]) for k, v in per_expert_model.state_dict().items() if not k.startswith(VISION))
    # identical weights; two model instances may still differ in the last float bits
    ids = sample_session(fused, tokens_per_phase=16)[0][1][None]
    torch.testing.assert_close(reference_logits(per_expert_model, ids), reference_logits(fused_model, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_one_experts_tensors_are_contiguous_in_the_file(synth_models, arch):
    header = _header(synth_models(arch) / "model.safetensors")
    header.pop("__metadata__")
    prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    spans = sorted((v["data_offsets"], k) for k, v in header.items())
    assert all(a[0][1] == b[0][0] for a, b in itertools.pairwise(spans))   # dense, no gaps
    for layer in (1, 2):
        for e in range(synth.arch_preset(arch, PRESETS["tiny"]).num_experts):
            mine = [off for off, k in spans if k.startswith(f"{layer_prefix(arch, layer)}{prefix}.experts.{e}.")]
            assert len(mine) == 3
            assert mine[0][1] == mine[1][0] and mine[1][1] == mine[2][0]


@needs_transformers
def test_sharded_write_loads_the_same_as_one_file(synth_models, tmp_path, monkeypatch):
    one_file_folder = synth_models("glm4_moe")  # written (once a session) before the preset is patched to shard
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], shard_bytes=300_000))
    sharded = write_synthetic(tmp_path / "sharded", "glm4_moe", "tiny")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    header_bytes = [8 + int.from_bytes((sharded / f).read_bytes()[:8], "little") for f in shards]
    assert index["metadata"]["total_size"] == sum((sharded / f).stat().st_size for f in shards) - sum(header_bytes)
    ids = sample_session(sharded, tokens_per_phase=16)[1][1][None]
    one_file, split = load_reference(one_file_folder)[0], load_reference(sharded)[0]
    torch.testing.assert_close(reference_logits(one_file, ids), reference_logits(split, ids), rtol=0, atol=1e-5)


def test_configs_carry_the_arch_features():
    glm = synth_config._config("glm4_moe", synth.arch_preset("glm4_moe", PRESETS["tiny"]))
    assert [glm[k] for k in ("first_k_dense_replace", "n_shared_experts", "n_group", "topk_group")] == [1, 1, 4, 2]
    assert glm["routed_scaling_factor"] != 1.0 and glm["partial_rotary_factor"] == 0.5
    qwen = synth_config._config("qwen3_moe", PRESETS["small"])
    assert qwen["norm_topk_prob"] is True
    for preset in PRESETS:
        mixtral = synth.arch_preset("mixtral", PRESETS[preset])
        assert (mixtral.num_experts, mixtral.top_k) == (8, 2)
    nxt = synth_config._config("qwen3_next", synth.arch_preset("qwen3_next", PRESETS["tiny"]))
    assert nxt["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]     # tiny's 3 layers made 4
    assert nxt["rope_parameters"]["partial_rotary_factor"] == 0.25 and nxt["norm_topk_prob"] is True
    assert nxt["shared_expert_intermediate_size"] == nxt["moe_intermediate_size"] and nxt["mlp_only_layers"] == []
    assert nxt["linear_num_key_heads"] < nxt["linear_num_value_heads"]
    assert nxt["linear_key_head_dim"] == nxt["linear_value_head_dim"]              # llama.cpp's qwen3next loads it
    g5 = synth_config._config("glm5_next", synth.arch_preset("glm5_next", PRESETS["tiny"]))
    text = g5["text_config"]
    assert g5["architectures"] == ["Glm5NextForConditionalGeneration"] and g5["vision_config"]["depth"] == 1
    assert text["layer_types"] == ["linear_attention"] * 3 + ["indexed_attention"] and text["indexer_types"] == ["full"] * 4
    assert text["mlp_layer_types"] == ["dense"] + ["sparse"] * 3
    assert [text[k] for k in ("n_shared_experts", "n_group", "topk_group", "hc_mult", "qk_rope_head_dim")] == [1, 4, 2, 4, 0]
    assert text["routed_scaling_factor"] == glm["routed_scaling_factor"] and text["norm_topk_prob"] is True
    assert text["num_key_value_heads"] == text["num_attention_heads"] and text["q_lora_rank"] != text["kv_lora_rank"]
    assert text["index_topk"] % text["index_kpool"] == 0 and text["index_topk"] < 3 * TOKENS_PER_PHASE   # the indexer picks
    assert 0 <= text["pad_token_id"] < text["vocab_size"] and text["swiglu_limit"] >= 10.0
    assert text["linear_lower_bound"] == -5.0 and text["linear_num_heads"] * text["linear_head_dim"] == text["hidden_size"]


def test_every_preset_has_qwen3_next_dims_and_seed_has_the_real_routing_geometry():
    for name, preset in PRESETS.items():
        dims = synth.arch_preset("qwen3_next", preset)
        assert dims.num_layers % 4 == 0 and dims.num_layers >= preset.num_layers, name
        assert dims.linear.value_heads % dims.linear.key_heads == 0, name
        assert int(dims.head_dim * 0.25) % 2 == 0, name                               # rotary pairs
        assert synth.arch_preset("qwen3_moe", preset).linear is None
    for arch in ("qwen3_moe", "glm4_moe", "qwen3_next"):
        seed = synth.arch_preset(arch, PRESETS["seed"])
        assert (seed.num_layers, seed.num_experts, seed.top_k) == (48, 512, 10), arch
    with pytest.raises(ValueError, match="linear-attention dims"):
        synth.arch_preset("qwen3_next", dataclasses.replace(PRESETS["tiny"], linear=None))


def test_every_preset_has_glm5_next_dims_and_seed_has_glm5s_routing_geometry():
    for name, preset in PRESETS.items():
        dims = synth.arch_preset("glm5_next", preset)
        if name != "seed":
            assert dims.num_layers % 4 == 0 and dims.num_layers >= preset.num_layers and dims.glm5.dense_layers == 1, name
        assert dims.num_kv_heads == dims.num_heads and dims.glm5.kv_rank % 2 == 0, name     # latent: key half, value half
        assert dims.linear.key_heads == dims.linear.value_heads and dims.linear.key_head_dim == dims.linear.value_head_dim
        for arch in ("qwen3_moe", "glm4_moe", "mixtral", "qwen3_next"):   # their versions do not see the glm5 fields
            assert not {"glm5", "glm5_routing"} & set(synth_config._dims_dict(synth.arch_preset(arch, preset))), (name, arch)
    seed = synth.arch_preset("glm5_next", PRESETS["seed"])
    assert (seed.num_layers, seed.glm5.dense_layers, seed.num_experts, seed.top_k) == (45, 3, 288, 8)
    assert synth.synth_version("glm5_next", "seed") != synth.synth_version("glm4_moe", "seed")


def test_qwen3_next_tensors_carry_the_arch_features(synth_models):
    from safetensors.numpy import load_file
    tensors = load_file(synth_models("qwen3_next") / "model.safetensors")
    dims = synth.arch_preset("qwen3_next", PRESETS["tiny"])
    D, lin, H = dims.hidden_size, dims.linear, dims.num_heads * dims.head_dim
    zero_centred = [k for k in tensors if k.endswith("norm.weight") and ".linear_attn." not in k]
    assert len(zero_centred) == 1 + 2 * dims.num_layers + 2 * (dims.num_layers // 4)   # final, per layer, q/k norms
    assert all(abs(float(tensors[k].mean())) < 0.05 and np.abs(tensors[k]).max() < 0.3 for k in zero_centred)
    gated_norm = tensors["model.layers.0.linear_attn.norm.weight"]                      # [dv], scales by w itself
    assert gated_norm.shape == (lin.value_head_dim,) and abs(float(gated_norm.mean()) - 1.0) < 0.05
    assert tensors["model.layers.3.self_attn.q_proj.weight"].shape == (2 * H, D)        # query and gate rows per head
    assert "model.layers.0.self_attn.q_proj.weight" not in tensors and "model.layers.3.linear_attn.A_log" not in tensors
    assert tensors["model.layers.2.linear_attn.conv1d.weight"].shape == (lin.conv_channels, 1, lin.conv_kernel)
    assert np.abs(tensors["model.layers.2.linear_attn.conv1d.weight"]).max() < 2.0
    for layer in range(dims.num_layers):
        pre = f"model.layers.{layer}.mlp."
        assert tensors[pre + "shared_expert_gate.weight"].shape == (1, D)
        assert tensors[pre + "shared_expert.down_proj.weight"].shape == (D, dims.moe_intermediate_size)
        if layer % 4 != 3:
            la = f"model.layers.{layer}.linear_attn."
            decay = np.exp(-np.exp(tensors[la + "A_log"]) * np.logaddexp(0.0, tensors[la + "dt_bias"]))   # [Hv] at a = 0
            assert ((0.3 < decay) & (decay < 0.99)).all(), (layer, decay)


@pytest.mark.parametrize("arch", ["glm4_moe", "glm5_next"])
def test_glm_correction_bias_is_nonzero(synth_models, arch):
    from safetensors.numpy import load_file
    tensors = load_file(synth_models(arch) / "model.safetensors")
    bias = tensors[layer_prefix(arch, 1) + "mlp.gate.e_score_correction_bias"]       # [E]
    assert np.abs(bias).max() > 0.01 and layer_prefix(arch, 0) + "mlp.gate_proj.weight" in tensors
    assert layer_prefix(arch, 1) + "mlp.shared_experts.down_proj.weight" in tensors


def test_glm5_next_tensors_carry_the_arch_features(synth_models):
    from safetensors.numpy import load_file
    tensors = load_file(synth_models("glm5_next") / "model.safetensors")
    dims = synth.arch_preset("glm5_next", PRESETS["tiny"])
    n, heads, hd, half = dims.glm5.streams, dims.num_heads, dims.head_dim, dims.glm5.kv_rank // 2
    assert "lm_head.weight" in tensors and not any(k.startswith(("model.layers.", VISION)) for k in tensors)
    for layer in range(dims.num_layers):
        pre = layer_prefix("glm5_next", layer)
        for block in ("attn", "ffn"):         # near a plain residual: collapse = mean, expand by 1, comb symmetric
            base = tensors[f"{pre}hc_{block}_base"]                                  # [(2 + N) N]
            np.testing.assert_allclose(1 / (1 + np.exp(-base[:n])), 1 / n, rtol=1e-6)
            comb = base[2 * n:].reshape(n, n)
            assert not base[n:2 * n].any() and (comb == comb.T).all()
            assert tensors[f"{pre}hc_{block}_fn"].shape == ((2 + n) * n, n * dims.hidden_size)
        attn = pre + "self_attn."
        if layer % 4 == 3:                    # latent attention: keys from one half of the latent, values from the other
            kv_b = tensors[attn + "kv_b_proj.weight"].reshape(heads, 2 * hd, 2 * half)
            assert not kv_b[:, :hd, half:].any() and not kv_b[:, hd:, :half].any() and kv_b[:, :hd, :half].all()
            assert attn + "indexer.wq_b.weight" in tensors and attn + "q_proj.weight" not in tensors
            continue
        assert {f"{attn}{c}_conv1d.weight" for c in "qkv"} <= tensors.keys() and attn + "q_a_proj.weight" not in tensors
        rate = np.exp(tensors[attn + "A_log"].astype(np.float64))[:, None]               # [H, 1]
        decay = np.exp(-5.0 / (1 + np.exp(-rate * tensors[attn + "dt_bias"].reshape(heads, -1))))   # [H, d] at f = 0
        assert ((0.3 < decay) & (decay < 0.995)).all() and decay.std(1).min() > 0, (layer, decay)   # per key channel


@needs_transformers
def test_logits_depend_on_context(synth_models):
    a, b = (np.concatenate([t for _, t in sample_session(synth_models("qwen3_moe"), seed=s)])[None] for s in (1, 2))
    b[0, -1] = a[0, -1]
    model, _ = load_reference(synth_models("qwen3_moe"))
    la, lb = reference_logits(model, a)[0, -1], reference_logits(model, b)[0, -1]
    assert (la - lb).abs().mean() > 0.05


# --- determinism and atomic writes ----------------------------------------------------

@pytest.mark.parametrize("arch", ["glm4_moe", "qwen3_next", "glm5_next"])
def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path, arch):
    one = _tree_digest(write_synthetic(tmp_path / "a", arch, "tiny", seed=3))
    two = _tree_digest(write_synthetic(tmp_path / "b", arch, "tiny", seed=3))
    other = _tree_digest(write_synthetic(tmp_path / "c", arch, "tiny", seed=4))
    assert one == two
    assert one["model.safetensors"] != other["model.safetensors"]
    assert one["config.json"] != other["config.json"]  # the seed is in the config: fingerprints differ


def test_fingerprint_tells_seeds_apart(tmp_path):
    from moetier.model import open_checkpoint

    a = open_checkpoint(write_synthetic(tmp_path / "a", "qwen3_moe", "tiny", seed=1)).fingerprint
    b = open_checkpoint(write_synthetic(tmp_path / "b", "qwen3_moe", "tiny", seed=2)).fingerprint
    assert a != b


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_next", "glm5_next"])
def test_bytes_do_not_depend_on_the_blas_thread_count(tmp_path, arch):
    here = _tree_digest(write_synthetic(tmp_path / "here", arch, "tiny", seed=1, fused=True))
    repo = pathlib.Path(synth.__file__).resolve().parents[2]
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    code = ("from moetier.model.synth import write_synthetic; "
            f"write_synthetic({str(tmp_path / 'one')!r}, {arch!r}, 'tiny', seed=1, fused=True)")
    subprocess.run([sys.executable, "-c", code], env=env, check=True)
    assert _tree_digest(tmp_path / "one") == here


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    real = synth._write_safetensors

    def fail_after_writing(path, tensors):
        real(path, tensors[:3])
        raise OSError("disk full")

    monkeypatch.setattr(synth, "_write_safetensors", fail_after_writing)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic(tmp_path / "model", "qwen3_moe", "tiny")
    assert list(tmp_path.iterdir()) == []


def test_refuses_a_non_empty_directory_but_fills_an_empty_one(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    with pytest.raises(ValueError, match="exists and is not empty"):
        write_synthetic(tmp_path / "full")
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]
    (tmp_path / "empty").mkdir()
    out = write_synthetic(tmp_path / "empty")
    assert {"config.json", "model.safetensors", synth.SYNTH_META} <= {p.name for p in out.iterdir()}
    with pytest.raises(ValueError, match="preset"):
        write_synthetic(tmp_path / "x", preset="huge")
    with pytest.raises(ValueError, match="arch"):
        write_synthetic(tmp_path / "y", arch="llama")
