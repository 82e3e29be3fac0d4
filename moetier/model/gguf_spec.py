"""GGUF metadata -> ModelSpec, and GGUF tensor names <-> HF tensor names, as llama.cpp defines them.

llama.cpp is the reference for what a GGUF means: its converter
(convert_hf_to_gguf.py, conversion/{qwen,glm,llama}.py) writes the keys and
names, its loader (src/llama-model.cpp, src/models/{qwen3moe,glm4-moe,llama,
qwen3next}.cpp) reads them, with defaults where a key is optional.
`spec_from_gguf` reads the keys the way that loader does (same defaults, same
fixed behaviours: qwen3moe, qwen3next and llama always renormalise the top-k
weights; qwen3next runs every layer as MoE) and ends in `ModelSpec.validate`,
naming the file and the GGUF key on every refusal; what llama.cpp computes
differently from transformers (qwen3next's L2 norm epsilon) is refused. Floats
are stored as float32; each is read back as the shortest decimal that rounds to
it, which is the config's own value for every config that writes a short one
(1e-6, 1e6, 2.5). The name tables here are the one place that knows both
spellings; the writer and the reader both use them. No torch, no gguf import.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from moetier.model.spec import MAX_LAYERS, LinearAttention, ModelSpec, SpecError

# GGUF general.architecture -> moetier arch; llama is read only with experts (Mixtral)
ARCHITECTURES = {"qwen3moe": "qwen3_moe", "glm4moe": "glm4_moe", "llama": "mixtral", "qwen3next": "qwen3_next"}
GGUF_ARCHITECTURES = {arch: name for name, arch in ARCHITECTURES.items()}

GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
# stacked routed experts [E, rows, cols] in GGUF, by part of the SwiGLU block
EXPERT_STACKS = {"gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"}
# qwen3next tensors the converter computes from HF ones beyond a reader's undoing (rows regrouped across two
# tensors; A_log -> -exp(A_log)): HF inner name -> the GGUF inner names made from it; the reader keeps these by GGUF name
CONVERTED = {"linear_attn.in_proj_qkvz.weight": ("attn_qkv.weight", "attn_gate.weight"), "linear_attn.A_log": ("ssm_a",)}
# transformers' l2norm epsilon for DeltaNet's q and k (moetier.engine.deltanet); llama.cpp's qwen3next uses the RMS one
L2_NORM_EPS = 1e-6
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
    vocab = keys.get("vocab_size", int, default=token_count)
    if vocab is None:
        raise SpecError(f"{source}: no vocabulary size (expected key {keys.key('vocab_size')!r} or 'tokenizer.ggml.tokens')")
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


def _refuse_rope_extras(keys: _Keys) -> None:
    """RoPE scaling moetier does not compute (YaRN, LongRoPE, a linear factor other than 1) is refused, never ignored."""
    kind = keys.get("rope.scaling.type", str, default="none")
    factor = keys.get("rope.scaling.factor", float, default=0.0)
    if kind not in ("none", "linear") or factor not in (0.0, 1.0):
        raise SpecError(f"{keys.source}: keys {keys.key('rope.scaling.type')!r} = {kind!r}, {keys.key('rope.scaling.factor')!r} = "
                        f"{factor}: RoPE scaling is not supported yet (expected none)")
