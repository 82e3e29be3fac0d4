"""GGUF: written as llama.cpp's converter writes it, read back into the checkpoint interface exactly.

Tiny synthetic qwen3_moe, glm4_moe (a dense first layer, a shared expert, 4
groups, a correction bias) and mixtral (Q/K rows permuted by the converter)
checkpoints are written as F32 GGUF and opened again: the spec equals the HF
folder's, every tensor the engine reads equals the HF one bit for bit, and the
engine's teacher-forced logits match within 1e-6. F16, BF16 and Q8_0 files
dequantize bit for bit as gguf.quants does. Split sets, the GLM NextN block,
whole-or-nothing writing and the tensor names against gguf's TensorNameMap are
checked too, and every bad file is one line and exit code 2 through the CLI
(in this process, cli_runs.moetier_here: GGUF headers are read in Python; one
as a real process).
The hybrid architectures (qwen3next, glm5-next): tests/test_gguf_hybrids.py.
"""

from __future__ import annotations

import json
import shutil

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QType

from cli_runs import moetier, moetier_here, refused
from moetier.engine import Engine, score
from moetier.model import CheckpointError, SpecError, open_checkpoint
from moetier.model.gguf_file import GgufCheckpoint
from moetier.model.gguf_spec import GGUF_ARCHITECTURES, expert_layer, gguf_name
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic

