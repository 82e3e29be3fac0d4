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
