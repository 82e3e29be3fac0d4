"""Commands on one model: `run`, `score`, `info`, `synth`.

`run` generates and reports prefill and decode speed (over a layout's tiers
with --layout, reported by moetier.cli.layout); `score` writes teacher-forced
logits; `info` reads a checkpoint's headers; `synth` writes a synthetic
checkpoint with realistic routing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import numpy as np
import typer
from rich.table import Table

from moetier.cli.common import (UsageError, console, default_prompt, errors_to_exit, expert_formats, layout_model, load_ids,
                                model_given, open_engine, parse_list, status)


@errors_to_exit
def run(
    model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file; default: the built-in synthetic model"),
    max_new_tokens: int = typer.Option(32, help="tokens to generate"),
    prompt: Optional[str] = typer.Option(None, help="prompt text, tokenized by the model's tokenizer (BOS where it asks); "
                                                    "the completion streams as text"),
    prompt_ids: Optional[str] = typer.Option(None, help="prompt token ids, e.g. 1,2,3"),
    ignore_eos: bool = typer.Option(False, help="run past the model's end-of-generation tokens"),
    seed: Optional[int] = typer.Option(None, help="sample with this seed (greedy when omitted and temperature is 0)"),
    temperature: float = typer.Option(0.0, help="0 = greedy"),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(0),
    presence_penalty: float = typer.Option(0.0, help="OpenAI's: off the logit of each token generated so far (-2..2)"),
    frequency_penalty: float = typer.Option(0.0, help="OpenAI's: times each token's count so far (-2..2)"),
    backend: str = typer.Option("torch", help="expert backend: torch, numpy, cupy, or an entry point"),
    device: str = typer.Option("cpu", help="cpu, cuda, cuda:N"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    layout: Optional[Path] = typer.Option(None, help="cluster.toml: run over its tiers and report where time goes"),
    trace: Optional[Path] = typer.Option(None, help="with --layout: write the decode routing trace (.npz)"),
    bias: Optional[Path] = typer.Option(None, help="router bias table (.safetensors, from `moetier bias`)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (needs --layout with a vram tier)"),
    bias_mode: Optional[str] = typer.Option(None, help="selection | damped (weights from the biased scores too)"),
    defer_into_linear: Optional[bool] = typer.Option(
        None, "--defer-into-linear/--no-defer-into-linear",
        help="with --layout: DEFER_CPU defers into linear-attention layers too (the seed's; lossy in their state); "
             "default: the layout's [scheduler].defer_into_linear"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
):
    """Generate tokens and report prefill and decode speed (as text, streamed, where the model has a tokenizer)."""
    from moetier.engine import Sampling, generate
    from moetier.engine.router_bias import apply_router_options
    from moetier.model.output import check_output
    from moetier.model.tokenizer import TokenizerError, has_tokenizer, load_tokenizer

    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens is {max_new_tokens} (expected >= 1)")
    if prompt is not None and prompt_ids:
        raise UsageError("give --prompt (text) or --prompt-ids (token ids), not both")
    if prompt is not None and not prompt:
        raise UsageError("--prompt is empty (expected some text)")
    if trace is not None and layout is None:
        raise UsageError("--trace needs --layout (the trace records which tier served each expert)")
    if defer_into_linear is not None and layout is None:
        raise UsageError("--defer-into-linear needs --layout (DEFER_CPU defers a layout's CPU-lane partials)")
    if trace is not None:
        check_output(trace, "--trace", [("--model", model), ("--layout", layout), ("--bias", bias)])
    if seed is not None and temperature == 0.0:
        temperature = 1.0  # a seed asks for sampling
    sampling = Sampling(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, presence_penalty=presence_penalty,
                        frequency_penalty=frequency_penalty)  # refuses bad flags before any loading
    engine, runtime = open_engine(model, backend, device, threads, layout, defer_into_linear)
    apply_router_options(engine, bias, affinity, bias_mode)
    tokenizer = None
    if prompt is not None:
        tokenizer = load_tokenizer(engine.checkpoint)
    elif has_tokenizer(engine.checkpoint):
        try:  # ids in: the text and the stop tokens are a bonus, not a reason to fail
            tokenizer = load_tokenizer(engine.checkpoint)
        except TokenizerError as err:
            print(f"moetier: note: no text ({err})", file=sys.stderr)
    if prompt is not None:
        ids = tokenizer.encode(prompt, add_special=True)
    else:
        ids = parse_list(prompt_ids, "--prompt-ids") if prompt_ids else default_prompt(engine)
    stop_ids = tuple(sorted(tokenizer.stop_ids)) if tokenizer is not None and not ignore_eos else ()
    engine.warm_up()
    if runtime is not None:
        from moetier.cli.layout import run_over_layout

        run_over_layout(runtime, ids, max_new_tokens, sampling, trace, as_json, console, tokenizer, stop_ids)
        return
    if tokenizer is not None and not as_json:
        _stream_text(engine, tokenizer, ids, max_new_tokens, sampling, stop_ids)
        return
    result = generate(engine, ids, max_new_tokens, sampling, stop_ids=stop_ids)
    report = {
        "model": str(engine.checkpoint.folder),
        "fingerprint": engine.checkpoint.fingerprint,
        "backend": engine.backend.describe(),
        "decode_path": engine.decode_path(),
        "experts": expert_formats(engine.checkpoint),
        "prompt_ids": result.prompt_ids,
        "generated_ids": result.ids,
        "prefill_tokens": len(result.prompt_ids),
        "prefill_s": result.prefill_s,
        "prefill_tok_per_s": result.prefill_tok_per_s,
        "decode_tokens": len(result.ids) - 1,
        "decode_s": result.decode_s,
        "decode_tok_per_s": result.decode_tok_per_s,
    }
    if tokenizer is not None:
        report |= {"prompt": tokenizer.decode(ids), "text": _completion_text(tokenizer, result.ids, stop_ids),
                   "finish_reason": "stop" if result.ids[-1] in stop_ids else "length"}
    if as_json:
        print(json.dumps(report))
        return
    console.print(f"model {report['model']} ({report['fingerprint']}), experts {report['experts']}, backend {report['backend']}",
                  highlight=False)
    console.print(f"decode    {report['decode_path']}", highlight=False)
    console.print(f"prompt    {result.prompt_ids}", highlight=False)
    console.print(f"generated {result.ids}", highlight=False)
    table = Table("phase", "tokens", "seconds", "tok/s")
    table.add_row("prefill", str(report["prefill_tokens"]), f"{result.prefill_s:.3f}", f"{result.prefill_tok_per_s:.1f}")
    table.add_row("decode", str(report["decode_tokens"]), f"{result.decode_s:.3f}", f"{result.decode_tok_per_s:.1f}")
    console.print(table)


def _completion_text(tokenizer, ids: list[int], stop_ids) -> str:
    """The generated text, a final stop token left out (special tokens are skipped in any case)."""
    return tokenizer.decode(ids[:-1] if ids and ids[-1] in stop_ids else ids, skip_special=True)


def _stream_text(engine, tokenizer, ids: list[int], max_new_tokens: int, sampling, stop_ids) -> None:
    """`run` with a tokenizer: the prompt to stderr, the completion streamed to stdout, the speeds to stderr."""
    from moetier.engine.generate import check_request
    from moetier.serve.textgen import TextParams, generate_text

    check_request(engine, ids, max_new_tokens)  # a refused request prints its one line and nothing else
    sys.stderr.write(tokenizer.decode(ids))  # the prompt as the model reads it (its specials included)
    sys.stderr.flush()

    def write(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    params = TextParams(max_new_tokens, sampling, ignore_eos=not stop_ids)
    try:
        result = generate_text(engine, tokenizer, ids, params, on_text=write)
    except BaseException:
        sys.stderr.write("\n")  # the prompt's line ends, so an error is a line of its own
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    s = result.stats.to_dict()
    status.print(f"[dim]prefill {s['prefill_tokens']} tokens, {s['prefill_tok_per_s']:.1f} tok/s; decode "
                 f"{s['decode_tokens']} tokens, {s['decode_tok_per_s']:.1f} tok/s; {result.finish_reason}; "
                 f"{engine.decode_path()}[/dim]", highlight=False)


@errors_to_exit
def score(
    model: Optional[Path] = typer.Argument(None, help="HF model folder or GGUF file; default: the layout's model, else the "
                                                      "built-in synthetic model"),
    ids: Path = typer.Option(..., help="token ids: a 1-D integer .npy file"),
    out: Path = typer.Option(..., help="where to write float32 logits [T, vocab] (.npy)"),
    backend: str = typer.Option("torch"),
    device: str = typer.Option("cpu"),
    threads: Optional[int] = typer.Option(None),
    layout: Optional[Path] = typer.Option(None, help="cluster.toml: score over its tiers"),
    bias: Optional[Path] = typer.Option(None, help="router bias table (.safetensors, from `moetier bias`)"),
    affinity: Optional[float] = typer.Option(None, help="live-cache affinity lambda (needs --layout with a vram tier)"),
    bias_mode: Optional[str] = typer.Option(None, help="selection | damped"),
    model_option: Optional[Path] = typer.Option(None, "--model", help="MODEL, as an option"),
):
    """Teacher-forced logits for every position of a sequence."""
    from moetier.engine import score as score_ids
    from moetier.engine.router_bias import apply_router_options
    from moetier.model.output import check_output, new_file

    model = model_given(model, model_option)
    check_output(out, "--out", [("--ids", ids), ("MODEL", model), ("layout's model", layout_model(layout)),
                                ("--layout", layout), ("--bias", bias)])
    token_ids = load_ids(ids)
    engine, runtime = open_engine(model, backend, device, threads, layout)
    try:
        apply_router_options(engine, bias, affinity, bias_mode)
        logits = score_ids(engine, token_ids)
    finally:
        if runtime is not None:
            runtime.close()
    with new_file(out, ".npy") as partial:  # whole file or nothing
        np.save(partial, logits)
    console.print(f"wrote logits {list(logits.shape)} float32 to {out}", highlight=False)


@errors_to_exit
def info(
    model: Optional[Path] = typer.Argument(None, help="HF model folder or GGUF file; default: the built-in synthetic model"),
    as_json: bool = typer.Option(False, "--json"),
    model_option: Optional[Path] = typer.Option(None, "--model", help="MODEL, as an option"),
):
    """Layers, experts, router and sizes of a checkpoint (reads headers only).

    Experts are held in their stored formats (expert_formats, bytes_per_expert: the largest layer's); the trunk is
    held in its stored formats too (trunk_bytes), norms and router as float32."""
    from moetier.model import open_checkpoint
    from moetier.model.builtin import builtin_model

    model = model_given(model, model_option) or builtin_model()
    checkpoint = open_checkpoint(model)
    s = checkpoint.spec
    summary = {
        "model": str(model),
        "arch": s.arch,
        "layers": s.num_layers,
        "moe_layers": len(s.moe_layers),
        "experts_per_layer": s.num_experts,
        "top_k": s.top_k,
        "router": s.router,
        "n_group": s.n_group,
        "topk_group": s.topk_group,
        "shared_experts": s.n_shared_experts,
        **({"shared_expert": f"width {s.shared_width}, sigmoid-gated"} if s.shared_expert_gate else {}),
        **(_linear_attention(s) if s.linear_layers else {}),
        "hidden_size": s.hidden_size,
        "moe_intermediate_size": s.moe_intermediate_size,
        "vocab_size": s.vocab_size,
        "expert_formats": expert_formats(checkpoint),
        "bytes_per_expert": checkpoint.expert_nbytes,
        "expert_bytes_total": sum(checkpoint.expert_nbytes_at(layer) for layer in s.moe_layers) * s.num_experts,
        "trunk_bytes": checkpoint.trunk_bytes,
        "total_bytes": checkpoint.total_bytes,
        "fingerprint": checkpoint.fingerprint,
    }
    if as_json:
        print(json.dumps(summary))
        return
    table = Table("field", "value", title=f"{model}")
    for key, value in summary.items():
        table.add_row(key, f"{value:,}" if isinstance(value, int) and "bytes" in key else str(value))
    console.print(table)


def _linear_attention(s) -> dict[str, str]:
    """info's rows for a hybrid model's layers: linear attention (Qwen3-Next's Gated DeltaNet, GLM-5.3's KDA), and
    GLM-5.3's latent attention, its indexer and its hyper-connections."""
    g, mla, index, hyper = s.linear_attention, s.latent_attention, s.indexer, s.hyper
    attention = "latent attention" if mla is not None else "full attention"
    rows = {"linear_attention_layers": f"{len(s.linear_layers)} of {s.num_layers} ({attention}: "
                                       f"{', '.join(map(str, s.attention_layers)) or 'none'})",
            "linear_attention": f"{'KDA' if g.kind == 'kda' else 'Gated DeltaNet'}: {g.key_heads} key heads x {g.key_dim}, "
                                f"{g.value_heads} value heads x {g.value_dim}, conv {g.conv_kernel}; "
                                f"state {g.value_heads * g.key_dim * g.value_dim * 4:,} bytes a layer"}
    if mla is not None:
        rows["latent_attention"] = (f"{s.num_heads} heads x {mla.key_dim} (values {mla.value_dim}), no rotary; q rank "
                                    f"{mla.q_rank}, kv rank {mla.kv_rank} (the cached latent a position)")
    if index is not None:
        shared = f"; layers {', '.join(map(str, index.shared_layers))} reuse the previous one's" if index.shared_layers else ""
        rows["indexer"] = (f"top {index.topk} positions in pools of {index.pool}, {index.heads} heads x {index.head_dim} "
                           f"(a key and its pool gate cached a position){shared}")
    if hyper is not None:
        rows["hyper_connections"] = f"{hyper.streams} residual streams, {hyper.sinkhorn_iters} Sinkhorn iterations"
    return rows


@errors_to_exit
def synth(
    out: Path = typer.Option(..., help="folder to write the checkpoint into (a .gguf file with --format gguf)"),
    arch: str = typer.Option("qwen3_moe", help="qwen3_moe | glm4_moe | mixtral | qwen3_next | glm5_next"),
    preset: str = typer.Option("tiny", help="tiny | small | blocks | medium | wide | deep | seed"),
    seed: int = typer.Option(0),
    fused: bool = typer.Option(False, help="fused expert tensors (experts.gate_up_proj) instead of per-expert names"),
    format: str = typer.Option("hf", "--format", help="hf (safetensors folder) | gguf (the file llama.cpp's converter writes)"),
    gguf_type: str = typer.Option("F32", help="with --format gguf: F32 | F16 | BF16 | Q8_0 (convert_hf_to_gguf.py --outtype)"),
):
    """Write a synthetic HF-format MoE checkpoint with realistic routing (or, with --format gguf, its GGUF)."""
    import tempfile

    from moetier.model.output import check_output
    from moetier.model.synth import ARCHES, PRESETS, write_synthetic

    if arch not in ARCHES:
        raise UsageError(f"--arch {arch!r} is not supported (expected one of {', '.join(ARCHES)})")
    if preset not in PRESETS:
        raise UsageError(f"--preset {preset!r} is unknown (expected one of {', '.join(PRESETS)})")
    if format not in ("hf", "gguf"):
        raise UsageError(f"--format {format!r} is unknown (expected hf or gguf)")
    if format == "hf":
        check_output(out, "--out", kind="new folder")
        folder = write_synthetic(out, arch=arch, preset=preset, seed=seed, fused=fused)
        console.print(f"wrote {arch} {preset} (seed {seed}) to {folder}", highlight=False)
        return
    from moetier.model.gguf_spec import GGUF_ARCHITECTURES
    from moetier.model.gguf_write import OUT_TYPES, write_gguf

    if arch not in GGUF_ARCHITECTURES:
        raise UsageError(f"--format gguf: moetier writes no GGUF for {arch} (expected --arch one of {', '.join(GGUF_ARCHITECTURES)})")
    if gguf_type not in OUT_TYPES:
        raise UsageError(f"--gguf-type {gguf_type!r} is unknown (expected one of {', '.join(OUT_TYPES)})")
    if fused:
        raise UsageError("--fused applies to --format hf (a GGUF stacks every layer's experts either way)")
    check_output(out, "--out", suffixes=(".gguf",))
    with tempfile.TemporaryDirectory(prefix="moetier-synth-") as tmp:  # the HF folder, converted, then removed
        folder = write_synthetic(Path(tmp) / f"{arch}-{preset}", arch=arch, preset=preset, seed=seed)
        paths = write_gguf(folder, out, gguf_type)
    console.print(f"wrote {arch} {preset} (seed {seed}) as {gguf_type} GGUF to {paths[0]}", highlight=False)
