"""Print the residency-policy tables of docs/policies.md from the real traces in ../shared/traces.

Protocol (per trace, per capacity = 25% and 50% of a layer's experts): the first half of the
token stream gives the profile (per-layer pick counts); every policy is replayed on the second
half, starting from that profile where it uses one (static: its top experts; lru/lfu: a warm
cache of the same experts; xlayer: its frequency prior). lru*/lfu* instead run over the whole
trace and count only the second half (their state warmed on the first half). Belady is the
offline optimum on the second half: demand paging (every miss admitted) and with bypass.
Also: xlayer's hit rate against its upload budget, and static hit rates from the count-only
files (OLMoE, Mixtral, Switch), in-domain and across OLMoE's domains.

    .venv/bin/python scripts/policy_report.py            # markdown, as pasted into docs/policies.md
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.sim import belady, from_flame, from_qwen15moe, load_counts, replay  # noqa: E402

TRACES = {
    "FLAME-MoE-290M (prefill, 2048 tok, 8 layers, top-6 of 64)": ("flame_moe_290m_prefill_4x512_layers2-9.npz", from_flame),
    "Qwen1.5-MoE-A2.7B (GSM8K serving, 4292 tok, 5 layers, top-4 of 60)": ("qwen15moe_gsm8k_layers_0_8_12_18_23.npz", from_qwen15moe),
}
OLMOE_DOMAINS = ("arxiv", "book", "c4", "github", "wikipedia")


def policy_table(traces_dir: Path) -> list[str]:
    out = ["| trace | capacity | static | lru | lfu | lru* | lfu* | **xlayer** | belady | belady bypass | xlayer / belady | "
           "uploads per layer-token lru / lfu / xlayer |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for title, (file, adapter) in TRACES.items():
        trace = adapter(traces_dir / file)
        half = trace.num_tokens // 2
        second, profile = trace.tokens(half), trace.tokens(0, half).counts()
        for fraction in (0.25, 0.5):
            r = {p: replay(second, p, fraction, profile) for p in ("static", "lru", "lfu", "xlayer")}
            warm = {p: replay(trace, p, fraction, warmup_tokens=half) for p in ("lru", "lfu")}
            opt, opt_bypass = belady(second, fraction), belady(second, fraction, bypass=True)
            up = " / ".join(f"{r[p].uploads_per_token / trace.num_layers:.2f}" for p in ("lru", "lfu", "xlayer"))
            out.append(f"| {title} | {fraction:.0%} ({r['lru'].capacity[0]}) | {r['static'].hit_rate:.3f} | {r['lru'].hit_rate:.3f} | "
                       f"{r['lfu'].hit_rate:.3f} | {warm['lru'].hit_rate:.3f} | {warm['lfu'].hit_rate:.3f} | **{r['xlayer'].hit_rate:.3f}** | "
                       f"{opt.hit_rate:.3f} | {opt_bypass.hit_rate:.3f} | {r['xlayer'].hit_rate / opt.hit_rate:.2f} | {up} |")
    return out


def budget_table(traces_dir: Path) -> list[str]:
    budgets = (1, 2, 3, 4, 6)
    out = ["| trace | capacity | " + " | ".join(f"budget {b}" for b in budgets) + " | lfu |", "|---|---|" + "---|" * (len(budgets) + 1)]
    for title, (file, adapter) in TRACES.items():
        trace = adapter(traces_dir / file)
        half = trace.num_tokens // 2
        second, profile = trace.tokens(half), trace.tokens(0, half).counts()
        for fraction in (0.25, 0.5):
            cells = []
            for b in budgets:
                r = replay(second, "xlayer", fraction, profile, budget=b)
                cells.append(f"{r.hit_rate:.3f} ({r.uploads_per_token / trace.num_layers:.2f})")
            lfu = replay(second, "lfu", fraction, profile)
            cells.append(f"{lfu.hit_rate:.3f} ({lfu.uploads_per_token / trace.num_layers:.2f})")
            out.append(f"| {title.split(' (')[0]} | {fraction:.0%} | " + " | ".join(cells) + " |")
    return out


def top_share(counts: np.ndarray, profile: np.ndarray, fraction: float) -> float:
    """Static hit rate: share of `counts` picks that land on each layer's top experts of `profile`."""
    slots = max(1, int(round(fraction * counts.shape[1])))
    top = np.argsort(-profile, axis=1, kind="stable")[:, :slots]  # [L, slots]
    return float(np.take_along_axis(counts, top, 1).sum() / counts.sum())


def counts_table(traces_dir: Path) -> list[str]:
    out = ["| counts file | layers | experts | static 25% | static 50% | notes |", "|---|---|---|---|---|---|"]
    for file, key, note in (("mixtral_expert_activation_counts.npy", None, "Mixtral-8x7B-Instruct, ~59.5k tokens"),
                            ("switch_base_128_layer_expert_counts.npz", None, "Switch-base-128, top-1, ~207k tokens")):
        c = load_counts(traces_dir / file, key).counts
        out.append(f"| {file} | {len(c)} | {c.shape[1]} | {top_share(c, c, 0.25):.3f} | {top_share(c, c, 0.5):.3f} | {note}; in-sample profile |")
    olmoe = traces_dir / "olmoe_expert_counts_layers_0_7_15.npz"
    counts = {d: load_counts(olmoe, f"olmoe__expert_counts__{d}").counts for d in OLMOE_DOMAINS}
    inside = [np.mean([top_share(c, c, f) for c in counts.values()]) for f in (0.25, 0.5)]
    across = [[top_share(counts[y], counts[x], f) for x, y in itertools.permutations(OLMOE_DOMAINS, 2)] for f in (0.25, 0.5)]
    out.append(f"| {olmoe.name} ({', '.join(OLMOE_DOMAINS)}) | 3 | 64 | {inside[0]:.3f} | {inside[1]:.3f} | OLMoE-1B-7B, in-domain mean; "
               f"profile from another domain: {np.mean(across[0]):.3f} / {np.mean(across[1]):.3f} "
               f"(worst pair {np.min(across[0]):.3f} / {np.min(across[1]):.3f}) |")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--traces", type=Path, default=Path(__file__).resolve().parents[1].parent / "shared" / "traces")
    args = parser.parse_args()
    if not args.traces.is_dir():
        sys.exit(f"traces folder not found: {args.traces}")
    for title, lines in (("Hit rates on the second half (first half = profile)", policy_table(args.traces)),
                         ("xlayer: hit rate (uploads per layer-token) by prefetch budget, second half", budget_table(args.traces)),
                         ("Static profiles from the count-only files", counts_table(args.traces))):
        print(f"### {title}\n")
        print("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
