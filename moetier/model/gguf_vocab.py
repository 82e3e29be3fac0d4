"""The vocabulary a GGUF carries (tokenizer.ggml.*), tokenized as llama.cpp tokenizes it.

`gguf_tokenizer(path)` reads tokenizer.ggml.model and builds one of two backends:
- "gpt2": byte-level BPE. Text is split on the special tokens first (control
  ones only when parsing them), then by the regexes llama.cpp runs for the
  tokenizer.ggml.pre name (PRE_TOKENIZERS, from llama-vocab.cpp), mapped to
  GPT-2's byte alphabet and merged by rank (whole words first where llama.cpp
  ignores merges); the `tokenizers` library does the splitting and merging.
- "llama": SentencePiece-style, llama.cpp's own algorithm (`SpmBackend`): a
  space prefix, spaces as U+2581, the highest-scoring adjacent pair merged
  first (ties: leftmost), unknown pieces as <0xXX> byte tokens.
Decoding joins each token's bytes (control tokens only when asked), as
llama.cpp's token_to_piece does, without its clean-up of spaces. A pre-tokenizer
or model llama.cpp implements with custom code is refused by name.
Invariant: the ids are llama.cpp's (`Llama.tokenize`) for the same text and flags.
"""

from __future__ import annotations

import heapq
import struct
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from moetier.model.tokenizer import END_OF_TURN_NAMES, Specials, Tokenizer, TokenizerError, byte_alphabet

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # tokenizer.ggml.token_type values

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DEEPSEEK3 = [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
              r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+"]
_DEFAULT = [r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"]
_DEEPSEEK_LETTERS = "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df\U0001e900-\U0001e943]+"  # deepseek-llm's letter class, as llama.cpp spells it
_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
_DEEPSEEK_LLM = ["[\r\n]", _DEEPSEEK_LETTERS, "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+", r"\s+$", _CJK, r"\p{N}+"]
_DEEPSEEK_CODER = ["[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"]
_FALCON = [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]"]


class Pre(NamedTuple):
    regexes: list[str]  # llama.cpp's, in order
    ignore_merges: bool = False  # a word already in the vocabulary skips the merges
    add_bos: bool = False  # llama.cpp's default when the file has no tokenizer.ggml.add_bos_token


def _names(names: str, pre: Pre) -> dict[str, Pre]:
    return dict.fromkeys(names.split(), pre)


# tokenizer.ggml.pre -> what llama.cpp runs for it (llama-vocab.cpp); names it runs custom code for are absent
PRE_TOKENIZERS: dict[str, Pre] = {
    **_names("default", Pre(_DEFAULT)),
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert jina-v1-en "
             "jina-v2-code roberta-bpe mpt olmo exaone4", Pre([_GPT2])),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b", Pre([r"\p{N}", _GPT2])),
    **_names("falcon", Pre(_FALCON)),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2", Pre([_LLAMA3], True, True)),
    **_names("dbrx smaug-bpe chatglm-bpe", Pre([_LLAMA3])),
    **_names("glm4 glm5", Pre([_LLAMA3], True)),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open", Pre([_QWEN2])),
    **_names("qwen35", Pre([_QWEN35])),
    **_names("deepseek-llm", Pre(_DEEPSEEK_LLM)),
    **_names("deepseek-coder", Pre(_DEEPSEEK_CODER)),
    **_names("deepseek-v3 hunyuan-dense joyai-llm hy_v4", Pre(_DEEPSEEK3)),
}


def _byte_decoder() -> dict[str, int]:
    return {char: b for b, char in enumerate(byte_alphabet())}


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_ARRAYS = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
STRING, ARRAY = 8, 9


class _Cursor:
    """A bounds-checked reader over a GGUF file's bytes (the metadata only: nothing past the key-value section)."""

    def __init__(self, data, where: str):
        self.data, self.at, self.where = data, 0, where

    def take(self, n: int):
        if n < 0 or self.at + n > len(self.data):
            raise TokenizerError(f"{self.where}: the GGUF metadata ends early (at byte {self.at}, wanted {n} more)")
        chunk = self.data[self.at : self.at + n]
        self.at += n
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        raw = self.take(self.scalar("<Q"))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise TokenizerError(f"{self.where}: a GGUF string is not UTF-8 (at byte {self.at})") from None

    def value(self, kind: int, keep: bool):
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == STRING:
            return self.string()
        if kind != ARRAY:
            raise TokenizerError(f"{self.where}: GGUF value type {kind} is unknown")
        element, count = self.scalar("<I"), self.scalar("<Q")
        if element in _ARRAYS:
            width = np.dtype(_ARRAYS[element]).itemsize
            raw = self.take(count * width)
            return np.frombuffer(raw, _ARRAYS[element]).tolist() if keep else None
        if element == STRING:
            if not keep:
                for _ in range(count):
                    self.take(self.scalar("<Q"))
                return None
            return [self.string() for _ in range(count)]
        return [self.value(element, keep) for _ in range(count)]


def read_vocabulary(path: Path) -> dict:
    """tokenizer.* keys of a GGUF file -> Python values (arrays as lists); one TokenizerError naming the file.
    Reads the header and key-value section itself (gguf's reader builds every tensor's view first: seconds for
    a 150k-token vocabulary)."""
    import mmap

    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            cursor = _Cursor(data, str(path))
            if cursor.take(4) != b"GGUF":
                raise TokenizerError(f"{path}: not a GGUF file (no GGUF magic)")
            version = cursor.scalar("<I")
            if version not in (2, 3):
                raise TokenizerError(f"{path}: GGUF version {version} (expected 2 or 3)")
            cursor.scalar("<Q")  # tensors
            keys = {}
            for _ in range(cursor.scalar("<Q")):
                key = cursor.string()
                keep = key.startswith("tokenizer.")
                value = cursor.value(cursor.scalar("<I"), keep)
                if keep:
                    keys[key] = value
    except (OSError, ValueError) as err:
        if isinstance(err, TokenizerError):
            raise
        raise TokenizerError(f"{path}: not a readable GGUF file ({err})") from None
    if "tokenizer.ggml.tokens" not in keys:
        raise TokenizerError(f"{path}: no vocabulary (expected tokenizer.ggml.tokens)")
    return keys


class _Pieces:
    """Decoding as llama.cpp's token_to_piece: each token's bytes, control and unknown tokens only when asked."""

    def __init__(self, pieces: list[bytes], hidden: frozenset[int], strip_space: bool = False):
        self.piece_bytes = pieces
        self.hidden = hidden  # control and unknown ids
        self.strip_space = strip_space  # the space prefix encode added: dropped from the first text token

    def decode(self, ids: list[int], skip_special: bool) -> str:
        pieces = [self.piece_bytes[i] for i in ids if not (skip_special and i in self.hidden)]
        first = next((k for k, i in enumerate(i for i in ids if not (skip_special and i in self.hidden))
                      if i not in self.hidden), None)  # the first text token among those kept
        if self.strip_space and first is not None and pieces[first].startswith(b" "):
            pieces[first] = pieces[first][1:]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def pieces(self) -> list[bytes]:
        return list(self.piece_bytes)


class GgufBpeBackend(_Pieces):
    """Byte-level BPE ("gpt2") with the pre-tokenizer llama.cpp runs for `pre`; see the module docstring."""

    def __init__(self, tokens: list[str], types: list[int], merges: list[str], pre: str, where: str):
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as RustTokenizer

        if pre not in PRE_TOKENIZERS:
            raise TokenizerError(f"{where}: tokenizer.ggml.pre {pre!r} is not supported (expected one of "
                                 f"{', '.join(sorted(PRE_TOKENIZERS))})")
        regexes, ignore_merges, _ = PRE_TOKENIZERS[pre]
        vocab = {text: i for i, text in enumerate(tokens)}  # a repeated text: the last id, as llama.cpp's map keeps it
        pairs = []
        for merge in merges:
            cut = merge.find(" ", 1)  # llama.cpp splits at the first space after the first character
            if cut < 0:
                raise TokenizerError(f"{where}: merge {merge!r} has no space (expected 'left right')")
            pairs.append((merge[:cut], merge[cut + 1:]))
        try:
            model = models.BPE(vocab=vocab, merges=pairs, ignore_merges=ignore_merges, byte_fallback=False)
        except Exception as err:  # a merge whose halves or result are not tokens
            raise TokenizerError(f"{where}: the merges do not fit the tokens ({err})") from None
        rust = RustTokenizer(model)
        rust.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
            + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
        rust.decoder = decoders.ByteLevel()
        # control and unknown tokens split the text when parsed; user-defined ones always (llama.cpp's partition)
        rust.add_tokens([AddedToken(tokens[i], special=types[i] in (CONTROL, UNKNOWN), normalized=False)
                         for i in range(len(tokens)) if types[i] in (CONTROL, UNKNOWN, USER_DEFINED) and tokens[i]])
        self.rust = rust
        self.lock = threading.Lock()  # encode_special_tokens is the tokenizer's state: one mode at a time
        table = _byte_decoder()
        pieces = []
        for text, kind in zip(tokens, types):
            if kind == NORMAL:
                pieces.append(bytes(table[c] for c in text) if all(c in table for c in text) else text.encode())
            elif kind == BYTE:
                pieces.append(bytes([int(text[3:5], 16)]) if text.startswith("<0x") else text.encode())
            else:
                pieces.append(text.encode())
        super().__init__(pieces, frozenset(i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)))

    def encode(self, text: str, parse_special: bool) -> list[int]:
        with self.lock:
            self.rust.encode_special_tokens = not parse_special
            return self.rust.encode(text, add_special_tokens=False).ids


