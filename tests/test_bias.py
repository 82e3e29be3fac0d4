"""Bias tables: properties of graded / flat / hard, refusal of bad tables, off is off, and `bias write`."""

from __future__ import annotations

import dataclasses
import json
import os

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from safetensors.numpy import save_file
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.config import ConfigError, load_layout
from moetier.engine import Engine, generate, route, score
from moetier.engine.runtime import build_runtime
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.engine.router_bias import BiasError, apply_router_options, load_table
from moetier.profile.bias import build_table, check_hard_mask, penalties
from moetier.profile.brightness import profile_requests
from moetier.profile.sessions import load_sessions, write_example_sessions
from layouts import cache_layout

IDS = np.array([7, 19, 3, 250, 41, 8, 8, 90, 310, 12, 5, 77, 200, 31, 64, 2, 99, 150, 11, 4])


def _built(tmp_path_factory, arch: str):
    root = tmp_path_factory.mktemp(arch)
    folder = write_synthetic(root / "model", arch=arch, preset="tiny", seed=2)
    sessions = write_example_sessions(folder, root / "s.jsonl", sessions=1, tokens_per_phase=32)
    checkpoint = open_checkpoint(folder)
    profile = profile_requests(Engine(checkpoint), load_sessions(sessions, folder, checkpoint.spec.vocab_size))
    return checkpoint, profile, root


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    return _built(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    return _built(tmp_path_factory, "glm4_moe")


brightness_arrays = st.integers(1, 3).flatmap(lambda layers: st.integers(2, 24).flatmap(
    lambda experts: arrays(np.float64, (layers, experts), elements=st.sampled_from([0.0, 0.01, 0.05, 0.2]) | st.floats(0, 1))))


@settings(max_examples=150, deadline=None)
@given(brightness=brightness_arrays, data=st.data(), cap=st.floats(-8.0, -0.01))
def test_tables_hot_zero_graded_monotone_and_capped(brightness, data, cap):
    experts = brightness.shape[1]
    hot = data.draw(st.integers(1, experts))
    graded, hot_mask, b_edge = penalties(brightness, hot, "graded", cap)
    assert (hot_mask.sum(axis=1) == hot).all()
    assert (graded[hot_mask] == 0).all()
    # the hot set is the N brightest: nothing cold is brighter than the weakest hot expert
    assert all((b[~m] <= edge).all() and (b[m] >= edge).all() for b, m, edge in zip(brightness, hot_mask, b_edge))
    assert (graded >= np.float32(cap)).all() and (graded <= 0).all()
    for b, row in zip(brightness, graded):  # monotone in brightness: b[i] >= b[j] -> penalty[i] >= penalty[j]
        brighter = b[:, None] >= b[None, :]  # [E, E]
        assert (row[:, None] >= row[None, :])[brighter].all()
    flat, _, _ = penalties(brightness, hot, "flat", cap)
    assert (flat[hot_mask] == 0).all() and (flat[~hot_mask] == np.float32(cap)).all()
    hard, _, _ = penalties(brightness, hot, "hard", cap)
    assert (hard[hot_mask] == 0).all() and np.isneginf(hard[~hot_mask]).all()


def _spec(checkpoint, **changes):
    return dataclasses.replace(checkpoint.spec, **changes)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_a_hard_table_never_picks_a_cold_expert(qwen, glm, data):
    sigmoid = data.draw(st.booleans())
    checkpoint = (glm if sigmoid else qwen)[0]
    experts = data.draw(st.sampled_from([8, 16, 32]))
    top_k = data.draw(st.integers(1, 4))
    spec = _spec(checkpoint, num_experts=experts, top_k=top_k, **({"n_group": 4, "topk_group": 2} if sigmoid else {}))
    brightness = data.draw(arrays(np.float64, (1, experts), elements=st.floats(0, 1)))
    hot = data.draw(st.integers(top_k, experts))
    table, hot_mask, _ = penalties(brightness, hot, "hard", 0.0)
    if sigmoid:
        try:
            check_hard_mask(hot_mask, top_k, spec.n_group, spec.topk_group)
        except BiasError:
            assume(False)
    logits = torch.tensor(data.draw(arrays(np.float32, (5, experts), elements=st.floats(-6, 6, width=32))))  # [T, E]
    correction = torch.tensor(data.draw(arrays(np.float32, (experts,), elements=st.floats(-0.5, 0.5, width=32)))) if sigmoid else None
    picks = route(spec, logits, correction, torch.from_numpy(table[0])).picks  # [T, k]
    assert hot_mask[0][picks.numpy()].all()


def test_hard_tables_need_a_hot_set_of_at_least_top_k(qwen, glm):
    checkpoint, profile, _ = qwen
    with pytest.raises(BiasError, match="expected --hot >= top_k"):
        build_table(profile, checkpoint.spec.top_k - 1, "hard")
    with pytest.raises(BiasError, match="negative penalty"):
        build_table(profile, 6, "graded", 0.5)
    with pytest.raises(BiasError, match="unknown"):
        build_table(profile, 6, "soft", -0.5)
    glm_checkpoint, glm_profile, _ = glm  # 4 groups of 4, 2 kept, top-4: hot 2 cannot fill two groups
    with pytest.raises(BiasError, match="groups the router keeps"):
        build_table(glm_profile, 4, "hard")


def _bad_table(path, bias, fingerprint):
    save_file({"bias": bias}, str(path), metadata={"format": "moetier-bias", "model_fingerprint": fingerprint})
    return path


def test_bad_tables_are_refused_with_a_clear_error(qwen, glm, tmp_path):
    checkpoint, profile, _ = qwen
    spec, fingerprint = checkpoint.spec, checkpoint.fingerprint
    shape = (len(spec.moe_layers), spec.num_experts)
    cases = {
        "shape": (np.zeros((shape[0], shape[1] + 1), np.float32), fingerprint, r"has shape \[3, 17\] \(expected \[3, 16\]"),
        "nan": (np.where(np.eye(*shape) > 0, np.nan, 0).astype(np.float32), fingerprint, "NaN at MoE layer 0, expert 0"),
        "plus inf": (np.full(shape, np.inf, np.float32), fingerprint, r"\+inf"),
        "positive": (np.full(shape, 0.5, np.float32), fingerprint, "positive entries"),
        "foreign": (np.zeros(shape, np.float32), glm[0].fingerprint, f"built for model {glm[0].fingerprint}, this model is {fingerprint}"),
        "dtype": (np.zeros(shape, np.float64), fingerprint, "expected float32"),
    }
    engine = Engine(checkpoint)
    for name, (bias, built_for, message) in cases.items():
        path = _bad_table(tmp_path / f"{name}.safetensors", bias, built_for)
        with pytest.raises(BiasError, match=message):
            apply_router_options(engine, path)
        assert engine.router_bias is None
    save_file({"x": np.zeros(3, np.float32)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(BiasError, match="not a moetier-bias table"):
        load_table(tmp_path / "other.safetensors")
    with pytest.raises(BiasError, match="no such bias table"):
        load_table(tmp_path / "missing.safetensors")
    ids = tmp_path / "ids.npy"
    np.save(ids, IDS)
    result = CliRunner().invoke(app, ["score", str(checkpoint.folder), "--ids", str(ids), "--out", str(tmp_path / "l.npy"),
                                      "--bias", str(tmp_path / "nan.safetensors")])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "moetier: error:" in result.stderr


def test_off_is_bit_identical(qwen, tmp_path):
    checkpoint, profile, _ = qwen
    plain = score(Engine(checkpoint), IDS)
    engine = Engine(checkpoint)
    assert apply_router_options(engine, None, 0.0, "selection") is None
    np.testing.assert_array_equal(score(engine, IDS), plain)
    everything_hot = build_table(profile, checkpoint.spec.num_experts, "graded", -1.0).save(tmp_path / "all-hot.safetensors")
    assert apply_router_options(engine, everything_hot, 0.0, "damped") is None and engine.router_bias is None
    np.testing.assert_array_equal(score(engine, IDS), plain)
    ids = tmp_path / "ids.npy"
    np.save(ids, IDS)
    result = CliRunner().invoke(app, ["score", str(checkpoint.folder), "--ids", str(ids), "--out", str(tmp_path / "l.npy"),
                                      "--affinity", "0", "--bias-mode", "selection"])
    assert result.exit_code == 0, result.output
    np.testing.assert_array_equal(np.load(tmp_path / "l.npy"), plain)
    table = build_table(profile, 6, "graded", -1.0).save(tmp_path / "t.safetensors")
    apply_router_options(engine, table)
    assert not np.array_equal(score(engine, IDS), plain)  # and on is on


LAYOUT = cache_layout(slots=6, policy="lru", rtt_us=20.0)


def test_cluster_toml_router_section_is_honoured(qwen, tmp_path):
    checkpoint, profile, _ = qwen
    build_table(profile, 6, "hard").save(tmp_path / "hard.safetensors")
    (tmp_path / "on.toml").write_text(LAYOUT + '[router]\nbias = "hard.safetensors"\naffinity = 0.25\nbias_mode = "damped"\n')
    runtime = build_runtime(load_layout(tmp_path / "on.toml"), checkpoint)
    try:
        bias = runtime.engine.router_bias
        assert bias is not None and bias.damped and bias.affinity == 0.25
        np.testing.assert_array_equal(bias.table.cpu().numpy(), load_table(tmp_path / "hard.safetensors").bias)  # on the engine's device
    finally:
        runtime.close()
    (tmp_path / "off.toml").write_text(LAYOUT + "[router]\naffinity = 0.0\n")
    runtime = build_runtime(load_layout(tmp_path / "off.toml"), checkpoint)
    try:
        assert runtime.engine.router_bias is None
    finally:
        runtime.close()
    (tmp_path / "missing.toml").write_text(LAYOUT + '[router]\nbias = "nope.safetensors"\n')
    with pytest.raises(ConfigError, match=r"missing.toml: \[router\]: .*no such bias table"):
        build_runtime(load_layout(tmp_path / "missing.toml"), checkpoint)
    with pytest.raises(BiasError, match="live expert cache"):
        apply_router_options(Engine(checkpoint), None, 0.25)


def test_a_table_applies_in_prefill_decode_and_verify_windows(qwen, tmp_path):
    checkpoint, profile, _ = qwen
    table = build_table(profile, 6, "hard")
    engine = Engine(checkpoint)
    apply_router_options(engine, table.save(tmp_path / "hard.safetensors"))
    seen: list[tuple[int, int]] = []  # (tokens in the forward, cold picks)

    def observe(layer, decision):
        row = engine.moe_index[layer]
        seen.append((decision.picks.shape[0], int((~table.hot[row][decision.picks.numpy()]).sum())))

    engine.observer = observe
    generate(engine, IDS[:8].tolist(), 6)  # prefill of 8, then decode steps of 1
    cache = engine.new_cache()
    engine.forward(torch.tensor(IDS[:6]), cache)
    engine.forward(torch.tensor(IDS[6:10]), cache)  # a multi-token verify window after a cache
    assert {tokens for tokens, _ in seen} >= {8, 1, 6, 4}
    assert all(cold == 0 for _, cold in seen)


def test_bias_commands_build_and_show(qwen, tmp_path):
    checkpoint, profile, _ = qwen
    profile_path = profile.save(tmp_path / "p.npz")
    runner = CliRunner()
    out = tmp_path / "t.safetensors"
    result = runner.invoke(app, ["bias", "--profile", str(profile_path), "--hot", "6", "--kind", "graded", "--cap", "-0.5", "--out", str(out)])
    assert result.exit_code == 0, result.output
    again = runner.invoke(app, ["bias", "build", "--profile", str(profile_path), "--hot", "6", "--cap", "-0.5", "--out", str(tmp_path / "u.safetensors")])
    assert again.exit_code == 0, again.output
    assert (load_table(out).bias == load_table(tmp_path / "u.safetensors").bias).all()
    shown = runner.invoke(app, ["bias", "show", str(out), "--json"])
    assert shown.exit_code == 0, shown.output
    report = json.loads(shown.stdout)
    assert report["kind"] == "graded" and report["cap"] == -0.5 and report["space"] == "logit"
    assert [row["hot"] for row in report["layers"]] == [6] * len(checkpoint.spec.moe_layers)
    assert all(-0.5 <= row["min"] <= row["p50"] <= row["max"] <= 0 for row in report["layers"])
    assert "hot" in runner.invoke(app, ["bias", "show", str(out)]).stdout
    bad = runner.invoke(app, ["bias", "--profile", str(profile_path), "--hot", "99", "--out", str(out)])
    assert bad.exit_code == 2 and "moetier: error: --hot is 99 (expected 1..16" in bad.stderr


def test_bias_write_round_trip_matches_transformers(glm, tmp_path):
    from transformers import Glm4MoeForCausalLM

    checkpoint, profile, _ = glm
    for kind, cap in (("graded", -0.05), ("hard", 0.0)):
        table_path = build_table(profile, 8, kind, cap).save(tmp_path / f"{kind}.safetensors")
        out = tmp_path / f"written-{kind}"
        result = CliRunner().invoke(app, ["bias", "write", "--model", str(checkpoint.folder), "--table", str(table_path),
                                          "--out", str(out), "--json"])
        assert result.exit_code == 0, result.output
        report = json.loads(result.stdout)
        assert "model.safetensors" in report["rewritten"] and "moetier_synth.json" in report["linked"] + report["copied"]
        if "moetier_synth.json" in report["linked"]:
            assert os.stat(out / "moetier_synth.json").st_ino == os.stat(checkpoint.folder / "moetier_synth.json").st_ino
        engine = Engine(checkpoint)
        apply_router_options(engine, table_path)
        ours = score(engine, IDS)
        model = Glm4MoeForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
        with torch.no_grad():
            theirs = model(torch.tensor(IDS)[None]).logits[0].numpy()
        assert np.abs(ours - theirs).max() < 1e-4
        assert np.abs(score(Engine(checkpoint), IDS) - theirs).max() > 1e-2  # the table matters
        # the copy is a different model: the table cannot be applied to it a second time
        with pytest.raises(BiasError, match="built for model"):
            apply_router_options(Engine(open_checkpoint(out)), table_path)
    again = CliRunner().invoke(app, ["bias", "write", "--model", str(checkpoint.folder), "--table", str(table_path), "--out", str(out)])
    assert again.exit_code == 2 and "not empty" in again.stderr


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    return _built(tmp_path_factory, "glm5_next")


def test_bias_write_round_trip_matches_transformers_on_glm5_next(glm5, tmp_path):
    """GLM-5.3-Flash keeps its text model under model.language_model.: the copy's correction biases are rewritten
    under those names, and transformers' Glm5NextForConditionalGeneration routes with them as moetier with the table."""
    from transformers import Glm5NextForConditionalGeneration

    checkpoint, profile, _ = glm5
    table_path = build_table(profile, 8, "graded", -0.05).save(tmp_path / "t.safetensors")
    out = tmp_path / "written"
    result = CliRunner().invoke(app, ["bias", "write", "--model", str(checkpoint.folder), "--table", str(table_path),
                                      "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    engine = Engine(checkpoint)
    apply_router_options(engine, table_path)
    ours = score(engine, IDS)
    model = Glm5NextForConditionalGeneration.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor(IDS)[None]).logits[0].numpy()
    assert np.abs(ours - theirs).max() < 1e-4
    assert np.abs(score(Engine(checkpoint), IDS) - theirs).max() > 1e-2  # the table matters


def test_bias_write_refuses_models_without_a_correction_bias(qwen, tmp_path):
    checkpoint, profile, _ = qwen
    table_path = build_table(profile, 6, "graded", -0.5).save(tmp_path / "t.safetensors")
    from moetier.profile.write import write_biased_checkpoint

    with pytest.raises(BiasError, match="apply the table at run time with --bias"):
        write_biased_checkpoint(checkpoint.folder, table_path, tmp_path / "copy")
    assert not (tmp_path / "copy").exists()


def test_bias_write_on_a_gguf_routes_as_the_table_does(glm, tmp_path):
    """A GGUF's biased copy: every tensor and key as stored but exp_probs_b (plus the table's row) and the provenance
    key, which changes the fingerprint; moetier on the copy routes as moetier on the original with the table."""
    from moetier.model.gguf_write import write_gguf

    checkpoint, _, root = glm
    source = write_gguf(checkpoint.folder, tmp_path / "f32.gguf", "F32")[0]
    original = open_checkpoint(source)
    requests = load_sessions(root / "s.jsonl", checkpoint.folder, original.spec.vocab_size)
    table_path = build_table(profile_requests(Engine(original), requests), 8, "graded", -0.05).save(tmp_path / "t.safetensors")
    out = tmp_path / "biased.gguf"
    result = CliRunner().invoke(app, ["bias", "write", "--model", str(source), "--table", str(table_path), "--out", str(out), "--json"])
    assert result.exit_code == 0, result.output
    copy = open_checkpoint(out)
    assert json.loads(result.stdout)["fingerprint"] == copy.fingerprint != original.fingerprint
    assert json.loads(copy.metadata["moetier.router_bias"])["source_fingerprint"] == original.fingerprint
    for name in original.names():
        same = torch.equal(original.tensor(name), copy.tensor(name))
        assert same != name.endswith("e_score_correction_bias"), name
    engine = Engine(original)
    apply_router_options(engine, table_path)
    assert np.abs(score(engine, IDS) - score(Engine(copy), IDS)).max() < 1e-4
    with pytest.raises(BiasError, match="built for model"):
        apply_router_options(Engine(copy), table_path)
    onto = CliRunner().invoke(app, ["bias", "write", "--model", str(source), "--table", str(table_path), "--out", str(source)])
    assert onto.exit_code == 2 and onto.stderr.startswith("moetier: error:") and "--model" in onto.stderr
    assert open_checkpoint(source).fingerprint == original.fingerprint  # the source is untouched
