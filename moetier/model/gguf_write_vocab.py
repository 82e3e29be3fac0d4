"""The vocabulary moetier's GGUF writer (moetier.model.gguf_write) puts in a file, as llama.cpp's converter would.

A synthetic folder's own tokenizer.json (moetier.model.synth_tokenizer: its byte-level BPE, as the converter
writes one). A folder without one (a random transformers checkpoint) gets a stand-in: one token per id, the
config's bos/eos/pad ids as control tokens, the 256 byte tokens, then pieces with a BPE merge (gpt2) or a
score (llama) each, so llama.cpp can load the file and tokenize any text. A vocabulary too small for a piece
gets one in its last byte token's place: llama.cpp loads no BPE file without a merge ("cannot find tokenizer
merges").
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import gguf
from gguf import TokenType
from gguf.vocab import bytes_to_unicode

from moetier.model.checkpoint import Checkpoint
from moetier.model.synth_sessions import SYNTH_META
from moetier.model.synth_tokenizer import add_gguf_vocabulary, gguf_vocabulary

# the converter's vocabulary per architecture: (tokenizer.ggml.model, tokenizer.ggml.pre)
TOKENIZERS = {"qwen3_moe": ("gpt2", "qwen2"), "glm4_moe": ("gpt2", "glm4"), "mixtral": ("llama", "default"),
              "qwen3_next": ("gpt2", "qwen2"), "glm5_next": ("gpt2", "glm4")}
SPECIAL_NAMES = {"gpt2": {"bos": "<|bos|>", "eos": "<|eos|>", "pad": "<|pad|>"},
                 "llama": {"bos": "<s>", "eos": "</s>", "pad": "<pad>"}}


def _pieces(alphabet: list[str]) -> Iterator[str]:
    """Strings over the alphabet, shortest first: each one's prefix without its last character came before it."""
    for length in itertools.count(2):
        for chars in itertools.product(alphabet, repeat=length):
            yield "".join(chars)


def add_vocabulary(writer: gguf.GGUFWriter, checkpoint: Checkpoint, arch: str) -> None:
    """A synthetic folder's own tokenizer (moetier.model.synth_tokenizer: its BPE vocabulary as the converter writes a
    tokenizer.json's); else the stand-in vocabulary (the module docstring), written as _set_vocab_gpt2 /
    _set_vocab_sentencepiece write theirs: model, pre, tokens, (scores,) token types, (merges,) then SpecialVocab's ids."""
    if (Path(checkpoint.folder) / "tokenizer.json").exists() and (Path(checkpoint.folder) / SYNTH_META).exists():
        add_gguf_vocabulary(writer, gguf_vocabulary(checkpoint.folder))
        return
    model, pre = TOKENIZERS[arch]
    size, config = checkpoint.spec.vocab_size, checkpoint.config
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    # SpecialVocab: the root's id, else text_config's (a vision-language config's)
    special = {role: next((c[f"{role}_token_id"] for c in (config, text) if c.get(f"{role}_token_id") is not None), None)
               for role in ("bos", "eos", "pad")}
    special = {role: i for role, i in special.items() if isinstance(i, int) and not isinstance(i, bool) and 0 <= i < size}
    table = bytes_to_unicode()
    byte_chars = [table[b] for b in range(256)]  # GPT-2's byte-level characters, in byte order
    if model == "gpt2":
        bytes_ = [(text, TokenType.NORMAL) for text in byte_chars]
    else:
        bytes_ = [(f"<0x{b:02X}>", TokenType.BYTE) for b in range(256)]
    printable = [byte_chars[b] for b in range(0x21, 0x7F)] if model == "gpt2" else [chr(b) for b in range(0x21, 0x7F)]
    fill = itertools.chain(bytes_, ((text, TokenType.NORMAL) for text in _pieces(printable)))
    by_id = {i: (SPECIAL_NAMES[model][role], TokenType.CONTROL) for role, i in special.items()}
    tokens, types = [], []
    for i in range(size):
        text, kind = by_id[i] if i in by_id else next(fill)
        tokens.append(text)
        types.append(kind)
    normal = [i for i, kind in enumerate(types) if kind == TokenType.NORMAL]
    if model == "gpt2" and len(normal) >= 2 and all(len(tokens[i]) == 1 for i in normal):
        tokens[normal[-1]] = 2 * tokens[normal[0]]  # too few ids for a piece: one, so the file has a merge to load
    writer.add_tokenizer_model(model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    if model == "llama":
        writer.add_token_scores([-float(i) if kind == TokenType.NORMAL else 0.0 for i, kind in enumerate(types)])
    writer.add_token_types(types)
    if model == "gpt2":
        writer.add_token_merges([f"{t[:-1]} {t[-1]}" for t, kind in zip(tokens, types) if kind == TokenType.NORMAL and len(t) > 1])
    for role, i in special.items():
        getattr(writer, f"add_{role}_token_id")(i)