ARCHES = ("qwen3_moe", "glm4_moe", "mixtral")
LOGIT_TOLERANCE = 1e-6


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (HF folder, its F32 GGUF)."""
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for arch in ARCHES:
        folder = write_synthetic(root / arch, arch=arch, preset="tiny", seed=1)
        out[arch] = (folder, write_gguf(folder, root / f"{arch}.gguf")[0])
    return out


def bits(tensor: torch.Tensor) -> np.ndarray:
    return tensor.contiguous().numpy().view(np.int32)


def permute(values: np.ndarray, heads: int) -> np.ndarray:
    """LlamaModel.permute from llama.cpp's conversion/llama.py, copied: what the file holds for Mixtral's Q/K."""
    return values.reshape(heads, 2, values.shape[0] // heads // 2, *values.shape[1:]).swapaxes(1, 2).reshape(values.shape)


# -- the F32 round trip -------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
def test_spec_equals_the_hf_spec(models, arch):
    """Every field: the synthetic configs use none of what GGUF cannot carry. What it cannot: a sliding window
    (llama.cpp runs these archs without one), Qwen3-MoE's dense layers (mlp_only_layers, decoder_sparse_step)
    and norm_topk_prob false (its qwen3moe always renormalises) — write_gguf refuses all three — and float64
    precision (eps, theta and scale are float32; read back as the shortest decimal that rounds to them)."""
    folder, path = models[arch]
    checkpoint = open_checkpoint(path)
    assert isinstance(checkpoint, GgufCheckpoint)
    assert checkpoint.spec == open_checkpoint(folder).spec
    if arch == "glm4_moe":
        assert checkpoint.spec.moe_layers[0] == 1 and checkpoint.spec.n_shared_experts == 1 and checkpoint.spec.n_group == 4


@pytest.mark.parametrize("arch", ARCHES)
def test_every_tensor_the_engine_reads_is_bit_for_bit_the_hf_one(models, arch):
    folder, path = models[arch]
    hf, g = open_checkpoint(folder), open_checkpoint(path)
    assert g.names() == hf.names()
    for name in hf.names():
        assert np.array_equal(bits(g.tensor(name)), bits(hf.tensor(name))), name
        assert np.array_equal(bits(g.load(name)), bits(hf.load(name))), name
    s = hf.spec
    for layer in range(s.num_layers):
        if not s.is_moe(layer):
            ours, theirs = g.dense_mlp(layer), hf.dense_mlp(layer)
            assert np.array_equal(bits(ours.gate_up), bits(theirs.gate_up)) and np.array_equal(bits(ours.down), bits(theirs.down))
            continue
        assert np.array_equal(bits(g.router_weight(layer)), bits(hf.router_weight(layer)))
        assert (g.router_bias(layer) is None) == (hf.router_bias(layer) is None)
        if hf.router_bias(layer) is not None:
            assert np.array_equal(bits(g.router_bias(layer)), bits(hf.router_bias(layer)))
        pairs = [(g.expert(layer, e), hf.expert(layer, e)) for e in range(s.num_experts)]
        if hf.shared_experts(layer) is not None:
            pairs.append((g.shared_experts(layer), hf.shared_experts(layer)))
        for ours, theirs in pairs:
            assert np.array_equal(bits(ours.gate_up), bits(theirs.gate_up)) and np.array_equal(bits(ours.down), bits(theirs.down))
    assert g.expert_nbytes == hf.expert_nbytes and g.total_bytes == hf.total_bytes


@pytest.mark.parametrize("arch", ARCHES)
def test_engine_logits_match_the_hf_folder(models, arch):
    folder, path = models[arch]
    ids = np.arange(48) * 37 % open_checkpoint(folder).spec.vocab_size
    delta = np.abs(score(Engine(open_checkpoint(path)), ids) - score(Engine(open_checkpoint(folder)), ids)).max()
    assert delta <= LOGIT_TOLERANCE, f"{arch}: max |dlogit| {delta}"


# -- quantized files ------------------------------------------------------------------


@pytest.mark.parametrize("arch", ARCHES)
@pytest.mark.parametrize("dtype", ["F16", "BF16", "Q8_0"])
def test_quantized_files_dequantize_bit_for_bit_as_gguf_does(models, arch, dtype, tmp_path):
    folder, f32 = models[arch]
    path = write_gguf(folder, tmp_path / f"{arch}-{dtype}.gguf", dtype)[0]
    g, hf = open_checkpoint(path), open_checkpoint(folder)
    raw = {t.name: t for t in gguf.GGUFReader(path).tensors}
    s = hf.spec
    assert {t.tensor_type for t in raw.values()} == {QType.F32, QType[dtype]}  # the tiny dims are whole Q8_0 blocks
    assert all(raw[n].tensor_type == QType.F32 for n in raw if raw[n].data.ndim == 1 or "norm" in n or "gate_inp" in n)
    for name in hf.names():
        layer = expert_layer(s.arch, name)
        if layer is None:
            stored = raw[gguf_name(s.arch, name)]
            values = gguf.quants.dequantize(stored.data, stored.tensor_type)
        else:
            expert, part = int(name.split(".experts.")[1].split(".")[0]), name.split(".")[-2]
            part = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}[part]
            stored = raw[f"blk.{layer}.ffn_{part}_exps.weight"]
            values = gguf.quants.dequantize(stored.data[expert], stored.tensor_type)
        ours = g.tensor(name).numpy()
        if s.arch == "mixtral" and ".self_attn.q_proj." in name:
            ours = permute(ours, s.num_heads)
        if s.arch == "mixtral" and ".self_attn.k_proj." in name:
            ours = permute(ours, s.num_kv_heads)
        assert np.array_equal(ours.view(np.int32), values.view(np.int32)), name
        # ... and that is the converter's rounding of the HF value (permuting rows commutes with it)
        converted = gguf.quants.dequantize(gguf.quants.quantize(hf.tensor(name).numpy(), stored.tensor_type), stored.tensor_type)
        assert np.array_equal(g.tensor(name).numpy().view(np.int32), converted.view(np.int32)), name
    assert g.fingerprint != open_checkpoint(f32).fingerprint
    assert g.expert_nbytes == sum(int(raw[f"blk.{s.moe_layers[0]}.ffn_{p}_exps.weight"].n_bytes) for p in ("gate", "up", "down")) // s.num_experts


# -- files, sets, blocks --------------------------------------------------------------


def test_a_split_set_opens_by_its_first_file_or_its_folder(models, tmp_path):
    folder, single = models["qwen3_moe"]
    paths = write_gguf(folder, tmp_path / "set" / "model.gguf", split_max_tensors=10)
    assert [p.name for p in paths] == [f"model-{i:05d}-of-{len(paths):05d}.gguf" for i in range(1, len(paths) + 1)] and len(paths) > 2
    whole = open_checkpoint(single)
    for opened in (open_checkpoint(paths[0]), open_checkpoint(tmp_path / "set")):
        assert opened.spec == whole.spec and opened.names() == whole.names() and opened.files == paths
        assert all(torch.equal(opened.tensor(n), whole.tensor(n)) for n in whole.names())
    with pytest.raises(CheckpointError, match="file 2 of"):
        open_checkpoint(paths[1])


def test_glm_nextn_block_is_recognised_and_not_run(models, tmp_path):
    """A GLM-4 MoE whose last block is its NextN/MTP layer: block_count counts it, nextn_predict_layers says so."""
    source, _ = models["glm4_moe"]
    folder = tmp_path / "glm-mtp"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    config |= {"num_hidden_layers": config["num_hidden_layers"] - 1, "num_nextn_predict_layers": 1}
    (folder / "config.json").write_text(json.dumps(config))
    path = write_gguf(folder, tmp_path / "glm-mtp.gguf")[0]
    fields = gguf.GGUFReader(path).fields
    assert fields["glm4moe.block_count"].contents() == 3 and fields["glm4moe.nextn_predict_layers"].contents() == 1
    g, hf = open_checkpoint(path), open_checkpoint(folder)
    assert g.spec == hf.spec and g.spec.num_layers == 2
    assert not any(n.startswith("model.layers.2.") for n in g.names()) and g.names() == [n for n in hf.names() if not n.startswith("model.layers.2.")]
    ids = np.arange(24) * 5 % g.spec.vocab_size
    assert np.abs(score(Engine(g), ids) - score(Engine(hf), ids)).max() <= LOGIT_TOLERANCE


@pytest.mark.parametrize("arch", ARCHES)
def test_tensor_names_are_gguf_tensor_name_maps(models, arch):
    """The names moetier writes are the ones the converter gets from gguf's TensorNameMap, after its own renames
    (e_score_correction_bias -> e_score_correction.bias; experts merged under their per-expert names' stem)."""
    folder, path = models[arch]
    hf = open_checkpoint(folder)
    model_arch = next(a for a, name in gguf.MODEL_ARCH_NAMES.items() if name == GGUF_ARCHITECTURES[arch])
    names = gguf.get_tensor_name_map(model_arch, hf.spec.num_layers)
    expected = set()
    for name in hf.names():
        layer = expert_layer(arch, name)
        if layer is not None:
            proj = name.split(".")[-2]
            name = f"layers.{layer}.feed_forward.experts.{proj}.weight" if arch == "mixtral" else f"model.layers.{layer}.mlp.experts.{proj}.weight"
        expected.add(names.get_name(name.replace("e_score_correction_bias", "e_score_correction.bias"), try_suffixes=(".weight", ".bias")))
    assert {t.name for t in gguf.GGUFReader(path).tensors} == expected


def test_metadata_and_vocabulary_follow_llama_cpp(models):
    fields = {arch: gguf.GGUFReader(models[arch][1]).fields for arch in ARCHES}
    value = lambda arch, key: fields[arch][key].contents()
    assert [value(a, "general.architecture") for a in ARCHES] == ["qwen3moe", "glm4moe", "llama"]
    glm = {k: value("glm4_moe", f"glm4moe.{k}") for k in ("leading_dense_block_count", "expert_shared_count", "expert_gating_func",
                                                         "expert_group_count", "expert_group_used_count", "rope.dimension_count",
                                                         "expert_weights_norm", "expert_weights_scale")}
    assert glm == {"leading_dense_block_count": 1, "expert_shared_count": 1, "expert_gating_func": 2, "expert_group_count": 4,
                   "expert_group_used_count": 2, "rope.dimension_count": 8, "expert_weights_norm": True, "expert_weights_scale": 2.5}
    assert value("mixtral", "llama.vocab_size") == 512 and value("qwen3_moe", "qwen3moe.expert_feed_forward_length") == 32
    for arch in ARCHES:  # a synthetic folder's own BPE tokenizer, as the converter writes a tokenizer.json's
        check_vocabulary(value, arch, "gpt2")


def check_vocabulary(value, arch: str, model: str) -> None:
    tokens = value(arch, "tokenizer.ggml.tokens")
    assert value(arch, "tokenizer.ggml.model") == model and len(tokens) == 512 and len(set(tokens)) == 512
    assert len(value(arch, "tokenizer.ggml.token_type")) == 512
    assert (value(arch, "tokenizer.ggml.bos_token_id"), value(arch, "tokenizer.ggml.eos_token_id")) == (1, 2)
    if model == "gpt2":  # every merge joins two tokens into a third
        merges, known = value(arch, "tokenizer.ggml.merges"), set(tokens)
        assert merges and all(a in known and b in known and a + b in known for a, b in (m.split(" ") for m in merges))
    else:
        assert len(value(arch, "tokenizer.ggml.scores")) == 512 and "<0x0A>" in tokens


def test_a_folder_without_a_tokenizer_gets_the_converters_stand_in_vocabulary(models, tmp_path):
    """No tokenizer.json (a transformers-saved random checkpoint): the stand-in vocabulary, SentencePiece for a llama
    GGUF and BPE for the others, as the converter's _set_vocab_sentencepiece / _set_vocab_gpt2 write them."""
    import shutil

    fields = {}
    for arch in ("qwen3_moe", "mixtral"):
        folder = tmp_path / arch
        shutil.copytree(models[arch][0], folder)
        (folder / "tokenizer.json").unlink()
        fields[arch] = gguf.GGUFReader(write_gguf(folder, tmp_path / f"{arch}.gguf", "F32")[0]).fields
    value = lambda arch, key: fields[arch][key].contents()  # noqa: E731
    check_vocabulary(value, "qwen3_moe", "gpt2")
    check_vocabulary(value, "mixtral", "llama")


def small_vocab_checkpoint(folder):
    """A random transformers Qwen3-MoE of 100 token ids, saved without a tokenizer: fewer ids than bytes."""
    import transformers

    config = transformers.Qwen3MoeConfig(vocab_size=100, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, bos_token_id=1,
                                         eos_token_id=2)
    torch.manual_seed(5)
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.1)
    model.save_pretrained(folder)
    return folder


