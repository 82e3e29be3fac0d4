"""Replay speed: expert look-ups per second of `moetier.sim.replay` for each residency policy.

Regime: one CPU process, numpy only. Traces: the real FLAME-MoE trace (2048 tokens x 8 layers,
top-6 of 64; skipped when ../shared/traces is absent) and a synthetic Qwen3-Next-like trace
(48 layers x 512 experts, top-10, 20k tokens by default; skewed, temporally and cross-layer
correlated, from `synthetic_trace`). Capacity 25% of a layer's experts, profile = the trace's
own counts. Each policy is timed `--repeats` times and the best run is kept, replayed one token
at a time (`shards=1`: all layers per numpy step) and with automatic time sharding (shards side
by side as extra rows; chosen only for narrow traces). Look-ups/s is wall time; the CPU-time
rate (this process) is shown too because the machine may be shared. The peer in the same run
is the online path: `policy.access(layer, picks)` token by token on a 100-token prefix, which
gives the same hits. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.sim import RoutingTrace, belady, from_flame, replay, synthetic_trace  # noqa: E402
from moetier.residency import make_policy  # noqa: E402

TRACES_DIR = Path(__file__).resolve().parents[1].parent / "shared" / "traces"
FLAME = "flame_moe_290m_prefill_4x512_layers2-9.npz"
VARIANTS = [("static", {}), ("lru", {}), ("lfu", {}), ("xlayer", {}), ("xlayer", {"context": 2})]


def online_rate(trace: RoutingTrace, policy: str, slots: int, profile: np.ndarray, options: dict, tokens: int = 100) -> float:
    """Look-ups/s of the online path (access per layer per token) on a prefix."""
    pol = make_policy(policy, trace.num_layers, trace.num_experts, slots, profile, **options)
    picks = trace.picks[:tokens].astype(np.int64)
    start = time.perf_counter()
    for t in range(len(picks)):
        for layer in range(trace.num_layers):
            pol.access(layer, picks[t, layer])
    return picks.size / (time.perf_counter() - start)


def best_of(repeats: int, run):
    results = [run() for _ in range(repeats)]
    return min(results, key=lambda r: r.seconds)


def bench_trace(name: str, trace: RoutingTrace, repeats: int) -> list[dict]:
    slots = trace.num_experts // 4
    profile = trace.counts()
    rows = []
    for policy, options in VARIANTS:
        label = policy + "".join(f" {k}={v}" for k, v in options.items())
        seq = best_of(repeats, lambda: replay(trace, policy, slots, profile, shards=1, **options))
        auto = best_of(repeats, lambda: replay(trace, policy, slots, profile, **options))
        rows.append({
            "trace": name, "policy": label, "hit_rate": seq.hit_rate, "uploads_per_layer_token": seq.uploads_per_token / trace.num_layers,
            "lookups_per_s": seq.lookups_per_s, "lookups_per_cpu_s": seq.lookups_per_cpu_s,
            "sharded_lookups_per_s": auto.lookups_per_s, "sharded_lookups_per_cpu_s": auto.lookups_per_cpu_s,
            "shards": auto.shards, "rounds": auto.rounds,
            "online_lookups_per_s": online_rate(trace, policy, slots, profile, options),
        })
        assert auto.hits.tolist() == seq.hits.tolist(), f"{name} {label}: sharded replay differs"
    opt = best_of(1, lambda: belady(trace, slots))
    rows.append({"trace": name, "policy": "belady", "hit_rate": opt.hit_rate, "uploads_per_layer_token": opt.uploads_per_token / trace.num_layers,
                 "lookups_per_s": opt.lookups_per_s, "lookups_per_cpu_s": opt.lookups_per_cpu_s})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=20000, help="tokens of the synthetic 48 x 512 trace")
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    traces = []
    if (TRACES_DIR / FLAME).exists():
        traces.append(("flame", from_flame(TRACES_DIR / FLAME)))
    started = time.perf_counter()
    traces.append((f"synthetic-48x512-top10-{args.tokens}", synthetic_trace(args.tokens, 48, 512, 10, seed=0)))
    print(f"synthetic trace generated in {time.perf_counter() - started:.1f} s")
    rows = [row for name, trace in traces for row in bench_trace(name, trace, args.repeats)]
    head = f"{'trace':<28} {'policy':<18} {'hit':>6} {'up/L/tok':>8} {'Mlook/s':>8} {'cpu':>6} {'sharded':>8} {'cpu':>6} {'S x r':>6} {'online':>7}"
    print(head)
    print("-" * len(head))
    for r in rows:
        sharded = " " * 22
        if "shards" in r:
            sharded = f"{r['sharded_lookups_per_s'] / 1e6:8.2f} {r['sharded_lookups_per_cpu_s'] / 1e6:6.2f} {r['shards']:>3}x{r['rounds']:<2}"
        online = f"{r['online_lookups_per_s'] / 1e6:7.3f}" if "online_lookups_per_s" in r else ""
        print(f"{r['trace']:<28} {r['policy']:<18} {r['hit_rate']:6.3f} {r['uploads_per_layer_token']:8.2f} "
              f"{r['lookups_per_s'] / 1e6:8.2f} {r['lookups_per_cpu_s'] / 1e6:6.2f} {sharded} {online}")
    print(json.dumps({"bench": "replay", "capacity_fraction": 0.25, "rows": rows}))


if __name__ == "__main__":
    main()
