"""The `moetier` command line as a user runs it: real subprocesses, exit codes, JSON.

What is refused (or read from headers) in Python before an engine is built runs in this process
(cli_runs.moetier_here, checked against the real process here); refusals that come after the engine has loaded its
native kernels, and every command that does its work, run as real processes.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from cli_runs import moetier, moetier_here, refused
from moetier.engine import Engine, score
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("cli") / "tiny", arch="glm4_moe", preset="tiny", seed=3)


def test_run_json_reports_tokens_and_speeds(tiny):
    result = moetier("run", "--model", tiny, "--max-new-tokens", 6, "--prompt-ids", "5,6,7", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["prompt_ids"] == [5, 6, 7] and len(report["generated_ids"]) == 6
    assert report["decode_tok_per_s"] > 0 and report["prefill_tok_per_s"] > 0
    assert report["decode_path"].startswith("native step: every layer in one call")
    numpy = json.loads(moetier("run", "--model", tiny, "--max-new-tokens", 2, "--backend", "numpy", "--json").stdout)
    assert numpy["decode_path"].startswith("per layer from Python (")


def test_run_sampling_is_reproducible_by_seed(tiny):
    runs = [json.loads(moetier("run", "--model", tiny, "--max-new-tokens", 8, "--seed", s, "--json").stdout)["generated_ids"] for s in (1, 1)]
    assert runs[0] == runs[1]


def test_run_without_model_uses_the_builtin(tmp_path):
    from moetier import native

    env = dict(__import__("os").environ, MOETIER_HOME=str(tmp_path))
    builds = native.moetier_home() / "native"  # shared: the native builds, not 25 s of cc again
    builds.mkdir(parents=True, exist_ok=True)
    (tmp_path / "native").symlink_to(builds, target_is_directory=True)
    result = moetier("run", "--max-new-tokens", 3, "--json", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["model"].startswith(str(tmp_path))
    assert (tmp_path / "models").is_dir()


def test_score_writes_float32_logits_equal_to_the_library(tiny, tmp_path):
    ids = np.array([3, 9, 27, 81, 243, 11], dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    result = moetier("score", tiny, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "logits.npy")
    assert result.returncode == 0, result.stderr
    logits = np.load(tmp_path / "logits.npy")
    assert logits.dtype == np.float32 and logits.shape == (6, open_checkpoint(tiny).spec.vocab_size)
    assert np.array_equal(logits, score(Engine(open_checkpoint(tiny)), ids))


def test_info_json(tiny):
    info = json.loads(moetier_here("info", tiny, "--json").stdout)  # headers only; the real process: the test below
    checkpoint = open_checkpoint(tiny)
    assert info["router"] == "sigmoid" and info["experts_per_layer"] == checkpoint.spec.num_experts
    assert info["fingerprint"] == checkpoint.fingerprint
    assert info["bytes_per_expert"] == 3 * checkpoint.spec.hidden_size * checkpoint.spec.moe_intermediate_size * 4


def test_info_and_score_take_the_model_as_their_argument_or_as_model(tiny, tmp_path):
    """`info` and `score` take MODEL as the other commands take it, --model, too; given twice it must be the same."""
    assert moetier_here("info", "--model", tiny, "--json").stdout == moetier_here("info", tiny, "--json").stdout
    assert moetier_here("info", tiny, "--model", tiny, "--json").returncode == 0
    refused(moetier_here("info", tiny, "--model", tmp_path, "--json"), "given twice", str(tmp_path))
    np.save(tmp_path / "ids.npy", np.array([3, 9, 27], dtype=np.int64))
    refused(moetier_here("score", tiny, "--model", tmp_path, "--ids", tmp_path / "ids.npy", "--out", tmp_path / "o.npy"),
            "given twice")
    assert not (tmp_path / "o.npy").exists()


def test_a_layouts_model_is_found_relative_to_the_layout(tiny, tmp_path):
    """`model = "..."` in a cluster.toml is relative to that file for every command, wherever it runs from: `score`
    (through the engine every run opens) reads the layout's model, and refuses an --out inside it."""
    from layouts import cache_layout

    folder = tiny.parent
    (folder / "layout.toml").write_text(f'model = "{tiny.name}"\n' + cache_layout())
    ids = np.array([3, 9, 27, 81], dtype=np.int64)
    np.save(tmp_path / "ids.npy", ids)
    result = moetier("score", "--layout", folder / "layout.toml", "--ids", tmp_path / "ids.npy", "--out",
                     tmp_path / "logits.npy", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    np.testing.assert_allclose(np.load(tmp_path / "logits.npy"), score(Engine(open_checkpoint(tiny)), ids), atol=1e-5)
    refused(moetier_here("score", "--layout", folder / "layout.toml", "--ids", tmp_path / "ids.npy", "--out",
                         tiny / "o.npy", cwd=tmp_path), "inside the layout's model folder")
    # kl and sweep without --model take the layout's model too (they took the built-in one): a missing one is named
    (tmp_path / "elsewhere.toml").write_text('model = "no-such-model"\n' + cache_layout())
    missing = str(tmp_path / "no-such-model")
    refused(moetier_here("kl", "--ids", tmp_path / "ids.npy", "--layout", tmp_path / "elsewhere.toml"), missing)
    (tmp_path / "s.jsonl").write_text("")
    refused(moetier_here("sweep", "--sessions", tmp_path / "s.jsonl", "--layout", tmp_path / "elsewhere.toml", "--out",
                         tmp_path / "sweep"), missing)


@pytest.mark.parametrize("arch", ["qwen3_next", "glm5_next"])
def test_info_names_a_hybrids_layers(arch, tmp_path):
    """info's rows for the hybrids: which layers attend and how (Gated DeltaNet or KDA; GLM-5.3's latent attention, its
    indexer and hyper-connections), from the spec, as a user checks a file before running it."""
    folder = write_synthetic(tmp_path / arch, arch=arch, preset="tiny", seed=1)
    spec = open_checkpoint(folder).spec
    info = json.loads(moetier_here("info", folder, "--json").stdout)
    attending = ", ".join(map(str, spec.attention_layers))
    assert info["linear_attention_layers"] == f"{len(spec.linear_layers)} of {spec.num_layers} (" + (
        "latent" if arch == "glm5_next" else "full") + f" attention: {attending})"
    assert info["linear_attention"].startswith("KDA: " if arch == "glm5_next" else "Gated DeltaNet: ")
    glm = {"latent_attention", "indexer", "hyper_connections"}
    if arch == "glm5_next":
        assert info["latent_attention"].endswith(f"kv rank {spec.latent_attention.kv_rank} (the cached latent a position)")
        assert info["indexer"].startswith(f"top {spec.indexer.topk} positions in pools of {spec.indexer.pool}, ")
        assert info["hyper_connections"].startswith(f"{spec.hyper.streams} residual streams")
    else:
        assert not glm & set(info)


def test_synth_writes_a_loadable_checkpoint(tmp_path):
    result = moetier("synth", "--arch", "mixtral", "--preset", "tiny", "--seed", 1, "--out", tmp_path / "m")
    assert result.returncode == 0, result.stderr
    assert open_checkpoint(tmp_path / "m").spec.arch == "mixtral"


def _bad(tmp_path, tiny):
    """label -> (args, words of the error line, how it runs): in this process where the refusal comes before the
    engine is built, as a real process where it comes after (the engine has loaded its native kernels by then)."""
    llama = tmp_path / "llama"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama"}))
    np.save(tmp_path / "float_ids.npy", np.zeros(4, dtype=np.float32))
    np.save(tmp_path / "matrix_ids.npy", np.zeros((3, 4), dtype=np.int64))
    np.save(tmp_path / "big_ids.npy", np.array([1, 10**6]))
    (tmp_path / "text_ids.npy").write_text("1,2,3")
    return {
        "missing dir": (["info", tmp_path / "nope"], "not a directory", moetier_here),
        "unsupported arch": (["info", llama], "llama", moetier_here),
        "float ids": (["score", tiny, "--ids", tmp_path / "float_ids.npy", "--out", tmp_path / "o.npy"], "integer", moetier_here),
        "2-D ids": (["score", tiny, "--ids", tmp_path / "matrix_ids.npy", "--out", tmp_path / "o.npy"], "1-D", moetier_here),
        "absent ids": (["score", tiny, "--ids", tmp_path / "none.npy", "--out", tmp_path / "o.npy"], "no such ids file", moetier_here),
        "not npy": (["score", tiny, "--ids", tmp_path / "text_ids.npy", "--out", tmp_path / "o.npy"], "not a readable", moetier_here),
        "id out of vocab": (["score", tiny, "--ids", tmp_path / "big_ids.npy", "--out", tmp_path / "o.npy"], "outside the vocabulary",
                            moetier),
        "bad prompt": (["run", "--model", tiny, "--prompt-ids", "1,x"], "comma-separated", moetier),
        "bad backend": (["run", "--model", tiny, "--backend", "gpu9000"], "unknown", moetier_here),
        "bad arch": (["synth", "--arch", "llama", "--out", tmp_path / "s"], "not supported", moetier_here),
    }


def test_bad_input_gives_one_line_and_exit_2(tiny, tmp_path):
    for args, words, run in _bad(tmp_path, tiny).values():
        refused(run(*args), words)
    assert not (tmp_path / "o.npy").exists()


def test_a_command_run_here_reads_as_the_real_process(tiny, request):
    """moetier_here's promise: the same exit code, stdout (a rich table) and stderr (click's usage error) as
    `python -m moetier.cli`. Under `pytest -s` rich sizes its tables to the terminal, which the process's pipe has not."""
    if request.config.getoption("capture") == "no":
        pytest.skip("pytest -s: rich's consoles see the terminal in this process")
    for args in (["info", tiny], ["run", "--no-such-flag"]):
        here, there = moetier_here(*args), moetier(*args)
        assert (here.returncode, here.stdout, here.stderr) == (there.returncode, there.stdout, there.stderr), args
