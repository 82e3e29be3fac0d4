"""Fill-in-the-middle for /v1/completions' `suffix`: the model's FIM tokens, and the prompt laid out around them.

`fim_tokens(tokenizer)` finds the prefix, suffix and middle tokens: a GGUF's
`tokenizer.ggml.fim_pre_token_id` / `fim_suf` / `fim_mid` (or the older
`prefix_` / `suffix_` / `middle_token_id`), else tokens the vocabulary spells
as special tokens of one of the families llama.cpp knows (`<|fim_prefix|>` Qwen2.5-Coder,
`<fim_prefix>` StarCoder, `<fim-prefix>`, `<｜fim▁begin｜>` DeepSeek-Coder,
`<|code_prefix|>` GLM-4, `<PRE>` CodeLlama); None when there are none. The
family's pad / repo / file-separator tokens end a FIM generation too, as in
llama.cpp. `fim_prompt` lays the request out prefix-suffix-middle, as
llama.cpp's /infill does: [BOS] PRE prefix SUF suffix MID, the prefix and the
suffix tokenized as text (special tokens' text not parsed).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from moetier.model.gguf_vocab import read_vocabulary
from moetier.model.tokenizer import Tokenizer

# (prefix, suffix, middle, what else ends a generation), as each family spells them
FAMILIES = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", ("<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<fim_pad>", "<reponame>", "<file_sep>")),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>", ("<fim-pad>", "<fim-repo>", "<fim-sep>")),
    ("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ()),
    ("<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>", ()),
    ("<PRE>", "<SUF>", "<MID>", ("<EOT>",)),
    (" <PRE>", " <SUF>", " <MID>", (" <EOT>",)),  # SentencePiece's "▁<PRE>", as its bytes read
)
GGUF_KEYS = (("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle"))


@dataclass(frozen=True)
class FimTokens:
    prefix: int
    suffix: int
    middle: int
    stops: frozenset[int] = frozenset()


def _from_gguf(tokenizer: Tokenizer) -> FimTokens | None:
    path = Path(tokenizer.source)
    if path.suffix != ".gguf" or not path.is_file():
        return None
    keys = read_vocabulary(path)

    def key_id(name: str) -> int | None:
        value = keys.get(f"tokenizer.ggml.{name}_token_id")
        return int(value) if value is not None and 0 <= int(value) < tokenizer.vocab_size else None

    for names in GGUF_KEYS:
        ids = [key_id(n) for n in names]
        if None not in ids:
            stops = {key_id(n) for n in ("fim_pad", "fim_rep", "fim_sep")} - {None}
            return FimTokens(*ids, frozenset(stops))
    return None


@lru_cache(maxsize=8)  # a server asks once per request; a tokenizer never changes
def fim_tokens(tokenizer: Tokenizer) -> FimTokens | None:
    """See the module docstring."""
    found = _from_gguf(tokenizer)
    if found is not None:
        return found
    by_bytes: dict[bytes, int] = {}  # special tokens only: "<PRE>" may be plain text in a vocabulary
    pieces = tokenizer.token_bytes()
    for i in sorted(tokenizer.specials.control_ids):
        by_bytes.setdefault(pieces[i], i)
    for prefix, suffix, middle, stops in FAMILIES:
        ids = [by_bytes.get(t.encode()) for t in (prefix, suffix, middle)]
        if None not in ids:
            return FimTokens(*ids, frozenset(by_bytes[s.encode()] for s in stops if s.encode() in by_bytes))
    return None


def fim_prompt(tokenizer: Tokenizer, fim: FimTokens, prefix: str | list[int], suffix: str) -> list[int]:
    """The ids of a FIM request: a text prefix gets the model's BOS where it asks for one; ids go in as they are."""
    if isinstance(prefix, str):
        bos = tokenizer.specials.bos_id
        head = [bos] if tokenizer.specials.add_bos and bos is not None else []
        prefix_ids = head + [fim.prefix] + tokenizer.encode(prefix, parse_special=False)
    else:
        prefix_ids = [fim.prefix] + list(prefix)
    return prefix_ids + [fim.suffix] + tokenizer.encode(suffix, parse_special=False) + [fim.middle]
