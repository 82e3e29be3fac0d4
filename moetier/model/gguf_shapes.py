"""The tensors llama.cpp's loader creates for a GGUF, each with the shape (ggml order) its metadata implies.

`required_tensors(spec, keys, present)` yields, for every tensor the engine
reads, its GGUF name and its dims ne0 first, each with the metadata it comes
from (`keys`: ModelSpec field -> GGUF key, moetier.model.gguf_spec.spec_keys),
as load_arch_tensors in src/models/{qwen3moe,glm4-moe,llama,qwen3next,glm5-next}.cpp
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
    if s.arch == "glm5_next":
        yield from _glm5_next(s, k)
        return
    D, V, d = (s.hidden_size, k["hidden_size"]), (s.vocab_size, k["vocab_size"]), (s.head_dim, k["head_dim"])
    # a gated attention's q rows: per head, the query then its gate (Qwen3-Next)
    q_rows = s.num_heads * s.head_dim * (2 if s.attention_gate else 1)
    q = (q_rows, f"{'2 x ' if s.attention_gate else ''}{k['num_heads']} x {k['head_dim']}")
    o = (s.num_heads * s.head_dim, f"{k['num_heads']} x {k['head_dim']}")
    kv = (s.num_kv_heads * s.head_dim, f"{k['num_kv_heads']} x {k['head_dim']}")
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
        yield from _experts(s, k, b)
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


def _experts(s: ModelSpec, k: Mapping[str, str], b: str) -> Iterator[tuple[str, tuple[Dim, ...]]]:
    D, E, inter = (s.hidden_size, k["hidden_size"]), (s.num_experts, k["num_experts"]), (s.moe_intermediate_size, k["moe_intermediate_size"])
    yield b + "ffn_gate_inp.weight", (D, E)
    yield b + "ffn_gate_exps.weight", (D, inter, E)
    yield b + "ffn_up_exps.weight", (D, inter, E)
    yield b + "ffn_down_exps.weight", (inter, D, E)
    if s.router == "sigmoid":
        yield b + "exp_probs_b.bias", (E,)


def _glm5_next(s: ModelSpec, k: Mapping[str, str]) -> Iterator[tuple[str, tuple[Dim, ...]]]:
    """GLM-5.3-Flash's tensors as llama_model_glm5_next::load_arch_tensors creates them (a conv's {K, 1, C, 1} is
    {K, 1, C} to the loader, which takes both; k_b is per head {dn, r}: kv_b's key rows transposed)."""
    D, V, H = (s.hidden_size, k["hidden_size"]), (s.vocab_size, k["vocab_size"]), (s.num_heads, k["num_heads"])
    n, g, mla, index = s.hyper.streams, s.linear_attention, s.latent_attention, s.indexer
    hc, mix = (n * s.hidden_size, f"{k['streams']} x {k['hidden_size']}"), ((2 + n) * n, f"(2 + {k['streams']}) x {k['streams']}")
    yield "token_embd.weight", (D, V)
    yield "output_norm.weight", (D,)
    yield "output.weight", (D, V)  # required: glm5-next has no tied embeddings
    for layer in range(s.num_layers):
        b = f"blk.{layer}."
        yield b + "attn_norm.weight", (D,)
        yield b + "ffn_norm.weight", (D,)
        for block in ("attn", "ffn"):
            yield f"{b}hc_{block}_fn.weight", (hc, mix)
            yield f"{b}hc_{block}_base.weight", (mix,)
            yield f"{b}hc_{block}_scale.weight", ((3, "pre, post, comb"),)
        if s.is_linear(layer):
            d, width = (g.key_dim, k["key_dim"]), (g.value_width, f"{k['num_heads']} x {k['key_dim']}")
            for name in "qkv":
                yield f"{b}ssm_conv1d_{name}.weight", ((g.conv_kernel, k["conv_kernel"]), (1, "1"), width)
                yield f"{b}attn_{name}.weight", (D, width)
            yield from ((b + name, dims) for name, dims in (
                ("ssm_f_a.weight", (D, d)), ("ssm_f_b.weight", (d, width)), ("ssm_beta.weight", (D, H)), ("ssm_a", (H,)),
                ("ssm_dt.bias", (width,)), ("ssm_g_a.weight", (D, d)), ("ssm_g_b.weight", (d, width)), ("ssm_norm.weight", (d,)),
                ("attn_output.weight", (width, D))))
        else:
            q, kv = (mla.q_rank, k["q_rank"]), (mla.kv_rank, k["kv_rank"])
            dn, dv = (mla.key_dim, k["head_dim"]), (mla.value_dim, k["value_dim_mla"])
            yield from ((b + name, dims) for name, dims in (
                ("attn_q_a_norm.weight", (q,)), ("attn_kv_a_norm.weight", (kv,)), ("attn_q_a.weight", (D, q)),
                ("attn_q_b.weight", (q, (s.num_heads * mla.key_dim, f"{k['num_heads']} x {k['head_dim']}"))),
                ("attn_kv_a_mqa.weight", (D, kv)), ("attn_k_b.weight", (dn, kv, H)), ("attn_v_b.weight", (kv, dv, H)),
                ("attn_output.weight", ((s.num_heads * mla.value_dim, f"{k['num_heads']} x {k['value_dim_mla']}"), D))))
            if layer not in index.shared_layers:
                di, hi = (index.head_dim, k["index_head_dim"]), (index.heads, k["heads"])
                yield from ((b + name, dims) for name, dims in (
                    ("indexer.k_norm.weight", (di,)), ("indexer.k_norm.bias", (di,)), ("indexer.proj.weight", (D, hi)),
                    ("indexer.attn_k.weight", (D, di)), ("indexer.attn_q_b.weight", (q, (index.heads * index.head_dim, f"{k['heads']} x {k['index_head_dim']}"))),
                    ("indexer_compressor_gate.weight", (D, di)), ("indexer_compressor_ape.weight", (di, (index.pool, k["pool"])))))
        if not s.is_moe(layer):
            F = (s.dense_intermediate_size, k["dense_intermediate_size"])
            yield from ((b + name, dims) for name, dims in (("ffn_gate.weight", (D, F)), ("ffn_down.weight", (F, D)), ("ffn_up.weight", (D, F))))
            continue
        yield from _experts(s, k, b)
        shared = (s.moe_intermediate_size * s.n_shared_experts, f"{k['moe_intermediate_size']} x {k['n_shared_experts']}")
        yield from ((b + name, dims) for name, dims in (("ffn_gate_shexp.weight", (D, shared)), ("ffn_down_shexp.weight", (shared, D)),
                                                         ("ffn_up_shexp.weight", (D, shared))))
