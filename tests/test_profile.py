"""Session files and profiles: clear one-line errors, tokenizer text, phase-balanced brightness."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from moetier.cli.app import app
from moetier.engine import Engine
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.profile.brightness import Profile, ProfileError, profile_requests
from moetier.profile.sessions import Request, SessionError, load_sessions, write_example_sessions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("profile") / "tiny", arch="qwen3_moe", preset="tiny", seed=1)


@pytest.fixture(scope="module")
def sessions(tiny, tmp_path_factory):
    return write_example_sessions(tiny, tmp_path_factory.mktemp("sessions") / "s.jsonl", sessions=2, tokens_per_phase=24)


def test_example_sessions_have_three_phases_and_a_held_out_family(tiny, sessions):
    requests = load_sessions(sessions, tiny, vocab_size=open_checkpoint(tiny).spec.vocab_size)
    assert [r.phase for r in requests if r.profile] == ["explore", "edit", "verify"] * 2
    held_out = [r for r in requests if not r.profile]
    assert [r.phase for r in held_out] == ["second_language"]
    assert all(len(r.ids) == 24 and r.ids.dtype == np.int64 for r in requests)


BAD_RECORDS = {
    "not json": ("{phase: explore}", "not valid JSON"),
    "not an object": ("[1, 2]", "expected a JSON object"),
    "no phase": ('{"ids": [1, 2]}', "'phase' is None"),
    "ids and text": ('{"phase": "edit", "ids": [1], "text": "x"}', "exactly one of 'ids'"),
    "ids not integers": ('{"phase": "edit", "ids": [1, "2"]}', "list of integers"),
    "empty ids": ('{"phase": "edit", "ids": []}', "no tokens"),
    "outside vocabulary": ('{"phase": "edit", "ids": [1, 99999]}', "token id 99999 is outside the vocabulary"),
    "unknown key": ('{"phase": "edit", "ids": [1], "phse": "x"}', "unknown key 'phse'"),
    "profile not bool": ('{"phase": "edit", "ids": [1], "profile": "no"}', "expected true or false"),
    "text without tokenizer": ('{"phase": "edit", "text": "hello"}', "has no tokenizer"),
}


@pytest.mark.parametrize("name", sorted(BAD_RECORDS))
def test_bad_records_are_refused_naming_file_and_line(tiny, tmp_path, name):
    line, message = BAD_RECORDS[name]
    path = tmp_path / "bad.jsonl"
    path.write_text('{"phase": "explore", "ids": [5, 6]}\n\n' + line + "\n")
    model = tiny
    if name == "text without tokenizer":  # a synthetic folder has one: a copy without it
        import shutil

        model = tmp_path / "untokenized"
        shutil.copytree(tiny, model)
        (model / "tokenizer.json").unlink()
    with pytest.raises(SessionError) as caught:
        load_sessions(path, model, vocab_size=512)
    text = str(caught.value)
    assert text.startswith(f"{path}:3: ") and message in text and "\n" not in text, text


def test_missing_and_empty_session_files(tmp_path):
    with pytest.raises(SessionError, match="no such session file"):
        load_sessions(tmp_path / "none.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SessionError, match="no records"):
        load_sessions(tmp_path / "empty.jsonl")


def test_text_records_use_the_model_folders_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, "fix": 3, "the": 4, "bug": 5}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="[UNK]").save_pretrained(tmp_path / "model")
    path = tmp_path / "s.jsonl"
    path.write_text('{"phase": "edit", "text": "fix the bug"}\n{"phase": "verify", "ids": [1, 2]}\n')
    requests = load_sessions(path, tmp_path / "model", vocab_size=6)
    assert requests[0].ids.tolist() == [3, 4, 5] and requests[1].ids.tolist() == [1, 2]


def _requests(tiny, sessions):
    return load_sessions(sessions, tiny, vocab_size=512)


def test_brightness_gives_each_phase_an_equal_vote(tiny, sessions):
    engine = Engine(open_checkpoint(tiny))
    requests = _requests(tiny, sessions)
    base = profile_requests(engine, requests)
    assert base.phases == ("explore", "edit", "verify")
    np.testing.assert_allclose(base.brightness.sum(axis=1), 1.0, rtol=1e-12)
    # three times the edit tokens: more mass for edit, the same brightness
    tripled = profile_requests(engine, requests + [r for r in requests if r.phase == "edit"] * 2)
    assert tripled.tokens[1] == 3 * base.tokens[1] and tripled.mass[1].sum() > 2.9 * base.mass[1].sum()
    np.testing.assert_allclose(tripled.brightness, base.brightness, rtol=1e-12, atol=1e-15)
    # held-out records do not vote
    only_voting = profile_requests(engine, [r for r in requests if r.profile])
    np.testing.assert_array_equal(only_voting.mass, base.mass)
    assert (base.picks.sum(axis=-1) == base.tokens[:, None] * engine.spec.top_k).all()


def test_profile_refuses_a_biased_engine_and_no_votes(tiny):
    import torch

    from moetier.engine.router_bias import RouterBias

    engine = Engine(open_checkpoint(tiny))
    with pytest.raises(ProfileError, match="no request votes"):
        profile_requests(engine, [Request(np.array([5, 6]), "edit", profile=False)])
    engine.set_router_bias(RouterBias(torch.full((len(engine.spec.moe_layers), engine.spec.num_experts), -0.5)))
    with pytest.raises(ProfileError, match="plain model"):
        profile_requests(engine, [Request(np.array([5, 6]), "edit")])


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_profile_files_round_trip_and_refuse_tampering(tiny, sessions, tmp_path, suffix):
    profile = profile_requests(Engine(open_checkpoint(tiny)), _requests(tiny, sessions))
    path = profile.save(tmp_path / f"p{suffix}")
    loaded = Profile.load(path)
    assert loaded.fingerprint == profile.fingerprint and loaded.phases == profile.phases
    np.testing.assert_array_equal(loaded.brightness, profile.brightness)
    with pytest.raises(ProfileError, match="no such profile"):
        Profile.load(tmp_path / f"missing{suffix}")
    (tmp_path / f"junk{suffix}").write_bytes(b"not a profile")
    with pytest.raises(ProfileError, match="not a readable profile"):
        Profile.load(tmp_path / f"junk{suffix}")
    if suffix == ".npz":
        with np.load(path) as f:
            arrays = {k: f[k] for k in f.files}
        arrays["mass"] = arrays["mass"] * 2
        np.savez(tmp_path / "altered.npz", **arrays)
        with pytest.raises(ProfileError, match="altered"):
            Profile.load(tmp_path / "altered.npz")


def test_profile_command_writes_a_profile_and_a_static_cache_npy(tiny, sessions, tmp_path):
    runner = CliRunner()
    out, npy = tmp_path / "p.npz", tmp_path / "b.npy"
    result = runner.invoke(app, ["profile", str(sessions), "--model", str(tiny), "--out", str(out), "--npy", str(npy), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["phases"] == {"explore": 48, "edit": 48, "verify": 48}
    np.testing.assert_array_equal(np.load(npy), Profile.load(out).brightness)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"phase": "edit", "ids": [1, 2]}\n{"phase": "edit"}\n')
    result = runner.invoke(app, ["profile", str(bad), "--model", str(tiny), "--out", str(out)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [f"moetier: error: {bad}:2: give exactly one of 'ids' (token ids) or 'text'"]
