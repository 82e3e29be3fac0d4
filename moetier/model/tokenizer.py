"""A model's own tokenizer: text <-> token ids, its special tokens, the ids that end a generation, its chat template.

`load_tokenizer(model)` reads a HF folder's tokenizer.json (through the
`tokenizers` library, as transformers' fast tokenizers do) with
tokenizer_config.json, generation_config.json and config.json, or a GGUF's
tokenizer.ggml.* vocabulary (moetier.model.gguf_vocab: byte-level BPE with the
pre-tokenizer tokenizer.ggml.pre names, or SentencePiece-style scores as
llama.cpp tokenizes them), into one `Tokenizer`. `encode` parses special
tokens' text unless told not to, and adds BOS/EOS only when asked and the model
says so; `decode` keeps special tokens unless told to skip them.
`StreamDecoder` turns ids into text as they come, never splitting a character.
Invariants: ids match transformers' (tokenizer.json) or llama.cpp's (GGUF)
for the same text; decode(encode(text)) == text for text without special tokens.
"""

from __future__ import annotations

import json
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

# tokens that end a turn, by their text (llama.cpp's list of end-of-generation tokens, the ones in use)
END_OF_TURN_NAMES = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                               "<|endoftext|>", "<|eom_id|>", "<EOT>", "<|end_of_text|>", "<｜end▁of▁sentence｜>"})


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level characters, in byte order: printable bytes stand for themselves, the rest are shifted
    past U+0100 (the space is "Ġ", the newline "Ċ")."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return [table[b] for b in range(256)]


class TokenizerError(ValueError):
    """A model without a usable tokenizer, or a tokenizer file that cannot be read; one line naming the file."""


class Backend(Protocol):
    def encode(self, text: str, parse_special: bool) -> list[int]:
        """text -> ids, no BOS/EOS added; special tokens' text becomes their ids only when parse_special."""

    def decode(self, ids: list[int], skip_special: bool) -> str:
        """ids -> text; special (control) tokens as their text unless skip_special."""

    def pieces(self) -> list[bytes]:
        """Each id's bytes as decode joins them (a special token's text; b"" for an id without a token)."""


@dataclass(frozen=True)
class Specials:
    """What a tokenizer knows about its special tokens."""

    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    stop_ids: frozenset[int] = frozenset()  # generation ends on any of these
    add_bos: bool = False  # encode(..., add_special=True) puts BOS first
    add_eos: bool = False
    control_ids: frozenset[int] = frozenset()  # tokens decode(skip_special=True) drops
    template_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as a chat template sees them


class Tokenizer:
    """See the module docstring. Thread-safe: encode and decode hold no state between calls."""

    def __init__(self, backend: Backend, vocab_size: int, specials: Specials, chat_templates: dict[str, str], source: str,
                 post_processed: bool = False):
        self.backend = backend
        self.vocab_size = vocab_size
        self.specials = specials
        self.chat_templates = chat_templates  # name ("default", "tool_use", ...) -> jinja source
        self.source = source
        self.post_processed = post_processed  # the backend adds BOS/EOS itself (a tokenizer.json post-processor)
        self._pieces: list[bytes] | None = None

    @property
    def stop_ids(self) -> frozenset[int]:
        return self.specials.stop_ids

    def encode(self, text: str, add_special: bool = False, parse_special: bool = True) -> list[int]:
        """text -> ids; add_special puts the model's BOS (and EOS) around them where the model asks for it."""
        if not isinstance(text, str):
            raise TokenizerError(f"encode: expected text (str), got {type(text).__name__}")
        if add_special and self.post_processed:
            return self.backend.encode_with_specials(text, parse_special)
        ids = self.backend.encode(text, parse_special)
        s = self.specials
        if add_special and s.add_bos and s.bos_id is not None:
            ids = [s.bos_id] + ids
        if add_special and s.add_eos and s.eos_id is not None:
            ids = ids + [s.eos_id]
        return ids

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        bad = [i for i in ids if not 0 <= int(i) < self.vocab_size]
        if bad:
            raise TokenizerError(f"decode: token id {bad[0]} is outside the vocabulary (expected 0 <= id < {self.vocab_size})")
        return self.backend.decode([int(i) for i in ids], skip_special)

    def token_bytes(self) -> list[bytes]:
        """Each id's bytes, vocab_size of them (read once): what the id adds to decoded text, a space prefix that
        decode drops at the start of a text and transformers' space clean-up aside (logprobs' `bytes`, JSON mode)."""
        if self._pieces is None:
            pieces = list(self.backend.pieces())[: self.vocab_size]
            self._pieces = pieces + [b""] * (self.vocab_size - len(pieces))
        return self._pieces

    def chat_template(self, tools: bool = False) -> str | None:
        """The template to render a chat with: the "tool_use" one when there are tools and the model has one."""
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        return self.chat_templates.get("default")


