"""Write a HF MoE checkpoint as the GGUF llama.cpp's own converter writes for it, vocabulary included.

`write_gguf(folder, out, dtype)` writes what `convert_hf_to_gguf.py --outtype
f32|f16|bf16|q8_0` writes for a Qwen3MoeForCausalLM, Glm4MoeForCausalLM,
MixtralForCausalLM, Qwen3NextForCausalLM or Glm5NextForConditionalGeneration
folder (its text model; conversion/{qwen,glm,llama}.py
on conversion/base.py; Qwen3-Next as with --no-mtp, a checkpoint with MTP
tensors is refused): the same architecture name, metadata keys in the same
order and types (TextModel.set_gguf_parameters, then each class's own), tensor
names (gguf's TensorNameMap, spelled out in moetier.model.gguf_spec), value
transforms (routed experts stacked [E, ...]; Mixtral's Q/K rows permuted for
llama.cpp's interleaved RoPE; Qwen3-Next's norms + 1, A_log -> -exp(A_log),
in_proj_qkvz's rows regrouped into attn_qkv and attn_gate, conv taps squeezed;
GLM-5.3's kv_b_proj split per head into k_b, transposed, and v_b, A_log ->
-exp(A_log), conv taps as {K, 1, C, 1})
and tensor types (1-D tensors, norms, routers and conv taps in F32, and GLM-5.3's
hyper-connections, indexer pooling and weights, dt bias; a Q8_0
tensor whose rows are not whole blocks falls back to F16, as there); for
Qwen3-Next and GLM-5.3, measured against the converter, the same bytes but for
the vocabulary (docs/gguf-qwen3next.md, docs/gguf-glm5-next.md). The
vocabulary is a synthetic folder's own tokenizer.json (moetier.model.synth_tokenizer:
its byte-level BPE, as the converter writes one); a folder without one gets a
stand-in (moetier.model.gguf_write_vocab). A checkpoint llama.cpp would
compute differently from transformers (a sliding window; Qwen3-MoE's and
Qwen3-Next's dense layers, unrenormalised top-k or an o_proj bias; Qwen3-Next's
DeltaNet key and value heads of two sizes, or an rms_norm_eps other than the
L2 norm's 1e-6; GLM-5.3 without the incomplete pool attended, NaN there), or
that llama.cpp would not load (GLM-5.3 with other than 4 hyper-connection
streams, pools of one position, tied embeddings, biases, KDA heads other than
the attention heads, dense layers after a MoE layer; GLM without a shared
expert; a hybrid without a linear or without an attention layer), is refused,
not written.
Tensors stream one at a time; the file, or every file of a split set, appears
whole or not at all (moetier.model.output.new_file).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType as QType
from gguf import LlamaFileType

from moetier.model.checkpoint import Checkpoint, open_checkpoint
from moetier.model.gguf_spec import (CONVERTED, EXPERT_STACKS, GGUF_ARCHITECTURES, HYPER_STREAMS, INDEX_NORM_EPS, L2_NORM_EPS,
                                     expert_layer, gguf_name)
from moetier.model.output import check_output, new_file
from moetier.model.gguf_write_vocab import add_vocabulary
from moetier.model.safetensors_mmap import CheckpointError
from moetier.model.spec import ModelSpec, SpecError

# --outtype -> (general.file_type, the type of the tensors it quantizes)
OUT_TYPES = {"F32": (LlamaFileType.ALL_F32, QType.F32), "F16": (LlamaFileType.MOSTLY_F16, QType.F16),
             "BF16": (LlamaFileType.MOSTLY_BF16, QType.BF16), "Q8_0": (LlamaFileType.MOSTLY_Q8_0, QType.Q8_0)}
# Glm5NextModel.tensor_force_quant: the small mHC / gating tensors kept F32 (and ModelBase's SSM_CONV1D_Q/K/V, INDEXER_PROJ)
EXACT = ("hc_attn_", "hc_ffn_", "indexer_compressor_", "ssm_a", "ssm_dt", "exp_probs_b", "ssm_conv1d_", "indexer.proj.")


@dataclass(frozen=True)
class _Planned:
    name: str
    shape: tuple[int, ...]  # numpy order
    qtype: QType
    values: Callable[[], np.ndarray]  # float32, numpy order


class _StagedWriter(gguf.GGUFWriter):
    """A GGUFWriter that writes its file (or each file of a split set) to the staged path given for it."""

    staged: tuple[Path, ...] = ()

    def format_shard_names(self, path: Path) -> list[Path]:
        return list(self.staged) or super().format_shard_names(path)


def _permute(values: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute (conversion/llama.py): per head, rows [2, pairs...] -> [pairs..., 2]."""
    return values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


