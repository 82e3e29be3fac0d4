"""Synthetic checkpoints: transformers loads them, bytes are deterministic, writes are
atomic, and routing over sampled sessions has a realistic skew (hot sets per phase,
a cold-leaning family, temporal reuse).

Router outputs come from moetier's engine through `route_sessions`, or from
transformers' reference model for an arch the engine cannot open (qwen3_next
until moetier runs it): the one place that picks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import json
import os
import pathlib
import resource
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
    token_families,
    write_synthetic,
)

try:
    import transformers
    transformers.logging.set_verbosity_error()
except ImportError:     # a dev extra; the numpy-only tests still run
    transformers = None
needs_transformers = pytest.mark.skipif(transformers is None, reason="needs transformers (pip install -e '.[dev]')")
MODEL_CLASSES = {"qwen3_moe": "Qwen3MoeForCausalLM", "glm4_moe": "Glm4MoeForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_next": "Qwen3NextForCausalLM",
                 "glm5_next": "Glm5NextForConditionalGeneration"}
N_SESSIONS = 6
TOKENS_PER_PHASE = 64
VISION = "model.visual."    # glm5_next's vision tower: never written (moetier never reads it), transformers initialises it


def load_reference(model_dir):
    config = json.loads((pathlib.Path(model_dir) / "config.json").read_text())
    cls = getattr(transformers, MODEL_CLASSES[config["model_type"]])
    model, info = cls.from_pretrained(model_dir, output_loading_info=True)
    return model.eval(), info


def loading_problems(info) -> dict:
    """transformers' loading info less what is expected: the missing keys of glm5_next's vision tower, and only those."""
    info = dict(info, missing_keys={k for k in info["missing_keys"] if not k.startswith(VISION)})
    return {k: info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs") if info[k]}


def layer_prefix(arch: str, layer: int) -> str:
    """Where a decoder layer's tensors are named in the file: glm5_next's text model is model.language_model."""
    return f"model.{'language_model.' if arch == 'glm5_next' else ''}layers.{layer}."


def route_sessions(model_dir, token_ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per MoE layer: (router mass per token [T, E], top-k picks [T, k]) for a batch [S, L] of sessions.

    Measured with moetier's own engine (its router matches transformers', see test_engine):
    mass is the softmax probabilities (qwen3_moe, mixtral, qwen3_next) or the sigmoid scores
    normalised per token (glm4_moe); picks are the router's choice (for glm4_moe after the
    correction bias and the group limit). Sessions run one at a time (the engine is batch 1),
    rows in order. An arch whose config moetier refuses (SpecError) is routed by transformers.
    """
    from moetier.engine import Engine, score
    from moetier.model import open_checkpoint
    from moetier.model.spec import SpecError

    try:
        checkpoint = open_checkpoint(model_dir)
    except SpecError:
        return route_sessions_with_transformers(model_dir, token_ids)
    engine = Engine(checkpoint)
    sigmoid = engine.spec.router == "sigmoid"
    captured: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {}

    def observe(layer, decision):
        p = decision.probs.float()  # [T, E]
        if sigmoid:
            p = p / p.sum(-1, keepdim=True)
        captured.setdefault(layer, []).append((p.numpy(), decision.picks.numpy()))

    engine.observer = observe
    for row in np.asarray(token_ids):
        score(engine, row)
    return {layer: (np.concatenate([m for m, _ in rows]), np.concatenate([k for _, k in rows])) for layer, rows in captured.items()}


