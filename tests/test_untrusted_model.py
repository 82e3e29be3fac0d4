"""Untrusted model inputs: a bad config.json, safetensors header or shard index is refused in one line.

Every spec rule lives in ModelSpec.validate, whatever the spec was read from; the
known bad configs of the issue go through the CLI (`moetier run`, `moetier
score`): one line `moetier: error: <file>: ... <key> ...` on stderr, exit code
2, no traceback, no signal, no output file. They are refused in Python as the
checkpoint opens, so they run in this process (cli_runs.moetier_here), but for
the one that crashed the native router and the FIFO, which run as real
processes. Headers and indexes are crafted byte by byte.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from cli_runs import moetier, moetier_here, refused
from moetier.model import CheckpointError, ModelSpec, SpecError, open_checkpoint
from moetier.model.safetensors_mmap import SafetensorsFile
from moetier.model.spec import MAX_COUNT, MAX_LAYERS
from moetier.model.synth import PRESETS, arch_preset, write_synthetic
from moetier.model.synth_config import _config


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("untrusted-model")
    return {arch: write_synthetic(root / arch, arch=arch, preset="tiny") for arch in ("qwen3_moe", "glm4_moe")}


def edited(synthetic: dict[str, Path], tmp_path: Path, arch: str, change: dict) -> Path:
    """A copy of the tiny `arch` checkpoint whose config.json has `change` applied (None deletes a key)."""
    folder = tmp_path / f"{arch}-edited"
    shutil.copytree(synthetic[arch], folder)
    config = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (folder / "config.json").write_text(json.dumps(config))  # NaN and Infinity as Python's json writes them
    return folder


def spec_error(arch: str, change: dict) -> str:
    config = _config(arch, arch_preset(arch, PRESETS["tiny"]))
    for key, value in change.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    with pytest.raises(SpecError) as err:
        ModelSpec.from_hf_config(config, source="m/config.json")
    message = str(err.value)
    assert message.startswith("m/config.json: ") and "\n" not in message
    return message


# -- config.json through the CLI: the cases of the issue -------------------------------------------------------
NAN_THETA = {"rope_theta": math.nan, "rope_parameters": {"rope_type": "default", "rope_theta": math.nan}}
SEGFAULTED = {"num_experts_per_tok": 0}  # runs as a real process: were it let through again, a crash is an exit status
ISSUE_CASES = [
    ("qwen3_moe", SEGFAULTED, "num_experts_per_tok"),  # SIGSEGV in the native router
    ("qwen3_moe", {"rms_norm_eps": -1}, "rms_norm_eps"),
    ("qwen3_moe", NAN_THETA, "rope_theta"),
    ("qwen3_moe", {"num_hidden_layers": 0}, "num_hidden_layers"),
    ("qwen3_moe", {"num_experts_per_tok": 17}, "num_experts_per_tok"),  # top-k above the 16 experts
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),  # ZeroDivisionError
    ("glm4_moe", {"n_group": 0}, "n_group"),  # ZeroDivisionError
]


@pytest.mark.parametrize("arch, change, key", ISSUE_CASES, ids=[f"{a}-{k}-{next(iter(c.values()))}" for a, c, k in ISSUE_CASES])
def test_a_bad_config_is_one_line_from_run_and_score(synthetic, tmp_path, arch, change, key):
    folder = edited(synthetic, tmp_path, arch, change)
    run = moetier if change is SEGFAULTED else moetier_here
    refused(run("run", "--model", folder, "--max-new-tokens", 3), "config.json", key)
    ids, out = tmp_path / "ids.npy", tmp_path / "out.npy"
    np.save(ids, np.arange(5))
    refused(run("score", folder, "--ids", ids, "--out", out), "config.json", key)
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == sorted([f"{arch}-edited", "ids.npy"])


def test_a_config_that_is_not_utf8_or_nests_absurdly_deep_is_one_line(synthetic, tmp_path):
    folder = edited(synthetic, tmp_path, "qwen3_moe", {})
    (folder / "config.json").write_bytes(b'{"model_type": "qwen3_moe\xff\xfe"}')  # read_text raised UnicodeDecodeError
    refused(moetier_here("run", "--model", folder, "--max-new-tokens", 3), "config.json", "UTF-8")
    (folder / "config.json").write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")  # RecursionError
    refused(moetier_here("run", "--model", folder, "--max-new-tokens", 3), "config.json", "nests deeper")


def test_a_config_that_is_a_fifo_is_refused_not_waited_on(synthetic, tmp_path):
    folder = edited(synthetic, tmp_path, "qwen3_moe", {})
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # reading it used to block for ever, waiting for a writer: a real process, timed out
    refused(moetier("run", "--model", folder, "--max-new-tokens", 3, timeout=60), "config.json", "not a regular file")


# -- ModelSpec.validate: every rule, one line naming the file and the key -----------------------------------------
SPEC_CASES = [
    ("qwen3_moe", {"vocab_size": 0}, "vocab_size"),
    ("qwen3_moe", {"hidden_size": -64}, "hidden_size"),
    ("qwen3_moe", {"num_attention_heads": 0, "head_dim": None}, "num_attention_heads"),  # ZeroDivisionError
    ("qwen3_moe", {"hidden_size": 2, "head_dim": None}, "hidden_size / num_attention_heads"),  # head_dim 2 // 4 = 0
    ("qwen3_moe", {"num_key_value_heads": 0}, "num_key_value_heads"),  # ZeroDivisionError
    ("qwen3_moe", {"head_dim": 0}, "head_dim"),  # silently replaced by hidden_size / heads
    ("qwen3_moe", {"intermediate_size": 0}, "intermediate_size"),
    ("qwen3_moe", {"moe_intermediate_size": -1}, "moe_intermediate_size"),
    ("qwen3_moe", {"num_experts": 0}, "num_experts"),
    ("qwen3_moe", {"num_hidden_layers": MAX_LAYERS + 1}, "num_hidden_layers"),
    ("qwen3_moe", {"hidden_size": 2**70}, "hidden_size"),
    ("qwen3_moe", {"rope_theta": 2**1100, "rope_parameters": None}, "rope_theta"),  # OverflowError in float()
    ("qwen3_moe", {"mlp_only_layers": [3]}, "mlp_only_layers"),  # out of range: silently ignored
    ("qwen3_moe", {"mlp_only_layers": [[0]]}, "mlp_only_layers"),  # TypeError: unhashable
    ("qwen3_moe", {"mlp_only_layers": [True]}, "mlp_only_layers"),
    ("qwen3_moe", {"mlp_only_layers": [0, 1, 2]}, "no MoE layer"),
    ("qwen3_moe", {"decoder_sparse_step": 4}, "no MoE layer"),
    ("qwen3_moe", {"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ("qwen3_moe", {"rms_norm_eps": math.inf}, "rms_norm_eps"),
    ("qwen3_moe", {"rms_norm_eps": 0}, "rms_norm_eps"),
    ("qwen3_moe", {"rope_theta": math.inf, "rope_parameters": None}, "rope_theta"),
    ("qwen3_moe", {"rope_parameters": "default"}, "rope_parameters"),  # AttributeError: str has no get
    ("qwen3_moe", {"rope_scaling": [1]}, "rope_scaling"),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 0}, "sliding_window"),
    ("qwen3_moe", {"max_position_embeddings": 0}, "max_position_embeddings"),
    ("glm4_moe", {"n_group": 3}, "n_group"),
    ("glm4_moe", {"topk_group": 0}, "topk_group"),
    ("glm4_moe", {"topk_group": 5}, "topk_group"),  # more groups kept than there are
    ("glm4_moe", {"num_experts_per_tok": 9}, "topk_group"),  # 2 kept groups of 4 hold only 8 experts
    ("glm4_moe", {"n_shared_experts": -1}, "n_shared_experts"),
    ("glm4_moe", {"routed_scaling_factor": 0}, "routed_scaling_factor"),
    ("glm4_moe", {"routed_scaling_factor": math.nan}, "routed_scaling_factor"),
    ("glm4_moe", {"first_k_dense_replace": -1}, "first_k_dense_replace"),  # a MoE layer -1
    ("glm4_moe", {"first_k_dense_replace": 4}, "first_k_dense_replace"),
    ("glm4_moe", {"first_k_dense_replace": 3}, "no MoE layer"),
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.3125}}, "partial_rotary_factor"),  # 5 dims
    ("glm4_moe", {"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.0625}}, "partial_rotary_factor"),  # 1 dim
    ("mixtral", {"num_local_experts": 0}, "num_local_experts"),
    ("mixtral", {"num_experts_per_tok": 9}, "num_experts_per_tok"),
]


@pytest.mark.parametrize("arch, change, key", SPEC_CASES, ids=[f"{a}-{'-'.join(map(str, c.items()))[:60]}" for a, c, k in SPEC_CASES])
def test_every_spec_rule_is_one_line_naming_the_key(arch, change, key):
    assert key in spec_error(arch, change)


def test_validate_guards_every_constructor_not_only_the_config_reader():
    """A spec built another way (a GGUF reader, dataclasses.replace) goes through the same rules; without key
    names the messages name the fields."""
    spec = ModelSpec.from_hf_config(_config("glm4_moe", arch_preset("glm4_moe", PRESETS["tiny"])))
    assert spec.validate() is spec
    for change, word in [({"top_k": 0}, "'top_k'"), ({"rope_theta": math.nan}, "'rope_theta'"), ({"moe_layers": ()}, "no MoE layer"),
                         ({"moe_layers": (2, 1)}, "increasing"), ({"num_layers": True}, "'num_layers'"), ({"rotary_dim": 7}, "'rotary_dim'")]:
        with pytest.raises(SpecError, match=word):
            dataclasses.replace(spec, **change).validate("model.gguf")


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe", "mixtral"])
def test_every_synthetic_preset_still_validates(arch):
    for preset in PRESETS.values():
        ModelSpec.from_hf_config(_config(arch, arch_preset(arch, preset)))


def test_a_config_claiming_more_experts_than_the_files_hold_fails_at_once(synthetic, tmp_path):
    """The completeness check stops at the first tensor missing: it never lists 2**31 experts first."""
    folder = edited(synthetic, tmp_path, "qwen3_moe", {"num_experts": MAX_COUNT, "num_hidden_layers": MAX_LAYERS})
    with pytest.raises(CheckpointError, match="mlp.gate.weight"):
        open_checkpoint(folder)


# -- safetensors headers --------------------------------------------------------------------------------------------
def write_safetensors(path: Path, header: dict | bytes, data: bytes = b"\0" * 16, pad: int = 0) -> Path:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * pad
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return path


F32 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
HEADER_CASES = [
    ("nested 100,000 deep", b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nests deeper"),  # RecursionError
    ("float offsets", {"w": F32 | {"data_offsets": [0.0, 8.0]}}, "data_offsets"),  # accepted, then TypeError in frombuffer
    ("bool offsets", {"w": {"dtype": "U8", "shape": [1], "data_offsets": [False, True]}}, "data_offsets"),
    ("string offsets", {"w": F32 | {"data_offsets": ["0", "8"]}}, "data_offsets"),  # TypeError
    ("three offsets", {"w": F32 | {"data_offsets": [0, 8, 8]}}, "data_offsets"),  # "too many values to unpack"
    ("offsets not a list", {"w": F32 | {"data_offsets": 8}}, "data_offsets"),  # TypeError
    ("huge offset", b'{"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, ' + b"9" * 5000 + b"]}}", "not valid JSON"),
    ("bool shape", {"w": {"dtype": "U8", "shape": [True], "data_offsets": [0, 1]}}, "shape"),
    ("dtype a list", {"w": F32 | {"dtype": ["F32"]}}, "dtype"),  # TypeError: unhashable
    ("metadata of numbers", {"__metadata__": {"format": 1}, "w": F32}, "__metadata__"),
    ("metadata a list", {"__metadata__": ["pt"], "w": F32}, "__metadata__"),
    ("overlapping tensors", {"a": F32, "b": F32 | {"data_offsets": [4, 12]}}, "overlap"),
    ("one tensor twice", {"a": F32, "b": F32}, "overlap"),
]


@pytest.mark.parametrize("header, word", [c[1:] for c in HEADER_CASES], ids=[c[0] for c in HEADER_CASES])
def test_a_malformed_header_is_one_checkpoint_error(tmp_path, header, word):
    path = write_safetensors(tmp_path / "model.safetensors", header)
    with pytest.raises(CheckpointError) as err:
        SafetensorsFile(path)
    message = str(err.value)
    assert message.startswith(str(path)) and "\n" not in message and word in message, message


def test_a_header_nested_100000_deep_is_one_line_from_the_cli(synthetic, tmp_path):
    folder = edited(synthetic, tmp_path, "qwen3_moe", {})
    write_safetensors(folder / "model.safetensors", b"[" * 100_000 + b"]" * 100_000)
    refused(moetier_here("run", "--model", folder, "--max-new-tokens", 3), "model.safetensors", "nests deeper")


def test_adjacent_and_empty_tensors_do_not_overlap(tmp_path):
    header = {"a": F32, "b": F32 | {"data_offsets": [8, 16]}, "empty": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}}
    assert set(SafetensorsFile(write_safetensors(tmp_path / "x.safetensors", header)).entries) == {"a", "b", "empty"}


def test_a_tensor_at_a_misaligned_offset_comes_back_aligned(tmp_path):
    """Native kernels read whole float32s: a tensor the file places at an odd address is copied, not viewed."""
    values = torch.tensor([1.5, -2.0, 3.25])
    header = json.dumps({"w": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}}).encode()
    pad = (-(8 + len(header))) % 8  # the data section starts 8-aligned, the tensor one byte into it
    path = write_safetensors(tmp_path / "x.safetensors", header, b"\0" + values.numpy().tobytes() + b"\0" * 3, pad)
    tensor = SafetensorsFile(path).tensor("w")
    assert tensor.data_ptr() % 4 == 0 and torch.equal(tensor, values)


def test_the_fingerprint_covers_where_each_tensor_lies(synthetic, tmp_path):
    """Two experts' bytes swapped in the header: same names, dtypes and shapes, other weights, other fingerprint."""
    folder = edited(synthetic, tmp_path, "qwen3_moe", {})
    path = folder / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    a, b = "model.layers.0.mlp.experts.0.up_proj.weight", "model.layers.0.mlp.experts.1.up_proj.weight"
    header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
    swapped = json.dumps(header, separators=(",", ":")).encode()
    assert len(swapped) <= length
    path.write_bytes(raw[:8] + swapped.ljust(length) + raw[8 + length :])
    assert open_checkpoint(folder).fingerprint != open_checkpoint(synthetic["qwen3_moe"]).fingerprint


