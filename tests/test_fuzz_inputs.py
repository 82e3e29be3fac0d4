"""Fuzz: model configs, safetensors headers, layouts and CLI flags as a stranger would write them.

Each generated case is a real command line run by one long-lived child process
(`moetier.cli.app` in-process, torch imported once), so hundreds of cases cost
seconds, not minutes. The child reports each command's exit code and whether
anything escaped as an exception; if the child itself dies (a signal: a
segfault in native code, an abort) the case that killed it fails the test and
a fresh child takes the next one. Asserted for every case: the exit code is 0
or 2, never a traceback or a signal; exit 2 comes with exactly one line
`moetier: error: ...`; exit 0 only with finite outputs (the logits `score`
writes). The fast suite runs a bounded number of examples per target; the slow
suite many more (FUZZ_EXAMPLES at the bottom).
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from layouts import cache_layout
from moetier.model.synth import write_synthetic

RUNNER = textwrap.dedent("""
    import contextlib, io, json, sys, traceback
    import numpy as np
    from moetier.cli.app import app
    for line in sys.stdin:
        case = json.loads(line)
        err, out = io.StringIO(), io.StringIO()
        escaped = None
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                app(case["args"], standalone_mode=True)
                code = 0
            except SystemExit as done:
                code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
            except BaseException:
                code, escaped = None, traceback.format_exc(limit=4)
        finite = None
        if code == 0 and case.get("check"):
            try:
                finite = bool(np.isfinite(np.load(case["check"])).all())
            except Exception as exc:
                finite = f"unreadable: {exc!r}"
        print(json.dumps({"code": code, "escaped": escaped, "stderr": err.getvalue()[-2000:], "finite": finite}), flush=True)
""")


class Runner:
    """One child running CLI commands in-process; restarted when a case kills it."""

    def __init__(self, cwd: Path, script: str = RUNNER):
        self.cwd, self.script, self.proc = cwd, script, None

    def run(self, args: list[str], check: Path | None = None) -> dict:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, "-c", self.script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=subprocess.PIPE, text=True, cwd=self.cwd)
        self.proc.stdin.write(json.dumps({"args": [str(a) for a in args], "check": str(check) if check else None}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait(timeout=30)
            tail = self.proc.stderr.read()[-2000:]
            self.proc = None
            return {"code": code, "escaped": f"the process died (exit {code}): {tail}", "stderr": "", "finite": None}
        return json.loads(line)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def assert_clean(result: dict, what: str, record: bool = True) -> None:
    """0 or 2; 2 with one `moetier: error:` line; 0 with finite outputs; nothing escaped."""
    if record:  # inside a hypothesis test: --hypothesis-show-statistics counts the exit codes
        event(f"{what.split()[0]}: exit {result['code']}")
    assert result["escaped"] is None, f"{what}: {result['escaped']}"
    assert result["code"] in (0, 2), f"{what}: exit {result['code']}: {result['stderr']}"
    if result["code"] == 2:
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("moetier: error: "), f"{what}: {result['stderr']!r}"
    if result["finite"] is not None:
        assert result["finite"] is True, f"{what}: exit 0 with non-finite output ({result['finite']})"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz-inputs")
    models = {arch: write_synthetic(root / arch, arch=arch, preset="tiny", seed=3) for arch in ("qwen3_moe", "glm4_moe")}
    np.save(root / "ids.npy", np.array([1, 5, 9, 14, 3, 2], dtype=np.int64))
    runner = Runner(root)
    yield root, models, runner
    runner.close()


# -- values a careless user or an attacker writes ---------------------------------------------
NUMBERS = st.one_of(
    st.integers(-3, 3), st.sampled_from([0, -1, 2**31, 2**63 - 1, 10**12]),
    st.floats(allow_nan=True, allow_infinity=True, width=64), st.sampled_from([0.0, -0.0, 1e-300, -1e-6, 1e308]),
)
JSON_VALUES = st.one_of(NUMBERS, st.booleans(), st.none(), st.text(max_size=8),
                        st.lists(st.integers(-2, 70), max_size=4), st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))
CONFIG_KEYS = ["num_experts_per_tok", "num_experts", "n_routed_experts", "num_hidden_layers", "hidden_size", "intermediate_size",
               "moe_intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
               "vocab_size", "decoder_sparse_step", "mlp_only_layers", "n_group", "topk_group", "first_k_dense_replace",
               "routed_scaling_factor", "n_shared_experts", "norm_topk_prob", "partial_rotary_factor", "max_position_embeddings",
               "sliding_window", "use_sliding_window", "tie_word_embeddings", "model_type", "rope_parameters", "hidden_act"]


def _model_copy(models: dict, arch: str, root: Path, name: str) -> Path:
    """A fresh folder that shares the model's weights (hard links: nothing big is copied)."""
    folder = root / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for path in models[arch].iterdir():
        if path.is_file():
            (folder / path.name).hardlink_to(path) if path.suffix == ".safetensors" else shutil.copy(path, folder / path.name)
    return folder


