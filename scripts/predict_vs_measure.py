"""Prediction against measurement on this machine: calibrate, simulate, run, compare, for several layouts.

For each layout (all experts resident; CPU-lane heavy; two parts with DEFER_CPU off and on;
a remote worker on loopback), --repeats times, layouts interleaved: `moetier calibrate
--layout` writes the rates, `moetier run --layout --json --trace` measures a decode right
after, and the simulator predicts that run from that calibration and the run's own routing
trace replayed through the same policy. Each side keeps its median, so prediction and
measurement sample the same minutes of a machine whose speed drifts. Pass: decode tok/s
within 15%, hit rate within 1 percentage point (the median run's). `calibrate --layout` times its own decode over the layout (trunk,
head, GPU rate, dispatch, the CPU lane's call cost, a remote call's cost beyond its link); the
measured run is a separate process, prompt and length. The model is the synthetic `small` (or
--preset medium); prompts are one token, so the caches start as cold as the replay's. Prints
a table, then JSON.

    python scripts/predict_vs_measure.py [--preset small] [--tokens 256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

HEAD = """name = "{name}"
[[hosts]]
name = "local"
[[devices]]
name = "gpu0"
host = "local"
kind = "cuda"
[[devices]]
name = "gpu1"
host = "local"
kind = "cuda"
index = 1
[[links]]
name = "pcie"
rtt_us = 10.0
gbps = 64.0
[[links]]
name = "loopback"
rtt_us = 60.0
gbps = 10.0
[scheduler]
budget_us = 50000.0
defer_cpu = {defer}
calibration = "{name}.calibration.json"
"""
PART = '[[parts]]\nname = "{name}"\ndevice = "{device}"\nlayers = "{layers}"\n'
VRAM = '[[tiers]]\nname = "{name}"\nkind = "vram"\ndevice = "{device}"\nslots = {slots}\npolicy = "{policy}"\nlink = "pcie"\n{profile}'
CPU = '[[tiers]]\nname = "cpu"\nkind = "cpu"\nhost = "local"\nthreads = 1\n'
REMOTE = '[[tiers]]\nname = "worker"\nkind = "remote"\naddress = "tcp://127.0.0.1:{port}"\nlink = "loopback"\nexperts = "all"\n'


def layouts(experts: int, layers: int, port: int, rtt_us: float) -> dict[str, str]:
    """name -> cluster.toml text; the all-resident one holds every expert from the start (a flat static profile)."""
    half = layers // 2
    one = PART.format(name="all", device="gpu0", layers="0:")
    two = PART.format(name="first", device="gpu0", layers=f"0:{half}") + PART.format(name="second", device="gpu1", layers=f"{half}:")
    resident = VRAM.format(name="vram", device="gpu0", slots=experts, policy="static", profile='profile = "flat.npy"\n')
    split = lambda policy: (VRAM.format(name="vram0", device="gpu0", slots=experts // 4, policy=policy, profile="")  # noqa: E731
                            + VRAM.format(name="vram1", device="gpu1", slots=experts // 4, policy=policy, profile=""))
    return {
        "all resident": HEAD.format(name="resident", defer=0) + one + resident + CPU,
        "cpu-lane heavy": HEAD.format(name="lane", defer=0) + one + VRAM.format(name="vram", device="gpu0", slots=max(1, experts // 12),
                                                                                 policy="lru", profile="") + CPU,
        "DEFER_CPU=0": HEAD.format(name="defer0", defer=0) + two + split("lru") + CPU,
        "DEFER_CPU=2": HEAD.format(name="defer2", defer=2) + two + split("lru") + CPU,
        "remote loopback": (HEAD.format(name="remote", defer=0).replace("rtt_us = 60.0", f"rtt_us = {rtt_us:.1f}")
                            + one + VRAM.format(name="vram", device="gpu0", slots=max(1, experts // 12), policy="lru", profile="")
                            + CPU + REMOTE.format(port=port)),
    }


def moetier(*args) -> str:
    result = subprocess.run([sys.executable, "-m", "moetier.cli", *map(str, args)], capture_output=True, text=True, cwd=REPO)
    if result.returncode != 0:
        raise SystemExit(f"moetier {' '.join(map(str, args))} failed: {result.stderr.strip()}")
    return result.stdout


def start_worker(model: Path, threads: int) -> tuple[subprocess.Popen, int, float]:
    """A `moetier worker` on a free loopback port; returns it, its port and the median round trip (us) `moetier ping` measures."""
    worker = subprocess.Popen([sys.executable, "-m", "moetier.cli", "worker", "--listen", "tcp://127.0.0.1:0", "--model", str(model),
                               "--threads", str(threads)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
    line = worker.stdout.readline()
    if "listening on" not in line:
        worker.terminate()
        raise SystemExit(f"moetier worker did not start: {line!r}")
    port = int(line.strip().rsplit(":", 1)[1])
    ping = json.loads(moetier("ping", f"tcp://127.0.0.1:{port}", "--model", model, "--json"))
    return worker, port, float(ping["model"]["rtt_us"])  # median round trip of one float32 hidden state


def compare(name: str, path: Path, runs: list, model: Path) -> dict:
    """runs: (report, trace, calibration) per repeat -> the medians of measured and predicted tok/s, and
    the median run beside its own prediction (hit rate, categories)."""
    from moetier.config import load_layout
    from moetier.model import open_checkpoint
    from moetier.sched.cost import Calibration
    from moetier.sim.layout_sim import ModelShape, load_trace, simulate

    # the shape the run has: its stored bytes, and its linear-attention layers, so that DEFER_CPU defers where the
    # run's engine does (the layout's [scheduler].defer_into_linear, off by default: moetier.sched.defer)
    layout, shape = load_layout(path), ModelShape.from_checkpoint(open_checkpoint(model))
    sims = [simulate(layout, shape, Calibration.load(calibration), load_trace(trace)) for _, trace, calibration in runs]
    measured_runs, predicted_runs = [r["decode_tok_per_s"] for r, _, _ in runs], [sim.tok_per_s for sim in sims]
    middle = int(np.argsort(measured_runs)[len(runs) // 2])
    report, sim = runs[middle][0], sims[middle]  # the median run and the prediction from its own calibration and trace
    measured, predicted = float(np.median(measured_runs)), float(np.median(predicted_runs))
    return {"layout": name, "measured_tok_per_s": measured, "runs_tok_per_s": measured_runs, "predicted_runs_tok_per_s": predicted_runs,
            "predicted_tok_per_s": predicted, "tok_per_s_error": predicted / measured - 1,
            "measured_hit_rate": report["hit_rate"], "predicted_hit_rate": sim.hit_rate, "hit_rate_pp": 100 * (sim.hit_rate - report["hit_rate"]),
            "measured_ms_per_token": report["ms_per_token"], "predicted_ms_per_token": sim.prediction.ms_per_token}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="small", choices=["small", "medium"])
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="calibrations and measured runs per layout (interleaved); medians are kept")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "predict_vs_measure")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for calibrate and run alike")
    args = parser.parse_args()

    import torch

    from moetier.model.builtin import cached_synthetic
    from moetier.config import load_layout
    from moetier.model import open_checkpoint

    model = cached_synthetic("qwen3_moe", args.preset)
    spec = open_checkpoint(model).spec
    args.out.mkdir(parents=True, exist_ok=True)
    np.save(args.out / "flat.npy", np.ones((len(spec.moe_layers), spec.num_experts)))
    worker, port, rtt_us = start_worker(model, 1)
    try:
        paths, written = {}, {}  # layout name -> its toml, the calibration file calibrate writes for it
        for name, text in layouts(spec.num_experts, spec.num_layers, port, rtt_us).items():
            paths[name] = args.out / f"{text.splitlines()[0].split(chr(34))[1]}.toml"
            paths[name].write_text(text)
            layout = load_layout(paths[name])
            written[name] = layout.relative(layout.scheduler.calibration)
            moetier("calibrate", "--layout", paths[name], "--model", model, "--threads", args.threads)
        runs: dict[str, list] = {name: [] for name in paths}
        run = lambda path, trace: json.loads(moetier("run", "--layout", path, "--model", model, "--json", "--trace", trace,  # noqa: E731
                                                     "--max-new-tokens", args.tokens, "--prompt-ids", "1", "--threads", args.threads))
        for name, path in paths.items():  # warm-up: page cache, worker
            run(path, args.out / "warmup.npz")
        for index in range(args.repeats):  # layouts interleaved, so a busy spell hits all of them
            for name, path in paths.items():
                trace, calibration = args.out / f"{path.stem}.{index}.npz", args.out / f"{path.stem}.{index}.calibration.json"
                moetier("calibrate", "--layout", path, "--model", model, "--threads", args.threads)  # the run plans with it too
                shutil.copyfile(written[name], calibration)
                runs[name].append((run(path, trace), trace, calibration))
    finally:
        worker.terminate()
        worker.wait()
    rows = [compare(name, paths[name], runs[name], model) for name in paths]
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {args.threads} torch threads, torch {torch.__version__}"
    print(f"model {args.preset} ({spec.num_layers} layers x {spec.num_experts} experts, top-{spec.top_k}); machine: {machine}")
    print(f"{'layout':16} {'measured':>9} {'predicted':>10} {'error':>7} {'hit meas.':>9} {'hit pred.':>9} {'diff pp':>7}")
    for row in rows:
        print(f"{row['layout']:16} {row['measured_tok_per_s']:9.1f} {row['predicted_tok_per_s']:10.1f} {100 * row['tok_per_s_error']:+6.1f}% "
              f"{100 * row['measured_hit_rate']:8.2f}% {100 * row['predicted_hit_rate']:8.2f}% {row['hit_rate_pp']:+7.2f}")
    ok = all(abs(r["tok_per_s_error"]) <= 0.15 and abs(r["hit_rate_pp"]) <= 1.0 for r in rows)
    print(json.dumps({"machine": machine, "preset": args.preset, "rows": rows, "remote": f"loopback, {rtt_us:.0f} us round trip",
                      "pass": ok}))


if __name__ == "__main__":
    main()
