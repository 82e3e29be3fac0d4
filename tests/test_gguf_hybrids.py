"""GGUF files of the hybrid architectures, written as llama.cpp's converter writes them and read back exactly.

Qwen3-Next (qwen3next) comes from transformers-saved checkpoints
(tests/qwen3_next_files): the round trip of tests/test_gguf.py (its GGUF logits equal the HF
folder's), the file against what llama.cpp's converter wrote for one of them,
the older fused ssm_in layout and a NextN block, and the files llama.cpp would
refuse or compute differently, each refused in one line, reading or writing.
GLM-5.3-Flash (glm5-next) likewise (tests/glm5_next_files): the round trip, the
HF tensors back by their names (kv_b_proj from k_b and v_b; A_log whose exp is
the file's), the file against what the converter wrote, kv_b in half and Q8_0
files, and the refusals.
(The MoE architectures without linear attention: tests/test_gguf.py.)
"""

from __future__ import annotations

import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from moetier.engine import Engine, generate, score
from moetier.model import CheckpointError, SpecError, open_checkpoint
from moetier.model.gguf_file import GgufCheckpoint
from moetier.model.gguf_spec import expert_layer
from moetier.model.gguf_write import write_gguf


def bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().numpy().view(np.int32)


# -- qwen3next ------------------------------------------------------------------------------

# transformers-saved Qwen3-Next checkpoints (tests/qwen3_next_files): value heads grouped two per key head; and key
# heads = value heads, a 3-tap conv, full attention first and fourth (layer_types), MHA, tied embeddings. Every row
# a whole number of Q8_0 blocks; DeltaNet's key and value heads of one size (llama.cpp's qwen3next needs it).
NEXT = dict(vocab_size=288, hidden_size=64, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_experts=8, num_experts_per_tok=3, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, bos_token_id=1, eos_token_id=2)
NEXT_CASES = {"grouped": {},
              "equal-heads-tied": dict(num_hidden_layers=5, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                                         "full_attention", "linear_attention"],
                                       linear_num_key_heads=4, linear_conv_kernel_dim=3, num_attention_heads=2,
                                       num_key_value_heads=2, num_experts_per_tok=2, tie_word_embeddings=True)}
# the keys and types llama.cpp's converter wrote for the "grouped" checkpoint (convert_hf_to_gguf.py --outtype f32
# --no-mtp, run once on this machine's llama.cpp sources; --no-mtp as the checkpoint has no MTP tensors)
CONVERTER_KEYS = [
    ("block_count", "UINT32"), ("context_length", "UINT32"), ("embedding_length", "UINT32"), ("feed_forward_length", "UINT32"),
    ("attention.head_count", "UINT32"), ("attention.head_count_kv", "UINT32"), ("rope.freq_base", "FLOAT32"),
    ("attention.layer_norm_rms_epsilon", "FLOAT32"), ("expert_count", "UINT32"), ("expert_used_count", "UINT32"),
    ("attention.key_length", "UINT32"), ("attention.value_length", "UINT32"), ("expert_feed_forward_length", "UINT32"),
    ("expert_shared_feed_forward_length", "UINT32"), ("ssm.conv_kernel", "UINT32"), ("ssm.state_size", "UINT32"),
    ("ssm.group_count", "UINT32"), ("ssm.time_step_rank", "UINT32"), ("ssm.inner_size", "UINT32"),
    ("attention.recurrent_layers", "ARRAY"), ("full_attention_interval", "UINT32"), ("rope.dimension_count", "UINT32")]


@pytest.fixture(scope="module")
def next_models(tmp_path_factory):
    """case -> (HF folder, its F32 GGUF)."""
    pytest.importorskip("transformers")
    from qwen3_next_files import save_qwen3_next

    root, out = tmp_path_factory.mktemp("gguf-next"), {}
    for i, (case, overrides) in enumerate(NEXT_CASES.items()):
        folder = save_qwen3_next(root / case, NEXT | overrides, seed=i)
        out[case] = folder, write_gguf(folder, root / f"{case}.gguf")[0]
    return out


@pytest.mark.parametrize("case", NEXT_CASES)
def test_qwen3_next_round_trip_spec_and_logits(next_models, case):
    """The spec is the HF config's; teacher-forced logits over 80 positions (two prefill chunks) and 8 cached decode
    steps after a 70-token prompt equal the HF checkpoint's within 1e-5 (measured: equal)."""
    folder, path = next_models[case]
    g, hf = open_checkpoint(path), open_checkpoint(folder)
    assert isinstance(g, GgufCheckpoint) and g.spec == hf.spec and g.spec.arch == "qwen3_next" and not g.norm_offset
    ids = np.arange(80) * 37 % g.spec.vocab_size
    assert np.abs(score(Engine(g), ids) - score(Engine(hf), ids)).max() <= 1e-5
    ours, theirs = (generate(Engine(c), ids[:70].tolist(), 8, keep_logits=True) for c in (g, hf))
    assert ours.ids == theirs.ids and np.abs(ours.logits - theirs.logits).max() <= 1e-5


