"""Write a randomly initialised Qwen3-MoE checkpoint with transformers (its own init and save_pretrained), float32.

What a new user arrives with when they try moetier on a model of their own: a transformers-written folder
(config.json + model.safetensors, no tokenizer). The defaults are the shape of the first measurement behind
the CPU-kernels work: 10 layers of 48 experts of 3.5 MB in float32 (hidden 768, width 384), top-8, 2.0 GB
in all. `benchmarks/bench_decode.py --checkpoint OUT` runs moetier, llama.cpp and transformers on it.

    .venv/bin/python scripts/make_qwen3moe_checkpoint.py /tmp/qwen3moe-48x
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to write (must not exist yet)")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--experts", type=int, default=48)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--width", type=int, default=384, help="each expert's intermediate size")
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.out.exists():
        parser.error(f"{args.out} exists (expected a new folder)")
    sizes = {"--layers": args.layers, "--experts": args.experts, "--top-k": args.top_k, "--hidden": args.hidden,
             "--width": args.width, "--heads": args.heads, "--kv-heads": args.kv_heads, "--vocab": args.vocab}
    bad = [f"{name} {value}" for name, value in sizes.items() if value < 1]
    if bad or args.top_k > args.experts or args.hidden % args.heads or args.heads % args.kv_heads:
        parser.error(f"{', '.join(bad) or 'sizes'}: expected positive sizes, --top-k <= --experts, --hidden a multiple "
                     f"of --heads and --heads of --kv-heads")

    import torch
    import transformers

    config = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden, moe_intermediate_size=args.width,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
        head_dim=args.hidden // args.heads, num_experts=args.experts, num_experts_per_tok=args.top_k, norm_topk_prob=True,
        max_position_embeddings=4096)
    torch.manual_seed(args.seed)
    model = transformers.Qwen3MoeForCausalLM(config).float()
    model.save_pretrained(args.out)
    total = sum(p.numel() for p in model.parameters()) * 4
    print(f"wrote {args.out}: {total / 1e9:.2f} GB float32, {args.layers} layers x {args.experts} experts "
          f"({3 * args.hidden * args.width * 4 / 1e6:.2f} MB each), top-{args.top_k}")


if __name__ == "__main__":
    main()