def route_sessions_with_transformers(model_dir, token_ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """route_sessions through transformers, for softmax routers whose `mlp.gate` returns (logits, weights, picks)
    as Qwen3-Next's does: the batch in one forward, its rows in order."""
    model, _ = load_reference(model_dir)
    captured: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def observer(layer):
        def observe(module, inputs, output):
            logits, _, picks = output                                        # [S*L, E], _, [S*L, k]
            captured[layer] = (torch.softmax(logits.float(), -1).numpy(), picks.numpy())
        return observe

    hooks = [decoder.mlp.gate.register_forward_hook(observer(layer))
             for layer, decoder in enumerate(model.model.layers) if hasattr(decoder.mlp, "gate")]
    try:
        _logits(model, np.asarray(token_ids))
    finally:
        for hook in hooks:
            hook.remove()
    return dict(sorted(captured.items()))


def sessions_batch(model_dir, n=N_SESSIONS):
    """Token ids [S, 3*TOKENS_PER_PHASE], phase index per token [S*L], family name per token [S*L]."""
    fams = token_families(model_dir)
    family_of = {int(t): name for name, ids in fams.items() for t in ids}
    ids, phase = [], []
    for s in range(n):
        sess = sample_session(model_dir, tokens_per_phase=TOKENS_PER_PHASE, seed=s)
        ids.append(np.concatenate([t for _, t in sess]))
        phase.append(np.concatenate([np.full(len(t), i) for i, (_, t) in enumerate(sess)]))
    ids = np.stack(ids)
    family = np.array([family_of.get(int(t), "special") for t in ids.ravel()])
    return ids, np.concatenate(phase), family


def top_set(mass: np.ndarray, share: float) -> set[int]:
    n = max(1, round(share * len(mass)))
    return set(np.argsort(-mass, kind="stable")[:n].tolist())


def routing_properties(probs, picks, phase, family, session_len) -> dict[str, float]:
    """The four properties for one layer, over all session tokens.

    top20_mass: share of router mass on the top 20% of experts. max_phase_jaccard:
    largest Jaccard overlap of two phases' top-25% expert sets. *_cold: share of
    top-k picks outside the pooled top-25% hot set (pooled_cold: all tokens;
    others_cold: every token not in second_language; max_other_cold: the worst single family).
    reuse_*: mean |picks(t) & picks(t+1)| / k, in order and with each session shuffled.
    """
    E, k = probs.shape[1], picks.shape[1]
    mass = probs.sum(0)                                              # [E]
    top20 = float(np.sort(mass)[::-1][: max(1, round(0.2 * E))].sum() / mass.sum())
    hot_by_phase = [top_set(probs[phase == i].sum(0), 0.25) for i in range(3)]
    jaccard = max(len(a & b) / len(a | b) for i, a in enumerate(hot_by_phase) for b in hot_by_phase[i + 1:])
    hot = np.array(sorted(top_set(mass, 0.25)))
    cold = ~np.isin(picks, hot)                                      # [T, k]
    cold_rate = {f: float(cold[family == f].mean()) for f in np.unique(family) if f != "special"}
    pooled_cold = float(cold.mean())
    others_cold = float(cold[(family != "second_language") & (family != "special")].mean())
    onehot = np.zeros((len(picks), E), bool)                         # [T, E]
    np.put_along_axis(onehot, picks, True, axis=1)
    onehot = onehot.reshape(-1, session_len, E)                      # [S, L, E]
    consecutive = float((onehot[:, 1:] & onehot[:, :-1]).sum(-1).mean() / k)
    rng = np.random.default_rng(0)
    shuffled = np.stack([s[rng.permutation(session_len)] for s in onehot])
    random_pairs = float((shuffled[:, 1:] & shuffled[:, :-1]).sum(-1).mean() / k)
    others = max(v for f, v in cold_rate.items() if f != "second_language")
    return {"top20_mass": top20, "max_phase_jaccard": jaccard, "pooled_cold": pooled_cold,
            "others_cold": others_cold, "sl_cold": cold_rate["second_language"], "max_other_cold": others,
            "reuse_consecutive": consecutive, "reuse_shuffled": random_pairs}


def measure(model_dir) -> dict[int, dict[str, float]]:
    ids, phase, family = sessions_batch(model_dir)
    routed = route_sessions(model_dir, ids)
    return {layer: routing_properties(probs, picks, phase, family, ids.shape[1])
            for layer, (probs, picks) in sorted(routed.items())}


def check_properties(props: dict[int, dict[str, float]]) -> None:
    assert props, "no MoE layer observed"
    for layer, m in props.items():
        assert m["top20_mass"] >= 0.60, (layer, m)
        assert m["max_phase_jaccard"] < 0.60, (layer, m)
        assert m["sl_cold"] >= 2.0 * m["others_cold"], (layer, m)
        assert m["sl_cold"] > m["max_other_cold"], (layer, m)
        assert m["reuse_consecutive"] >= 1.15 * m["reuse_shuffled"], (layer, m)


# --- fixtures -------------------------------------------------------------------

@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(arch, preset, fused) -> model dir, each written once per module."""
    root = tmp_path_factory.mktemp("synth")
    cache = {}

    def get(arch, preset="tiny", fused=False):
        key = (arch, preset, fused)
        if key not in cache:
            out = root / f"{arch}-{preset}-{int(fused)}"
            cache[key] = write_synthetic(out, arch, preset, seed=0, fused=fused)
        return cache[key]

    return get


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits


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
def test_transformers_loads_without_missing_or_unexpected_keys(models, arch, preset):
    model, info = load_reference(models(arch, preset))
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
def test_fused_layout_gives_the_same_logits(models, arch):
    fused = models(arch, fused=True)
    moe = layer_prefix(arch, 1) + ("block_sparse_moe" if arch == "mixtral" else "mlp")   # a MoE layer in every arch
    header = _header(fused / "model.safetensors")
    dims = synth.arch_preset(arch, PRESETS["tiny"])
    E, I, D = dims.num_experts, dims.moe_intermediate_size, dims.hidden_size
    assert header[f"{moe}.experts.gate_up_proj"]["shape"] == [E, 2 * I, D]
    assert header[f"{moe}.experts.down_proj"]["shape"] == [E, D, I]
    assert not any(".experts.0." in k for k in header)
    per_expert_model, fused_model = load_reference(models(arch))[0], load_reference(fused)[0]
    fused_state = fused_model.state_dict()
    assert all(torch.equal(v, fused_state[k]) for k, v in per_expert_model.state_dict().items() if not k.startswith(VISION))
    # identical weights; two model instances may still differ in the last float bits
    ids = sample_session(fused, tokens_per_phase=16)[0][1][None]
    torch.testing.assert_close(_logits(per_expert_model, ids), _logits(fused_model, ids), rtol=0, atol=1e-5)


@pytest.mark.parametrize("arch", ARCHES)
def test_one_experts_tensors_are_contiguous_in_the_file(models, arch):
    header = _header(models(arch) / "model.safetensors")
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
def test_sharded_write_loads_the_same_as_one_file(models, tmp_path, monkeypatch):
    monkeypatch.setitem(PRESETS, "tiny", dataclasses.replace(PRESETS["tiny"], shard_bytes=300_000))
    sharded = write_synthetic(tmp_path / "sharded", "glm4_moe", "tiny")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    header_bytes = [8 + int.from_bytes((sharded / f).read_bytes()[:8], "little") for f in shards]
    assert index["metadata"]["total_size"] == sum((sharded / f).stat().st_size for f in shards) - sum(header_bytes)
    ids = sample_session(sharded, tokens_per_phase=16)[1][1][None]
    one_file, split = load_reference(models("glm4_moe"))[0], load_reference(sharded)[0]
    torch.testing.assert_close(_logits(one_file, ids), _logits(split, ids), rtol=0, atol=1e-5)


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


def test_qwen3_next_tensors_carry_the_arch_features(models):
    from safetensors.numpy import load_file
    tensors = load_file(models("qwen3_next") / "model.safetensors")
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
def test_glm_correction_bias_is_nonzero(models, arch):
    from safetensors.numpy import load_file
    tensors = load_file(models(arch) / "model.safetensors")
    bias = tensors[layer_prefix(arch, 1) + "mlp.gate.e_score_correction_bias"]       # [E]
    assert np.abs(bias).max() > 0.01 and layer_prefix(arch, 0) + "mlp.gate_proj.weight" in tensors
    assert layer_prefix(arch, 1) + "mlp.shared_experts.down_proj.weight" in tensors


def test_glm5_next_tensors_carry_the_arch_features(models):
    from safetensors.numpy import load_file
    tensors = load_file(models("glm5_next") / "model.safetensors")
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
def test_logits_depend_on_context(models):
    a, b = (np.concatenate([t for _, t in sample_session(models("qwen3_moe"), seed=s)])[None] for s in (1, 2))
    b[0, -1] = a[0, -1]
    model, _ = load_reference(models("qwen3_moe"))
    la, lb = _logits(model, a)[0, -1], _logits(model, b)[0, -1]
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


# --- sessions -------------------------------------------------------------------

def test_sessions_draw_runs_from_the_phase_family(models):
    model_dir = models("qwen3_moe")
    families = token_families(model_dir)
    assert set(families) == {"common", "explore", "edit", "verify", "second_language"}
    every = np.concatenate(list(families.values()))
    assert len(every) == len(set(every.tolist())) == PRESETS["tiny"].vocab_size - 3
    session = sample_session(model_dir, tokens_per_phase=200, seed=5)
    assert [p for p, _ in session] == ["explore", "edit", "verify"]
    for phase, ids in session:
        assert ids.shape == (200,) and ids.dtype == np.int64
        own = np.isin(ids, families[phase]).mean()
        assert 0.55 < own < 0.85, (phase, own)
        runs = 1 + np.count_nonzero(np.diff(np.isin(ids, families[phase]).astype(int)))
        assert runs < 0.5 * len(ids)                                     # runs, not a token-by-token mix
    again = sample_session(model_dir, tokens_per_phase=200, seed=5)
    assert all(np.array_equal(a[1], b[1]) for a, b in zip(session, again))
    only_sl = sample_session(model_dir, phases=("edit",), family_mix={"second_language": 1.0})[0][1]
    assert np.isin(only_sl, families["second_language"]).all()
    with pytest.raises(ValueError, match="family"):
        sample_session(model_dir, phases=("plan",))


# --- routing properties -----------------------------------------------------------

@needs_transformers
def test_transformers_routes_qwen3_next_as_the_engine_does(models):
    """route_sessions' fallback for an arch moetier refuses gives the decisions moetier's engine makes."""
    model_dir = models("qwen3_next")
    ids = sessions_batch(model_dir, n=2)[0]
    reference, engine = route_sessions_with_transformers(model_dir, ids), route_sessions(model_dir, ids)
    assert sorted(reference) == sorted(engine) == list(range(synth.arch_preset("qwen3_next", PRESETS["tiny"]).num_layers))
    for layer, (mass, picks) in reference.items():
        np.testing.assert_allclose(mass, engine[layer][0], rtol=0, atol=1e-4)
        assert (np.sort(picks, 1) == np.sort(engine[layer][1], 1)).all(1).mean() > 0.98, layer   # near-ties aside


@needs_transformers
def test_glm5_next_streams_act_as_a_plain_residual_no_swiglu_clamps_and_the_engine_agrees(models):
    """The hyper-connections stay near a plain residual (streams within 5% of their mean, the collapse a multiple
    of their mean within 5% -- the multiple, sum(pre), 1 +- 0.08 (rms), which the block's RMSNorm divides out --
    the expansion 1 +- 0.05 (rms); worst tokens within 0.5 and 0.3), swiglu_limit never binds, and route_sessions'
    engine gives transformers' logits on this designed model (test_glm5_next checks it on random ones)."""
    from moetier.engine import Engine, score
    from moetier.model import open_checkpoint

    model_dir = models("glm5_next")
    model, _ = load_reference(model_dir)
    ids = torch.as_tensor(sessions_batch(model_dir, n=1)[0])                      # [1, L]
    seen = []

    def observe(module, inputs, output):
        post, _, collapsed = output                                             # [1, L, N], _, [1, L, D]
        streams = inputs[0]                                                     # [1, L, N, D]
        mean = streams.mean(2)                                                  # [1, L, D]
        scale = (collapsed * mean).sum(-1, keepdim=True) / mean.square().sum(-1, keepdim=True)   # sum of pre, per token
        seen.append(((streams - mean[:, :, None]).norm() / (mean.norm() * streams.shape[2] ** 0.5),
                     (collapsed - scale * mean).norm() / collapsed.norm(), (scale - 1).abs().max(), (post - 1).abs().max()))
    language = model.model.language_model
    hooks = [hc.register_forward_hook(observe) for layer in language.layers for hc in (layer.attn_hc, layer.ffn_hc)]
    try:
        logits = _logits(model, ids)                                            # [1, L, V]
    finally:
        for hook in hooks:
            hook.remove()
    spread, collapse, collapse_scale, expand = (max(float(s[i]) for s in seen) for i in range(4))
    assert len(seen) == 2 * len(language.layers), seen
    assert spread < 0.05 and collapse < 0.05 and collapse_scale < 0.5 and expand < 0.3, seen   # scale: the norm's
    for module in model.modules():
        if hasattr(module, "swiglu_limit"):
            module.swiglu_limit = float("inf")
    assert torch.equal(_logits(model, ids), logits)
    engine = score(Engine(open_checkpoint(model_dir)), ids[0].numpy())
    assert np.abs(engine - logits[0].numpy()).max() < 1e-4


@needs_transformers
@pytest.mark.parametrize("arch", ARCHES)
def test_routing_is_skewed_phase_specific_and_local_tiny(models, arch):
    check_properties(measure(models(arch, "tiny")))


@needs_transformers
@pytest.mark.parametrize("arch", ARCHES)
def test_routing_is_skewed_phase_specific_and_local_small(models, arch):
    check_properties(measure(models(arch, "small")))


# --- medium (about 1 GB) --------------------------------------------------------------

def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@needs_transformers
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_medium_is_about_1gb_sharded_lazy_and_routes_realistically(tmp_path, arch):
    from safetensors import safe_open
    out = write_synthetic(tmp_path / "medium", arch, "medium")
    shards = sorted(out.glob("model-*.safetensors"))
    total = sum(f.stat().st_size for f in shards)
    assert 0.9e9 <= total <= 1.2e9 and len(shards) >= 3
    assert all(f.stat().st_size < 0.4e9 for f in shards)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    prefix = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = [k for k in weight_map if f"layers.5.{prefix}.experts.7." in k]
    assert len(names) == 3 and len({weight_map[k] for k in names}) == 1     # one expert, one shard
    before = _rss_bytes()
    with safe_open(out / weight_map[names[0]], framework="pt") as f:
        expert = [f.get_tensor(k) for k in names]
    assert sum(t.numel() * 4 for t in expert) < 20e6
    assert _rss_bytes() - before < 150e6                                       # not the whole shard
    model, info = load_reference(out)
    assert not loading_problems(info), loading_problems(info)
    del model
    check_properties(measure(out))


# --- seed (Qwen3-Next's routing geometry, about 0.6 GB; GLM-5.3-Flash's for glm5_next, about 0.33 GB) -------

SEED_GEOMETRY = {"glm4_moe": (48, 47, 0.5e9, 0.8e9), "glm5_next": (45, 42, 0.3e9, 0.4e9)}   # layers, MoE layers, bytes


@needs_transformers
@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHES)
def test_seed_has_the_real_routing_geometry_and_routes_realistically(tmp_path, arch):
    layers, moe_layers, low, high = SEED_GEOMETRY.get(arch, (48, 48, 0.5e9, 0.8e9))
    out = write_synthetic(tmp_path / "seed", arch, "seed")
    total = sum(f.stat().st_size for f in out.glob("model-*.safetensors"))
    assert low <= total <= high
    dims = synth.arch_preset(arch, PRESETS["seed"])
    model, info = load_reference(out)
    assert not loading_problems(info), loading_problems(info)
    config = model.config.get_text_config()
    assert (config.num_hidden_layers, config.num_experts_per_tok) == (layers, dims.top_k)
    del model
    props = measure(out)
    assert len(props) == moe_layers
    check_properties(props)
