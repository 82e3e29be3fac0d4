"""Model specs and checkpoint loading: configs, sharding, lazy mapping, bad input."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moetier.engine import Engine, score
from moetier.model import CheckpointError, ModelSpec, SpecError, open_checkpoint
from moetier.model.safetensors_mmap import SafetensorsFile

QWEN = {
    "model_type": "qwen3_moe", "vocab_size": 32, "hidden_size": 16, "num_hidden_layers": 2,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "intermediate_size": 24,
    "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 2, "rope_theta": 10000.0,
}


def qwen_tensors(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    d, i, e, v = config["hidden_size"], config["moe_intermediate_size"], config["num_experts"], config["vocab_size"]
    hd, kv, h = config["head_dim"], config["num_key_value_heads"], config["num_attention_heads"]
    rand = lambda *shape: torch.randn(*shape, generator=g) * 0.2  # noqa: E731
    tensors = {"model.embed_tokens.weight": rand(v, d), "lm_head.weight": rand(v, d), "model.norm.weight": torch.ones(d)}
    for layer in range(config["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        tensors |= {
            p + "self_attn.q_proj.weight": rand(h * hd, d), p + "self_attn.k_proj.weight": rand(kv * hd, d),
            p + "self_attn.v_proj.weight": rand(kv * hd, d), p + "self_attn.o_proj.weight": rand(d, h * hd),
            p + "self_attn.q_norm.weight": torch.ones(hd), p + "self_attn.k_norm.weight": torch.ones(hd),
            p + "input_layernorm.weight": torch.ones(d), p + "post_attention_layernorm.weight": torch.ones(d),
            p + "mlp.gate.weight": rand(e, d),
        }
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            tensors |= {q + "gate_proj.weight": rand(i, d), q + "up_proj.weight": rand(i, d), q + "down_proj.weight": rand(d, i)}
    return tensors


@pytest.fixture
def qwen_folder(tmp_path):
    folder = tmp_path / "qwen"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN))
    save_file(qwen_tensors(QWEN), folder / "model.safetensors")
    return folder


# -- config.json -----------------------------------------------------------------
def test_spec_reads_v4_and_v5_rope_keys():
    v4 = ModelSpec.from_hf_config(dict(QWEN, rope_theta=5e5))
    v5 = ModelSpec.from_hf_config({k: v for k, v in QWEN.items() if k != "rope_theta"} | {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert v4.rope_theta == v5.rope_theta == 5e5


def test_glm_defaults_to_half_rotary():
    glm = dict(QWEN, model_type="glm4_moe", n_routed_experts=4, first_k_dense_replace=1, n_shared_experts=1)
    spec = ModelSpec.from_hf_config(glm)
    assert spec.rotary_dim == QWEN["head_dim"] // 2 and spec.router == "sigmoid" and spec.moe_layers == (1,)


@pytest.mark.parametrize(
    "change, words",
    [
        ({"model_type": "llama"}, ["model_type", "llama", "expected one of"]),
        ({"hidden_size": None}, ["hidden_size", "missing"]),
        ({"num_experts_per_tok": "two"}, ["num_experts_per_tok", "expected int"]),
        ({"num_key_value_heads": 3}, ["num_key_value_heads", "multiple"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, ["yarn", "not supported"]),
        ({"hidden_act": "gelu"}, ["hidden_act", "silu"]),
    ],
)
def test_bad_configs_are_refused_with_the_key(change, words):
    with pytest.raises(SpecError) as err:
        ModelSpec.from_hf_config({k: v for k, v in (QWEN | change).items() if v is not None}, source="x/config.json")
    message = str(err.value)
    assert message.startswith("x/config.json: ") and "\n" not in message
    assert all(w in message for w in words)


# -- checkpoint files ----------------------------------------------------------------
def test_sharded_index_and_bare_shards_load_the_same_weights(qwen_folder, tmp_path):
    tensors = qwen_tensors(QWEN)
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    expected = score(Engine(open_checkpoint(qwen_folder)), np.arange(10))
    for with_index in (True, False):
        folder = tmp_path / f"sharded-{with_index}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(QWEN))
        for shard, members in halves.items():
            save_file({n: tensors[n] for n in members}, folder / shard)
        if with_index:
            weight_map = {n: shard for shard, members in halves.items() for n in members}
            (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        assert np.array_equal(score(Engine(open_checkpoint(folder)), np.arange(10)), expected)


def test_bfloat16_checkpoint_keeps_bf16_experts_and_computes_in_float32(qwen_folder, tmp_path):
    folder = tmp_path / "bf16"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN))
    save_file({n: t.to(torch.bfloat16) for n, t in qwen_tensors(QWEN).items()}, folder / "model.safetensors")
    checkpoint = open_checkpoint(folder)
    expert = checkpoint.expert(0, 1)
    assert expert.gate_up.dtype == torch.bfloat16 and expert.formats == "BF16"
    assert checkpoint.tensor("model.layers.0.self_attn.q_proj.weight").dtype == torch.float32  # the trunk
    assert checkpoint.expert_nbytes == 3 * 16 * 8 * 2
    assert np.isfinite(score(Engine(checkpoint), np.arange(6))).all()


def test_fingerprint_is_stable_and_tracks_config(qwen_folder):
    first = open_checkpoint(qwen_folder).fingerprint
    assert open_checkpoint(qwen_folder).fingerprint == first
    (qwen_folder / "config.json").write_text(json.dumps(dict(QWEN, rope_theta=1e6)))
    assert open_checkpoint(qwen_folder).fingerprint != first


def test_missing_tensor_is_named(qwen_folder):
    tensors = qwen_tensors(QWEN)
    del tensors["model.layers.1.mlp.experts.3.down_proj.weight"]
    save_file(tensors, qwen_folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts\.3\.down_proj\.weight.*missing"):
        open_checkpoint(qwen_folder)


def test_wrong_shape_is_named(qwen_folder):
    tensors = qwen_tensors(QWEN)
    tensors["model.layers.0.mlp.gate.weight"] = torch.zeros(5, 16)
    save_file(tensors, qwen_folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mlp\.gate\.weight.*\[5, 16\].*expected \[4, 16\]"):
        open_checkpoint(qwen_folder)


@pytest.mark.parametrize("damage", ["truncate", "bad-json", "not-an-object", "offsets", "dtype", "huge-header"])
def test_damaged_safetensors_are_refused(qwen_folder, damage):
    path = qwen_folder / "model.safetensors"
    raw = path.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    name = "model.layers.0.mlp.gate.weight"
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "bad-json":
        raw = raw[:8] + b"!" + raw[9:]
    elif damage == "not-an-object":
        raw = raw[:8] + b"[" + raw[9 : 8 + header_len - 1] + b"]" + raw[8 + header_len :]
    elif damage == "huge-header":
        raw = struct.pack("<Q", 10**15) + raw[8:]
    else:
        if damage == "offsets":
            header[name]["data_offsets"][1] += 4
        else:
            header[name]["dtype"] = "F7"
        encoded = json.dumps(header).encode().ljust(header_len)
        raw = raw[:8] + encoded[:header_len] + raw[8 + header_len :]
    path.write_bytes(raw)
    with pytest.raises(CheckpointError, match=str(path)):
        open_checkpoint(qwen_folder)


def test_not_a_folder_and_no_weights(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        open_checkpoint(tmp_path / "absent")
    (tmp_path / "config.json").write_text(json.dumps(QWEN))
    with pytest.raises(CheckpointError, match="no safetensors"):
        open_checkpoint(tmp_path)


def _rss_bytes() -> int:
    with open(f"/proc/{os.getpid()}/statm") as handle:
        return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc to read resident memory")
def test_opening_a_checkpoint_larger_than_ram_maps_it_lazily(tmp_path):
    """A 32 GB (sparse) checkpoint opens, and one expert is read, for a few MB of resident memory."""
    config = dict(QWEN, hidden_size=4096, moe_intermediate_size=2048, num_experts=512, num_hidden_layers=2,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=1024, intermediate_size=1024)
    d, i, e = 4096, 2048, 512
    shapes: dict[str, list[int]] = {"model.embed_tokens.weight": [1024, d], "lm_head.weight": [1024, d], "model.norm.weight": [d]}
    for layer in range(2):
        p = f"model.layers.{layer}."
        shapes |= {p + "self_attn.q_proj.weight": [4096, d], p + "self_attn.k_proj.weight": [1024, d],
                   p + "self_attn.v_proj.weight": [1024, d], p + "self_attn.o_proj.weight": [d, 4096],
                   p + "self_attn.q_norm.weight": [128], p + "self_attn.k_norm.weight": [128],
                   p + "input_layernorm.weight": [d], p + "post_attention_layernorm.weight": [d], p + "mlp.gate.weight": [e, d]}
        for x in range(e):
            q = f"{p}mlp.experts.{x}."
            shapes |= {q + "gate_proj.weight": [i, d], q + "up_proj.weight": [i, d], q + "down_proj.weight": [d, i]}
    header, offset = {}, 0
    for name, shape in shapes.items():
        nbytes = int(np.prod(shape)) * 4
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header).encode()
    (tmp_path / "config.json").write_text(json.dumps(config))
    with open(tmp_path / "model.safetensors", "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)) + encoded)
        handle.truncate(8 + len(encoded) + offset)  # sparse: no data blocks on disk
    assert offset > 32e9
    before = _rss_bytes()
    checkpoint = open_checkpoint(tmp_path)
    weights = checkpoint.expert(1, 300)
    assert float(weights.down.sum()) == 0.0  # touches the expert's pages
    assert checkpoint.total_bytes > 32e9
    assert _rss_bytes() - before < 300e6


def test_safetensors_views_alias_the_file(qwen_folder):
    file = SafetensorsFile(qwen_folder / "model.safetensors")
    a = file.tensor("model.norm.weight")
    b = file.tensor("model.norm.weight")
    assert a.data_ptr() == b.data_ptr()