def _config_case(workspace, arch, edits) -> None:
    root, models, runner = workspace
    folder = _model_copy(models, arch, root, "config-case")
    config = json.loads((folder / "config.json").read_text())
    for key, value in edits:
        config[key] = value
    (folder / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    out = root / "logits.npy"
    out.unlink(missing_ok=True)
    assert_clean(runner.run(["info", folder]), f"info with {edits}")
    assert_clean(runner.run(["score", folder, "--ids", root / "ids.npy", "--out", out], check=out), f"score with {edits}")


def _header_case(workspace, mutate) -> None:
    """The first safetensors file of the model with its JSON header replaced by a mutated one."""
    root, models, runner = workspace
    folder = _model_copy(models, "qwen3_moe", root, "header-case")
    shard = sorted(folder.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    text = mutate(header)
    body = data[8 + length:]
    shard.unlink()  # a hard link: write a new file, leave the shared one alone
    shard.write_bytes(struct.pack("<Q", len(text)) + text + body)
    out = root / "logits.npy"
    out.unlink(missing_ok=True)
    assert_clean(runner.run(["info", folder]), "info with a mutated header")
    assert_clean(runner.run(["score", folder, "--ids", root / "ids.npy", "--out", out], check=out), "score with a mutated header")


@st.composite
def header_mutations(draw):
    kind = draw(st.sampled_from(["field", "nest", "overlap", "metadata", "garbage"]))
    if kind == "nest":
        depth = draw(st.sampled_from([10, 1000, 100_000]))
        return lambda header: (b'{"a":' + b"[" * depth + b"]" * depth + b"}")
    if kind == "garbage":
        blob = draw(st.binary(max_size=64))
        return lambda header: blob
    if kind == "metadata":
        value = draw(JSON_VALUES)
        return lambda header: json.dumps({**header, "__metadata__": value}).encode()
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets"]))
    value = draw(st.one_of(JSON_VALUES, st.lists(NUMBERS, min_size=1, max_size=3), st.sampled_from(["F32", "Q4", "BF16", ""])))
    pick = draw(st.integers(0, 10_000))

    def mutate(header):
        names = sorted(k for k in header if k != "__metadata__")
        name = names[pick % len(names)]
        if kind == "overlap":  # a tensor's range moved onto its neighbour's
            other = header[names[(pick + 1) % len(names)]]
            header[name] = {**header[name], "data_offsets": other["data_offsets"]}
        else:
            header[name] = {**header[name], field: value}
        return json.dumps(header).encode()

    return mutate


LAYOUT_EDITS = [("slots = 4", "slots = {}"), ("rtt_us = 10.0", "rtt_us = {}"), ("gbps = 64.0", "gbps = {}"),
                ('kind = "cuda"', 'kind = "cuda"\nindex = {}'), ('kind = "cpu"\n', 'kind = "cpu"\nthreads = {}\n'),
                ('kind = "cuda"', 'kind = "cuda"\nmemory_bytes = {}'), ("slots = 4", "capacity_bytes = {}")]
SCHEDULER_KEYS = ["budget_us", "defer_cpu", "tail_skip"]
TOML_VALUES = st.one_of(st.integers(-5, 5), st.sampled_from([0, -1, 100_000, 2**62, "nan", "inf", "-inf", "-0.0", "1e300", '"x"', "true"]),
                        st.floats(-1e6, 1e6, allow_nan=False).map(repr))


def _layout_case(workspace, edits, scheduler) -> None:
    root, models, runner = workspace
    text = cache_layout(scheduler="\n".join(f"{k} = {v}" for k, v in scheduler) + "\n" if scheduler else None)
    for (old, new), value in edits:
        text = text.replace(old, new.format(value), 1)
    path = root / "layout.toml"
    path.write_text(text)
    checked = runner.run(["layout", "check", path])
    assert_clean(checked, f"layout check {edits} {scheduler}")
    if checked["code"] == 0:
        assert_clean(runner.run(["run", "--layout", path, "--model", models["qwen3_moe"], "--max-new-tokens", "2", "--json"]),
                     f"run --layout {edits} {scheduler}")


FLAG_VALUES = {
    "--temperature": st.one_of(st.sampled_from(["nan", "inf", "-1", "0", "0.7", "1e308"]), st.floats(-2, 3).map(repr)),
    "--top-p": st.sampled_from(["nan", "0", "-0.5", "0.9", "1", "2", "inf"]),
    "--top-k": st.sampled_from(["-1", "0", "3", "100000"]),
    "--max-new-tokens": st.sampled_from(["0", "-3", "1", "3", "1000000000"]),
    "--device": st.sampled_from(["cpu", "cuda", "cuda:7", "cuda:-1", "gpu", "", "cpu:0"]),
    "--threads": st.sampled_from(["0", "-2", "1", "2", "100000"]),
    "--seed": st.sampled_from(["0", "-1", "7", str(2**70)]),
    "--prompt-ids": st.sampled_from(["1,2,3", "", ",", "-1", "999999999", "1,x", "0"]),
}


def _flags_case(workspace, flags) -> None:
    root, models, runner = workspace
    args = ["run", "--model", models["glm4_moe"], "--json"]
    for flag, value in flags:
        args += [flag, value]
    if "--max-new-tokens" not in dict(flags):
        args += ["--max-new-tokens", "2"]
    assert_clean(runner.run(args), f"run {flags}")


# -- the targets: a few examples each in the fast suite, many in the slow one -------------------
def _targets(examples: int):
    common = dict(max_examples=examples, deadline=None, derandomize=examples <= 40,
                  suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

    @settings(**common)
    @given(arch=st.sampled_from(["qwen3_moe", "glm4_moe"]),
           edits=st.lists(st.tuples(st.sampled_from(CONFIG_KEYS), JSON_VALUES), min_size=1, max_size=3))
    def configs(workspace, arch, edits):
        _config_case(workspace, arch, edits)

    @settings(**common)
    @given(mutate=header_mutations())
    def headers(workspace, mutate):
        _header_case(workspace, mutate)

    @settings(**common)
    @given(edits=st.lists(st.tuples(st.sampled_from(LAYOUT_EDITS), TOML_VALUES), max_size=3),
           scheduler=st.lists(st.tuples(st.sampled_from(SCHEDULER_KEYS), TOML_VALUES), max_size=2, unique_by=lambda kv: kv[0]))
    def layouts(workspace, edits, scheduler):
        _layout_case(workspace, edits, scheduler)

    @settings(**common)
    @given(flags=st.lists(st.sampled_from(sorted(FLAG_VALUES)).flatmap(lambda f: st.tuples(st.just(f), FLAG_VALUES[f])),
                          min_size=1, max_size=4, unique_by=lambda kv: kv[0]))
    def flags(workspace, flags):
        _flags_case(workspace, flags)

    return configs, headers, layouts, flags


FUZZ_EXAMPLES = {"fast": 50, "slow": 2000}
test_configs, test_headers, test_layouts, test_flags = _targets(FUZZ_EXAMPLES["fast"])
_slow = _targets(FUZZ_EXAMPLES["slow"])
test_configs_many, test_headers_many, test_layouts_many, test_flags_many = (pytest.mark.slow(t) for t in _slow)


def test_the_runner_sees_a_crash(tmp_path):
    """The harness must not pass by missing a dead process: a child killed by a signal mid-case fails the case."""
    runner = Runner(tmp_path, script="import os, signal, sys\nsys.stdin.readline()\nos.kill(os.getpid(), signal.SIGSEGV)\n")
    result = runner.run(["info", "anything"])
    assert result["code"] == -11 and "died" in result["escaped"]
    with pytest.raises(AssertionError, match="died"):
        assert_clean(result, "a segfault", record=False)
