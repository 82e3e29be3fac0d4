"""Decode speed: moetier's engine against transformers' generate, and against the memory roofline.

Regime: batch 1, float32, every expert resident in RAM, greedy decode, the same
checkpoint (synthetic `medium`, ~1 GB, written once into $MOETIER_HOME) and the
same torch thread count for both, in one process, timed alternately. Decode
tok/s covers the N steps after the first new token (prefill excluded), timed
by the engine itself and by a clock-only logits processor inside generate. The roofline
is bytes of weights touched per decoded token (from the engine's own routing)
divided by the bandwidth of a large tensor copy measured in the same run
(bytes copied per second, as memcpy bandwidth is quoted; the bus moves twice
that, which is also printed). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moetier.backends.torch_backend import TorchBackend  # noqa: E402
from moetier.calibrate import copy_bandwidth_bytes_per_s  # noqa: E402
from moetier.model.builtin import cached_synthetic  # noqa: E402
from moetier.engine import Engine, generate  # noqa: E402
from moetier.model import open_checkpoint  # noqa: E402
from moetier.model.synth import sample_session  # noqa: E402


def bytes_per_decoded_token(engine: Engine) -> int:
    """Weight bytes one decode step reads: embed row, attention, norms, router, k experts, dense/shared MLPs, lm head."""
    s = engine.spec
    total = s.hidden_size * 4 + engine.lm_head.numel() * 4 + engine.final_norm.numel() * 4
    for layer, w in enumerate(engine.layers):
        total += sum(t.numel() * 4 for t in (w.input_norm, w.post_norm, w.qkv, w.o_proj) if t is not None)
        total += sum(t.numel() * 4 for t in (w.qk_norm, w.qkv_bias, w.o_bias, w.router) if t is not None)
        total += sum(m.nbytes for m in (w.mlp, w.shared) if m is not None)
        if s.is_moe(layer):
            total += s.top_k * engine.checkpoint.expert_nbytes
    return total


def time_engine(engine: Engine, prompt: list[int], new_tokens: int) -> float:
    """Decode tok/s: the steps after the first new token (prefill excluded)."""
    return generate(engine, prompt, new_tokens + 1).decode_tok_per_s


class StepClock:
    """A logits processor that only reads the clock: generate calls it once per new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def __call__(self, input_ids, scores):
        self.stamps.append(time.perf_counter())
        return scores


def time_transformers(model, prompt: list[int], new_tokens: int) -> float:
    """Decode tok/s over the same steps as time_engine: from the first new token's logits to the last's."""
    from transformers import LogitsProcessorList

    clock = StepClock()
    with torch.inference_mode():
        model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens + 1, min_new_tokens=new_tokens + 1,
                       do_sample=False, pad_token_id=0, logits_processor=LogitsProcessorList([clock]))
    return new_tokens / (clock.stamps[-1] - clock.stamps[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="HF model folder (default: synthetic medium, written once)")
    parser.add_argument("--arch", default="qwen3_moe")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3, help="alternating timed rounds; the best of each is kept")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--lanes", type=int, default=1,
                        help="the engine's expert lanes (default 1); with lanes > 1 the engine's own kernels run single-threaded")
    parser.add_argument("--torch-ops", action="store_true", help="decode experts with torch ops, not the native kernel")
    args = parser.parse_args()
    # Same thread budget for both: transformers gets `threads` intra-op threads; so does the engine,
    # unless it spends them as expert lanes (each single-threaded), its other kernels then on one thread.
    engine_intra_op = 1 if args.lanes > 1 else args.threads
    torch.set_num_threads(args.threads)

    folder = args.model or cached_synthetic(args.arch, "medium")
    checkpoint = open_checkpoint(folder)
    prompt = [int(i) for i in sample_session(folder, tokens_per_phase=16, seed=1)[0][1][:16]] if (folder / "moetier_synth.json").exists() else list(range(1, 17))

    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    engine = Engine(checkpoint, backend=TorchBackend("cpu", lanes=args.lanes, native_kernel=not args.torch_ops))
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert generate(engine, prompt, 8).ids == reference.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist(), "engine and transformers disagree on greedy tokens"

    bandwidth = copy_bandwidth_bytes_per_s()
    engine_rates, reference_rates = [], []
    for _ in range(args.rounds):  # alternate, so drift on a shared machine hits both
        torch.set_num_threads(engine_intra_op)
        engine_rates.append(time_engine(engine, prompt, args.new_tokens))
        torch.set_num_threads(args.threads)
        reference_rates.append(time_transformers(reference, prompt, args.new_tokens))
    touched = bytes_per_decoded_token(engine)
    engine_tps, reference_tps = max(engine_rates), max(reference_rates)
    roofline_tps = bandwidth / touched
    result = {
        "model": str(folder),
        "fingerprint": checkpoint.fingerprint,
        "threads": args.threads,
        "lanes": args.lanes,
        "engine_backend": engine.backend.describe(),
        "new_tokens": args.new_tokens,
        "copy_bandwidth_gb_per_s": bandwidth / 1e9,
        "bytes_per_token_mb": touched / 1e6,
        "roofline_tok_per_s": roofline_tps,
        "engine_decode_tok_per_s": engine_tps,
        "transformers_decode_tok_per_s": reference_tps,
        "speedup_vs_transformers": engine_tps / reference_tps,
        "engine_roofline_share": engine_tps / roofline_tps,
        "transformers_roofline_share": reference_tps / roofline_tps,
        "engine_rounds": engine_rates,
        "transformers_rounds": reference_rates,
        "cpu": _cpu_name(),
    }
    print(f"{'':28}{'decode tok/s':>14}{'roofline share':>16}")
    print(f"{'moetier engine':28}{engine_tps:14.1f}{engine_tps / roofline_tps:16.1%}")
    print(f"{'transformers generate':28}{reference_tps:14.1f}{reference_tps / roofline_tps:16.1%}")
    print(f"{'roofline (copy bandwidth)':28}{roofline_tps:14.1f}{'':>16}")
    print(f"speedup {engine_tps / reference_tps:.2f}x; {touched / 1e6:.0f} MB touched per token; "
          f"copy bandwidth {bandwidth / 1e9:.1f} GB/s copied ({2 * bandwidth / 1e9:.1f} GB/s read + written); "
          f"{args.threads} threads each; engine backend {result['engine_backend']}; {result['cpu']}")
    print(json.dumps(result))


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()} x{os.cpu_count()}"
    except OSError:
        pass
    return f"{os.cpu_count()} cpus"


if __name__ == "__main__":
    main()
