"""GGUF metadata -> ModelSpec, and GGUF tensor names <-> HF tensor names, as llama.cpp defines them.

llama.cpp is the reference for what a GGUF means: its converter
(convert_hf_to_gguf.py, conversion/{qwen,glm,llama}.py) writes the keys and
names, its loader (src/llama-model.cpp, src/models/{qwen3moe,glm4-moe,llama,
qwen3next,glm5-next}.cpp) reads them, with defaults where a key is optional.
`spec_from_gguf` reads the keys the way that loader does (same defaults, same
fixed behaviours: qwen3moe, qwen3next and llama always renormalise the top-k
weights; qwen3next runs every layer as MoE) and ends in `ModelSpec.validate`,
naming the file and the GGUF key on every refusal; what llama.cpp computes
differently from transformers (qwen3next's L2 norm epsilon) or cannot load
(glm5-next with other than 4 hyper-connection streams) is refused. Floats
are stored as float32; each is read back as the shortest decimal that rounds to
it, which is the config's own value for every config that writes a short one
(1e-6, 1e6, 2.5). The name tables here are the one place that knows both
spellings; the writer and the reader both use them. No torch, no gguf import.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from moetier.model.spec import MAX_LAYERS, ModelSpec, SpecError
from moetier.model.spec_hybrid import HyperConnections, LatentAttention, LinearAttention, SparseIndexer

# GGUF general.architecture -> moetier arch; llama is read only with experts (Mixtral)
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "llama": "mixtral", "qwen3next": "qwen3_next",
                 "glm5-next": "glm5_next"}
GGUF_ARCHITECTURES = {arch: name for name, arch in ARCHITECTURES.items()}

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
# stacked routed experts [E, rows, cols] in GGUF, by part of the SwiGLU block
EXPERT_STACKS = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}
# tensors the converter computes from HF ones: arch -> HF inner name -> the GGUF inner names made from it. qwen3next's
# are beyond a reader's undoing (rows regrouped across two tensors; A_log -> -exp(A_log)) and keep their GGUF names;
# glm5-next's are answered by their HF names (kv_b_proj split per head into k_b, transposed, and v_b; ssm_a = -exp(A_log))
CONVERTED = {"qwen3_next": {"linear_attn.in_proj_qkvz.weight": ("attn_qkv.weight", "attn_gate.weight"),
                            "linear_attn.A_log": ("ssm_a",)},
             "glm5_next": {"self_attn.kv_b_proj.weight": ("attn_k_b.weight", "attn_v_b.weight"), "self_attn.A_log": ("ssm_a",)}}
# transformers' l2norm epsilon for DeltaNet's q and k (moetier.engine.deltanet); llama.cpp's qwen3next uses the RMS one
L2_NORM_EPS = 1e-6
# transformers' LayerNorm epsilon of GLM-5.3's indexer keys (moetier.engine.mla); llama.cpp's glm5-next reads it from
# attention.layer_norm_epsilon, which its converter always writes as this
INDEX_NORM_EPS = 1e-6
# the hyper-connection streams llama.cpp's glm5-next runs (its loader asserts hc_mult == 4)
HYPER_STREAMS = 4
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_BLOCK = re.compile(r"blk\.(\d+)\.(.+)")


def moe_prefix(arch: str) -> str:
    return "block_sparse_moe" if arch == "mixtral" else "mlp"


def expert_parts(arch: str) -> dict[str, str]:
    """part -> the HF per-expert projection name (Mixtral's w1/w3/w2)."""
    if arch == "mixtral":
        return {"gate": "w1", "up": "w3", "down": "w2"}
    return {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _layer_names(arch: str) -> dict[str, str]:
    """HF name inside model.layers.N. -> GGUF name inside blk.N. (tensor_mapping.py's entries for the arch)."""
    if arch == "glm5_next":
        return _glm5_next_names()
    names = {"input_layernorm.weight": "attn_norm.weight",
             # GLM-4 MoE and Qwen3-Next keep a separate post-attention norm; the others call it the FFN norm
             "post_attention_layernorm.weight": "post_attention_norm.weight" if arch in ("glm4_moe", "qwen3_next") else "ffn_norm.weight",
             f"{moe_prefix(arch)}.gate.weight": "ffn_gate_inp.weight"}
    for hf, gguf in (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_output")):
        names |= {f"self_attn.{hf}.weight": f"{gguf}.weight", f"self_attn.{hf}.bias": f"{gguf}.bias"}
    if arch != "mixtral":
        names |= {"self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight"}
    if arch == "glm4_moe":
        # the converter renames e_score_correction_bias to e_score_correction.bias (ModelBase.filter_tensors)
        names["mlp.gate.e_score_correction_bias"] = "exp_probs_b.bias"
        for part in ("gate", "up", "down"):
            names[f"mlp.{part}_proj.weight"] = f"ffn_{part}.weight"
            names[f"mlp.shared_experts.{part}_proj.weight"] = f"ffn_{part}_shexp.weight"
        # the NextN/MTP block's own tensors (its attention and MoE use the names above)
        names |= {"eh_proj.weight": "nextn.eh_proj.weight", "enorm.weight": "nextn.enorm.weight",
                  "hnorm.weight": "nextn.hnorm.weight", "embed_tokens.weight": "nextn.embed_tokens.weight",
                  "shared_head.head.weight": "nextn.shared_head_head.weight",
                  "shared_head.norm.weight": "nextn.shared_head_norm.weight"}
    if arch == "qwen3_next":
        for part in ("gate", "up", "down"):
            names[f"mlp.shared_expert.{part}_proj.weight"] = f"ffn_{part}_shexp.weight"
        # the linear-attention layers (Qwen3NextModel.modify_tensors renames dt_bias to dt_proj.bias)
        names |= {"mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight", "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
                  "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.dt_bias": "ssm_dt.bias",
                  "linear_attn.norm.weight": "ssm_norm.weight", "linear_attn.out_proj.weight": "ssm_out.weight"}
    return names


def _glm5_next_names() -> dict[str, str]:
    """GLM-5.3-Flash's names (Glm5NextModel.modify_tensors on tensor_mapping.py): the hyper-connections' and the
    indexer's pooling tensors get a .weight suffix, dt_bias becomes dt_proj.bias, e_score_correction_bias
    e_score_correction.bias (ModelBase.filter_tensors); kv_b_proj and A_log are CONVERTED."""
    names = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "mlp.gate.weight": "ffn_gate_inp.weight", "mlp.gate.e_score_correction_bias": "exp_probs_b.bias"}
    for part in ("gate", "up", "down"):
        names[f"mlp.{part}_proj.weight"] = f"ffn_{part}.weight"
        names[f"mlp.shared_experts.{part}_proj.weight"] = f"ffn_{part}_shexp.weight"
    names |= {f"hc_{block}_{n}": f"hc_{block}_{n}.weight" for block in ("attn", "ffn") for n in ("fn", "base", "scale")}
    # a KDA layer (the tensor_mapping entries of Kimi Linear)
    for n in "qkv":
        names |= {f"self_attn.{n}_proj.weight": f"attn_{n}.weight", f"self_attn.{n}_conv1d.weight": f"ssm_conv1d_{n}.weight"}
    names |= {"self_attn.o_proj.weight": "attn_output.weight", "self_attn.f_a_proj.weight": "ssm_f_a.weight",
              "self_attn.f_b_proj.weight": "ssm_f_b.weight", "self_attn.b_proj.weight": "ssm_beta.weight",
              "self_attn.g_a_proj.weight": "ssm_g_a.weight", "self_attn.g_b_proj.weight": "ssm_g_b.weight",
              "self_attn.dt_bias": "ssm_dt.bias", "self_attn.o_norm.weight": "ssm_norm.weight"}
    # a latent-attention layer (DeepSeek-2's entries) and its indexer (DSA's)
    names |= {"self_attn.q_a_proj.weight": "attn_q_a.weight", "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
              "self_attn.q_b_proj.weight": "attn_q_b.weight", "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
              "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight"}
    names |= {"self_attn.indexer.k_norm.weight": "indexer.k_norm.weight", "self_attn.indexer.k_norm.bias": "indexer.k_norm.bias",
              "self_attn.indexer.weights_proj.weight": "indexer.proj.weight", "self_attn.indexer.wk.weight": "indexer.attn_k.weight",
              "self_attn.indexer.wq_b.weight": "indexer.attn_q_b.weight",
              "self_attn.indexer.index_kpool_compress_gate": "indexer_compressor_gate.weight",
              "self_attn.indexer.index_kpool_compress_ape": "indexer_compressor_ape.weight"}
    return names


_HF_TO_GGUF = {arch: _layer_names(arch) for arch in ARCHITECTURES.values()}
_GGUF_TO_HF = {arch: {g: h for h, g in names.items()} for arch, names in _HF_TO_GGUF.items()}
# the fused in-projection older converters wrote unchanged (llama.cpp's loader still reads it): read, never written
_GGUF_TO_HF["qwen3_next"]["ssm_in.weight"] = "linear_attn.in_proj_qkvz.weight"


def gguf_name(arch: str, hf_name: str) -> str | None:
    """The GGUF name of a non-expert HF tensor name, or None when llama.cpp has none for it."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    match = _LAYER.fullmatch(hf_name)
    inner = _HF_TO_GGUF[arch].get(match.group(2)) if match else None
    return f"blk.{match.group(1)}.{inner}" if inner else None


def hf_name(arch: str, gguf_tensor: str) -> str | None:
    """The HF name of a non-expert GGUF tensor name, or None (expert stacks, tensors moetier does not read)."""
    for hf, gguf in GLOBAL_NAMES.items():
        if gguf == gguf_tensor:
            return hf
    match = _BLOCK.fullmatch(gguf_tensor)
    inner = _GGUF_TO_HF[arch].get(match.group(2)) if match else None
    return f"model.layers.{match.group(1)}.{inner}" if inner else None


def expert_layer(arch: str, hf_name: str) -> int | None:
    """The layer of an HF routed-expert tensor (per-expert or fused layout), else None."""
    match = _LAYER.fullmatch(hf_name)
    if not match:
        return None
    inner = match.group(2)
    experts = f"{moe_prefix(arch)}.experts."
    return int(match.group(1)) if inner.startswith(experts) else None


def expert_hf_name(arch: str, layer: int, expert: int, part: str) -> str:
    return f"model.layers.{layer}.{moe_prefix(arch)}.experts.{expert}.{expert_parts(arch)[part]}.weight"


# -- metadata ---------------------------------------------------------------------


class _Keys:
    """Typed access to GGUF metadata values; every failure names the file and the key."""

    def __init__(self, meta: Mapping[str, Any], source: str, arch: str):
        self.meta, self.source, self.arch = meta, source, arch

    def key(self, name: str) -> str:
        return f"{self.arch}.{name}"

    def get(self, name: str, kind: type, default: Any = ...) -> Any:
        """The value of key ARCH.name as `kind` (one value for a per-layer array that holds one), or default."""
        key = self.key(name)
        if key not in self.meta:
            if default is ...:
                raise SpecError(f"{self.source}: missing key {key!r} (expected {_noun(kind)})")
            return default
        value = self.meta[key]
        if isinstance(value, list) and kind is not list:  # a per-layer array: moetier runs one value for every layer
            if not value or any(v != value[0] for v in value):
                raise SpecError(f"{self.source}: key {key!r} differs between layers ({_short(value)}; expected one value)")
            value = value[0]
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) if kind is float else
              isinstance(value, int) and not isinstance(value, bool) if kind is int else isinstance(value, kind))
        if not ok:
            raise SpecError(f"{self.source}: key {key!r} is {_short(value)} (expected {_noun(kind)})")
        return float(value) if kind is float else value


def _noun(kind: type) -> str:
    return {int: "an integer", float: "a number", bool: "a boolean", str: "a string", list: "an array"}[kind]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def spec_keys(arch: str, meta: Mapping[str, Any]) -> dict[str, str]:
    """ModelSpec field -> the GGUF key it is read from in a file of this GGUF architecture (validate's and the
    shape checks' messages name the key)."""
    names = {"hidden_size": "embedding_length", "num_layers": "block_count", "num_heads": "attention.head_count",
             "num_kv_heads": "attention.head_count_kv", "head_dim": "attention.key_length", "rope_theta": "rope.freq_base",
             "rotary_dim": "rope.dimension_count", "rms_norm_eps": "attention.layer_norm_rms_epsilon",
             "dense_intermediate_size": "feed_forward_length", "num_experts": "expert_count", "top_k": "expert_used_count",
             "moe_intermediate_size": "feed_forward_length" if arch == "llama" else "expert_feed_forward_length",
             "n_group": "expert_group_count", "topk_group": "expert_group_used_count",
             "routed_scaling_factor": "expert_weights_scale", "n_shared_experts": "expert_shared_count",
             "max_position_embeddings": "context_length",
             "moe_layers": "leading_dense_block_count" if arch == "glm4moe" else "block_count",
             # qwen3next: the linear-attention geometry (validate's and gguf_shapes' messages), the shared expert
             "key_heads": "ssm.group_count", "value_heads": "ssm.time_step_rank", "key_dim": "ssm.state_size",
             "value_dim": "ssm.state_size", "conv_kernel": "ssm.conv_kernel", "value_width": "ssm.inner_size",
             "shared_intermediate_size": "expert_shared_feed_forward_length",
             "linear_layers": "attention.recurrent_layers" if f"{arch}.attention.recurrent_layers" in meta else "full_attention_interval"}
    if arch == "glm5-next":  # KDA heads are the attention heads; the latent attention, its indexer, the streams
        names |= {"head_dim": "attention.key_length_mla", "moe_layers": "leading_dense_block_count",
                  "linear_layers": "attention.head_count_kv", "key_heads": "attention.head_count", "value_heads": "attention.head_count",
                  "key_dim": "kda.head_dim", "value_dim": "kda.head_dim", "lower_bound": "kda.gate_lower_bound",
                  "streams": "hyper_connection.count", "eps": "hyper_connection.epsilon",
                  "sinkhorn_iters": "hyper_connection.sinkhorn_iterations", "q_rank": "attention.q_lora_rank",
                  "kv_rank": "attention.kv_lora_rank", "value_dim_mla": "attention.value_length_mla",
                  "topk": "attention.indexer.top_k", "heads": "attention.indexer.head_count",
                  "index_head_dim": "attention.indexer.key_length", "pool": "attention.indexer.kpool",
                  "shared_layers": "attention.indexer.types", "swiglu_limit": "swiglu_clamp_exp"}
    keys = {field: f"{arch}.{key}" for field, key in names.items()}
    keys["vocab_size"] = f"{arch}.vocab_size" if f"{arch}.vocab_size" in meta else "tokenizer.ggml.tokens"
    return keys


def spec_from_gguf(meta: Mapping[str, Any], tensors: Sequence[str], token_count: int | None, source: str) -> ModelSpec:
    """The spec llama.cpp's loader would build from this metadata (see the module docstring); `tensors` are the
    file's tensor names (biases and q/k norms are optional tensors there), `token_count` the length of
    tokenizer.ggml.tokens (llama.cpp's n_vocab where the arch writes no vocab_size)."""
    name = meta.get("general.architecture")
    if not isinstance(name, str):
        raise SpecError(f"{source}: missing key 'general.architecture' (expected a string)")
    if name not in ARCHITECTURES:
        raise SpecError(f"{source}: {name}: not supported yet (general.architecture; moetier reads "
                        f"{', '.join(ARCHITECTURES)} with experts)")
    arch, keys = ARCHITECTURES[name], _Keys(meta, source, name)
    present = set(tensors)
    block_count = keys.get("block_count", int)
    nextn = keys.get("nextn_predict_layers", int, default=0)
    if not 0 <= nextn < block_count <= MAX_LAYERS:
        raise SpecError(f"{source}: keys {keys.key('block_count')!r} = {block_count} and {keys.key('nextn_predict_layers')!r} = "
                        f"{nextn} (expected 0 <= nextn_predict_layers < block_count <= {MAX_LAYERS})")
    num_layers = block_count - nextn  # the NextN/MTP blocks come last; moetier recognises them and does not run them
    if arch == "glm5_next":  # per-layer head_count_kv, latent head sizes: its own reading from here
        return _glm5_next(keys, present, block_count, num_layers, token_count).validate(source, spec_keys(name, meta))
    hidden = keys.get("embedding_length", int)
    heads = keys.get("attention.head_count", int)
    head_dim = keys.get("attention.key_length", int, default=hidden // heads if heads > 0 else 0)
    value_dim = keys.get("attention.value_length", int, default=hidden // heads if heads > 0 else 0)
    if value_dim != head_dim:
        raise SpecError(f"{source}: key {keys.key('attention.value_length')!r} is {value_dim} but the key length is {head_dim} "
                        "(expected equal: moetier runs one head size)")
    rotary = keys.get("rope.dimension_count", int, default=head_dim)
    if arch == "mixtral" and rotary != head_dim:  # llama.cpp refuses it too ("invalid n_rot")
        raise SpecError(f"{source}: key {keys.key('rope.dimension_count')!r} is {rotary} (expected the head size {head_dim})")
    _refuse_rope_extras(keys)
    vocab = _vocabulary(keys, token_count)
    experts = keys.get("expert_count", int, default=0)
    if experts == 0:
        raise SpecError(f"{source}: {name} without experts: not supported (key {keys.key('expert_count')!r}; moetier runs MoE models)")
    top_k = keys.get("expert_used_count", int)
    n_ff = keys.get("feed_forward_length", int, default=0)
    groups = keys.get("expert_group_count", int, default=0) or 1  # 0: no groups, as in llama.cpp
    groups_used = keys.get("expert_group_used_count", int, default=0) or 1
    scale = keys.get("expert_weights_scale", float, default=0.0) or 1.0  # 0 and 1 both mean unscaled in build_moe_ffn

    field_keys = spec_keys(name, meta)
    common = dict(
        arch=arch, vocab_size=vocab, hidden_size=hidden, num_layers=num_layers, num_heads=heads,
        num_kv_heads=keys.get("attention.head_count_kv", int, default=heads), head_dim=head_dim,
        rope_theta=keys.get("rope.freq_base", float, default=10000.0), rotary_dim=rotary,
        rms_norm_eps=keys.get("attention.layer_norm_rms_epsilon", float),
        # llama.cpp runs these without a sliding window whatever the source model had
        sliding_window=None, tie_word_embeddings="output.weight" not in present,
        max_position_embeddings=keys.get("context_length", int), num_experts=experts, top_k=top_k,
        routed_scaling_factor=scale, n_group=groups, topk_group=groups_used,
        attention_bias="blk.0.attn_q.bias" in present,
    )
    if arch == "qwen3_next":
        return _qwen3_next(keys, common, present, block_count, n_ff).validate(source, field_keys)
    if arch == "qwen3_moe":
        ff_exp = keys.get("expert_feed_forward_length", int, default=n_ff // top_k if top_k > 0 else 0)
        spec = ModelSpec(**common, qk_norm=True, output_bias="blk.0.attn_output.bias" in present,
                         dense_intermediate_size=n_ff or ff_exp, moe_intermediate_size=ff_exp, router="softmax",
                         norm_topk_prob=True, n_shared_experts=0, moe_layers=tuple(range(num_layers)))
    elif arch == "glm4_moe":
        gating = keys.get("expert_gating_func", int, default=0)
        if gating not in (0, 2):  # 0: unset, which llama.cpp reads as sigmoid
            raise SpecError(f"{source}: key {keys.key('expert_gating_func')!r} is {gating} (expected 2, sigmoid: "
                            "moetier runs GLM-4 MoE's sigmoid router only)")
        if any(keys.get("rope.dimension_sections", list, default=[])):
            raise SpecError(f"{source}: key {keys.key('rope.dimension_sections')!r}: M-RoPE (vision GLM) is not supported yet")
        dense = keys.get("leading_dense_block_count", int, default=0)
        ff_exp = keys.get("expert_feed_forward_length", int, default=n_ff // top_k if top_k > 0 else 0)
        spec = ModelSpec(**common, qk_norm="blk.0.attn_q_norm.weight" in present, output_bias=False,
                         dense_intermediate_size=n_ff, moe_intermediate_size=ff_exp, router="sigmoid",
                         norm_topk_prob=keys.get("expert_weights_norm", bool, default=False),
                         n_shared_experts=keys.get("expert_shared_count", int),
                         moe_layers=tuple(range(max(dense, 0), num_layers)))
    else:
        for tensor in ("blk.0.attn_q.bias", "blk.0.attn_output.bias"):
            if tensor in present:
                raise SpecError(f"{source}: tensor {tensor!r}: attention biases in a llama GGUF are not supported yet")
        if keys.get("expert_shared_feed_forward_length", int, default=0):
            raise SpecError(f"{source}: key {keys.key('expert_shared_feed_forward_length')!r}: shared experts in a llama "
                            "GGUF (Granite MoE) are not supported yet")
        spec = ModelSpec(**common, qk_norm=False, output_bias=False, dense_intermediate_size=n_ff,
                         moe_intermediate_size=n_ff, router="softmax", norm_topk_prob=True, n_shared_experts=0,
                         moe_layers=tuple(range(num_layers)))
    return spec.validate(source, field_keys)


def _qwen3_next(keys: _Keys, common: dict[str, Any], present: set[str], block_count: int, n_ff: int) -> ModelSpec:
    """Qwen3-Next as src/models/qwen3next.cpp loads it: the recurrent (Gated DeltaNet) layers from the
    recurrent_layers array, else every layer but each full_attention_interval-th; DeltaNet key and value heads both
    of ssm.state_size dims (the loader sizes both by it); every layer MoE with a gated shared expert of
    expert_shared_feed_forward_length (feed_forward_length when 0), top-k renormalised; gated attention with q/k
    norms and no output bias."""
    source, num_layers, top_k = keys.source, common["num_layers"], common["top_k"]
    flags = keys.get("attention.recurrent_layers", list, default=None)
    if flags is None:
        interval = keys.get("full_attention_interval", int, default=4)
        if interval < 1:
            raise SpecError(f"{source}: key {keys.key('full_attention_interval')!r} is {interval} (expected an integer >= 1)")
        linear = tuple(l for l in range(num_layers) if (l + 1) % interval)
    elif len(flags) != block_count or not all(isinstance(f, bool) for f in flags):
        raise SpecError(f"{source}: key {keys.key('attention.recurrent_layers')!r} is {_short(flags)} (expected "
                        f"{block_count} booleans, one per block)")
    else:
        linear = tuple(l for l in range(num_layers) if flags[l])
    state, value_heads = keys.get("ssm.state_size", int), keys.get("ssm.time_step_rank", int)
    inner = keys.get("ssm.inner_size", int)
    if value_heads < 1 or inner != value_heads * state:
        raise SpecError(f"{source}: key {keys.key('ssm.inner_size')!r} is {inner}, not {keys.key('ssm.time_step_rank')!r} = "
                        f"{value_heads} x {keys.key('ssm.state_size')!r} = {state} (expected equal: llama.cpp's qwen3next "
                        "sizes DeltaNet's key and value heads both by ssm.state_size)")
    if linear and common["rms_norm_eps"] != L2_NORM_EPS:
        raise SpecError(f"{source}: key {keys.key('attention.layer_norm_rms_epsilon')!r} is {common['rms_norm_eps']}: llama.cpp's "
                        f"qwen3next L2-normalises DeltaNet's q and k with it, transformers with {L2_NORM_EPS} (expected {L2_NORM_EPS})")
    ff_exp = keys.get("expert_feed_forward_length", int, default=n_ff // top_k if top_k > 0 else 0)
    attention = [l for l in range(num_layers) if l not in linear]
    return ModelSpec(
        **(common | {"attention_bias": bool(attention) and f"blk.{attention[0]}.attn_q.bias" in present}),
        qk_norm=True, output_bias=False, dense_intermediate_size=n_ff or ff_exp, moe_intermediate_size=ff_exp, router="softmax",
        norm_topk_prob=True, n_shared_experts=1, moe_layers=tuple(range(num_layers)), linear_layers=linear,
        linear_attention=LinearAttention(key_heads=keys.get("ssm.group_count", int), value_heads=value_heads,
                                         key_dim=state, value_dim=state, conv_kernel=keys.get("ssm.conv_kernel", int)),
        attention_gate=True, shared_intermediate_size=keys.get("expert_shared_feed_forward_length", int, default=0) or n_ff,
        shared_expert_gate=True)


def _glm5_next(keys: _Keys, present: set[str], block_count: int, num_layers: int, token_count: int | None) -> ModelSpec:
    """GLM-5.3-Flash as src/models/glm5-next.cpp loads it: a block is KDA where its head_count_kv is 0, else NoPE
    latent attention (key_length is the cached latent, key_length_mla / value_length_mla a head's dims) with the
    k-pool indexer where indexer.types says full (all, without the array); KDA's heads are the attention heads, its
    forget gate bounded by kda.gate_lower_bound (softplus without it); 4 hyper-connection streams (the loader asserts
    it), the incomplete pool always attended (without it llama.cpp's first positions are NaN: refused); the first
    leading_dense_block_count layers dense, the rest MoE with shared experts of the expert width, a
    sigmoid router (gating func unset reads as sigmoid); one SwiGLU clamp for experts, shared experts and dense
    MLPs (swiglu_clamp_shexp, which defaults to swiglu_clamp_exp, clamps every build_ffn; a limit <= 1e-6 is none);
    output.weight always (the loader requires it: no tied embeddings)."""
    source, name = keys.source, "glm5-next"

    def refuse(key: str, value: Any, expected: str) -> NoReturn:
        raise SpecError(f"{source}: key {keys.key(key)!r} is {_short(value)} (expected {expected})")

    per_block = keys.meta.get(keys.key("attention.head_count_kv"))
    per_block = [per_block] * block_count if isinstance(per_block, int) and not isinstance(per_block, bool) else per_block
    if not (isinstance(per_block, list) and len(per_block) == block_count
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in per_block)):
        refuse("attention.head_count_kv", per_block, f"{block_count} counts, one per block: 0 for KDA, 1 for latent attention")
    heads, kv_rank = keys.get("attention.head_count", int), keys.get("attention.kv_lora_rank", int)
    rope = keys.get("rope.dimension_count", int, default=keys.get("attention.key_length", int, default=0))
    if rope != 0:
        refuse("rope.dimension_count", rope, "0: glm5-next's latent attention is NoPE")
    for key in ("attention.key_length", "attention.value_length"):
        if keys.get(key, int) != kv_rank:
            refuse(key, keys.get(key, int), f"{keys.key('attention.kv_lora_rank')!r} = {kv_rank}: the cache holds the latent")
    if keys.get("attention.layer_norm_epsilon", float) != INDEX_NORM_EPS:
        refuse("attention.layer_norm_epsilon", keys.get("attention.layer_norm_epsilon", float),
               f"{INDEX_NORM_EPS}: transformers' indexer LayerNorm, which llama.cpp computes with this key")
    streams = keys.get("hyper_connection.count", int)
    if streams != HYPER_STREAMS:
        refuse("hyper_connection.count", streams, f"{HYPER_STREAMS}: llama.cpp's glm5-next asserts it")
    pool, top_k = keys.get("attention.indexer.kpool", int), keys.get("attention.indexer.top_k", int)
    if pool < 2:
        refuse("attention.indexer.kpool", pool, "an integer >= 2: llama.cpp's glm5-next asserts kpool > 1")
    tail = keys.get("attention.indexer.kpool_select_tail", bool, default=True)
    if not tail:
        refuse("attention.indexer.kpool_select_tail", tail, "true: without the incomplete pool llama.cpp's first positions attend "
               "to nothing and are NaN (transformers: zeros)")
    gating = keys.get("expert_gating_func", int, default=0)
    if gating not in (0, 2):
        refuse("expert_gating_func", gating, "2, sigmoid (0, unset, reads as sigmoid)")
    clamps = [keys.get(key, float, default=0.0) for key in ("swiglu_clamp_exp", "swiglu_clamp_shexp")]
    if keys.key("swiglu_clamp_shexp") not in keys.meta:
        clamps[1] = clamps[0]
    if clamps[0] != clamps[1]:
        refuse("swiglu_clamp_shexp", clamps[1], f"{keys.key('swiglu_clamp_exp')!r} = {clamps[0]}: moetier clamps every SwiGLU alike")
    lower = keys.get("kda.gate_lower_bound", float, default=-math.inf)
    full = keys.get("attention.indexer.types", list, default=[True] * num_layers)
    if len(full) < num_layers or not all(isinstance(f, bool) for f in full):
        refuse("attention.indexer.types", full, f"{num_layers} booleans, one per layer (true: the layer runs its indexer)")
    linear = tuple(l for l in range(num_layers) if per_block[l] == 0)
    dense = keys.get("leading_dense_block_count", int, default=0)
    experts, top = keys.get("expert_count", int, default=0), keys.get("expert_used_count", int)
    if experts == 0:
        raise SpecError(f"{source}: {name} without experts: not supported (key {keys.key('expert_count')!r})")
    kda_dim = keys.get("kda.head_dim", int)
    return ModelSpec(
        arch="glm5_next", vocab_size=_vocabulary(keys, token_count), hidden_size=keys.get("embedding_length", int),
        num_layers=num_layers, num_heads=heads, num_kv_heads=heads, head_dim=keys.get("attention.key_length_mla", int),
        rope_theta=keys.get("rope.freq_base", float, default=10000.0), rotary_dim=0,
        rms_norm_eps=keys.get("attention.layer_norm_rms_epsilon", float), qk_norm=False, attention_bias=False, output_bias=False,
        sliding_window=None, tie_word_embeddings=False, max_position_embeddings=keys.get("context_length", int),
        dense_intermediate_size=keys.get("feed_forward_length", int, default=0) or keys.get("expert_feed_forward_length", int),
        num_experts=experts, top_k=top, moe_intermediate_size=keys.get("expert_feed_forward_length", int),
        router="sigmoid", norm_topk_prob=keys.get("expert_weights_norm", bool, default=False),
        routed_scaling_factor=keys.get("expert_weights_scale", float, default=0.0) or 1.0,
        n_group=keys.get("expert_group_count", int, default=0) or 1, topk_group=keys.get("expert_group_used_count", int, default=0) or 1,
        n_shared_experts=keys.get("expert_shared_count", int), moe_layers=tuple(range(max(dense, 0), num_layers)), linear_layers=linear,
        linear_attention=LinearAttention(key_heads=heads, value_heads=heads, key_dim=kda_dim, value_dim=kda_dim,
                                         conv_kernel=keys.get("ssm.conv_kernel", int), kind="kda",
                                         lower_bound=None if lower == -math.inf else lower),
        hyper=HyperConnections(streams=streams, eps=keys.get("hyper_connection.epsilon", float),
                               sinkhorn_iters=keys.get("hyper_connection.sinkhorn_iterations", int)),
        latent_attention=LatentAttention(q_rank=keys.get("attention.q_lora_rank", int), kv_rank=kv_rank,
                                         key_dim=keys.get("attention.key_length_mla", int),
                                         value_dim=keys.get("attention.value_length_mla", int)),
        indexer=SparseIndexer(topk=top_k, heads=keys.get("attention.indexer.head_count", int),
                              head_dim=keys.get("attention.indexer.key_length", int), pool=pool,
                              select_tail=tail,
                              shared_layers=tuple(l for l in range(num_layers) if l not in linear and not full[l])),
        swiglu_limit=clamps[0] if clamps[0] > 1e-6 else None)


def _vocabulary(keys: _Keys, token_count: int | None) -> int:
    vocab = keys.get("vocab_size", int, default=token_count)
    if vocab is None:
        raise SpecError(f"{keys.source}: no vocabulary size (expected key {keys.key('vocab_size')!r} or 'tokenizer.ggml.tokens')")
    return vocab


def _refuse_rope_extras(keys: _Keys) -> None:
    """RoPE scaling moetier does not compute (YaRN, LongRoPE, a linear factor other than 1) is refused, never ignored."""
    kind = keys.get("rope.scaling.type", str, default="none")
    factor = keys.get("rope.scaling.factor", float, default=0.0)
    if kind not in ("none", "linear") or factor not in (0.0, 1.0):
        raise SpecError(f"{keys.source}: keys {keys.key('rope.scaling.type')!r} = {kind!r}, {keys.key('rope.scaling.factor')!r} = "
                        f"{factor}: RoPE scaling is not supported yet (expected none)")