def test_a_stand_in_vocabulary_smaller_than_the_bytes_still_has_a_merge(tmp_path):
    """100 ids hold no piece after the byte tokens; llama.cpp loads no BPE file without tokenizer.ggml.merges (it
    refuses 'cannot find tokenizer merges'), so the last byte token gives its place to one (test_peer_llama loads it)."""
    path = write_gguf(small_vocab_checkpoint(tmp_path / "hf"), tmp_path / "small.gguf", "F32")[0]
    fields = gguf.GGUFReader(path).fields
    tokens, merges = fields["tokenizer.ggml.tokens"].contents(), fields["tokenizer.ggml.merges"].contents()
    assert len(tokens) == 100 and len(set(tokens)) == 100
    assert merges and all(a in tokens and b in tokens and a + b in tokens for a, b in (m.split(" ") for m in merges))


def test_a_glm4_moe_without_a_shared_expert_is_refused_as_llama_cpp_runs_it_otherwise(tmp_path):
    """transformers writes n_shared_experts = 0 as a shared expert of width 0; llama.cpp's glm4moe fails to load those
    tensors ('wrong number of tensors'), and with them left out its logits were 1.5 from transformers' (moetier's
    within 4e-7): refused in one line, nothing written."""
    import transformers

    config = transformers.Glm4MoeConfig(vocab_size=300, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=0, first_k_dense_replace=1,
                                        norm_topk_prob=True, n_group=1, topk_group=1)
    transformers.Glm4MoeForCausalLM(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(SpecError, match="'n_shared_experts' is 0") as error:
        write_gguf(tmp_path / "hf", tmp_path / "glm.gguf")
    assert "\n" not in str(error.value) and not (tmp_path / "glm.gguf").exists()


# -- writing is whole or nothing ---------------------------------------------------------


def test_write_refuses_what_llama_cpp_would_compute_differently_and_leaves_nothing(models, tmp_path, monkeypatch):
    source, _ = models["qwen3_moe"]
    folder = tmp_path / "nonorm"
    shutil.copytree(source, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"norm_topk_prob": False}))
    with pytest.raises(SpecError, match="norm_topk_prob"):
        write_gguf(folder, tmp_path / "nonorm.gguf")
    calls = []

    def failing(data, qtype):
        calls.append(qtype)
        if len(calls) == 5:
            raise OSError(28, "No space left on device")
        return gguf.quants.quantize(data, qtype)

    monkeypatch.setattr("moetier.model.gguf_write.gguf.quants.quantize", failing)
    with pytest.raises(OSError):
        write_gguf(source, tmp_path / "out" / "m.gguf", split_max_tensors=30)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["nonorm"]