class SpmBackend(_Pieces):
    """llama.cpp's SentencePiece-style tokenizer ("llama"): see the module docstring."""

    def __init__(self, tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool, where: str):
        self.ids = {text: i for i, text in enumerate(tokens)}
        self.scores = [float(s) for s in scores]
        self.add_space_prefix = add_space_prefix
        self.where = where
        # llama.cpp's partition order: longest special text first; control/unknown only when parsing specials
        self.partition = sorted((i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN, USER_DEFINED) and tokens[i]),
                                key=lambda i: -len(tokens[i].encode()))
        self.parsed_only = frozenset(i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN))
        self.tokens = tokens
        pieces = []
        for text, kind in zip(tokens, types):
            if kind == BYTE and text.startswith("<0x"):
                pieces.append(bytes([int(text[3:5], 16)]))
            elif kind == NORMAL:
                pieces.append(text.replace("\u2581", " ").encode())
            else:
                pieces.append(text.encode())
        super().__init__(pieces, frozenset(self.parsed_only), strip_space=add_space_prefix)

    def _fragments(self, text: str, parse_special: bool) -> list[str | int]:
        """Text split on special tokens: str fragments and token ids, in order."""
        parts: list[str | int] = [text]
        for i in self.partition:
            if i in self.parsed_only and not parse_special:
                continue
            needle, out = self.tokens[i], []
            for part in parts:
                if isinstance(part, int) or needle not in part:
                    out.append(part)
                    continue
                for k, piece in enumerate(part.split(needle)):
                    if k:
                        out.append(i)
                    if piece:
                        out.append(piece)
            parts = out
        return parts

    def encode(self, text: str, parse_special: bool) -> list[int]:
        out: list[int] = []
        previous_special = True  # the first fragment gets the space prefix, as one after a special token does
        for part in self._fragments(text, parse_special):
            if isinstance(part, int):
                out.append(part)
                previous_special = True
                continue
            if self.add_space_prefix and previous_special:
                part = " " + part
            self._tokenize(part.replace(" ", "\u2581"), out)
            previous_special = False
        return out

    def _tokenize(self, text: str, out: list[int]) -> None:
        chars = list(text)  # symbols, one per character to begin with, linked both ways; "" once merged away
        n = len(chars)
        prev = list(range(-1, n - 1))
        nxt = [i + 1 if i + 1 < n else -1 for i in range(n)]
        queue: list[tuple[float, int, int, int]] = []  # (-score, left, right, length): best score, then leftmost

        def add(left: int, right: int) -> None:
            if left >= 0 and right >= 0:
                token = self.ids.get(chars[left] + chars[right])
                if token is not None:
                    heapq.heappush(queue, (-self.scores[token], left, right, len(chars[left]) + len(chars[right])))

        for i in range(1, n):
            add(i - 1, i)
        while queue:
            _, left, right, length = heapq.heappop(queue)
            if not chars[left] or not chars[right] or len(chars[left]) + len(chars[right]) != length:
                continue  # one side merged since
            chars[left], chars[right] = chars[left] + chars[right], ""
            nxt[left] = nxt[right]
            if nxt[right] >= 0:
                prev[nxt[right]] = left
            add(prev[left], left)
            add(left, nxt[left])
        i = 0 if n else -1
        while i != -1:  # every merged symbol is a token; a single character that is not becomes its bytes
            token = self.ids.get(chars[i])
            out.extend([token] if token is not None else [self._byte_token(b) for b in chars[i].encode()])
            i = nxt[i]

    def _byte_token(self, byte: int) -> int:
        token = self.ids.get(f"<0x{byte:02X}>")
        if token is None:
            token = self.ids.get(chr(byte))
        if token is None:
            raise TokenizerError(f"{self.where}: no byte token for 0x{byte:02X} (expected <0x{byte:02X}> in the vocabulary)")
        return token


