"""moetier's GGUF writer against llama.cpp's own converter on one HF folder: keys, tensor names, types, shapes, bytes.

    .venv/bin/python scripts/gguf_vs_converter.py LLAMA_CPP_DIR HF_FOLDER [--outtype f32|f16|bf16|q8_0] [--out DIR]

LLAMA_CPP_DIR is a llama.cpp source tree (convert_hf_to_gguf.py, conversion/,
gguf-py/; llama-cpp-python's sdist holds one under vendor/llama.cpp). The
converter runs on a copy of the folder (same name: general.name comes from it)
given a stand-in tokenizer (the byte-level pieces and a few merges, built with
`tokenizers`), its BPE pre-tokenizer check answered as moetier names it
("qwen2", or "glm4" for GLM-5.3: a stand-in has no known hash) and, for a
Qwen3-Next folder without MTP tensors, --no-mtp (it asserts otherwise). For a
GLM-5.3 (glm5_next) folder the stand-in also holds the four special tokens
_set_vocab_glm looks up, and the copy's text_config gains the keys of the
released config.json the converter reads and transformers' config does not
write (linear_attn_config, mla_use_nope, first_k_dense_replace; transformers
reads them back to the same model). moetier writes the original folder (its
own stand-in vocabulary). Every difference outside tokenizer.ggml.{tokens,
token_type,merges} (and GLM's special-token ids, the stand-in's) is printed,
then a JSON line: {"keys_differing": n, "tensors_differing": n}. For the
gpt2-vocabulary architectures with a stand-in the converter takes (qwen3moe,
qwen3next, glm5_next): it wants GLM-4's own tokenizer and Mixtral's
sentencepiece model, which a stand-in does not give.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np

from moetier.model.gguf_write import write_gguf

VOCABULARY = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
# the ids _set_vocab_glm sets from GLM's special tokens (the stand-in's): vocabulary too
GLM_SPECIAL = {"bos": "[gMASK]", "eot": "<|user|>", "unknown": "<|endoftext|>", "eom": "<|observation|>"}
# the converter with its pre-tokenizer check answered (argv: the answer, then the converter's own arguments)
RUN_CONVERTER = """
import runpy, sys
tree, pre = sys.argv.pop(1), sys.argv.pop(1)
sys.path.insert(0, tree)
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: pre
sys.argv[0] = tree + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def stand_in_tokenizer(folder: Path, vocab_size: int, special: tuple[str, ...] = ()) -> None:
    """tokenizer.json + tokenizer_config.json: up to 256 byte-level pieces, then merges of two pieces each, then
    `special` as special added tokens."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())[: vocab_size - len(special)]
    vocab, merges = {c: i for i, c in enumerate(chars)}, []
    for pair in ((a, b) for a in "abcd" for b in "efgh"):  # llama.cpp loads no gpt2 vocabulary without merges
        if len(vocab) < vocab_size - len(special) and all(c in vocab for c in pair):
            vocab["".join(pair)] = len(vocab)
            merges.append(pair)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(text, special=True, normalized=False) for text in special])
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))


def released_keys(text: dict) -> dict:
    """The keys GLM-5.3-Flash's released text config holds that Glm5NextModel reads and transformers does not write,
    from the keys transformers does (Glm5NextTextConfig.__post_init__ reads linear_attn_config back to them)."""
    bound = text.get("linear_lower_bound")
    return {"linear_attn_config": {"num_heads": text["linear_num_heads"], "head_dim": text["linear_head_dim"],
                                   "short_conv_kernel_size": text["linear_conv_kernel_dim"], "gate_lower_bound": bound,
                                   "safe_gate": bound is not None},
            "mla_use_nope": True, "first_k_dense_replace": text["mlp_layer_types"].index("sparse")}


def convert(tree: Path, folder: Path, outtype: str, out: Path, work: Path) -> Path:
    copy = work / folder.name
    shutil.copytree(folder, copy, symlinks=True)
    config = json.loads((folder / "config.json").read_text())
    glm5 = config.get("model_type") == "glm5_next"
    if glm5:
        config["text_config"] |= released_keys(config["text_config"])
        (copy / "config.json").write_text(json.dumps(config, indent=2))
    text = config.get("text_config", config)
    stand_in_tokenizer(copy, text["vocab_size"], tuple(GLM_SPECIAL.values()) if glm5 else ())
    args = ["glm4" if glm5 else "qwen2", str(copy), "--outtype", outtype, "--outfile", str(out)]
    if config.get("model_type") == "qwen3_next" and not any(p.name.startswith("mtp") for p in folder.iterdir()):
        args.append("--no-mtp")  # a Qwen3-Next without MTP tensors (as transformers saves it)
    env = os.environ | {"PYTHONPATH": str(tree / "gguf-py")}
    result = subprocess.run([sys.executable, "-c", RUN_CONVERTER, str(tree), *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"convert_hf_to_gguf.py failed:\n{result.stderr[-2000:]}")
    return out


def differences(theirs: Path, ours: Path) -> tuple[list[str], list[str]]:
    """(metadata differences, tensor differences), one line each."""
    a, b = gguf.GGUFReader(theirs), gguf.GGUFReader(ours)
    fields = [{k: ([t.name for t in f.types], f.contents()) for k, f in r.fields.items() if not k.startswith("GGUF.")} for r in (a, b)]
    keys = []
    if [k for k in fields[0] if k in fields[1]] != [k for k in fields[1] if k in fields[0]]:
        keys.append("keys in another order")
    for key in fields[0].keys() | fields[1].keys():
        if key in VOCABULARY or key in {f"tokenizer.ggml.{role}_token_id" for role in GLM_SPECIAL} and key not in fields[1]:
            continue
        if key not in fields[1] or key not in fields[0]:
            keys.append(f"{key}: only in {'the converter' if key in fields[0] else 'moetier'}'s file")
        elif fields[0][key] != fields[1][key]:
            keys.append(f"{key}: converter {str(fields[0][key])[:60]}, moetier {str(fields[1][key])[:60]}")
    tensors = [] if [t.name for t in a.tensors] == [t.name for t in b.tensors] else ["tensors in another order or set"]
    mine = {t.name: t for t in b.tensors}
    for t in a.tensors:
        u = mine.get(t.name)
        if u is None:
            tensors.append(f"{t.name}: only in the converter's file")
            continue
        shape, other = [int(n) for n in t.shape], [int(n) for n in u.shape]
        if t.tensor_type != u.tensor_type or shape != other:
            tensors.append(f"{t.name}: converter {t.tensor_type.name} {shape}, moetier {u.tensor_type.name} {other}")
        elif not np.array_equal(np.asarray(t.data).view(np.uint8), np.asarray(u.data).view(np.uint8)):
            delta = np.abs(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64) - gguf.quants.dequantize(u.data, u.tensor_type)).max()
            tensors.append(f"{t.name}: other bytes (max |difference| {delta:.3g})")
    tensors += [f"{name}: only in moetier's file" for name in mine.keys() - {t.name for t in a.tensors}]
    return keys, tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("llama_cpp", type=Path)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--outtype", default="f32", choices=["f32", "f16", "bf16", "q8_0"])
    parser.add_argument("--out", type=Path, default=None, help="keep both files here (default: a temporary folder)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        out = args.out or Path(work)
        out.mkdir(parents=True, exist_ok=True)
        theirs = convert(args.llama_cpp, args.folder, args.outtype, out / "converter.gguf", Path(work))
        ours = write_gguf(args.folder, out / "moetier.gguf", args.outtype.upper())[0]
        keys, tensors = differences(theirs, ours)
        count = len(gguf.GGUFReader(theirs).tensors)
        print(f"{args.folder} --outtype {args.outtype}: {count} tensors")
        for line in keys + tensors or ["no difference outside the vocabulary"]:
            print("  " + line)
        print(json.dumps({"folder": str(args.folder), "outtype": args.outtype, "tensors": count,
                          "keys_differing": len(keys), "tensors_differing": len(tensors)}))


if __name__ == "__main__":
    main()