# -- shard indexes -------------------------------------------------------------------------------------------------------
def sharded(synthetic: dict[str, Path], tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """The tiny qwen checkpoint split in two shards with an index; (folder, weight_map)."""
    folder = edited(synthetic, tmp_path, "qwen3_moe", {})
    source = SafetensorsFile(folder / "model.safetensors")
    tensors = {name: source.tensor(name).clone() for name in source.entries}
    del source
    (folder / "model.safetensors").unlink()
    from safetensors.torch import save_file

    names = sorted(tensors)
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, folder / shard)
    return folder, weight_map


def write_index(folder: Path, weight_map: object) -> None:
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_a_sharded_checkpoint_with_a_sound_index_opens(synthetic, tmp_path):
    folder, weight_map = sharded(synthetic, tmp_path)
    write_index(folder, weight_map)
    assert open_checkpoint(folder).names() == sorted(weight_map)


@pytest.mark.parametrize("case", ["parent", "absolute", "empty"])
def test_an_index_cannot_name_a_shard_outside_the_folder(synthetic, tmp_path, case):
    folder, weight_map = sharded(synthetic, tmp_path)
    outside = tmp_path / "outside.safetensors"
    shutil.copy(folder / "model-00001-of-00002.safetensors", outside)  # a real shard, so only the path is wrong
    shard = {"parent": "../outside.safetensors", "absolute": str(outside), "empty": ""}[case]
    write_index(folder, {n: shard if s.startswith("model-00001") else s for n, s in weight_map.items()})
    with pytest.raises(CheckpointError, match="not a file name inside the folder"):
        open_checkpoint(folder)


