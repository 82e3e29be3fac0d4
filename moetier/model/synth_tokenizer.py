"""A real tokenizer for a synthetic checkpoint: byte-level BPE over text in the style of each token family.

`write_synthetic_tokenizer(folder)` reads the folder's config.json (arch, vocab
size) and moetier_synth.json (special ids, token families in frequency-rank
order) and writes tokenizer.json (the split regex of the arch family's real
tokenizer, Qwen2's or GLM-4's; the GPT-2 byte alphabet; a merge per
multi-character token) and tokenizer_config.json (a ChatML chat template with
Hermes-style tools). Ids 0, 1, 2 (pad, bos, eos) are
<|endoftext|>, <|im_start|>, <|im_end|>, as in Qwen's vocabulary; the 256
byte tokens take the rarest ranks of the families, and every other id a piece
of text in the style of its family (explore: English-like words, edit: code,
verify: test logs, second_language: Cyrillic and Greek, common: short words,
punctuation, whitespace), built as a chain of merges so that BPE can reach it.
Generated text is gibberish, but real tokens through real code.
`gguf_vocabulary(folder)` gives the vocabulary arrays a GGUF carries for any
byte-level BPE tokenizer.json (what llama.cpp's converter writes), and
`add_gguf_vocabulary(writer, vocabulary)` writes them.
Invariant: the files are a pure function of (arch, vocab size, families, seed).
"""

from __future__ import annotations

import json
import os
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetier.model.gguf_vocab import PRE_TOKENIZERS
from moetier.model.synth_sessions import SYNTH_META
from moetier.model.tokenizer import byte_alphabet

TOKENIZER_VERSION = 1  # of this generator: part of synth_version's hash, so a cache without these files is rewritten
# tokenizer.ggml.pre of the synthetic vocabulary, by arch: the split regex of the family's real tokenizer (Qwen2's;
# GLM-4's, with whole words first) in tokenizer.json, and the name llama.cpp runs it under in the GGUF
PRE_BY_ARCH = {"glm4_moe": "glm4", "glm5_next": "glm4"}
DEFAULT_PRE = "qwen2"
SPECIAL_NAMES = {"pad": "<|endoftext|>", "bos": "<|im_start|>", "eos": "<|im_end|>"}
MAX_PIECE_CHARS = 10  # no synthetic piece is longer (in characters)

CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# what each family's pieces look like: fixed words first (they take the most frequent ranks), then generated ones
_ENGLISH = ("the", "report", "file", "search", "look", "find", "read", "show", "list", "where", "which", "module",
            "function", "about", "there", "into", "found", "open", "path", "first", "then", "because", "should")
_CODE = ("def", "return", "self", "class", "import", "from", "None", "True", "False", "lambda", "yield", "for", "in",
         "if", "else", "elif", "while", "try", "except", "with", "as", "print", "len", "range", "dict", "str", "int")
_CODE_PUNCT = ("(", ")", "):\n", "()", "[", "]", "{", "}", ",", ".", ":", " =", " ==", " ->", " +=", "\"", "'", " #",
               ",\n", ")\n", "_", "):", "[]", " {", "})", "\n", "   ", "       ")
_VERIFY = ("assert", "test", "passed", "failed", "error", "ok", "expected", "got", "PASSED", "FAILED", "Error", "check",
           "pytest", "tests", "case", "raises", "equal", "warning", "seconds")
_VERIFY_PUNCT = ("::", "...", " [", "]", "%", " ==", " !=", ":", " -", "\n", " (", ")")
_COMMON = ("a", "of", "and", "to", "is", "in", "that", "it", "for", "on", "be", "as", "at", "by", "or", "we", "an")
_COMMON_PUNCT = (".", ",", "\n", "\n\n", " (", ")", ".\n", ",", " -", "'s", " \"", "\".", ":", "?", "!")
_SYLLABLES = {"latin": ("bcdfghklmnprstvw", "aeiou"), "cyrillic": ("бвгдзклмнпрстфхчш", "аеиоуыя"),
              "greek": ("βγδζθκλμνξπρστφχ", "αεηιουω")}


def _word(rng: np.random.Generator, script: str, syllables: tuple[int, int] = (1, 3)) -> str:
    consonants, vowels = _SYLLABLES[script]
    out = []
    for _ in range(int(rng.integers(syllables[0], syllables[1] + 1))):
        out.append(consonants[rng.integers(len(consonants))] + vowels[rng.integers(len(vowels))])
        if rng.random() < 0.3:
            out.append(consonants[rng.integers(len(consonants))])
    return "".join(out)