def _tensor_type(name: str, ndim: int, row: int, qtype: QType) -> QType:
    """ModelBase.prepare_tensors' choice: 1-D tensors, norms, routers, convolution taps and non-weights (ssm_a,
    biases) in F32; else the out type, F16 where the rows do not split into its blocks (QuantError)."""
    if ndim <= 1 or name.endswith(("_norm.weight", ".ffn_gate_inp.weight", ".ffn_gate_inp_shexp.weight", ".ssm_conv1d.weight")) \
            or not name.endswith(".weight") or any(part in name for part in EXACT):
        return QType.F32
    block, _ = gguf.GGML_QUANT_SIZES[qtype]
    return qtype if row % block == 0 else QType.F16


def _nbytes(shape: tuple[int, ...], qtype: QType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return int(np.prod(shape)) // block * size


def _plan(checkpoint: Checkpoint, arch: str, out_type: QType) -> list[_Planned]:
    """Every GGUF tensor in the converter's order: files by name, tensors by name in each (ModelBase.index_tensors,
    SafetensorsLocal); a layer's expert stacks where its last expert tensor is, merged down, gate, up as
    conversion/{qwen,glm}.py do, w1, w2, w3 as conversion/llama.py does."""
    spec, folder = checkpoint.spec, checkpoint.folder
    blocks = _block_count(checkpoint)
    planned: list[_Planned] = []

    def add(name: str, shape: tuple[int, ...], values: Callable[[], np.ndarray]) -> None:
        planned.append(_Planned(name, shape, _tensor_type(name, len(shape), shape[-1], out_type), values))

    order = sorted(checkpoint.names(), key=lambda n: (checkpoint.entry(n).file.name, n))
    last_expert = {expert_layer(arch, n): n for n in order if expert_layer(arch, n) is not None}  # layer -> its last
    for name in order:
        layer, target = expert_layer(arch, name), gguf_name(arch, name)
        block = re.match(r"model\.layers\.(\d+)\.(.+)", name)
        made = CONVERTED.get(arch, {}).get(block.group(2)) if block else None  # GGUF tensors made from it
        if (layer is None and target is None and made is None) or (block and int(block.group(1)) >= blocks):
            raise CheckpointError(f"{folder}: tensor {name!r} has no GGUF name in {GGUF_ARCHITECTURES[arch]} "
                                  "(llama.cpp's converter refuses it too: 'Can not map tensor')")
        if made is not None:
            index = int(block.group(1))
            for part in made:
                add(f"blk.{index}.{part}", _made_shape(spec, part), lambda index=index, part=part: _made(checkpoint, index, part))
        elif layer is None:
            shape = checkpoint.entry(name).shape
            if arch == "qwen3_next" and name.endswith(".conv1d.weight"):  # squeezed: [C, 1, K] -> [C, K]
                shape = tuple(n for n in shape if n != 1)
            elif arch == "glm5_next" and name.endswith("_conv1d.weight"):  # Glm5NextModel: [C, 1, K] -> [1, C, 1, K]
                shape = (1, shape[0], 1, shape[-1])
            add(target, shape, lambda name=name: _value(checkpoint, name))
        elif name == last_expert[layer]:
            E, D, inter = spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
            for part in ("gate", "down", "up") if arch == "mixtral" else ("down", "gate", "up"):
                shape = (E, D, inter) if part == "down" else (E, inter, D)
                add(f"blk.{layer}.{EXPERT_STACKS[part]}", shape, lambda layer=layer, part=part: _stack(checkpoint, layer, part))
    return planned


def _block_count(checkpoint: Checkpoint) -> int:
    """The layers, plus GLM-4 MoE's NextN/MTP blocks, which its converter keeps after them (Glm4MoeModel)."""
    nextn = checkpoint.config.get("num_nextn_predict_layers") if checkpoint.spec.arch == "glm4_moe" else None
    return checkpoint.spec.num_layers + (nextn or 0)


def _value(checkpoint: Checkpoint, name: str) -> np.ndarray:
    spec = checkpoint.spec
    if spec.arch == "qwen3_next" and name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        return _as_converted(checkpoint, name, lambda w: w + 1)  # Qwen3NextModel.modify_tensors: zero-centred norms + 1
    values = checkpoint.tensor(name).numpy()
    if spec.arch == "glm5_next" and name.endswith("_conv1d.weight"):
        return values.reshape(1, values.shape[0], 1, values.shape[-1])
    if spec.arch == "mixtral" and ".self_attn.q_proj." in name:
        return _permute(values, spec.num_heads)
    if spec.arch == "mixtral" and ".self_attn.k_proj." in name:
        return _permute(values, spec.num_kv_heads)
    return values


def _as_converted(checkpoint: Checkpoint, name: str, change: Callable[[torch.Tensor], torch.Tensor]) -> np.ndarray:
    """change(tensor) computed as the converter computes it: in float16 for a float16 tensor, else in float32
    (ModelBase.prepare_tensors converts every other dtype to float32 first), by torch; float32 values."""
    data, _ = checkpoint.stored(name)
    data = data if data.dtype in (torch.float16, torch.float32) else data.float()
    return change(data).float().numpy()


def _made_shape(spec: ModelSpec, part: str) -> tuple[int, ...]:
    g, mla, heads = spec.linear_attention, spec.latent_attention, spec.num_heads
    if spec.arch == "glm5_next":  # k_b [H, r, dn], v_b [H, dv, r]; ssm_a one per head
        return {"attn_k_b.weight": (heads, mla.kv_rank, mla.key_dim), "attn_v_b.weight": (heads, mla.value_dim, mla.kv_rank),
                "ssm_a": (g.key_heads,)}[part]
    return {"attn_qkv.weight": (g.conv_channels, spec.hidden_size), "attn_gate.weight": (g.value_width, spec.hidden_size),
            "ssm_a": (g.value_heads,)}[part]


def _made(checkpoint: Checkpoint, layer: int, part: str) -> np.ndarray:
    """A tensor Qwen3NextModel.modify_tensors makes: in_proj_qkvz's rows regrouped into attn_qkv (q of every key
    head, k, v) and attn_gate (z) — the HF reader's own regrouping, Checkpoint.deltanet — or -exp(A_log); or one
    Glm5NextModel.modify_tensors makes: kv_b_proj's rows per head split into k_b (transposed) and v_b, or
    -exp(A_log) computed in float32 (it takes .float() first, for a float16 tensor too)."""
    spec, p = checkpoint.spec, f"model.layers.{layer}.self_attn."
    if spec.arch == "glm5_next" and part == "ssm_a":
        return (-torch.exp(checkpoint.tensor(p + "A_log").flatten()[: spec.num_heads])).numpy()
    if spec.arch == "glm5_next":
        mla = spec.latent_attention
        kv_b = checkpoint.tensor(p + "kv_b_proj.weight").numpy().reshape(spec.num_heads, mla.key_dim + mla.value_dim, -1)
        k_b, v_b = np.split(kv_b, [mla.key_dim], axis=1)
        return k_b.transpose(0, 2, 1) if part == "attn_k_b.weight" else v_b
    if part == "ssm_a":
        return _as_converted(checkpoint, f"model.layers.{layer}.linear_attn.A_log", lambda a: -torch.exp(a))
    tensors = checkpoint.deltanet(layer)
    data, _ = tensors.qkv if part == "attn_qkv.weight" else tensors.z
    return data.float().numpy()


def _stack(checkpoint: Checkpoint, layer: int, part: str) -> np.ndarray:
    return np.stack([getattr(checkpoint.expert(layer, e), part).float().numpy() for e in range(checkpoint.spec.num_experts)])


def _check_convertible(checkpoint: Checkpoint) -> None:
    spec, source = checkpoint.spec, checkpoint.folder / "config.json"
    if spec.sliding_window is not None:
        raise SpecError(f"{source}: key 'sliding_window' is {spec.sliding_window}: llama.cpp runs {spec.arch} without one, "
                        "so no GGUF it reads computes this model (expected null)")
    attention = {"qwen3_next": "full_attention", "glm5_next": "indexed_attention"}.get(spec.arch)
    if attention is not None:  # the hybrids: a recurrent state for the linear layers, a KV cache for the others
        for kind, layers in (("linear_attention", spec.linear_layers), (attention, set(range(spec.num_layers)) - set(spec.linear_layers))):
            if not layers:
                raise SpecError(f"{source}: key 'layer_types' has no {kind} layer: llama.cpp's {GGUF_ARCHITECTURES[spec.arch]} "
                                "allocates a cache for each kind of layer and aborts on an empty one (GGML_ASSERT(buffer) in "
                                "ggml-backend.cpp; expected at least one of each)")
    if spec.arch == "glm5_next":
        return _check_glm5_next(checkpoint)
    if spec.arch == "glm4_moe" and spec.n_shared_experts < 1:
        raise SpecError(f"{source}: key 'n_shared_experts' is {spec.n_shared_experts}: llama.cpp's glm4moe does not load the width-0 "
                        "shared expert transformers writes ('wrong number of tensors') and without it computes otherwise "
                        "(expected >= 1)")
    if spec.arch not in ("qwen3_moe", "qwen3_next"):
        return
    name = GGUF_ARCHITECTURES[spec.arch]
    if spec.moe_layers != tuple(range(spec.num_layers)):
        raise SpecError(f"{source}: keys 'mlp_only_layers' / 'decoder_sparse_step' make dense layers {sorted(set(range(spec.num_layers)) - set(spec.moe_layers))}: "
                        f"llama.cpp's {name} runs every layer as MoE (expected none)")
    if not spec.norm_topk_prob:
        raise SpecError(f"{source}: key 'norm_topk_prob' is false: llama.cpp's {name} always renormalises the top-k weights (expected true)")
    if spec.output_bias:
        raise SpecError(f"{source}: key 'attention_bias' is true: llama.cpp's {name} has no o_proj bias (expected false)")
    if spec.arch != "qwen3_next":
        return
    g = spec.linear_attention
    if g is not None and g.key_dim != g.value_dim:
        raise SpecError(f"{source}: keys 'linear_key_head_dim' = {g.key_dim} and 'linear_value_head_dim' = {g.value_dim}: llama.cpp's "
                        "qwen3next sizes both by one key, ssm.state_size (expected equal)")
    if spec.linear_layers and spec.rms_norm_eps != L2_NORM_EPS:
        raise SpecError(f"{source}: key 'rms_norm_eps' is {spec.rms_norm_eps}: llama.cpp's qwen3next L2-normalises DeltaNet's q and k "
                        f"with it, transformers with {L2_NORM_EPS} (expected {L2_NORM_EPS})")
    mtp = next((n for n in checkpoint.names() if n.startswith(("mtp.", "model.mtp."))), None)
    if mtp is not None:
        raise CheckpointError(f"{checkpoint.folder}: tensor {mtp!r}: the MTP block is not written yet (llama.cpp's converter "
                              "keeps it, or drops it with --no-mtp)")


def _check_glm5_next(checkpoint: Checkpoint) -> None:
    """What llama.cpp's glm5-next would not load (its loader's and converter's asserts, tensors it does not create),
    or would compute differently from transformers."""
    spec, source = checkpoint.spec, checkpoint.folder / "config.json"

    def refuse(what: str, expected: str) -> NoReturn:
        raise SpecError(f"{source}: {what}: llama.cpp's glm5-next {expected}")

    if spec.hyper.streams != HYPER_STREAMS:
        refuse(f"key 'hc_mult' is {spec.hyper.streams}", f"runs {HYPER_STREAMS} hyper-connection streams only (expected {HYPER_STREAMS})")
    if spec.indexer.pool < 2:
        refuse(f"key 'index_kpool' is {spec.indexer.pool}", "asserts pools of more than one position (expected >= 2)")
    if not spec.indexer.select_tail:
        refuse("key 'index_kpool_always_select_tail' is false", "attends to nothing before the first pool completes and computes "
               "NaN there, transformers zeros (expected true)")
    if spec.tie_word_embeddings:
        refuse("key 'tie_word_embeddings' is true", "requires output.weight, which the converter drops for a tied model (expected false)")
    if spec.attention_bias:
        refuse("key 'attention_bias' is true", "loads no attention biases (expected false)")
    if spec.linear_attention.key_heads != spec.num_heads:
        refuse(f"keys 'linear_num_heads' = {spec.linear_attention.key_heads} and 'num_attention_heads' = {spec.num_heads}",
               "runs KDA with the attention heads (expected equal)")
    if spec.moe_layers != tuple(range(spec.moe_layers[0], spec.num_layers)):
        refuse(f"key 'mlp_layer_types' makes layers {list(spec.moe_layers)} sparse",
               "runs its leading_dense_block_count first layers dense and the rest MoE (expected dense layers first)")
    if spec.n_group > 1 and spec.topk_group >= spec.n_group:
        refuse(f"keys 'n_group' = {spec.n_group} and 'topk_group' = {spec.topk_group}", "asserts fewer groups kept than there are")
    if spec.n_shared_experts < 1:
        refuse(f"key 'n_shared_experts' is {spec.n_shared_experts}", "loads a shared expert in every MoE layer and aborts on "
               "transformers' width-0 one (GGML_ASSERT in ggml.c; expected >= 1)")
    if spec.swiglu_limit is not None and spec.swiglu_limit <= 1e-6:
        refuse(f"key 'swiglu_limit' is {spec.swiglu_limit}", "clamps only with a limit above 1e-6 (expected none or larger)")


def _add_glm5_next(writer: gguf.GGUFWriter, checkpoint: Checkpoint, file_type: LlamaFileType) -> None:
    """TextModel.set_gguf_parameters on a Glm5NextConfig's text_config (no head_dim: Glm5NextModel pops it; no rope
    keys: it has none), with head_count_kv where it writes it but as Glm5NextModel overwrites it (per layer: 0 for
    KDA, 1 for latent attention); then Glm5NextModel's own keys, in its order. gguf 0.19 has no add_* for KDA's gate
    bound, the indexer's pooling and types or the hyper-connections: their keys spelled out."""
    spec, text, arch = checkpoint.spec, checkpoint.config.get("text_config", {}), writer.arch
    g, mla, index, hyper = spec.linear_attention, spec.latent_attention, spec.indexer, spec.hyper
    writer.add_block_count(spec.num_layers)
    if spec.max_position_embeddings is not None:
        writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.dense_intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv([0 if spec.is_linear(l) else 1 for l in range(spec.num_layers)])
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_expert_count(spec.num_experts)
    writer.add_expert_used_count(spec.top_k)
    if text.get("n_group") is not None:
        writer.add_expert_group_count(spec.n_group)
    if text.get("topk_group") is not None:
        writer.add_expert_group_used_count(spec.topk_group)
    writer.add_file_type(file_type)
    writer.add_vocab_size(spec.vocab_size)
    writer.add_layer_norm_eps(INDEX_NORM_EPS)
    writer.add_ssm_conv_kernel(g.conv_kernel)
    writer.add_kda_head_dim(g.key_dim)
    if g.lower_bound is not None:
        writer.add_float32(f"{arch}.kda.gate_lower_bound", g.lower_bound)
    writer.add_q_lora_rank(mla.q_rank)
    writer.add_kv_lora_rank(mla.kv_rank)
    writer.add_rope_dimension_count(0)
    writer.add_key_length(mla.kv_rank)
    writer.add_value_length(mla.kv_rank)
    writer.add_key_length_mla(mla.key_dim)
    writer.add_value_length_mla(mla.value_dim)
    writer.add_indexer_head_count(index.heads)
    writer.add_indexer_key_length(index.head_dim)
    writer.add_indexer_top_k(index.topk)
    writer.add_uint32(f"{arch}.attention.indexer.kpool", index.pool)
    writer.add_bool(f"{arch}.attention.indexer.kpool_select_tail", index.select_tail)
    if text.get("indexer_types") is not None:
        writer.add_array(f"{arch}.attention.indexer.types", [l not in index.shared_layers for l in range(spec.num_layers)])
    writer.add_uint32(f"{arch}.hyper_connection.count", hyper.streams)
    writer.add_uint32(f"{arch}.hyper_connection.sinkhorn_iterations", hyper.sinkhorn_iters)
    writer.add_float32(f"{arch}.hyper_connection.epsilon", hyper.eps)
    writer.add_leading_dense_block_count(spec.moe_layers[0])
    writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    writer.add_expert_shared_count(spec.n_shared_experts)
    writer.add_expert_weights_scale(spec.routed_scaling_factor)
    writer.add_expert_weights_norm(spec.norm_topk_prob)
    if spec.swiglu_limit is not None:
        writer.add_swiglu_clamp_exp([spec.swiglu_limit] * spec.num_layers)
        writer.add_swiglu_clamp_shexp([spec.swiglu_limit] * spec.num_layers)


def _add_parameters(writer: gguf.GGUFWriter, checkpoint: Checkpoint, file_type: LlamaFileType) -> None:
    """TextModel.set_gguf_parameters, then Qwen2MoeModel's / Glm4MoeModel's / LlamaModel's own keys."""
    spec, config = checkpoint.spec, checkpoint.config
    if spec.arch == "glm5_next":
        return _add_glm5_next(writer, checkpoint, file_type)
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    nextn = config.get("num_nextn_predict_layers") if spec.arch == "glm4_moe" else None
    writer.add_block_count(_block_count(checkpoint))
    if spec.max_position_embeddings is not None:
        writer.add_context_length(spec.max_position_embeddings)
    writer.add_embedding_length(spec.hidden_size)
    writer.add_feed_forward_length(spec.dense_intermediate_size)
    writer.add_head_count(spec.num_heads)
    writer.add_head_count_kv(spec.num_kv_heads)
    if rope.get("rope_theta", config.get("rope_theta")) is not None:
        writer.add_rope_freq_base(spec.rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_norm_eps)
    writer.add_expert_count(spec.num_experts)
    writer.add_expert_used_count(spec.top_k)
    if config.get("n_group") is not None:
        writer.add_expert_group_count(spec.n_group)
    if config.get("topk_group") is not None:
        writer.add_expert_group_used_count(spec.topk_group)
    if config.get("head_dim") is not None or spec.arch == "qwen3_next":  # Qwen3NextConfig always holds one (default 256)
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_file_type(file_type)
    if spec.arch == "qwen3_moe":
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    elif spec.arch == "qwen3_next":
        _add_qwen3_next(writer, checkpoint)
    elif spec.arch == "glm4_moe":
        # The converter writes each of these only when the config holds it, and llama.cpp's defaults for an absent
        # one (no renormalisation, no shared expert count: a load error) are not transformers': written always.
        writer.add_rope_dimension_count(spec.rotary_dim)
        writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
        writer.add_expert_shared_count(spec.n_shared_experts)
        writer.add_leading_dense_block_count(spec.moe_layers[0])
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        writer.add_expert_weights_scale(spec.routed_scaling_factor)
        writer.add_expert_weights_norm(spec.norm_topk_prob)
        if nextn is not None:
            writer.add_nextn_predict_layers(nextn)
    else:
        writer.add_vocab_size(spec.vocab_size)
        writer.add_rope_dimension_count(spec.head_dim)


def _add_qwen3_next(writer: gguf.GGUFWriter, checkpoint: Checkpoint) -> None:
    """Qwen2MoeModel's expert widths, then Qwen3NextModel's keys: the DeltaNet geometry, the recurrent layers, the
    interval, the rotary dims. The converter reads the config through transformers (AutoConfig.to_dict()), whose
    Qwen3NextConfig holds the widths and layer_types whatever config.json says, so these are always written; its
    to_dict (transformers 5) drops full_attention_interval, for which the converter then writes 4: written here from
    the config (4 where it has none), which llama.cpp reads only without the recurrent_layers array."""
    spec, config, g = checkpoint.spec, checkpoint.config, checkpoint.spec.linear_attention
    writer.add_expert_feed_forward_length(spec.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(spec.shared_intermediate_size)
    writer.add_ssm_conv_kernel(g.conv_kernel)
    writer.add_ssm_state_size(g.key_dim)
    writer.add_ssm_group_count(g.key_heads)
    writer.add_ssm_time_step_rank(g.value_heads)
    writer.add_ssm_inner_size(g.value_width)
    # gguf 0.19 has no add_recurrent_layers: its key, a bool array
    writer.add_array(f"{writer.arch}.attention.recurrent_layers", [spec.is_linear(l) for l in range(spec.num_layers)])
    writer.add_full_attention_interval(config.get("full_attention_interval", 4))
    writer.add_rope_dimension_count(spec.rotary_dim)


def write_gguf(folder: str | Path, out: str | Path, dtype: str = "F32", split_max_tensors: int = 0) -> list[Path]:
    """Write the HF checkpoint in `folder` as the GGUF llama.cpp's converter writes (see the module docstring), at
    `out`, or as split files NAME-0000i-of-0000N.gguf of at most `split_max_tensors` tensors each; returns the paths."""
    if dtype not in OUT_TYPES:
        raise ValueError(f"dtype {dtype!r} (expected one of {', '.join(OUT_TYPES)})")
    folder, out = Path(folder), check_output(out, "out", [("model", folder)], suffixes=(".gguf",))
    checkpoint = open_checkpoint(folder)
    if not isinstance(checkpoint, Checkpoint):
        raise CheckpointError(f"{folder}: a GGUF already (expected a HF model folder to convert)")
    _check_convertible(checkpoint)
    arch, (file_type, out_type) = checkpoint.spec.arch, OUT_TYPES[dtype]
    plan = _plan(checkpoint, arch, out_type)
    writer = _StagedWriter(path=None, arch=GGUF_ARCHITECTURES[arch], split_max_tensors=split_max_tensors)
    for t in plan:
        writer.add_tensor_info(t.name, t.shape, np.dtype(np.float32), _nbytes(t.shape, t.qtype), raw_dtype=t.qtype)
    # ModelBase.prepare_metadata: general.type, the model card's names, the parameters, the quantization version; then the vocabulary
    writer.add_type(gguf.GGUFType.MODEL)
    total, shared, experts, count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, folder, None, total)
    metadata.name = metadata.name or folder.name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, experts, count)
    metadata.set_gguf_meta_model(writer)
    _add_parameters(writer, checkpoint, file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocabulary(writer, checkpoint, arch)
    paths = writer.format_shard_names(out)
    with ExitStack() as stack:
        writer.staged = tuple(stack.enter_context(new_file(path)) for path in paths)
        try:
            writer.write_header_to_file(out)
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            for t in plan:
                writer.write_tensor_data(gguf.quants.quantize(np.ascontiguousarray(t.values(), dtype=np.float32), t.qtype))
            for handle in writer.fout:
                handle.flush()
                os.fsync(handle.fileno())
        finally:
            writer.close()
    return paths