class StreamDecoder:
    """Ids in, text out as it becomes final: a piece is held back while it ends inside a character (a byte-level or
    byte-fallback token) and a decoder's context (a SentencePiece leading space) is kept by decoding a few tokens back."""

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, context: list[int] | None = None):
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = list(context or [])
        self.prefix = max(len(self.ids) - 6, 0)  # ids before `prefix` are never decoded again
        self.read = len(self.ids)  # ids up to `read` have been emitted

    def push(self, token: int) -> str:
        """The text that `token` makes final ("" while a character is incomplete)."""
        self.ids.append(int(token))
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip_special)
        text = self.tokenizer.decode(self.ids[self.prefix :], self.skip_special)
        if text.endswith("\ufffd") and len(self.ids) - self.read < 4:  # a character cut short (at most 4 bytes)
            return ""
        if not text.startswith(before):  # a decoder that rewrote earlier text: emit from the common start
            common = 0
            while common < min(len(text), len(before)) and text[common] == before[common]:
                common += 1
            before = before[:common]
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(before):]

    def pending(self) -> str:
        """What is still held back (an incomplete character, as the replacement character), left held."""
        if self.read == len(self.ids):
            return ""
        before = self.tokenizer.decode(self.ids[self.prefix : self.read], self.skip_special)
        text = self.tokenizer.decode(self.ids[self.prefix :], self.skip_special)
        return text[len(before):] if text.startswith(before) else text

    def flush(self) -> str:
        """What is still held back, given out."""
        text = self.pending()
        self.read = len(self.ids)
        return text


# -- HF tokenizer.json ------------------------------------------------------------------
class HfBackend:
    """tokenizer.json through the `tokenizers` library; decode cleans up spaces as transformers does when the
    tokenizer_config asks for it."""

    def __init__(self, path: Path, clean_up_spaces: bool):
        from tokenizers import Tokenizer as RustTokenizer

        try:
            self.rust = RustTokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises its own Exception type with the serde message
            raise TokenizerError(f"{path}: not a readable tokenizer.json ({err})") from None
        self.clean_up_spaces = clean_up_spaces
        self.lock = threading.Lock()  # encode_special_tokens is the tokenizer's state: one mode at a time

    def encode(self, text: str, parse_special: bool) -> list[int]:
        with self.lock:
            self.rust.encode_special_tokens = not parse_special
            return self.rust.encode(text, add_special_tokens=False).ids

    def encode_with_specials(self, text: str, parse_special: bool) -> list[int]:
        with self.lock:
            self.rust.encode_special_tokens = not parse_special
            return self.rust.encode(text, add_special_tokens=True).ids

    def decode(self, ids: list[int], skip_special: bool) -> str:
        with self.lock:  # not while another thread sets the mode (the binding would refuse the borrow)
            text = self.rust.decode(ids, skip_special_tokens=skip_special)
        return clean_up_tokenization(text) if self.clean_up_spaces else text

    def pieces(self) -> list[bytes]:
        """By the decoder's kind: byte-level pieces through GPT-2's alphabet; SentencePiece-style ones with U+2581
        as a space and <0xXX> as the byte (byte fallback); added tokens as their text."""
        decoder = json.loads(self.rust.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [decoder]) if isinstance(d, dict)}
        table = {c: b for b, c in enumerate(byte_alphabet())}
        added = {i: t.content for i, t in self.rust.get_added_tokens_decoder().items()}
        out = []
        for i in range(max(self.rust.get_vocab_size(with_added_tokens=True), max(added, default=-1) + 1)):
            piece = added.get(i, self.rust.id_to_token(i))
            if piece is None:
                out.append(b"")
            elif i in added:
                out.append(piece.encode())
            elif "ByteLevel" in kinds and all(c in table for c in piece):
                out.append(bytes(table[c] for c in piece))
            elif "ByteFallback" in kinds and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", piece):
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace("\u2581", " ").encode())
        return out


