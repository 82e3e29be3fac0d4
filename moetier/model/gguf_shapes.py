"""The tensors llama.cpp's loader creates for a GGUF, each with the shape (ggml order) its metadata implies.

`required_tensors(spec, keys, present)` yields, for every tensor the engine
reads, its GGUF name and its dims ne0 first, each with the metadata it comes
from (`keys`: ModelSpec field -> GGUF key, moetier.model.gguf_spec.spec_keys),
as load_arch_tensors in src/models/{qwen3moe,glm4-moe,llama,qwen3next}.cpp
creates them. `present` (the file's tensor names) picks between the layouts
a loader accepts for the same weights: a qwen3next linear-attention layer's
attn_qkv + attn_gate (today's converter) or the fused ssm_in of older files.
GgufCheckpoint compares the file with this list, in order; the first tensor
missing or misshapen is its one error. No torch, no gguf import.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from moetier.model.spec import ModelSpec

Dim = tuple[int, str]  # (size, the metadata it comes from)


def required_tensors(s: ModelSpec, k: Mapping[str, str], present: set[str]) -> Iterator[tuple[str, tuple[Dim, ...]]]:
    D, V, d, E = (s.hidden_size, k["hidden_size"]), (s.vocab_size, k["vocab_size"]), (s.head_dim, k["head_dim"]), (s.num_experts, k["num_experts"])
    # a gated attention's q rows: per head, the query then its gate (Qwen3-Next)
    q_rows = s.num_heads * s.head_dim * (2 if s.attention_gate else 1)
    q = (q_rows, f"{'2 x ' if s.attention_gate else ''}{k['num_heads']} x {k['head_dim']}")
    o = (s.num_heads * s.head_dim, f"{k['num_heads']} x {k['head_dim']}")
    kv = (s.num_kv_heads * s.head_dim, f"{k['num_kv_heads']} x {k['head_dim']}")
    inter = (s.moe_intermediate_size, k["moe_intermediate_size"])
    yield "token_embd.weight", (D, V)
    yield "output_norm.weight", (D,)
    if not s.tie_word_embeddings:
        yield "output.weight", (D, V)
    post_norm = "post_attention_norm" if s.arch in ("glm4_moe", "qwen3_next") else "ffn_norm"
    for layer in range(s.num_layers):
        b = f"blk.{layer}."
        yield b + "attn_norm.weight", (D,)
        if s.is_linear(layer):
            yield from _deltanet(s, k, b, present)
        else:
            for name, rows in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                yield f"{b}{name}.weight", (D, rows)
                if s.attention_bias:
                    yield f"{b}{name}.bias", (rows,)
            yield b + "attn_output.weight", (o, D)
            if s.output_bias:
                yield b + "attn_output.bias", (D,)
            if s.qk_norm:
                yield b + "attn_q_norm.weight", (d,)
                yield b + "attn_k_norm.weight", (d,)
        yield f"{b}{post_norm}.weight", (D,)
        if not s.is_moe(layer):
            F = (s.dense_intermediate_size, k["dense_intermediate_size"])
            yield b + "ffn_gate.weight", (D, F)
            yield b + "ffn_up.weight", (D, F)
            yield b + "ffn_down.weight", (F, D)
            continue
        yield b + "ffn_gate_inp.weight", (D, E)
        yield b + "ffn_gate_exps.weight", (D, inter, E)
        yield b + "ffn_up_exps.weight", (D, inter, E)
        yield b + "ffn_down_exps.weight", (inter, D, E)
        if s.router == "sigmoid":
            yield b + "exp_probs_b.bias", (E,)
        if s.shared_expert_gate:  # Qwen3-Next: one shared expert of its own width, its gate a row (stored {D, 1})
            shared = (s.shared_width, k["shared_intermediate_size"])
            yield b + "ffn_gate_inp_shexp.weight", (D,)
        elif s.n_shared_experts:
            shared = (s.moe_intermediate_size * s.n_shared_experts, f"{k['moe_intermediate_size']} x {k['n_shared_experts']}")
        else:
            continue
        yield b + "ffn_gate_shexp.weight", (D, shared)
        yield b + "ffn_up_shexp.weight", (D, shared)
        yield b + "ffn_down_shexp.weight", (shared, D)


def _deltanet(s: ModelSpec, k: Mapping[str, str], b: str, present: set[str]) -> Iterator[tuple[str, tuple[Dim, ...]]]:
    """A Gated DeltaNet layer's tensors as llama_model_qwen3next::load_arch_tensors creates them."""
    g, D = s.linear_attention, (s.hidden_size, k["hidden_size"])
    keys = f"{k['key_heads']} x {k['key_dim']}"
    channels = (g.conv_channels, f"2 x {keys} + {k['value_width']}")
    width = (g.value_width, k["value_width"])
    heads = (g.value_heads, k["value_heads"])
    if b + "ssm_in.weight" in present:  # older converters: q, k, v, z per key head, as HF's in_proj_qkvz
        yield b + "ssm_in.weight", (D, (g.conv_channels + g.value_width, f"2 x {keys} + 2 x {k['value_width']}"))
    else:
        yield b + "attn_qkv.weight", (D, channels)
        yield b + "attn_gate.weight", (D, width)
    yield b + "ssm_conv1d.weight", ((g.conv_kernel, k["conv_kernel"]), channels)
    yield b + "ssm_dt.bias", (heads,)
    yield b + "ssm_a", (heads,)
    yield b + "ssm_ba.weight", (D, (2 * g.value_heads, f"2 x {k['value_heads']}"))
    yield b + "ssm_norm.weight", ((g.value_dim, k["value_dim"]),)
    yield b + "ssm_out.weight", (width, D)