def _pieces(family: str, rng: np.random.Generator) -> Iterator[str]:
    """Pre-tokens in the style of `family`: its fixed words (with and without a leading space), then generated ones."""
    spaced = lambda words: [p for w in words for p in (" " + w, w)]  # noqa: E731
    if family == "explore":
        yield from spaced(_ENGLISH)
        while True:
            yield (" " if rng.random() < 0.7 else "") + _word(rng, "latin")
    elif family == "edit":
        yield from spaced(_CODE)
        yield from _CODE_PUNCT
        while True:
            word = _word(rng, "latin", (1, 2))
            yield (" ", "_", ".", "")[int(rng.integers(4))] + (word.capitalize() if rng.random() < 0.2 else word)
    elif family == "verify":
        yield from spaced(_VERIFY)
        yield from _VERIFY_PUNCT
        while True:
            yield (" test_", " ", "_", "")[int(rng.integers(4))] + _word(rng, "latin", (1, 2))
    elif family == "second_language":
        while True:
            script = "cyrillic" if rng.random() < 0.7 else "greek"
            yield (" " if rng.random() < 0.6 else "") + _word(rng, script, (1, 2))
    else:
        yield from spaced(_COMMON)
        yield from _COMMON_PUNCT
        while True:
            yield " " * int(rng.integers(1, 9)) if rng.random() < 0.1 else " " + _word(rng, "latin", (1, 2))


@dataclass(frozen=True)
class SynthVocabulary:
    tokens: list[str]  # [V] byte-level text per id (the specials as themselves)
    merges: list[tuple[str, str]]  # in rank order
    special: dict[str, int]  # role (pad, bos, eos) -> id


def synthetic_vocabulary(vocab_size: int, families: dict[str, list[int]], special: dict[str, int],
                         seed: int) -> SynthVocabulary:
    """Every id's text and the merges that reach it (see the module docstring)."""
    alphabet = byte_alphabet()
    tokens: list[str | None] = [None] * vocab_size
    for role, i in special.items():
        tokens[i] = SPECIAL_NAMES[role]
    queues = {name: list(ids) for name, ids in families.items()}
    # the 256 byte tokens: the rarest ranks, taken from the families' tails in turn
    names, turn = sorted(queues), 0
    for b in range(256):
        while not queues[names[turn % len(names)]]:
            turn += 1
        tokens[queues[names[turn % len(names)]].pop()] = alphabet[b]
        turn += 1
    known = {t for t in tokens if t is not None}
    merges: list[tuple[str, str]] = []
    rng = np.random.default_rng([seed, zlib.crc32(b"synthetic tokenizer")])
    streams = {name: _pieces(name, rng) for name in names}
    stalled = dict.fromkeys(names, 0)  # pieces in a row that added nothing: then longer generated words
    while any(queues.values()):
        for name in names:
            queue = queues[name]
            if not queue:
                continue
            piece = next(streams[name]) if stalled[name] < 64 else " " + _word(rng, "latin", (2, 4))
            # one unit a character, in the byte alphabet; a multi-byte character is merged from its bytes first,
            # so that no token but the 256 byte tokens ends inside a character
            units = ["".join(alphabet[b] for b in char.encode("utf-8")) for char in piece[:MAX_PIECE_CHARS]]
            before = len(queue)
            chains = [list(unit) for unit in units if len(unit) > 1] + [units]
            for chain in chains:
                for end in range(2, len(chain) + 1):  # the chain of prefixes, one merge each
                    text = "".join(chain[:end])
                    if not queue:
                        break
                    if text not in known:
                        known.add(text)
                        tokens[queue.pop(0)] = text
                        merges.append(("".join(chain[: end - 1]), chain[end - 1]))
            stalled[name] = 0 if len(queue) < before else stalled[name] + 1
    missing = [i for i, t in enumerate(tokens) if t is None]
    if missing:
        raise ValueError(f"synthetic tokenizer: id {missing[0]} is in no token family and not special "
                         f"(expected moetier_synth.json to cover every id but the specials)")
    return SynthVocabulary(tokens, merges, dict(special))


def _folder_inputs(folder: Path) -> tuple[int, dict[str, list[int]], dict[str, int], int]:
    config = json.loads((folder / "config.json").read_text())
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    meta = json.loads((folder / SYNTH_META).read_text())
    vocab_size = config.get("vocab_size") or text["vocab_size"]
    return int(vocab_size), meta["families"], {k: int(v) for k, v in meta["special_tokens"].items()}, int(meta["seed"])


def synthetic_pre(folder: str | Path) -> str:
    """The tokenizer.ggml.pre name of a synthetic folder's tokenizer (by its config.json's model_type)."""
    return PRE_BY_ARCH.get(json.loads((Path(folder) / "config.json").read_text()).get("model_type"), DEFAULT_PRE)