def gguf_tokenizer(path: Path) -> Tokenizer:
    """The tokenizer of a GGUF file (the first file of a split set holds the vocabulary)."""
    keys = read_vocabulary(path)
    where = str(path)
    model = keys.get("tokenizer.ggml.model", "")
    tokens = list(keys["tokenizer.ggml.tokens"])
    size = len(tokens)
    types = list(keys.get("tokenizer.ggml.token_type", [NORMAL] * size))
    if len(types) != size:
        raise TokenizerError(f"{where}: {len(types)} token types for {size} tokens")

    def key_id(name: str, default: int | None) -> int | None:
        value = keys.get(f"tokenizer.ggml.{name}_token_id", default)
        return int(value) if value is not None and 0 <= int(value) < size else None

    if model == "gpt2":
        pre = keys.get("tokenizer.ggml.pre", "default")
        backend = GgufBpeBackend(tokens, types, list(keys.get("tokenizer.ggml.merges", [])), pre, where)
        bos_default = None if pre in ("glm4", "glm5", "chatglm-bpe") else 11  # llama.cpp's defaults, where no key names one
        bos, eos = key_id("bos", bos_default), key_id("eos", 11)
        add_bos = bool(keys.get("tokenizer.ggml.add_bos_token", PRE_TOKENIZERS[pre].add_bos))
    elif model == "llama":
        scores = list(keys.get("tokenizer.ggml.scores", np.zeros(size)))
        if len(scores) != size:
            raise TokenizerError(f"{where}: {len(scores)} token scores for {size} tokens")
        backend = SpmBackend(tokens, scores, types, bool(keys.get("tokenizer.ggml.add_space_prefix", True)), where)
        bos, eos = key_id("bos", 1), key_id("eos", 2)
        add_bos = bool(keys.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise TokenizerError(f"{where}: tokenizer.ggml.model {model!r} is not supported (expected gpt2 or llama)")
    eot, eom = key_id("eot", None), key_id("eom", None)
    stops = {i for i in (eos, eot, eom) if i is not None}
    stops |= {i for i, text in enumerate(tokens) if text in END_OF_TURN_NAMES and types[i] in (CONTROL, USER_DEFINED)}
    names = {"bos": bos, "eos": eos, "unk": key_id("unknown", None), "pad": key_id("padding", None)}
    template_tokens = {f"{role}_token": tokens[i] for role, i in names.items() if i is not None}
    specials = Specials(bos, eos, names["pad"], frozenset(stops), add_bos and bos is not None,
                        bool(keys.get("tokenizer.ggml.add_eos_token", False)),
                        frozenset(i for i, k in enumerate(types) if k in (CONTROL, UNKNOWN)), template_tokens)
    templates = {"default": keys["tokenizer.chat_template"]} if isinstance(keys.get("tokenizer.chat_template"), str) else {}
    for key, value in keys.items():  # tokenizer.chat_template.<name> (e.g. tool_use)
        if key.startswith("tokenizer.chat_template.") and isinstance(value, str):
            templates[key.rsplit(".", 1)[1]] = value
    return Tokenizer(backend, size, specials, templates, where)