@pytest.mark.parametrize("weight_map", [["model-00001-of-00002.safetensors"], {"lm_head.weight": 3}, "x"],
                         ids=["list", "number", "string"])
def test_a_weight_map_that_is_not_names_to_file_names_is_one_line(synthetic, tmp_path, weight_map):
    folder, _ = sharded(synthetic, tmp_path)
    write_index(folder, weight_map)  # a list raised AttributeError, a number TypeError
    refused(moetier_here("run", "--model", folder, "--max-new-tokens", 3), "model.safetensors.index.json", "weight_map")


def test_a_tensor_the_index_places_in_the_wrong_shard_is_refused(synthetic, tmp_path):
    folder, weight_map = sharded(synthetic, tmp_path)
    weight_map["lm_head.weight"] = next(s for s in set(weight_map.values()) if s != weight_map["lm_head.weight"])
    write_index(folder, weight_map)
    with pytest.raises(CheckpointError, match="'lm_head.weight' is not in model-0000"):
        open_checkpoint(folder)


def test_an_index_that_is_not_utf8_names_the_file(synthetic, tmp_path):
    folder, _ = sharded(synthetic, tmp_path)
    (folder / "model.safetensors.index.json").write_bytes(b'{"weight_map": {"\xff": "x"}}')
    refused(moetier_here("run", "--model", folder, "--max-new-tokens", 3), "model.safetensors.index.json", "UTF-8")