def build_tokenizer_json(vocabulary: SynthVocabulary, pre: str = DEFAULT_PRE) -> str:
    """tokenizer.json's text: a BPE model over the byte alphabet, the split regexes llama.cpp runs for `pre`, the
    specials as added tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    split = PRE_TOKENIZERS[pre]
    vocab = {text: i for i, text in enumerate(vocabulary.tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=list(vocabulary.merges), byte_fallback=False,
                                     ignore_merges=split.ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in split.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.add_special_tokens([AddedToken(SPECIAL_NAMES[role], special=True, normalized=False)
                                  for role, _ in sorted(vocabulary.special.items(), key=lambda kv: kv[1])])
    return tokenizer.to_str(pretty=False)


def tokenizer_config(vocabulary: SynthVocabulary) -> dict:
    names = {role: SPECIAL_NAMES[role] for role in vocabulary.special}
    return {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 4096, "add_bos_token": False,
            "add_eos_token": False, "clean_up_tokenization_spaces": False, "bos_token": names.get("bos"),
            "eos_token": names.get("eos"), "pad_token": names.get("pad"), "unk_token": None,
            "chat_template": CHATML_TEMPLATE}


def write_synthetic_tokenizer(folder: str | Path) -> list[Path]:
    """Write tokenizer.json and tokenizer_config.json into a synthetic checkpoint's folder (which holds config.json
    and moetier_synth.json already); returns their paths. Each file is fsynced; call it before the folder is
    moved into place (it writes into `folder` directly)."""
    folder = Path(folder)
    vocab_size, families, special, seed = _folder_inputs(folder)
    vocabulary = synthetic_vocabulary(vocab_size, families, special, seed)
    written = []
    for name, text in (("tokenizer.json", build_tokenizer_json(vocabulary, synthetic_pre(folder))),
                       ("tokenizer_config.json", json.dumps(tokenizer_config(vocabulary), indent=2) + "\n")):
        path = folder / name
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        written.append(path)
    return written


# -- the GGUF side ---------------------------------------------------------------------
@dataclass(frozen=True)
class GgufVocabulary:
    """The tokenizer.ggml.* arrays and scalars of a byte-level BPE vocabulary, as llama.cpp's converter writes them."""

    pre: str
    tokens: list[str]
    token_types: list[int]  # gguf.TokenType: 1 normal, 3 control, 4 user-defined
    merges: list[str]  # "left right", in rank order
    special_ids: dict[str, int]  # bos / eos / pad / unk -> id
    add_bos: bool
    add_eos: bool
    chat_template: str | None


def gguf_vocabulary(folder: str | Path, pre: str | None = None) -> GgufVocabulary:
    """The GGUF vocabulary of a folder's byte-level BPE tokenizer.json (+ tokenizer_config.json, config.json):
    tokens by id, added tokens CONTROL (special) or USER_DEFINED, merges, special ids, add_bos/eos, chat template.
    `pre`: the tokenizer.ggml.pre name (the converter finds it by hashing a test string's ids); default: the
    synthetic vocabulary's, for a folder with moetier_synth.json, else refused."""
    folder = Path(folder)
    if pre is None:
        if not (folder / SYNTH_META).exists():
            raise ValueError(f"{folder}: not a synthetic model; name the tokenizer.ggml.pre of its tokenizer.json")
        pre = synthetic_pre(folder)
    data = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
    model = data.get("model", {})
    if model.get("type") != "BPE":
        raise ValueError(f"{folder / 'tokenizer.json'}: model type {model.get('type')!r} (expected a byte-level BPE)")
    config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8")) \
        if (folder / "tokenizer_config.json").exists() else {}
    added = {int(t["id"]): t for t in data.get("added_tokens", [])}
    size = max([*model["vocab"].values(), *added, -1]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]  # the converter's filler for ids nothing names
    types = [5] * size  # UNUSED
    for text, i in model["vocab"].items():
        tokens[i], types[i] = text, 1
    for i, t in added.items():
        tokens[i], types[i] = t["content"], 3 if t.get("special") else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {text: i for i, text in enumerate(tokens)}
    special = {}
    for role in ("bos", "eos", "unk", "pad"):
        name = config.get(f"{role}_token")
        name = name.get("content") if isinstance(name, dict) else name
        if isinstance(name, str) and name in ids:
            special[role] = ids[name]
    template = config.get("chat_template")
    if (folder / "chat_template.jinja").exists():
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    return GgufVocabulary(pre, tokens, types, merges, special, bool(config.get("add_bos_token", False)),
                          bool(config.get("add_eos_token", False)), template if isinstance(template, str) else None)


def add_gguf_vocabulary(writer, vocabulary: GgufVocabulary) -> None:
    """Write `vocabulary` into a gguf.GGUFWriter in the converter's order (_set_vocab_gpt2, then SpecialVocab)."""
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(vocabulary.pre)
    writer.add_token_list(vocabulary.tokens)
    writer.add_token_types(vocabulary.token_types)
    writer.add_token_merges(vocabulary.merges)
    for role in ("bos", "eos", "unk", "pad"):
        if role in vocabulary.special_ids:
            getattr(writer, f"add_{role}_token_id")(vocabulary.special_ids[role])
    writer.add_add_bos_token(vocabulary.add_bos)
    writer.add_add_eos_token(vocabulary.add_eos)
    if vocabulary.chat_template is not None:
        writer.add_chat_template(vocabulary.chat_template)