@pytest.mark.parametrize("case", NEXT_CASES)
def test_qwen3_next_tensors_are_what_the_engine_reads_from_hf(next_models, case):
    """Bit for bit: norms as normalisation multiplies (the file holds 1 + w, the HF reader adds it), each DeltaNet
    layer's tensors (the converter's qkv / z rows are the HF reader's regrouping; ssm_a its -exp(A_log)), the
    shared-expert gate [1, D] and every other tensor by its HF name; what no HF tensor holds keeps its GGUF name."""
    folder, path = next_models[case]
    g, hf, s = open_checkpoint(path), open_checkpoint(folder), open_checkpoint(folder).spec
    made = {f"model.layers.{l}.linear_attn.{n}" for l in s.linear_layers for n in ("in_proj_qkvz.weight", "A_log")}
    assert set(g.names()) == (set(hf.names()) - made) | {f"blk.{l}.{n}" for l in s.linear_layers
                                                         for n in ("attn_qkv.weight", "attn_gate.weight", "ssm_a")}
    for name in set(hf.names()) - made:
        if name.endswith("norm.weight") and ".linear_attn." not in name:  # DeltaNet's gated norm multiplies by w itself
            assert np.array_equal(bits(g.norm(name)), bits(hf.norm(name))), name
        elif name.endswith(".conv1d.weight"):
            assert np.array_equal(bits(g.tensor(name)), bits(hf.tensor(name)[:, 0])), name
        elif expert_layer(s.arch, name) is None:
            assert np.array_equal(bits(g.tensor(name)), bits(hf.tensor(name))), name
    for layer in range(s.num_layers):
        assert np.array_equal(bits(g.shared_expert_gate(layer)), bits(hf.shared_expert_gate(layer)))
        for ours, theirs in ((g.expert(layer, 0), hf.expert(layer, 0)), (g.shared_experts(layer), hf.shared_experts(layer))):
            assert np.array_equal(bits(ours.gate_up), bits(theirs.gate_up)) and np.array_equal(bits(ours.down), bits(theirs.down))
        if s.is_linear(layer):
            ours, theirs = g.deltanet(layer), hf.deltanet(layer)
            for field in ("qkv", "z", "ba", "out"):
                assert getattr(ours, field)[1] == getattr(theirs, field)[1] == QType.F32
                assert np.array_equal(bits(getattr(ours, field)[0]), bits(getattr(theirs, field)[0])), (layer, field)
            for field in ("conv", "dt_bias", "decay_rate", "norm"):
                assert np.array_equal(bits(getattr(ours, field)), bits(getattr(theirs, field))), (layer, field)