# -- the command line ---------------------------------------------------------------------


def test_synth_info_and_run_on_gguf(tmp_path):
    for arch in ARCHES + ("qwen3_next", "glm5_next"):  # every arch's default preset writes a file llama.cpp loads
        result = moetier("synth", "--arch", arch, "--preset", "tiny", "--format", "gguf", "--out", tmp_path / f"{arch}.gguf")
        assert result.returncode == 0, result.stderr
    info = json.loads(moetier("info", tmp_path / "glm4_moe.gguf", "--json").stdout)
    assert info["arch"] == "glm4_moe" and info["fingerprint"] == open_checkpoint(tmp_path / "glm4_moe.gguf").fingerprint
    result = moetier("run", "--model", tmp_path / "mixtral.gguf", "--max-new-tokens", 4, "--json")
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["generated_ids"]) == 4


def _edited(source, path, edit) -> object:
    """A copy of a GGUF file with its header edited in place (gguf's own r+ mapping, as gguf_set_metadata.py does)."""
    shutil.copy(source, path)
    reader = gguf.GGUFReader(path, "r+")
    edit(reader)
    reader.data.flush()
    del reader
    return path


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def _bad_files(models, tmp_path) -> dict:
    """label -> (path, words its one error line must hold)."""
    good = models["qwen3_moe"][1]
    size = good.stat().st_size
    (tmp_path / "truncated.gguf").write_bytes(good.read_bytes()[: size // 2])
    (tmp_path / "header-cut.gguf").write_bytes(good.read_bytes()[:1000])
    (tmp_path / "garbage.gguf").write_bytes(bytes(range(256)) * 8)
    (tmp_path / "magic-then-garbage.gguf").write_bytes(b"GGUF" + (3).to_bytes(4, "little") + b"\xff" * 200)
    last = gguf.GGUFReader(good).tensors[-1].name
    writer = gguf.GGUFWriter(tmp_path / "deepseek.gguf", "deepseek2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    split = write_gguf(models["glm4_moe"][0], tmp_path / "set" / "glm.gguf", split_max_tensors=15)
    (tmp_path / "empty.gguf").write_bytes(b"")
    split[1].unlink()
    return {
        "truncated": (tmp_path / "truncated.gguf", "runs past the end of the file"),
        "header cut": (tmp_path / "header-cut.gguf", "runs past the end of the file"),
        "declared size past the file": (_edited(good, tmp_path / "long.gguf",
                                                lambda r: _tensor(r, last).field.parts[3].__setitem__(-1, 4096)),
                                        f"tensor {last!r} runs past the end"),
        "unknown tensor type": (_edited(good, tmp_path / "type99.gguf",
                                        lambda r: _tensor(r, "token_embd.weight").field.parts[4].__setitem__(0, 99)),
                                "tensor 'token_embd.weight': unknown GGML type 99"),
        "type not supported yet": (_edited(good, tmp_path / "q4.gguf",
                                           lambda r: _tensor(r, "blk.1.ffn_gate_exps.weight").field.parts[4].__setitem__(0, int(QType.Q8_1))),
                                   "is Q8_1: not supported yet for experts"),
        "unsupported architecture": (tmp_path / "deepseek.gguf", "deepseek2: not supported yet"),
        "missing split file": (split[0], "split file 2 of"),
        "metadata disagrees with shapes": (_edited(good, tmp_path / "experts.gguf",
                                                   lambda r: r.fields["qwen3moe.expert_count"].parts[-1].__setitem__(0, 8)),
                                           "has shape {64, 16} (expected {64, 8} from the metadata, ggml order: dim 1 is qwen3moe.expert_count = 8)"),
        "garbage": (tmp_path / "garbage.gguf", "not a readable GGUF file"),
        "magic then garbage": (tmp_path / "magic-then-garbage.gguf", "magic-then-garbage.gguf: "),
        "empty": (tmp_path / "empty.gguf", "empty file"),
        "missing file": (tmp_path / "absent.gguf", "no such file"),
    }


def test_mutated_headers_open_or_are_refused_in_one_line(models, tmp_path):
    """GGUFReader raises assorted exceptions on garbage, and reads past the end short; every mutation of a real
    header (and a cut) is a file that opens or one CheckpointError / SpecError naming it, never another
    exception or a hang."""
    source = models["glm4_moe"][1]
    good, header = source.read_bytes(), gguf.GGUFReader(source).data_offset
    rng = np.random.default_rng(7)
    path = tmp_path / "mutant.gguf"
    for _ in range(200):
        data = bytearray(good)
        for _ in range(int(rng.integers(1, 4))):
            data[int(rng.integers(0, header))] = int(rng.integers(0, 256))
        path.write_bytes(bytes(data[: int(rng.integers(header // 2, len(data)))] if rng.random() < 0.2 else data))
        try:
            checkpoint = open_checkpoint(path)
        except (CheckpointError, SpecError) as err:
            assert "\n" not in str(err) and str(err).startswith(str(path)), str(err)
            continue
        checkpoint.expert(checkpoint.spec.moe_layers[0], 0)


def test_bad_gguf_input_gives_one_line_and_exit_2(models, tmp_path):
    for label, (path, words) in _bad_files(models, tmp_path).items():
        with pytest.raises((CheckpointError, SpecError)):  # the library raises the one error type; the CLI prints it
            open_checkpoint(path)
        run = moetier if label == "truncated" else moetier_here  # one as a real process: its exit status and stderr
        refused(run("info", path), words, path.name)
