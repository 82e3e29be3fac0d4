"""Routing of synthetic checkpoints over sampled sessions: a realistic skew (hot sets per phase, a cold-leaning
family, temporal reuse) in every preset, the medium preset's size and laziness, the seed preset's real geometry.

Router outputs come from moetier's engine through `route_sessions`, or from transformers' reference model for an
arch the engine cannot open: the one place that picks.
"""

from __future__ import annotations

import json
import resource

import numpy as np
import pytest
import torch

from moetier.model import synth
from moetier.model.synth import (
    ARCHES,
    PRESETS,
    sample_session,
    token_families,
    write_synthetic,
)
from synth_reference import load_reference, loading_problems, needs_transformers, reference_logits

N_SESSIONS = 6
TOKENS_PER_PHASE = 64


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
        reference_logits(model, np.asarray(token_ids))
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


# --- sessions -------------------------------------------------------------------

def test_sessions_draw_runs_from_the_phase_family(synth_models):
    model_dir = synth_models("qwen3_moe")
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
def test_transformers_routes_qwen3_next_as_the_engine_does(synth_models):
    """route_sessions' fallback for an arch moetier refuses gives the decisions moetier's engine makes."""
    model_dir = synth_models("qwen3_next")
    ids = sessions_batch(model_dir, n=2)[0]
    reference, engine = route_sessions_with_transformers(model_dir, ids), route_sessions(model_dir, ids)
    assert sorted(reference) == sorted(engine) == list(range(synth.arch_preset("qwen3_next", PRESETS["tiny"]).num_layers))
    for layer, (mass, picks) in reference.items():
        np.testing.assert_allclose(mass, engine[layer][0], rtol=0, atol=1e-4)
        assert (np.sort(picks, 1) == np.sort(engine[layer][1], 1)).all(1).mean() > 0.98, layer   # near-ties aside


@needs_transformers
def test_glm5_next_streams_act_as_a_plain_residual_no_swiglu_clamps_and_the_engine_agrees(synth_models):
    """The hyper-connections stay near a plain residual (streams within 5% of their mean, the collapse a multiple
    of their mean within 5% -- the multiple, sum(pre), 1 +- 0.08 (rms), which the block's RMSNorm divides out --
    the expansion 1 +- 0.05 (rms); worst tokens within 0.5 and 0.3), swiglu_limit never binds, and route_sessions'
    engine gives transformers' logits on this designed model (test_glm5_next checks it on random ones)."""
    from moetier.engine import Engine, score
    from moetier.model import open_checkpoint

    model_dir = synth_models("glm5_next")
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
        logits = reference_logits(model, ids)                                            # [1, L, V]
    finally:
        for hook in hooks:
            hook.remove()
    spread, collapse, collapse_scale, expand = (max(float(s[i]) for s in seen) for i in range(4))
    assert len(seen) == 2 * len(language.layers), seen
    assert spread < 0.05 and collapse < 0.05 and collapse_scale < 0.5 and expand < 0.3, seen   # scale: the norm's
    for module in model.modules():
        if hasattr(module, "swiglu_limit"):
            module.swiglu_limit = float("inf")
    assert torch.equal(reference_logits(model, ids), logits)
    engine = score(Engine(open_checkpoint(model_dir)), ids[0].numpy())
    assert np.abs(engine - logits[0].numpy()).max() < 1e-4


@needs_transformers
@pytest.mark.parametrize("arch", ARCHES)
def test_routing_is_skewed_phase_specific_and_local_tiny(synth_models, arch):
    check_properties(measure(synth_models(arch, "tiny")))


@needs_transformers
@pytest.mark.parametrize("arch", ARCHES)
def test_routing_is_skewed_phase_specific_and_local_small(synth_models, arch):
    check_properties(measure(synth_models(arch, "small")))


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