def test_qwen3_next_file_is_the_converters(next_models, tmp_path):
    """Keys in the converter's order and types, tensor names from gguf's TensorNameMap after the converter's
    renames (in_proj_qkvz -> attn_qkv + attn_gate, not TensorNameMap's ssm_in; dt_bias -> ssm_dt.bias), its
    shapes ({D, 1} for the shared-expert gate, conv taps squeezed to {K, C}) and types: F32 for 1-D tensors, norms,
    routers, conv taps and ssm_a; Q8_0 for the matrices ssm_ba included; Q8_0 values the converter's rounding."""
    folder, path = next_models["grouped"]
    hf = open_checkpoint(folder)
    s, reader = hf.spec, gguf.GGUFReader(path)
    keys = [(k.removeprefix("qwen3next."), f.types[0].name) for k, f in reader.fields.items() if k.startswith("qwen3next.")]
    assert keys == CONVERTER_KEYS
    assert reader.fields["qwen3next.attention.recurrent_layers"].contents() == [True, True, True, False]
    assert reader.fields["tokenizer.ggml.pre"].contents() == "qwen2"
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3NEXT, s.num_layers)
    expected = set()
    for name in hf.names():
        layer = expert_layer(s.arch, name)
        if layer is not None:
            expected |= {f"blk.{layer}.ffn_{p}_exps.weight" for p in ("gate", "up", "down")}
        elif name.endswith("in_proj_qkvz.weight"):
            expected |= {name.replace("model.layers.", "blk.").replace("linear_attn.in_proj_qkvz", n) for n in ("attn_qkv", "attn_gate")}
        else:
            expected.add(names.get_name(name.replace("dt_bias", "dt_proj.bias"), try_suffixes=(".weight", ".bias")))
    tensors = {t.name: t for t in reader.tensors}
    assert set(tensors) == expected
    g = s.linear_attention
    assert [int(n) for n in tensors["blk.0.ffn_gate_inp_shexp.weight"].shape] == [s.hidden_size, 1]
    assert [int(n) for n in tensors["blk.0.ssm_conv1d.weight"].shape] == [g.conv_kernel, g.conv_channels]
    q8 = {t.name: t for t in gguf.GGUFReader(write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")[0]).tensors}
    floats = {n for n, t in q8.items() if t.tensor_type == QType.F32}
    assert floats == {n for n in q8 if q8[n].data.ndim == 1 or n.endswith(("_norm.weight", "gate_inp.weight", "gate_inp_shexp.weight",
                                                                                  "ssm_conv1d.weight", "ssm_a", ".bias"))}
    assert {q8[n].tensor_type for n in q8} - {QType.F32} == {QType.Q8_0} and "blk.0.ssm_ba.weight" not in floats
    for name, t in q8.items():
        if t.tensor_type == QType.Q8_0:
            assert np.array_equal(np.asarray(t.data), gguf.quants.quantize(np.asarray(tensors[name].data), QType.Q8_0)), name


def test_qwen3_next_older_and_nextn_files_read_the_same(next_models, tmp_path):
    """A file with the fused ssm_in older converters wrote (llama.cpp's loader still reads it), and one with a
    NextN/MTP block after the layers (nextn_predict_layers: recognised, not run), give the same spec and logits."""
    from qwen3_next_files import legacy_in_projection, with_nextn_block

    folder, path = next_models["grouped"]
    s = open_checkpoint(folder).spec
    g = s.linear_attention
    legacy = legacy_in_projection(path, tmp_path / "legacy.gguf", g.key_heads, g.key_dim, g.value_width)
    nextn = with_nextn_block(path, tmp_path / "nextn.gguf", s.num_layers, s.attention_layers[-1], s.hidden_size)
    ids = np.arange(70) * 11 % s.vocab_size
    expected = score(Engine(open_checkpoint(path)), ids)
    for other in (legacy, nextn):
        checkpoint = open_checkpoint(other)
        assert checkpoint.spec == s and np.abs(score(Engine(checkpoint), ids) - expected).max() == 0.0
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in open_checkpoint(legacy).names()
    assert not any(n.startswith(f"blk.{s.num_layers}.") or f"layers.{s.num_layers}." in n for n in open_checkpoint(nextn).names())


def test_qwen3_next_bfloat16_checkpoint_converts_as_the_converter_does(tmp_path):
    """bfloat16 weights widen to float32 exactly, the norms' + 1 and -exp(A_log) computed on the widened values
    (ModelBase.prepare_tensors' order): the F32 file's norms and DeltaNet tensors equal the HF reader's bit for bit."""
    pytest.importorskip("transformers")
    from qwen3_next_files import save_qwen3_next

    folder = save_qwen3_next(tmp_path / "bf16", NEXT, seed=5, dtype="bfloat16")
    g, hf = open_checkpoint(write_gguf(folder, tmp_path / "bf16.gguf")[0]), open_checkpoint(folder)
    assert g.spec == hf.spec and hf.expert_format(0) == "BF16" and g.expert_format(0) == "F32"
    assert np.array_equal(bits(g.norm("model.layers.0.input_layernorm.weight")), bits(hf.norm("model.layers.0.input_layernorm.weight")))
    ours, theirs = g.deltanet(0), hf.deltanet(0)
    assert np.array_equal(bits(ours.decay_rate), bits(theirs.decay_rate))
    assert np.array_equal(bits(ours.qkv[0]), bits(theirs.qkv[0].float()))
    assert np.array_equal(bits(g.expert(0, 1).gate_up), bits(hf.expert(0, 1).gate_up.float()))


def _next_bad_files(path, tmp_path) -> dict:
    """label -> (a qwen3next file llama.cpp's loader refuses or would compute differently from transformers, words of
    its one error line)."""
    from gguf import GGUFValueType as T
    from qwen3_next_files import rewritten

    def tensors(edit):
        return lambda listed: [t for item in listed for t in edit(*item)]

    drop_gate = tensors(lambda n, d, q: [] if n == "blk.0.attn_gate.weight" else [(n, d, q)])
    short_conv = tensors(lambda n, d, q: [(n, d[:, :3].copy() if n == "blk.1.ssm_conv1d.weight" else d, q)])
    fused = tensors(lambda n, d, q: [(n.replace("attn_q.", "attn_qkv."), d, q)] if n.startswith("blk.3.attn_q.") else [(n, d, q)])
    cases = {
        "recurrent flags short": ({"qwen3next.attention.recurrent_layers": ([True, False], T.ARRAY, T.BOOL)}, None,
                                  "key 'qwen3next.attention.recurrent_layers' is [True, False] (expected 4 booleans, one per block)"),
        "value heads not state_size": ({"qwen3next.ssm.inner_size": (96, T.UINT32, None)}, None,
                                       "key 'qwen3next.ssm.inner_size' is 96, not 'qwen3next.ssm.time_step_rank' = 4 x"),
        "another L2 epsilon": ({"qwen3next.attention.layer_norm_rms_epsilon": (1e-5, T.FLOAT32, None)}, None,
                               "L2-normalises DeltaNet's q and k with it, transformers with 1e-06"),
        "no interval, no flags": ({"qwen3next.attention.recurrent_layers": None, "qwen3next.full_attention_interval": (0, T.UINT32, None)},
                                  None, "key 'qwen3next.full_attention_interval' is 0"),
        "no output gate": ({}, drop_gate, "tensor 'blk.0.attn_gate.weight' is missing (expected shape {64, 64}"),
        "conv taps": ({}, short_conv, "tensor 'blk.1.ssm_conv1d.weight' has shape {3, 128} (expected {4, 128} from the metadata, "
                                      "ggml order: dim 0 is qwen3next.ssm.conv_kernel = 4)"),
        "fused attention qkv": ({}, fused, "tensor 'blk.3.attn_qkv.weight': fused Q/K/V"),
    }
    return {label: (rewritten(path, tmp_path / f"{i}.gguf", keys, edit), words) for i, (label, (keys, edit, words)) in enumerate(cases.items())}


def test_bad_qwen3_next_files_are_refused_in_one_line(next_models, tmp_path):
    for label, (path, words) in _next_bad_files(next_models["grouped"][1], tmp_path).items():
        with pytest.raises((CheckpointError, SpecError)) as error:
            open_checkpoint(path)
        message = str(error.value)
        assert "\n" not in message and message.startswith(str(path)) and words in message, (label, message)


def test_write_refuses_qwen3_next_that_llama_cpp_computes_differently(next_models, tmp_path):
    """What llama.cpp's qwen3next cannot load or computes differently from transformers is refused, and nothing is
    written: DeltaNet key and value heads of two sizes, another rms_norm_eps (its L2 norm's epsilon there), dense
    layers, unrenormalised top-k, attention biases (it has no o_proj bias), no DeltaNet or no attention layer (it
    aborts on the empty cache), an MTP block (not written yet)."""
    from qwen3_next_files import save_qwen3_next
    from safetensors.torch import load_file, save_file

    source = next_models["grouped"][0]
    cases = {"linear_key_head_dim": dict(linear_value_head_dim=8), "rms_norm_eps": dict(rms_norm_eps=1e-5),
             "mlp_only_layers": dict(mlp_only_layers=[1]), "norm_topk_prob": dict(norm_topk_prob=False),
             "attention_bias": dict(attention_bias=True),
             "no full_attention layer": dict(layer_types=["linear_attention"] * NEXT["num_hidden_layers"]),
             "no linear_attention layer": dict(layer_types=["full_attention"] * NEXT["num_hidden_layers"])}
    for word, change in cases.items():
        folder = save_qwen3_next(tmp_path / word, NEXT | change, seed=0)
        with pytest.raises(SpecError, match=word) as error:
            write_gguf(folder, tmp_path / f"{word}.gguf")
        assert "\n" not in str(error.value)
    folder = tmp_path / "mtp"
    shutil.copytree(source, folder)
    weights = load_file(folder / "model.safetensors")
    save_file(weights | {"mtp.fc.weight": torch.zeros(64, 128)}, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="tensor 'mtp.fc.weight': the MTP block is not written yet"):
        write_gguf(folder, tmp_path / "mtp.gguf")
    assert not list(tmp_path.glob("*.gguf"))


# transformers-saved GLM-5.3-Flash checkpoints (tests/glm5_next_files, in the geometry llama.cpp's glm5-next loads):
# two dense layers, a shared indexer layer, 2 expert groups, 2 shared experts, a clamp that bites; and the softplus
# forget gate with index_topk above the length (pools of 8)
GLM5_CASES = {
    "grouped": dict(num_hidden_layers=6, n_group=2, topk_group=1, n_shared_experts=2, swiglu_limit=0.5,
                    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                                 "indexed_attention", "linear_attention"],
                    indexer_types=["full", "full", "shared", "full", "full", "full"], mlp_layer_types=["dense"] * 2 + ["sparse"] * 4),
    "softplus-topk-above-length": dict(linear_lower_bound=None, index_topk=512, index_kpool=8),
}
# what llama.cpp's converter wrote for "grouped" (convert_hf_to_gguf.py --outtype f32 through scripts/gguf_vs_converter.py,
# once on this machine's llama.cpp sources): the keys and types, the tensors of a KDA / latent-attention layer
GLM5_CONVERTER_KEYS = [
    ("block_count", "UINT32"), ("context_length", "UINT32"), ("embedding_length", "UINT32"), ("feed_forward_length", "UINT32"),
    ("attention.head_count", "UINT32"), ("attention.head_count_kv", "ARRAY"), ("attention.layer_norm_rms_epsilon", "FLOAT32"),
    ("expert_count", "UINT32"), ("expert_used_count", "UINT32"), ("expert_group_count", "UINT32"),
    ("expert_group_used_count", "UINT32"), ("vocab_size", "UINT32"), ("attention.layer_norm_epsilon", "FLOAT32"),
    ("ssm.conv_kernel", "UINT32"), ("kda.head_dim", "UINT32"), ("kda.gate_lower_bound", "FLOAT32"), ("attention.q_lora_rank", "UINT32"),
    ("attention.kv_lora_rank", "UINT32"), ("rope.dimension_count", "UINT32"), ("attention.key_length", "UINT32"),
    ("attention.value_length", "UINT32"), ("attention.key_length_mla", "UINT32"), ("attention.value_length_mla", "UINT32"),
    ("attention.indexer.head_count", "UINT32"), ("attention.indexer.key_length", "UINT32"), ("attention.indexer.top_k", "UINT32"),
    ("attention.indexer.kpool", "UINT32"), ("attention.indexer.kpool_select_tail", "BOOL"), ("attention.indexer.types", "ARRAY"),
    ("hyper_connection.count", "UINT32"), ("hyper_connection.sinkhorn_iterations", "UINT32"), ("hyper_connection.epsilon", "FLOAT32"),
    ("leading_dense_block_count", "UINT32"), ("expert_feed_forward_length", "UINT32"), ("expert_shared_count", "UINT32"),
    ("expert_weights_scale", "FLOAT32"), ("expert_weights_norm", "BOOL"), ("swiglu_clamp_exp", "ARRAY"), ("swiglu_clamp_shexp", "ARRAY")]
GLM5_BLOCK = {f"hc_{b}_{n}.weight" for b in ("attn", "ffn") for n in ("fn", "base", "scale")} | {"attn_norm.weight", "ffn_norm.weight"}
GLM5_KDA = {"attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ssm_a", "ssm_beta.weight", "ssm_dt.bias",
            "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight", "ssm_norm.weight"} | {
            f"ssm_conv1d_{n}.weight" for n in "qkv"}
GLM5_LATENT = {"attn_q_a.weight", "attn_q_a_norm.weight", "attn_q_b.weight", "attn_kv_a_mqa.weight", "attn_kv_a_norm.weight",
               "attn_k_b.weight", "attn_v_b.weight", "attn_output.weight"}
GLM5_INDEXER = {"indexer.attn_k.weight", "indexer.attn_q_b.weight", "indexer.k_norm.weight", "indexer.k_norm.bias",
                "indexer.proj.weight", "indexer_compressor_ape.weight", "indexer_compressor_gate.weight"}
GLM5_MOE = {f"ffn_{p}_{kind}.weight" for p in ("gate", "up", "down") for kind in ("exps", "shexp")} | {"ffn_gate_inp.weight", "exp_probs_b.bias"}


@pytest.fixture(scope="module")
def glm5_models(tmp_path_factory):
    """case -> (HF folder, its F32 GGUF)."""
    pytest.importorskip("transformers")
    from glm5_next_files import BASE, save_glm5_next

    root, out = tmp_path_factory.mktemp("gguf-glm5"), {}
    for i, (case, overrides) in enumerate(GLM5_CASES.items()):
        folder = save_glm5_next(root / case, BASE | overrides, seed=i)
        out[case] = folder, write_gguf(folder, root / f"{case}.gguf")[0]
    return out


@pytest.mark.parametrize("case", GLM5_CASES)
def test_glm5_next_round_trip_spec_and_logits(glm5_models, case):
    """The spec is the HF config's; teacher-forced logits over 80 positions (two KDA chunks) and 8 cached decode
    steps after a 70-token prompt equal the HF checkpoint's within 1e-5 (measured: equal)."""
    folder, path = glm5_models[case]
    g, hf = open_checkpoint(path), open_checkpoint(folder)
    assert isinstance(g, GgufCheckpoint) and g.spec == hf.spec and g.spec.arch == "glm5_next"
    ids = np.arange(80) * 37 % g.spec.vocab_size
    assert np.abs(score(Engine(g), ids) - score(Engine(hf), ids)).max() <= 1e-5
    ours, theirs = (generate(Engine(c), ids[:70].tolist(), 8, keep_logits=True) for c in (g, hf))
    assert ours.ids == theirs.ids and np.abs(ours.logits - theirs.logits).max() <= 1e-5


@pytest.mark.parametrize("case", GLM5_CASES)
def test_glm5_next_tensors_are_what_the_engine_reads_from_hf(glm5_models, case):
    """Every HF tensor by its HF name, bit for bit: kv_b_proj put back together from k_b (transposed) and v_b, in
    F32 bytes; conv taps back to [C, 1, K]; A_log a float32 whose exp is the file's -ssm_a, which is the HF A_log's
    exp (the engine takes nothing else of it); experts and shared experts with the clamp."""
    folder, path = glm5_models[case]
    g, hf = open_checkpoint(path), open_checkpoint(folder)
    s, stored_a = hf.spec, {t.name: -np.asarray(t.data) for t in gguf.GGUFReader(path).tensors if t.name.endswith(".ssm_a")}
    assert set(g.names()) == set(hf.names())
    for name in hf.names():
        if name.endswith(".A_log"):
            exp = bits(g.tensor(name).exp())
            assert np.array_equal(exp, bits(hf.tensor(name).exp())), name
            assert np.array_equal(exp, stored_a[f"blk.{name.split('.')[2]}.ssm_a"].view(np.int32)), name
        elif expert_layer(s.arch, name) is None:
            assert np.array_equal(bits(g.tensor(name)), bits(hf.tensor(name))), name
    for layer in s.attention_layers:
        stored, qtype = g.stored(f"model.layers.{layer}.self_attn.kv_b_proj.weight")
        assert qtype == QType.F32 and np.array_equal(bits(stored), bits(hf.tensor(f"model.layers.{layer}.self_attn.kv_b_proj.weight")))
    for layer in s.moe_layers:
        for ours, theirs in ((g.expert(layer, 1), hf.expert(layer, 1)), (g.shared_experts(layer), hf.shared_experts(layer))):
            assert ours.swiglu_limit == theirs.swiglu_limit == s.swiglu_limit
            assert np.array_equal(bits(ours.gate_up), bits(theirs.gate_up)) and np.array_equal(bits(ours.down), bits(theirs.down))


def test_glm5_next_file_is_the_converters(glm5_models, tmp_path):
    """Keys in the converter's order and types (head_count_kv an INT32 array: 0 for KDA, 1 for latent attention),
    each layer's tensors as it names them (kv_b_proj -> attn_k_b + attn_v_b, A_log -> ssm_a, the hyper-connections
    and the indexer's pooling with .weight), shapes (conv taps {K, 1, C, 1}, k_b {dn, r, H}) and types: F32 for 1-D
    tensors, norms, routers, conv taps, the hyper-connections, the indexer's pooling and head weights, ssm_a and the
    biases; the out type for the other matrices (F16 where rows are no whole Q8_0 blocks: k_b's 16, f_b's 16)."""
    folder, path = glm5_models["grouped"]
    s, reader = open_checkpoint(folder).spec, gguf.GGUFReader(path)
    keys = [(k.removeprefix("glm5-next."), f.types[0].name) for k, f in reader.fields.items() if k.startswith("glm5-next.")]
    assert keys == GLM5_CONVERTER_KEYS
    assert reader.fields["glm5-next.attention.head_count_kv"].types[1] == gguf.GGUFValueType.INT32
    assert reader.fields["glm5-next.attention.head_count_kv"].contents() == [0, 1, 1, 0, 1, 0]
    assert reader.fields["glm5-next.attention.indexer.types"].contents() == [True, True, False, True, True, True]
    assert reader.fields["tokenizer.ggml.pre"].contents() == "glm4"
    tensors = {t.name: t for t in reader.tensors}
    expected = {"token_embd.weight", "output_norm.weight", "output.weight"}
    for layer in range(s.num_layers):
        inner = GLM5_BLOCK | (GLM5_KDA if s.is_linear(layer) else GLM5_LATENT) | (GLM5_MOE if s.is_moe(layer) else
                                                                                   {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"})
        inner |= GLM5_INDEXER if not s.is_linear(layer) and layer not in s.indexer.shared_layers else set()
        expected |= {f"blk.{layer}.{n}" for n in inner}
    assert set(tensors) == expected
    mla, g = s.latent_attention, s.linear_attention
    assert [int(n) for n in tensors["blk.0.ssm_conv1d_q.weight"].shape] == [g.conv_kernel, 1, g.value_width, 1]
    assert [int(n) for n in tensors["blk.1.attn_k_b.weight"].shape] == [mla.key_dim, mla.kv_rank, s.num_heads]
    assert [int(n) for n in tensors["blk.1.attn_v_b.weight"].shape] == [mla.kv_rank, mla.value_dim, s.num_heads]
    q8 = {t.name: t.tensor_type for t in gguf.GGUFReader(write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")[0]).tensors}
    exact = ("hc_attn_", "hc_ffn_", "indexer_compressor_", "ssm_a", "ssm_dt", "exp_probs_b", "ssm_conv1d_", "indexer.proj.")
    floats = {n for n in q8 if tensors[n].data.ndim == 1 or n.endswith(("_norm.weight", "gate_inp.weight", ".bias"))
              or any(part in n for part in exact)}
    assert {n for n, t in q8.items() if t == QType.F32} == floats
    assert all(t == (QType.Q8_0 if int(tensors[n].shape[0]) % 32 == 0 else QType.F16) for n, t in q8.items() if n not in floats)
    assert q8["blk.1.attn_k_b.weight"] == QType.F16 and q8["blk.1.attn_v_b.weight"] == QType.Q8_0


def test_glm5_next_nextn_block_is_recognised_and_not_run(glm5_models, tmp_path):
    """A glm5-next file with a NextN/MTP block after the layers (the converter's supports_mtp_export: block_count
    grown by nextn_predict_layers, the per-layer arrays by one entry; the block a copy of an indexed layer plus its
    eh_proj and norms): the same spec and the same logits, the block's tensors in no name."""
    from gguf import GGUFValueType as V
    from qwen3_next_files import rewritten

    folder, path = glm5_models["grouped"]
    s = open_checkpoint(path).spec
    fields = gguf.GGUFReader(path).fields
    key = lambda name: f"glm5-next.{name}"  # noqa: E731
    extra = {"attention.head_count_kv": (1, V.UINT32), "attention.indexer.types": (True, V.BOOL),  # an indexed layer
             "swiglu_clamp_exp": (s.swiglu_limit, V.FLOAT32), "swiglu_clamp_shexp": (s.swiglu_limit, V.FLOAT32)}
    keys = {key(name): (list(fields[key(name)].contents()) + [value], V.ARRAY, kind)
            for name, (value, kind) in extra.items() if key(name) in fields}
    keys |= {key("block_count"): (s.num_layers + 1, V.UINT32, None), key("nextn_predict_layers"): (1, V.UINT32, None)}
    rng, L, D = np.random.default_rng(0), s.num_layers, s.hidden_size

    def append(listed):
        prefix = f"blk.{s.attention_layers[-1]}."
        block = [(f"blk.{L}." + name[len(prefix):], data, qtype) for name, data, qtype in listed if name.startswith(prefix)]
        block += [(f"blk.{L}.nextn.eh_proj.weight", rng.normal(0, 0.1, (D, 2 * D)).astype(np.float32), QType.F32)]
        return listed + block + [(f"blk.{L}.nextn.{n}.weight", np.ones(D, np.float32), QType.F32) for n in ("enorm", "hnorm")]

    nextn = open_checkpoint(rewritten(path, tmp_path / "nextn.gguf", keys=keys, tensors=append))
    ids = np.arange(70) * 11 % s.vocab_size
    assert nextn.spec == s and np.abs(score(Engine(nextn), ids) - score(Engine(open_checkpoint(path)), ids)).max() == 0.0
    assert not any(f"layers.{L}." in name for name in nextn.names())


def test_glm5_next_kv_b_of_quantized_and_half_files(glm5_models, tmp_path):
    """kv_b_proj in its bytes where k_b and v_b share a float type (F16, BF16: the transposition moves whole elements),
    else as float32 values (Q8_0's v_b with F16's k_b: blocks run along the other axis); the logits of both files
    as the engine computes them from the file's own values."""
    folder, _ = glm5_models["softplus-topk-above-length"]
    name = "model.layers.3.self_attn.kv_b_proj.weight"
    halves = []
    for dtype, qtype, torch_dtype in (("F16", QType.F16, torch.float16), ("BF16", QType.BF16, torch.bfloat16)):
        halves.append(open_checkpoint(write_gguf(folder, tmp_path / f"{dtype}.gguf", dtype)[0]))
        stored, stored_type = halves[-1].stored(name)
        assert stored_type == qtype and stored.dtype == torch_dtype
        assert np.array_equal(bits(stored.float()), bits(halves[-1].tensor(name)))
    q8 = open_checkpoint(write_gguf(folder, tmp_path / "q8.gguf", "Q8_0")[0])
    stored, qtype = q8.stored(name)
    assert qtype == QType.F32 and np.array_equal(bits(stored), bits(q8.tensor(name)))
    assert np.abs(q8.tensor(name).numpy() - open_checkpoint(folder).tensor(name).numpy()).max() < 1e-2
    for checkpoint in (*halves, q8):
        assert np.isfinite(score(Engine(checkpoint), np.arange(40) % checkpoint.spec.vocab_size)).all()


def _glm5_bad_files(path, tmp_path) -> dict:
    """label -> (a glm5-next file llama.cpp's loader refuses, or computes differently from transformers, words of its
    one error line)."""
    from gguf import GGUFValueType as T
    from qwen3_next_files import rewritten

    def drop(name):
        return lambda listed: [t for t in listed if t[0] != name]

    def conv(listed):
        return [(n, d[..., :3].copy() if n == "blk.0.ssm_conv1d_k.weight" else d, q) for n, d, q in listed]
    key = "glm5-next."
    cases = {
        "three streams": ({key + "hyper_connection.count": (3, T.UINT32, None)}, None,
                          "key 'glm5-next.hyper_connection.count' is 3 (expected 4: llama.cpp's glm5-next asserts it)"),
        "pools of one": ({key + "attention.indexer.kpool": (1, T.UINT32, None)}, None, "key 'glm5-next.attention.indexer.kpool' is 1"),
        "no tail": ({key + "attention.indexer.kpool_select_tail": (False, T.BOOL, None)}, None, "are NaN (transformers: zeros)"),
        "kv heads short": ({key + "attention.head_count_kv": ([0, 1], T.ARRAY, T.INT32)}, None,
                           "key 'glm5-next.attention.head_count_kv' is [0, 1] (expected 6 counts, one per block"),
        "index norm epsilon": ({key + "attention.layer_norm_epsilon": (1e-5, T.FLOAT32, None)}, None,
                               "transformers' indexer LayerNorm"),
        "softmax router": ({key + "expert_gating_func": (1, T.UINT32, None)}, None, "key 'glm5-next.expert_gating_func' is 1"),
        "two clamps": ({key + "swiglu_clamp_shexp": ([7.0] * 6, T.ARRAY, T.FLOAT32)}, None, "moetier clamps every SwiGLU alike"),
        "rope": ({key + "rope.dimension_count": (8, T.UINT32, None)}, None, "NoPE"),
        "latent size": ({key + "attention.key_length": (16, T.UINT32, None)}, None, "the cache holds the latent"),
        "no k_b": ({}, drop("blk.1.attn_k_b.weight"), "tensor 'blk.1.attn_k_b.weight' is missing (expected shape {16, 32, 4}"),
        "no output": ({}, drop("output.weight"), "tensor 'output.weight' is missing"),
        "conv taps": ({}, conv, "tensor 'blk.0.ssm_conv1d_k.weight' has shape {3, 1, 64, 1} (expected {4, 1, 64} from the "
                                "metadata, ggml order: dim 0 is glm5-next.ssm.conv_kernel = 4)"),
    }
    return {label: (rewritten(path, tmp_path / f"{i}.gguf", keys, edit), words) for i, (label, (keys, edit, words)) in enumerate(cases.items())}


def test_bad_glm5_next_files_are_refused_in_one_line(glm5_models, tmp_path):
    for label, (path, words) in _glm5_bad_files(glm5_models["grouped"][1], tmp_path).items():
        with pytest.raises((CheckpointError, SpecError)) as error:
            open_checkpoint(path)
        message = str(error.value)
        assert "\n" not in message and message.startswith(str(path)) and words in message, (label, message)


def test_write_refuses_glm5_next_that_llama_cpp_cannot_load_or_computes_differently(tmp_path):
    """Refused, nothing written: hyper-connections of other than 4 streams, pools of one position (llama.cpp's asserts),
    the incomplete pool not attended (NaN there in llama.cpp), tied embeddings (no output.weight, which its loader
    requires), attention biases (it loads none), KDA heads other than the attention heads, a dense layer after a
    sparse one (it runs leading_dense_block_count dense layers), every group kept (its loader asserts fewer), no
    shared expert (it loads one in every MoE layer, and aborts on transformers' width-0 one), no KDA or no indexed
    layer (it aborts on the empty cache)."""
    pytest.importorskip("transformers")
    from glm5_next_files import BASE, save_glm5_next

    cases = {"hc_mult": dict(hc_mult=2), "index_kpool": dict(index_kpool=1, index_topk=4),
             "index_kpool_always_select_tail": dict(index_kpool_always_select_tail=False),
             "tie_word_embeddings": dict(tie_word_embeddings=True), "attention_bias": dict(attention_bias=True),
             "linear_num_heads": dict(linear_num_heads=2), "mlp_layer_types": dict(mlp_layer_types=["sparse", "dense"] + ["sparse"] * 3),
             "topk_group": dict(n_group=2, topk_group=2), "n_shared_experts": dict(n_shared_experts=0),
             "no indexed_attention layer": dict(layer_types=["linear_attention"] * BASE["num_hidden_layers"]),
             "no linear_attention layer": dict(layer_types=["indexed_attention"] * BASE["num_hidden_layers"])}
    for word, change in cases.items():
        folder = save_glm5_next(tmp_path / word, BASE | change, seed=0)
        with pytest.raises(SpecError, match=word) as error:
            write_gguf(folder, tmp_path / f"{word}.gguf")
        assert "\n" not in str(error.value)
    assert not list(tmp_path.glob("*.gguf"))
