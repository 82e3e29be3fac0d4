"""The shape of the package: imports run one way between its parts, and light commands stay light.

Every import in moetier/ — at the top of a module or inside a function — is read
from the source (ast) and checked against LAYERS: a part may import only parts
of a lower layer (its own modules aside). The layering is the one DESIGN.md
draws; a function-local import that dodges a cycle is still a cycle, so it is
an error here too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "moetier"

# part of moetier -> its layer; a part imports only parts of strictly lower layers
LAYERS = {
    "cli": 8,
    "serve": 7,
    "profile": 6, "sim": 6, "calibrate": 6,
    "engine": 5,
    "tiers": 4, "sched": 4,
    "transport": 3,
    "backends": 2, "residency": 2,
    "model": 1, "config": 1,
    "native": 0,
}


def _part(module: str) -> str | None:
    """moetier.tiers.vram -> "tiers"; moetier -> None (the package root imports nothing)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else None


def _imports() -> list[tuple[str, int, str]]:
    """(module, line, imported moetier module) for every import in the package, nested ones included."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                # `from moetier import native` imports the module moetier.native
                targets = [source] if source != "moetier" else [f"moetier.{alias.name}" for alias in node.names]
            else:
                continue
            found += [(module, node.lineno, target) for target in targets if target == "moetier" or target.startswith("moetier.")]
    return found


def test_every_part_of_the_package_has_a_layer():
    parts = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir() if p.name != "__init__.py"
             and not p.name.startswith(("_", ".")) and (p.suffix == ".py" or (p / "__init__.py").exists())}
    assert parts == set(LAYERS), f"parts without a layer: {sorted(parts - set(LAYERS))}; layers without a part: {sorted(set(LAYERS) - parts)}"


def test_imports_run_one_way():
    wrong = []
    for module, line, target in _imports():
        source, imported = _part(module), _part(target)
        if imported is None or source is None or source == imported:
            continue
        if LAYERS[imported] >= LAYERS[source]:
            wrong.append(f"{module}:{line} imports {target} ({source} is layer {LAYERS[source]}, {imported} layer {LAYERS[imported]})")
    assert not wrong, "imports against the layering:\n" + "\n".join(wrong)


def test_no_cycle_between_parts():
    edges: dict[str, set[str]] = {}
    for module, _, target in _imports():
        source, imported = _part(module), _part(target)
        if source and imported and source != imported:
            edges.setdefault(source, set()).add(imported)
    state: dict[str, int] = {}  # 1 on the path, 2 done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            assert state.get(nxt) != 1, "cycle between parts: " + " -> ".join(path + [node, nxt])
            if nxt not in state:
                visit(nxt, path + [node])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [])


def test_the_walker_sees_nested_and_relative_imports(tmp_path):
    """The check must not pass by missing imports: a function-local one in cli is seen."""
    seen = {(module, target) for module, _, target in _imports()}
    assert ("moetier.cli.model", "moetier.engine") in seen  # inside run()
    assert ("moetier.transport.wire", "moetier.native") in seen  # `from moetier import native`


def test_simulate_does_not_import_torch(tmp_path):
    """`moetier simulate` (and the CLI's start) never import torch or the engine: the simulator stands below them."""
    from layouts import cache_layout

    from moetier.sim.traces import synthetic_trace

    layout = tmp_path / "layout.toml"
    layout.write_text(cache_layout(slots=4))
    trace = tmp_path / "trace.npz"
    synthetic_trace(tokens=64, layers=2, experts=16, top_k=2, seed=0).save(trace)
    probe = (
        "import sys, json\n"
        "from moetier.cli.app import app\n"
        "try:\n"
        f"    app(['simulate', '--layout', {str(layout)!r}, '--trace', {str(trace)!r}, '--expert-bytes', '4096', '--json'])\n"
        "except SystemExit as done:\n"
        "    code = done.code\n"
        "print(json.dumps({'code': code, 'heavy': sorted(m for m in sys.modules if m.split('.')[0] == 'torch'"
        " or m.startswith(('moetier.engine', 'moetier.tiers', 'moetier.backends')))}))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.strip().splitlines()
    result = json.loads(lines[-1])
    assert result["code"] in (0, None), done.stdout + done.stderr
    assert json.loads(lines[-2])["decode_tok_per_s"] > 0  # it simulated
    assert result["heavy"] == [], f"simulate imported {result['heavy'][:5]}"
