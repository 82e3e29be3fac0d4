"""cluster.toml parsing: the shipped layouts load; every error names the file and the key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moetier.config import ConfigError, load_layout
from layouts import cache_layout

ROOT = Path(__file__).resolve().parents[1]

MINIMAL = cache_layout(slots=4)


@pytest.mark.parametrize("name", ["cluster.toml", "examples/local.toml"])
def test_shipped_layouts_load(name):
    layout = load_layout(ROOT / name)
    assert layout.parts and any(t.kind == "cpu" for t in layout.tiers)


def test_minimal_layout_defaults():
    layout = load_layout(_write(MINIMAL))
    assert layout.scheduler.defer_cpu == 0 and layout.scheduler.tail_skip is False
    assert layout.scheduler.defer_into_linear is False  # the engine's rule: nothing deferred into a recurrence
    flagged = layout.with_scheduler(defer_into_linear=True, defer_cpu=None)  # a flag over the file's key; None leaves one
    assert flagged.scheduler.defer_into_linear is True and flagged.scheduler.defer_cpu == 0
    assert layout.with_scheduler(defer_into_linear=None) is layout
    assert layout.parts[0].layers(10) == range(10)
    assert layout.link("pcie").transfer_us(8_000) == pytest.approx(5 + 1.0)


@pytest.mark.parametrize(
    "edit, where, words",
    [
        (("slots = 4", "slots = -4"), "[tiers.0]", "slots"),
        (("slots = 4", "slots = \"four\""), "[tiers.0].slots", "expected int"),
        (("kind = \"vram\"", "kind = \"ssd\""), "[tiers.0].kind", "expected one of"),
        (("link = \"pcie\"", "link = \"usb\""), "[tiers.0].link", "not a link"),
        (("layers = \"0:\"", "layers = \"2:\""), "[parts.0].layers", "expected 0"),
        (("layers = \"0:\"", "layers = \"zero\""), "[parts.0].layers", "range"),
        (("device = \"gpu0\"\nlayers", "device = \"gpu9\"\nlayers"), "[parts.0].device", "not a device"),
        (("gbps = 64.0", "gbps = 64.0\nmtu = 9000"), "[links.0].mtu", "unknown key"),
        (("[[tiers]]\nname = \"cpu\"\nkind = \"cpu\"", ""), "tiers", "cpu"),
        (("[[links]]", "[scheduler]\ndefer_cpu = 3\n[[links]]"), "[scheduler].defer_cpu", "0, 1 or 2"),
        (("[[links]]", "[scheduler]\ndefer_into_linear = 1\n[[links]]"), "[scheduler].defer_into_linear", "expected bool"),
    ],
)
def test_errors_name_file_and_key(edit, where, words):
    old, new = edit
    assert old in MINIMAL
    path = _write(MINIMAL.replace(old, new, 1))
    with pytest.raises(ConfigError) as err:
        load_layout(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ") and where in message and words in message and "\n" not in message


def test_bad_toml_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="no such layout"):
        load_layout(tmp_path / "none.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[[tiers]\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_layout(bad)


def test_model_checks(tmp_path):
    layout = load_layout(_write(MINIMAL.replace("slots = 4", "slots = 40")))
    with pytest.raises(ConfigError, match="exceeds"):
        layout.check_model(num_layers=4, num_experts=16)
    closed = load_layout(_write(MINIMAL.replace('layers = "0:"', 'layers = "0:3"')))
    with pytest.raises(ConfigError, match="parts end at layer 3"):
        closed.check_model(num_layers=4, num_experts=16)


def test_layout_check_cli_exits_2_with_one_line(tmp_path):
    path = _write(MINIMAL.replace("slots = 4", "slots = 0"))
    result = subprocess.run([sys.executable, "-m", "moetier.cli", "layout", "check", str(path)], capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "slots or capacity_bytes" in result.stderr


_counter = iter(range(10**6))


def _write(text: str) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix="layout"))
    path = folder / f"cluster{next(_counter)}.toml"
    path.write_text(text)
    return path


def test_a_second_cpu_tier_is_refused_by_layout_check(tmp_path):
    """The executor carries one CPU-lane future per layer: a second lane's partial would be lost, so a layout
    with two is refused with one line (and `moetier layout check` exits 2)."""
    path = tmp_path / "two-lanes.toml"
    path.write_text(MINIMAL + '[[tiers]]\nname = "cpu2"\nkind = "cpu"\n')
    with pytest.raises(ConfigError) as err:
        load_layout(path)
    message = str(err.value)
    assert message.startswith(f"{path}: [tiers.2].kind") and "one CPU lane" in message and "\n" not in message
    result = subprocess.run([sys.executable, "-m", "moetier.cli", "layout", "check", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "[tiers.2].kind" in result.stderr


@pytest.mark.parametrize("kind", ["vram", "helper"])
def test_backend_on_a_gpu_tier_is_refused_not_ignored(tmp_path, kind):
    """A vram or helper tier computes with torch on its device; any other backend there was silently ignored."""
    text = MINIMAL.replace('kind = "vram"', f'kind = "{kind}"\nbackend = "numpy"', 1)
    path = tmp_path / "layout.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_layout(path)
    assert str(err.value).startswith(f"{path}: [tiers.0].backend") and "numpy" in str(err.value)
    path.write_text(MINIMAL.replace('kind = "vram"', f'kind = "{kind}"\nbackend = "torch"', 1))
    assert load_layout(path).tiers[0].backend_name == "torch"  # saying what it does is fine


def test_the_executor_refuses_two_deferrable_tiers_on_a_layer():
    """The invariant behind the config rule, where it holds: Partials has room for one lane future."""
    from moetier.engine.tier_executor import TierExecutor
    from moetier.tiers.base import Tier

    class Lane(Tier):
        kind, deferrable = "cpu", True

    one, two = Lane("a"), Lane("b")
    with pytest.raises(ValueError, match="2 deferrable tiers"):
        TierExecutor([one, two], {0: [one, two]}, {}, 1000.0)