def clean_up_tokenization(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and English contractions."""
    for before, after in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                          (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(before, after)
    return text


def _read_json(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise TokenizerError(f"{path}: not readable JSON ({err})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object")
    return data


def _token_text(value) -> str | None:
    """A tokenizer_config special token: "<s>" or {"content": "<s>", ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value) -> list[int]:
    """A config's eos_token_id: an int, a list of ints, or absent."""
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _hf_templates(folder: Path, config: dict) -> dict[str, str]:
    templates: dict[str, str] = {}
    source = config.get("chat_template")
    if isinstance(source, str):
        templates["default"] = source
    elif isinstance(source, list):  # [{"name": "default", "template": "..."}, {"name": "tool_use", ...}]
        templates |= {t["name"]: t["template"] for t in source if isinstance(t, dict) and isinstance(t.get("name"), str)
                      and isinstance(t.get("template"), str)}
    if (folder / "chat_template.jinja").exists():  # transformers' newer layout; it wins over tokenizer_config's
        templates["default"] = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    for path in sorted((folder / "additional_chat_templates").glob("*.jinja")) if (folder / "additional_chat_templates").is_dir() else []:
        templates[path.stem] = path.read_text(encoding="utf-8")
    return templates


def hf_tokenizer(folder: Path) -> Tokenizer:
    """The tokenizer of a HF model folder (tokenizer.json required)."""
    path = folder / "tokenizer.json"
    if not path.exists():
        hint = (" (it has tokenizer.model: save it as tokenizer.json with transformers' "
                "AutoTokenizer.from_pretrained(folder).save_pretrained(folder))") if (folder / "tokenizer.model").exists() else ""
        raise TokenizerError(f"{folder}: no tokenizer.json{hint}")
    config = _read_json(folder / "tokenizer_config.json")
    model_config = _read_json(folder / "config.json")
    text_config = model_config.get("text_config") if isinstance(model_config.get("text_config"), dict) else {}
    generation = _read_json(folder / "generation_config.json")
    backend = HfBackend(path, bool(config.get("clean_up_tokenization_spaces", False)))
    rust = backend.rust
    vocab_size = max(rust.get_vocab_size(with_added_tokens=True), max(rust.get_vocab(with_added_tokens=True).values()) + 1)
    added = rust.get_added_tokens_decoder()  # id -> AddedToken
    control = frozenset(i for i, t in added.items() if t.special)

    def role_id(role: str) -> int | None:
        text = _token_text(config.get(f"{role}_token"))
        if text is not None and rust.token_to_id(text) is not None:
            return rust.token_to_id(text)
        ids = _ids(model_config.get(f"{role}_token_id", text_config.get(f"{role}_token_id")))
        return ids[0] if ids else None

    bos, eos, pad = role_id("bos"), role_id("eos"), role_id("pad")
    stops = {eos} | set(_ids(generation.get("eos_token_id"))) | set(_ids(model_config.get("eos_token_id")))
    stops |= {i for i, t in added.items() if t.content in END_OF_TURN_NAMES}
    stops = frozenset(i for i in stops if i is not None and 0 <= i < vocab_size)
    template_tokens = {f"{role}_token": text for role in ("bos", "eos", "unk", "pad", "sep", "cls", "mask")
                       if (text := _token_text(config.get(f"{role}_token"))) is not None}
    post = json.loads(rust.to_str()).get("post_processor") is not None
    specials = Specials(bos, eos, pad, stops, bool(config.get("add_bos_token", False)), bool(config.get("add_eos_token", False)),
                        control, template_tokens)
    return Tokenizer(backend, vocab_size, specials, _hf_templates(folder, config), str(path), post_processed=post)


def load_tokenizer(model) -> Tokenizer:
    """The tokenizer of a model: a HF folder, a GGUF file (or split set's first file), or an opened checkpoint."""
    from moetier.model.gguf_vocab import gguf_tokenizer

    files = getattr(model, "files", None)
    if files:  # a GgufCheckpoint: its vocabulary lives in the first file
        return gguf_tokenizer(Path(files[0]))
    path = Path(getattr(model, "folder", model))
    if path.suffix.lower() == ".gguf":
        return gguf_tokenizer(path)
    if path.is_dir() and not (path / "config.json").exists() and any(p.suffix.lower() == ".gguf" for p in path.iterdir()):
        from moetier.model.checkpoint import open_checkpoint

        return load_tokenizer(open_checkpoint(path))
    if not path.is_dir():
        raise TokenizerError(f"{path}: not a model folder or GGUF file (expected one with a tokenizer)")
    return hf_tokenizer(path)


def has_tokenizer(model) -> bool:
    """Whether load_tokenizer would find one (without loading it): tokenizer.json in a folder, or a GGUF's vocabulary."""
    files = getattr(model, "files", None)
    if files:
        return True
    path = Path(getattr(model, "folder", model))
    return path.suffix.lower() == ".gguf" or (path / "tokenizer.json").exists()
