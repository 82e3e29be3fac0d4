"""Untrusted layouts and flags: one line `moetier: error: ...` on stderr, exit code 2, never a traceback or a signal.

Layout values are refused when the layout loads (so `moetier layout check` catches them), naming the file
and the key; flags are refused before anything is loaded, naming the flag. What is refused before an engine or a
layout's runtime is built runs in this process (cli_runs.moetier_here); what is refused after, and the worker,
run as real processes.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cli_runs import moetier, moetier_here, refused
from layouts import cache_layout
from moetier.config import MAX_THREADS, ConfigError, load_layout, thread_limit
from moetier.engine import Engine, Sampling, generate
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("flags") / "tiny", arch="glm4_moe", preset="tiny", seed=3)


def _layout(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


# -- layouts ------------------------------------------------------------------------------------
LAYOUT = cache_layout(slots=4)
DEVICE = 'kind = "cuda"\n'  # the end of the [[devices]] table in cache_layout

ISSUE_CASES = {  # the cases the issue names; each passed `layout check` before
    "gbps nan": (LAYOUT.replace("gbps = 64.0", "gbps = nan"), "[links.0].gbps", "finite"),
    "threads 100000": (cache_layout(slots=4, cpu_threads=100000), "[tiers.1].threads", f"<= {MAX_THREADS}"),
    "memory_bytes -1": (LAYOUT.replace(DEVICE, DEVICE + "memory_bytes = -1\n"), "[devices.0].memory_bytes", ">= 0"),
    "budget_us nan": (cache_layout(slots=4, scheduler="budget_us = nan\n"), "[scheduler].budget_us", "finite"),
    "device index -1": (LAYOUT.replace(DEVICE, DEVICE + "index = -1\n"), "[devices.0].index", ">= 0"),
}


@pytest.mark.parametrize("case", ISSUE_CASES)
def test_layout_check_refuses_bad_values_naming_file_and_key(tmp_path, case):
    text, key, expected = ISSUE_CASES[case]
    path = _layout(tmp_path, text)
    line = refused(moetier_here("layout", "check", path), str(path), key, expected)
    assert line.startswith(f"moetier: error: {path}: {key}: is ")


@pytest.mark.parametrize(
    "edit, key, expected",
    [
        (("rtt_us = 10.0", "rtt_us = inf"), "[links.0].rtt_us", "finite"),
        (("rtt_us = 10.0", "rtt_us = -1.0"), "[links.0].rtt_us", ">= 0"),
        (("gbps = 64.0", "gbps = 0.0"), "[links.0].gbps", ">= 0.001"),
        (("gbps = 64.0", "gbps = -inf"), "[links.0].gbps", "finite"),
        (("slots = 4", "slots = -1"), "[tiers.0].slots", ">= 0"),
        (("slots = 4", "capacity_bytes = -1"), "[tiers.0].capacity_bytes", ">= 0"),
        (("[[links]]", "[router]\naffinity = -0.5\n[[links]]"), "[router].affinity", ">= 0"),
        (("[[links]]", "[router]\naffinity = nan\n[[links]]"), "[router].affinity", "finite"),
        (("[[links]]", "[scheduler]\nbudget_us = 0.0\n[[links]]"), "[scheduler].budget_us", "> 0"),
        (("[[links]]", "[scheduler]\nbudget_us = inf\n[[links]]"), "[scheduler].budget_us", "finite"),
        (("[[devices]]", '[[hosts]]\nname = "local"\nram_bytes = -1\n[[devices]]'), "[hosts.0].ram_bytes", ">= 0"),
    ],
)
def test_every_number_in_a_layout_is_finite_and_in_range(tmp_path, edit, key, expected):
    old, new = edit
    assert old in LAYOUT
    path = _layout(tmp_path, LAYOUT.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_layout(path)
    message = str(err.value)
    assert message.startswith(f"{path}: {key}: is ") and expected in message and "\n" not in message


def test_lane_threads_at_the_bound_load(tmp_path):
    assert load_layout(_layout(tmp_path, cache_layout(slots=4, cpu_threads=MAX_THREADS))).tiers[1].threads == MAX_THREADS


@pytest.mark.parametrize("case", ["gbps nan", "threads 100000"])
def test_run_with_a_bad_layout_is_one_line_not_a_traceback(tmp_path, tiny, case):
    text, key, _ = ISSUE_CASES[case]
    path = _layout(tmp_path, text)
    refused(moetier_here("run", "--model", tiny, "--layout", path, "--max-new-tokens", 2), str(path), key)


def test_run_refuses_more_lane_threads_than_this_machine_can_start(tmp_path, tiny):
    """A layout may carry up to MAX_THREADS (it may be meant for a bigger machine); building it here bounds it by this one."""
    threads = thread_limit() + 1
    path = _layout(tmp_path, cache_layout(slots=4, cpu_threads=threads))
    refused(moetier_here("run", "--model", tiny, "--layout", path, "--max-new-tokens", 2), str(path), "[tiers.1].threads",
            str(threads))  # checked before any tier starts a thread


# -- flags ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--temperature", "nan"], "--temperature"),
        (["--temperature", "inf"], "--temperature"),
        (["--temperature", "-1"], "--temperature"),
        (["--top-p", "2"], "--top-p"),
        (["--top-p", "0"], "--top-p"),
        (["--top-p", "nan"], "--top-p"),
        (["--top-k", "-1"], "--top-k"),
        (["--seed", str(2**64)], "--seed"),
        (["--device", "cuda:7"], "--device"),
        (["--device", "gpu"], "--device"),
        (["--device", "cuda:-1"], "--device"),
        (["--device", "cpu:1"], "--device"),
        (["--threads", "0"], "--threads"),
        (["--threads", "-3"], "--threads"),
        (["--threads", "100000"], "--threads"),
    ],
)
def test_run_refuses_bad_flags(tiny, flags, flag):
    refused(moetier_here("run", "--model", tiny, "--max-new-tokens", 2, *flags), flag)


def test_run_refuses_generating_past_the_model_context(tiny):
    """Refused after the engine is built and warmed up (its native kernels run): a real process."""
    context = open_checkpoint(tiny).spec.max_position_embeddings
    assert context is not None
    refused(moetier("run", "--model", tiny, "--prompt-ids", "5,6,7", "--max-new-tokens", context, timeout=60),
            "max_new_tokens", str(context))


def test_run_over_a_layout_refuses_generating_past_the_model_context(tmp_path, tiny):
    context = open_checkpoint(tiny).spec.max_position_embeddings
    path = _layout(tmp_path, LAYOUT)
    refused(moetier("run", "--model", tiny, "--layout", path, "--max-new-tokens", context * 10, timeout=60), "max_new_tokens")


@pytest.mark.parametrize("flags", [["--device", "gpu"], ["--device", "cuda:7"], ["--threads", "0"], ["--threads", "100000"]])
def test_score_refuses_bad_device_and_threads_and_writes_nothing(tmp_path, tiny, flags):
    import numpy as np

    np.save(tmp_path / "ids.npy", np.array([3, 9, 27], dtype=np.int64))
    out = tmp_path / "logits.npy"
    refused(moetier_here("score", tiny, "--ids", tmp_path / "ids.npy", "--out", out, *flags), flags[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ids.npy"]


def test_worker_refuses_threads_it_cannot_start(tiny):
    refused(moetier("worker", "--model", tiny, "--listen", "tcp://127.0.0.1:0", "--threads", 100000, timeout=60), "--threads")


def test_calibrate_refuses_zero_threads_and_writes_nothing(tmp_path, tiny):
    out = tmp_path / "calibration.json"
    refused(moetier_here("calibrate", "--model", tiny, "--out", out, "--threads", 0), "--threads")
    assert not out.exists()


# -- the library under the flags --------------------------------------------------------------------
@pytest.mark.parametrize(
    "fields",
    [dict(temperature=float("nan")), dict(temperature=-0.5), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=float("nan")),
     dict(top_k=-2), dict(seed=-(2**63) - 1), dict(presence_penalty=2.5), dict(frequency_penalty=-3.0),
     dict(presence_penalty=float("nan")), dict(frequency_penalty=float("inf"))],
)
def test_sampling_refuses_values_it_cannot_sample_with(fields):
    with pytest.raises(ValueError) as err:
        Sampling(**fields)
    assert "\n" not in str(err.value)


def test_sampling_accepts_its_edges():
    Sampling(temperature=0.0, top_k=0, top_p=1.0, seed=2**64 - 1)
    Sampling(temperature=2.0, top_k=1, top_p=1e-6, seed=-1)


def test_run_refuses_a_penalty_outside_openai_s_range(tiny):
    refused(moetier_here("run", "--model", tiny, "--presence-penalty", 2.5), "--presence-penalty")
    refused(moetier_here("run", "--model", tiny, "--frequency-penalty", -2.01), "--frequency-penalty")


def test_generate_stops_at_the_context_before_computing(tiny):
    engine = Engine(open_checkpoint(tiny))
    context = engine.spec.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(engine, [5, 6, 7], context - 2)
    assert len(generate(engine, [5, 6], 2).ids) == 2  # well inside: runs


def test_a_tiny_temperature_samples_the_top_token_instead_of_failing(tmp_path):
    """Found by tests/test_fuzz_inputs.py: --temperature 8.5e-207 overflowed logits / T to inf and softmax to nan."""
    import torch

    from moetier.engine.generate import Sampling, pick_token

    logits = torch.tensor([1.0, 3.0, -2.0, 2.5])
    for temperature in (8.498230267932904e-207, 1e-30, 5e-324):
        assert pick_token(logits, Sampling(temperature=temperature, seed=1), torch.Generator().manual_seed(1)) == 1


def test_a_config_whose_numbers_overflow_is_refused_not_scored(tmp_path):
    """Found by tests/test_fuzz_inputs.py: routed_scaling_factor 3.4e38 is a finite float and a valid spec, but the
    model's logits overflow; score and run said exit 0. Now both refuse with one line and write nothing."""
    import json

    import numpy as np

    from moetier.model.synth import write_synthetic

    folder = write_synthetic(tmp_path / "m", arch="glm4_moe", preset="tiny", seed=0)
    config = json.loads((folder / "config.json").read_text())
    config["routed_scaling_factor"] = 3.4028235677973366e38
    (folder / "config.json").write_text(json.dumps(config))
    np.save(tmp_path / "ids.npy", np.array([1, 2, 3, 4], dtype=np.int64))
    out = tmp_path / "out.npy"
    refused(moetier("score", folder, "--ids", tmp_path / "ids.npy", "--out", out), "not finite")  # found by computing
    done = moetier("run", "--model", folder, "--max-new-tokens", "2")
    # `run` has streamed the prompt's text to stderr when the logits are found: its line ends, then the one error line
    prompt, error = done.stderr.strip().split("\n")
    assert "moetier: error" not in prompt
    refused(subprocess.CompletedProcess(done.args, done.returncode, done.stdout, error), "not finite")
    assert not out.exists()


@pytest.mark.parametrize("old, new, key", [("rtt_us = 10.0", "rtt_us = 4611686018427387904", "rtt_us"),
                                           ("gbps = 64.0", "gbps = 1e-300", "gbps"),
                                           ("[[links]]", "[scheduler]\nbudget_us = 1e300\n[[links]]", "budget_us")])
def test_link_times_too_long_to_emulate_are_refused(tmp_path, old, new, key):
    """Found by tests/test_fuzz_inputs.py: rtt_us = 2**62 passed `layout check`, then the emulated link's sleep
    overflowed inside `run --layout` (a traceback from the upload thread)."""
    path = tmp_path / "layout.toml"
    path.write_text(cache_layout().replace(old, new, 1))
    with pytest.raises(ConfigError, match=key):
        load_layout(path)
