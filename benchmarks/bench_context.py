"""Decode speed against context length on a hybrid model: linear-attention layers cost the same at any length.

Regime: CPU, batch 1, greedy, every expert resident. One model (`--model`, default the synthetic qwen3_next
`--preset medium`: 16 layers, 12 of them Gated DeltaNet and 4 full attention, 80 experts top-10, written once into
`benchmarks/.models`). For each context length (`--contexts`) a random prompt of that many tokens is prefilled (in
forwards of at most 512 tokens), then `--tokens` greedy tokens are decoded twice: once as the engine decodes
(the native step where it applies: tok/s), once with the engine's step timer on (the per-layer Python path: where
a token's time goes, ms/token: attention over the KV cache, the linear layers' mixing and state update, the
router, the head; the rest is experts, shared experts and glue). Lengths run interleaved `--runs` times, best
kept. Prints a table, then one JSON line.

    .venv/bin/python benchmarks/bench_context.py --contexts 64,1024,4096
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from moetier.engine import Engine  # noqa: E402
from moetier.engine.timing import StepTimes  # noqa: E402
from moetier.model import open_checkpoint  # noqa: E402
from moetier.model.synth import synth_version, write_synthetic  # noqa: E402

PREFILL_CHUNK = 512  # tokens per prefill forward: the full-attention layers' masks stay [512, P]


def default_model(root: Path, arch: str, preset: str) -> Path:
    folder = root / f"{arch}-{preset}-seed0-{synth_version(arch, preset)}" / "hf"
    if not (folder / "config.json").exists():
        print(f"writing the synthetic {arch} {preset} checkpoint to {folder} (once)", file=sys.stderr)
        write_synthetic(folder, arch=arch, preset=preset)
    return folder


def prefill(engine: Engine, ids: torch.Tensor):
    cache = engine.new_cache()
    for start in range(0, ids.shape[0], PREFILL_CHUNK):
        engine.forward(ids[start : start + PREFILL_CHUNK], cache, all_logits=False)
    return cache


def decode(engine: Engine, ids: torch.Tensor, tokens: int, timed: bool) -> tuple[float, dict[str, float]]:
    """(seconds per decoded token, ms/token per timing category) after prefilling ids."""
    cache = prefill(engine, ids)
    token = torch.tensor([int(ids[-1])])
    times = StepTimes() if timed else None
    engine.times = times
    try:
        begin = time.perf_counter()
        for _ in range(tokens):
            token = engine.forward(token, cache, all_logits=False).argmax(-1)
        seconds = (time.perf_counter() - begin) / tokens
    finally:
        engine.times = None
    spent = {name: s / times.steps * 1e3 for name, s in times.seconds.items()} if timed else {}
    return seconds, spent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="HF folder or GGUF file (default: the synthetic --arch --preset)")
    parser.add_argument("--arch", default="qwen3_next")
    parser.add_argument("--preset", default="medium")
    parser.add_argument("--models", type=Path, default=REPO / "benchmarks" / ".models")
    parser.add_argument("--contexts", default="64,1024,4096", help="comma-separated prompt lengths")
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens per measurement")
    parser.add_argument("--runs", type=int, default=2, help="interleaved runs over the lengths, best kept")
    parser.add_argument("--json", type=Path, help="also write the JSON object here")
    args = parser.parse_args()
    model = args.model or default_model(args.models, args.arch, args.preset)
    contexts = [int(c) for c in args.contexts.split(",")]
    engine = Engine(open_checkpoint(model))
    engine.warm_up()
    generator = torch.Generator().manual_seed(0)
    prompts = {n: torch.randint(0, engine.spec.vocab_size, (n,), generator=generator) for n in contexts}
    best: dict[int, dict] = {}
    for _ in range(args.runs):
        for n in contexts:
            seconds, _ = decode(engine, prompts[n], args.tokens, timed=False)
            timed_seconds, spent = decode(engine, prompts[n], args.tokens, timed=True)
            row = best.setdefault(n, {"tok_per_s": 0.0})
            if 1 / seconds > row["tok_per_s"]:
                row.update(tok_per_s=1 / seconds, ms_per_token=seconds * 1e3)
            if "timed_ms_per_token" not in row or timed_seconds * 1e3 < row["timed_ms_per_token"]:
                rest = timed_seconds * 1e3 - sum(spent.values())
                row.update(timed_ms_per_token=timed_seconds * 1e3, breakdown_ms=spent | {"experts, shared, glue": rest})
    spec = engine.spec
    print(f"{model}: {spec.arch}, {spec.num_layers} layers ({len(spec.linear_layers)} linear attention), "
          f"{spec.num_experts} experts top-{spec.top_k}; decode {engine.decode_path()}; {torch.get_num_threads()} torch "
          f"thread(s), {os.cpu_count()} CPUs")
    categories = sorted({c for row in best.values() for c in row["breakdown_ms"]})
    print("context | tok/s | ms/token | timed ms/token | " + " | ".join(categories))
    for n in contexts:
        row = best[n]
        cells = " | ".join(f"{row['breakdown_ms'].get(c, 0.0):.2f}" for c in categories)
        print(f"{n} | {row['tok_per_s']:.1f} | {row['ms_per_token']:.2f} | {row['timed_ms_per_token']:.2f} | {cells}")
    result = {"bench": "context", "model": str(model), "arch": spec.arch, "decode_path": engine.decode_path(),
              "tokens": args.tokens, "runs": args.runs, "contexts": {str(n): best[n] for n in contexts}}
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
