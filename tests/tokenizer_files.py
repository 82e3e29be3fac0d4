"""Tokenizer files for tests: a synthetic model that speaks text, an SPM-style tokenizer.json, vocabulary-only GGUFs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import gguf

from moetier.model.synth import write_synthetic
from moetier.model.synth_tokenizer import add_gguf_vocabulary, gguf_vocabulary, write_synthetic_tokenizer
from moetier.model.tokenizer import byte_alphabet
from tokenizer_text import MIXED_TEXT


def text_model(folder: Path, arch: str = "qwen3_moe", preset: str = "tiny", seed: int = 0) -> Path:
    """A synthetic checkpoint with its tokenizer (what `moetier synth` writes once the tokenizer is wired in)."""
    write_synthetic(folder, arch=arch, preset=preset, seed=seed)
    if not (folder / "tokenizer.json").exists():
        write_synthetic_tokenizer(folder)
    return folder


def spm_style_folder(folder: Path) -> Path:
    """A SentencePiece-style tokenizer.json as transformers converts Llama's: BPE with byte fallback over
    U+2581-marked text, a BOS post-processor; trained on the mixed text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = Tokenizer(models.BPE(unk_token=None, byte_fallback=True, fuse_unk=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"]
    trainer = trainers.BpeTrainer(vocab_size=900, special_tokens=specials + [f"<0x{b:02X}>" for b in range(256)],
                                  show_progress=False)
    tokenizer.train_from_iterator([MIXED_TEXT[i : i + 200] for i in range(0, len(MIXED_TEXT), 200)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    data = json.loads(tokenizer.to_str())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] in specials]  # byte tokens: plain vocabulary
    (folder / "tokenizer.json").write_text(json.dumps(data))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
        "add_bos_token": True, "clean_up_tokenization_spaces": False}))
    return folder


def _header(writer: gguf.GGUFWriter) -> None:
    """Just enough of a llama architecture for llama.cpp to load the file vocab-only."""
    writer.add_context_length(4096)
    writer.add_embedding_length(64)
    writer.add_block_count(1)
    writer.add_feed_forward_length(128)
    writer.add_head_count(4)
    writer.add_head_count_kv(4)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_dimension_count(16)


def _close(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    writer.close()


def bpe_gguf(path: Path, folder: Path, pre: str) -> Path:
    """A vocabulary-only GGUF with the byte-level BPE of a folder's tokenizer.json, under tokenizer.ggml.pre `pre`."""
    writer = gguf.GGUFWriter(str(path), "llama")
    _header(writer)
    add_gguf_vocabulary(writer, replace(gguf_vocabulary(folder, pre), chat_template=None))
    _close(writer)
    return path


def spm_gguf(path: Path, folder: Path) -> Path:
    """A vocabulary-only SentencePiece-style GGUF ("llama"): <unk> <s> </s>, 256 <0xXX> byte tokens, the characters of
    the mixed text, then the synthetic vocabulary's pieces as text (U+2581 for spaces) with falling scores, a control
    token and a user-defined one."""
    data = json.loads((folder / "tokenizer.json").read_text())
    table = {c: b for b, c in enumerate(byte_alphabet())}
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    for char in sorted(set(MIXED_TEXT[:600].replace(" ", "\u2581"))):
        tokens.append(char), types.append(1), scores.append(-1000.0 - len(tokens)), seen.add(char)
    for text, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1]):
        try:
            piece = bytes(table[c] for c in text).decode("utf-8").replace(" ", "\u2581")
        except (KeyError, UnicodeDecodeError):
            continue
        if len(piece) < 2 or piece in seen or piece.startswith("<"):
            continue
        seen.add(piece)
        tokens.append(piece), types.append(1), scores.append(-float(len(tokens)) * (1 if len(tokens) % 3 else 0.5))
    tokens += ["<|im_end|>", "<tool>"]
    types += [3, 4]
    scores += [0.0, 0.0]
    writer = gguf.GGUFWriter(str(path), "llama")
    _header(writer)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    _close(writer)
    return path
