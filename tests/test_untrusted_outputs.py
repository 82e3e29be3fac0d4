"""What moetier writes: whole or nothing, never onto its own inputs, nothing left behind after a signal.

The signal tests run the real CLI with one step of the write held open (a
sleep wrapped around one function, set up by a few lines given to `python -c`),
so that the signal lands while the output is staged, every time, however fast
the machine. Every output is checked before any work, in Python: the refusals
run in this process (cli_runs.moetier_here), one of them as a real process.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cli_runs import moetier, moetier_here, refused
from moetier.model import synth
from moetier.model.output import OutputError, check_output, new_file, new_folder
from moetier.model.synth import write_synthetic

# Runs the CLI with `module.function` wrapped so that, once it has run, the process sleeps (the output half-made).
HELD = """
import importlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # a runner started in the background may ignore it
module, name = sys.argv.pop(1).rsplit(".", 1)
module = importlib.import_module(module)
real = getattr(module, name)
def held(*args, **kwargs):
    real(*args, **kwargs)
    time.sleep(600)
setattr(module, name, held)
from moetier.cli.app import main
main()
"""


def held_open(hold: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HELD, hold, *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def staged_beside(out: Path, holding: str, process: subprocess.Popen) -> Path:
    """Wait until the process has staged `holding` in a hidden folder beside out; that folder."""
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        for entry in out.parent.glob(f".{out.name}.*"):
            if (entry / holding).exists():
                return entry
        assert process.poll() is None, process.communicate()
        time.sleep(0.05)
    process.kill()
    raise AssertionError(f"no staged folder for {out} appeared")


def leftovers(folder: Path, *keep: str) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in keep)


# --- synth: signals ------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_synth_stopped_by_a_signal_leaves_nothing(tmp_path, sig):
    out = tmp_path / "models" / "m"
    process = held_open("moetier.model.synth._write_safetensors", "synth", "--preset", "small", "--out", out)
    staged_beside(out, "model.safetensors", process)
    process.send_signal(sig)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode not in (0, 2) and "Traceback" not in stderr, (process.returncode, stderr)
    assert not out.exists() and leftovers(tmp_path) == []  # neither the staged folder nor the parent made for it
    assert moetier("synth", "--preset", "small", "--out", out).returncode == 0
    assert leftovers(out.parent) == ["m"]


def test_synth_killed_leaves_a_staged_folder_the_next_run_removes(tmp_path):
    out = tmp_path / "m"
    process = held_open("moetier.model.synth._write_safetensors", "synth", "--preset", "small", "--out", out)
    staged = staged_beside(out, "model.safetensors", process)
    process.kill()
    process.communicate(timeout=120)
    assert staged.exists() and not out.exists()  # SIGKILL: nobody could clean up
    done = moetier("synth", "--preset", "small", "--out", out)
    assert done.returncode == 0, done.stderr
    assert leftovers(tmp_path) == ["m"]
    assert synth.SYNTH_META in {p.name for p in out.iterdir()}


def test_a_staged_folder_of_a_live_process_is_left_alone(tmp_path):
    out = tmp_path / "m"
    live = tmp_path / f".m.partial-{os.getpid()}-999"
    live.mkdir()
    write_synthetic(out)
    assert live.exists() and out.is_dir()


def test_a_failed_write_removes_the_folders_made_for_it(tmp_path, monkeypatch):
    def fail(path, tensors):
        raise OSError("disk full")

    monkeypatch.setattr(synth, "_write_safetensors", fail)
    with pytest.raises(OSError, match="disk full"):
        write_synthetic(tmp_path / "a" / "b" / "model")
    assert leftovers(tmp_path) == []


def test_new_file_replaces_whole_or_leaves_the_old_one(tmp_path):
    out = tmp_path / "x.npy"
    np.save(out, np.arange(3))
    with pytest.raises(RuntimeError), new_file(out, ".npy") as partial:
        np.save(partial, np.arange(5))
        raise RuntimeError("cut short")
    assert np.load(out).tolist() == [0, 1, 2] and leftovers(tmp_path) == ["x.npy"]
    with new_file(out, ".npy") as partial:
        np.save(partial, np.arange(5))
    assert np.load(out).tolist() == [0, 1, 2, 3, 4] and leftovers(tmp_path) == ["x.npy"]
    with pytest.raises(OutputError, match="not empty"), new_folder(tmp_path):
        pass


# --- bias write: signals ---------------------------------------------------------

@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    """A glm4_moe model, a bias table built for it, and its session file."""
    from moetier.engine import Engine
    from moetier.model import open_checkpoint
    from moetier.profile.bias import build_table
    from moetier.profile.brightness import profile_requests
    from moetier.profile.sessions import load_sessions, write_example_sessions

    root = tmp_path_factory.mktemp("glm")
    folder = write_synthetic(root / "model", arch="glm4_moe", preset="tiny", seed=2)
    sessions = write_example_sessions(folder, root / "s.jsonl", sessions=1, tokens_per_phase=8)
    checkpoint = open_checkpoint(folder)
    profile = profile_requests(Engine(checkpoint), load_sessions(sessions, folder, checkpoint.spec.vocab_size))
    profile.save(root / "profile.npz")
    table = build_table(profile, 8, "graded", -0.05).save(root / "table.safetensors")
    return folder, table, sessions


def test_bias_write_stopped_by_sigterm_leaves_nothing(glm, tmp_path):
    model, table, _ = glm
    out = tmp_path / "copy"
    process = held_open("moetier.profile.write._rewrite_shard", "bias", "write", "--model", model, "--table", table,
                        "--out", out)
    staged_beside(out, "model.safetensors", process)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode not in (0, 2) and "Traceback" not in stderr, (process.returncode, stderr)
    assert leftovers(tmp_path) == []
    done = moetier("bias", "write", "--model", model, "--table", table, "--out", out)
    assert done.returncode == 0, done.stderr
    assert leftovers(tmp_path) == ["copy"]


def test_bias_write_killed_leaves_a_staged_folder_the_next_run_removes(glm, tmp_path):
    model, table, _ = glm
    out = tmp_path / "copy"
    process = held_open("moetier.profile.write._rewrite_shard", "bias", "write", "--model", model, "--table", table,
                        "--out", out)
    staged = staged_beside(out, "model.safetensors", process)
    process.kill()
    process.communicate(timeout=120)
    assert staged.exists()
    done = moetier("bias", "write", "--model", model, "--table", table, "--out", out)
    assert done.returncode == 0, done.stderr
    assert leftovers(tmp_path) == ["copy"]


# --- refused outputs: before any work, nothing written ----------------------------

@pytest.fixture(scope="module")
def tiny(glm):
    return glm[0]


def _ids(tmp_path: Path) -> Path:
    path = tmp_path / "ids.npy"
    np.save(path, np.array([5, 9, 2, 7]))
    return path


def test_score_refuses_an_out_that_is_a_directory(tiny, tmp_path):
    ids = _ids(tmp_path)
    (tmp_path / "logits").mkdir()
    refused(moetier("score", tiny, "--ids", ids, "--out", tmp_path / "logits"), "--out", "is a directory")  # a real process
    assert leftovers(tmp_path) == ["ids.npy", "logits"] and leftovers(tmp_path / "logits") == []


def test_score_refuses_an_out_that_is_the_ids_file(tiny, tmp_path):
    ids = _ids(tmp_path)
    (tmp_path / "sub").mkdir()
    (tmp_path / "link.npy").symlink_to(ids)
    before = ids.read_bytes()
    for out in (ids, tmp_path / "sub" / ".." / "ids.npy", tmp_path / "link.npy"):
        refused(moetier_here("score", tiny, "--ids", ids, "--out", out), "is the --ids file")
    refused(moetier_here("score", tiny, "--ids", ids, "--out", "ids.npy", cwd=tmp_path), "is the --ids file")  # relative
    assert ids.read_bytes() == before and leftovers(tmp_path) == ["ids.npy", "link.npy", "sub"]


def test_score_refuses_an_out_inside_the_model_folder(tiny, tmp_path):
    before = sorted(p.name for p in tiny.iterdir())
    refused(moetier_here("score", tiny, "--ids", _ids(tmp_path), "--out", tiny / "model.safetensors"), "inside the MODEL folder")
    assert sorted(p.name for p in tiny.iterdir()) == before


def test_score_writes_a_whole_file_and_no_partial(tiny, tmp_path):
    out = tmp_path / "new" / "logits"  # no .npy suffix: written where asked, not at logits.npy
    done = moetier("score", tiny, "--ids", _ids(tmp_path), "--out", out)
    assert done.returncode == 0, done.stderr
    assert np.load(out).shape[0] == 4 and leftovers(out.parent) == ["logits"]


def test_bias_write_refuses_its_inputs_as_out(glm, tmp_path):
    model, table, _ = glm
    before = sorted(p.name for p in model.iterdir())
    table_bytes = table.read_bytes()
    for out, words in ((model, "is the --model folder"), (model / "copy", "inside the --model folder"),
                       (model / ".." / model.name, "is the --model folder"), (table, "is the --table file")):
        refused(moetier_here("bias", "write", "--model", model, "--table", table, "--out", out), "--out", words)
    assert sorted(p.name for p in model.iterdir()) == before and table.read_bytes() == table_bytes


def test_synth_refuses_a_full_folder_and_a_file(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("x")
    (tmp_path / "file").write_text("x")
    refused(moetier_here("synth", "--out", tmp_path / "full"), "--out", "not empty")
    refused(moetier_here("synth", "--out", tmp_path / "file"), "--out", "is a file")
    refused(moetier_here("synth", "--out", tmp_path / "file" / "m"), "--out", "is not a folder")
    assert leftovers(tmp_path) == ["file", "full"] and leftovers(tmp_path / "full") == ["keep.txt"]


def test_check_output_reads_only(tmp_path):
    with pytest.raises(OutputError, match="is a directory"):
        check_output(tmp_path, "--out")
    check_output(tmp_path / "a" / "b" / "c.npy", "--out")
    assert leftovers(tmp_path) == []


# --- the other writers: an input or a directory as the output is refused before work ------------------

def test_profile_refuses_a_directory_an_input_or_a_wrong_suffix_as_out(glm, tmp_path):
    model, _, sessions = glm
    before = sessions.read_bytes()
    (tmp_path / "dir.npz").mkdir()
    for args, words in ((["--out", tmp_path / "dir.npz"], "is a directory"),
                        (["--out", sessions], "is the SESSIONS file"),
                        (["--out", model / "p.npz"], "inside the --model folder"),
                        (["--out", tmp_path / "p.txt"], "expected a .npz or .safetensors file"),
                        (["--out", tmp_path / "p.npz", "--npy", sessions], "--npy"),
                        (["--out", tmp_path / "p.npz", "--npy", tmp_path / "p.npz"], "is the --npy file")):
        refused(moetier_here("profile", sessions, "--model", model, *args), words)
    assert sessions.read_bytes() == before and leftovers(tmp_path) == ["dir.npz"]


def test_profile_writes_the_npy_whole_where_asked(glm, tmp_path):
    model, _, sessions = glm
    done = moetier("profile", sessions, "--model", model, "--out", tmp_path / "p.npz", "--npy", tmp_path / "bright")
    assert done.returncode == 0, done.stderr
    assert np.load(tmp_path / "bright").ndim == 2 and leftovers(tmp_path) == ["bright", "p.npz"]


def test_bias_build_refuses_the_profile_as_out(glm, tmp_path):
    from moetier.profile.brightness import Profile

    profile = Profile.load(glm[1].parent / "profile.npz").save(tmp_path / "profile.safetensors")
    before = profile.read_bytes()
    refused(moetier_here("bias", "--profile", profile, "--hot", 4, "--out", profile), "--out", "is the --profile file")
    (tmp_path / "t.safetensors").mkdir()
    refused(moetier_here("bias", "--profile", profile, "--hot", 4, "--out", tmp_path / "t.safetensors"), "is a directory")
    assert profile.read_bytes() == before


def test_example_sessions_refuses_a_directory_and_the_model_folder(glm, tmp_path):
    model = glm[0]
    config = (model / "config.json").read_bytes()
    refused(moetier_here("example-sessions", "--model", model, "--out", tmp_path), "--out", "is a directory")
    refused(moetier_here("example-sessions", "--model", model, "--out", model / "config.json"), "inside the --model folder")
    assert (model / "config.json").read_bytes() == config and leftovers(tmp_path) == []


def test_run_trace_refuses_the_layout_and_a_directory(glm, tmp_path):
    from layouts import cache_layout

    layout = tmp_path / "cluster.toml"
    layout.write_text(cache_layout())
    text = layout.read_text()
    common = ["run", "--model", glm[0], "--layout", layout, "--max-new-tokens", 2]
    refused(moetier_here(*common, "--trace", layout), "--trace", "is the --layout file")
    refused(moetier_here(*common, "--trace", tmp_path), "--trace", "is a directory")
    assert layout.read_text() == text and leftovers(tmp_path) == ["cluster.toml"]


def test_calibrate_refuses_its_layout_as_out_however_named(glm, tmp_path):
    from layouts import cache_layout

    layout = tmp_path / "cluster.toml"
    layout.write_text(cache_layout(scheduler='calibration = "cluster.toml"\n'))
    text = layout.read_text()
    refused(moetier_here("calibrate", "--layout", layout, "--model", glm[0]), "[scheduler].calibration", "is the --layout file")
    refused(moetier_here("calibrate", "--layout", layout, "--model", glm[0], "--out", layout), "--out", "is the --layout file")
    refused(moetier_here("calibrate", "--model", glm[0], "--out", tmp_path), "--out", "is a directory")
    assert layout.read_text() == text and leftovers(tmp_path) == ["cluster.toml"]


def test_sweep_refuses_an_input_as_out(glm, tmp_path):
    from layouts import cache_layout

    model, _, sessions = glm
    layout = tmp_path / "cluster.toml"
    layout.write_text(cache_layout())
    refused(moetier_here("sweep", "--sessions", sessions, "--layout", layout, "--model", model, "--out", layout),
            "--out", "is the --layout file")
    refused(moetier_here("sweep", "--sessions", sessions, "--layout", layout, "--model", model, "--out", model),
            "--out", "is the --model folder")
    assert leftovers(tmp_path) == ["cluster.toml"]


# --- the built-in model's cache: written at once by two processes -----------------------------------

CACHE_ONE = """
import pathlib, sys, time
import moetier.model.synth as synth
go = pathlib.Path(sys.argv[1])
real = synth._write_safetensors
def after_go(*args):
    real(*args)
    while not go.exists():  # held staged until the other process has put its copy in place
        time.sleep(0.05)
synth._write_safetensors = after_go
from moetier.model.builtin import cached_synthetic
print(cached_synthetic("qwen3_moe", "tiny"))
"""


def test_two_processes_writing_the_cached_model_both_use_the_first_copy(tmp_path):
    env = dict(os.environ, MOETIER_HOME=str(tmp_path / "home"))
    go = tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", CACHE_ONE, go], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env)
    models = tmp_path / "home" / "models"
    deadline = time.monotonic() + 240
    while not any(models.glob(".*/model.safetensors")) and time.monotonic() < deadline:
        assert first.poll() is None, first.communicate()
        time.sleep(0.05)
    write = "from moetier.model.builtin import cached_synthetic as c; print(c('qwen3_moe', 'tiny'))"
    second = subprocess.run([sys.executable, "-c", write], capture_output=True, text=True, env=env, timeout=300)
    assert second.returncode == 0, second.stderr
    go.touch()
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0 and "Traceback" not in stderr, stderr
    assert stdout.strip() == second.stdout.strip() and leftovers(models) == [Path(stdout.strip()).name]
