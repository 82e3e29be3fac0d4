"""Tokenizers: moetier's ids equal transformers' for the same tokenizer.json, and its GGUF path equals both; text round-trips.

The mixed text (tests/tokenizer_text.py) has code, English, other scripts, emoji and odd whitespace. llama.cpp's
side of the comparison (GGUF vocabularies through `Llama.tokenize`) is in test_tokenizer_llama.py (marker peer).
"""

from __future__ import annotations

import json

import pytest

from moetier.model.gguf_vocab import PRE_TOKENIZERS
from moetier.model.synth_tokenizer import SPECIAL_NAMES, write_synthetic_tokenizer
from moetier.model.tokenizer import StreamDecoder, TokenizerError, load_tokenizer
from tokenizer_files import bpe_gguf, spm_gguf, spm_style_folder, text_model
from tokenizer_text import MIXED_TEXT

SPECIAL_TEXT = MIXED_TEXT + "<|im_start|>user\nhi<|im_end|>\n"


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return text_model(tmp_path_factory.mktemp("tok") / "small", preset="small")


@pytest.fixture(scope="module")
def spm_folder(tmp_path_factory):
    return spm_style_folder(tmp_path_factory.mktemp("tok") / "spm")


def _transformers(folder):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def test_the_synthetic_tokenizer_is_deterministic_and_covers_every_id(small, tmp_path):
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "moetier_synth.json"):
        (copy / name).write_bytes((small / name).read_bytes())
    write_synthetic_tokenizer(copy)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (copy / name).read_bytes() == (small / name).read_bytes()
    tokenizer = load_tokenizer(small)
    config = json.loads((small / "config.json").read_text())
    assert tokenizer.vocab_size == config["vocab_size"]
    assert [tokenizer.decode([i]) for i in range(3)] == list(SPECIAL_NAMES.values())
    assert tokenizer.stop_ids == {config["eos_token_id"], 0}  # <|im_end|>, and <|endoftext|> by its name
    assert tokenizer.chat_template() is not None and "<|im_start|>" in tokenizer.chat_template()


@pytest.mark.parametrize("kind", ["synthetic", "spm"])
def test_ids_equal_transformers_and_text_round_trips(kind, small, spm_folder):
    folder = small if kind == "synthetic" else spm_folder
    ours, theirs = load_tokenizer(folder), _transformers(folder)
    for add_special in (False, True):
        ids = ours.encode(MIXED_TEXT, add_special=add_special)
        assert ids == theirs.encode(MIXED_TEXT, add_special_tokens=add_special)
        assert ours.decode(ids) == theirs.decode(ids)
        assert ours.decode(ids, skip_special=True) == MIXED_TEXT == theirs.decode(ids, skip_special_tokens=True)
    assert ours.encode(SPECIAL_TEXT) == theirs.encode(SPECIAL_TEXT, add_special_tokens=False)
    if kind == "spm":
        assert ours.encode("x")[0] != 1 and ours.encode("x", add_special=True)[0] == 1  # BOS only when asked


def test_special_tokens_parse_only_when_asked(small):
    tokenizer = load_tokenizer(small)
    parsed = tokenizer.encode("a<|im_end|>b")
    literal = tokenizer.encode("a<|im_end|>b", parse_special=False)
    assert 2 in parsed and 2 not in literal and len(literal) > len(parsed)
    assert tokenizer.decode(literal) == "a<|im_end|>b"


@pytest.mark.parametrize("arch", ["qwen3_moe", "glm4_moe"])
def test_a_gguf_vocabulary_tokenizes_as_its_tokenizer_json(arch, small, tmp_path):
    """A synthetic tokenizer.json splits with its family's regex (Qwen2's; GLM-4's, whole words first): the GGUF
    path under the pre name the folder's vocabulary gets (qwen2, glm4) must give the same ids."""
    from moetier.model.synth_tokenizer import gguf_vocabulary

    folder = small if arch == "qwen3_moe" else text_model(tmp_path / "glm", arch=arch, preset="small")
    pre = gguf_vocabulary(folder).pre
    assert pre == {"qwen3_moe": "qwen2", "glm4_moe": "glm4"}[arch]
    reference = load_tokenizer(folder)
    gguf = load_tokenizer(bpe_gguf(tmp_path / "v.gguf", folder, pre))
    for parse_special in (False, True):
        ids = gguf.encode(SPECIAL_TEXT, parse_special=parse_special)
        assert ids == reference.encode(SPECIAL_TEXT, parse_special=parse_special)
        assert gguf.decode(ids) == SPECIAL_TEXT
    assert gguf.stop_ids == reference.stop_ids and gguf.specials.bos_id == 1 and not gguf.specials.add_bos


def distinct_pre_tokenizers() -> list[str]:
    """One name per distinct (regexes, ignore merges) of PRE_TOKENIZERS."""
    names: dict = {}
    for name, pre in PRE_TOKENIZERS.items():
        names.setdefault((tuple(pre.regexes), pre.ignore_merges), name)
    return sorted(names.values())


def test_every_pre_tokenizer_round_trips(small, tmp_path):
    for name in distinct_pre_tokenizers():
        tokenizer = load_tokenizer(bpe_gguf(tmp_path / f"{name}.gguf", small, name))
        assert tokenizer.decode(tokenizer.encode(MIXED_TEXT)) == MIXED_TEXT, name


def test_spm_gguf_round_trips_and_adds_bos(small, tmp_path):
    tokenizer = load_tokenizer(spm_gguf(tmp_path / "spm.gguf", small))
    ids = tokenizer.encode(MIXED_TEXT, add_special=True)
    assert ids[0] == 1 and tokenizer.decode(ids, skip_special=True) == MIXED_TEXT
    assert tokenizer.decode(tokenizer.encode(MIXED_TEXT)) == MIXED_TEXT


@pytest.mark.parametrize("kind", ["synthetic", "spm_gguf"])
def test_streamed_text_is_the_decoded_text_and_never_splits_a_character(kind, small, tmp_path):
    tokenizer = load_tokenizer(small if kind == "synthetic" else spm_gguf(tmp_path / "spm.gguf", small))
    ids = tokenizer.encode(MIXED_TEXT)
    decoder = StreamDecoder(tokenizer)
    pieces = [decoder.push(i) for i in ids] + [decoder.flush()]
    assert "".join(pieces) == MIXED_TEXT
    assert not any("\ufffd" in p for p in pieces)  # every emoji, CJK character and accent arrives whole


@pytest.mark.parametrize("kind", ["synthetic", "spm", "bpe_gguf", "spm_gguf"])
def test_token_bytes_join_to_the_decoded_text(kind, small, spm_folder, tmp_path):
    """Each id's bytes (logprobs' `bytes`, JSON mode's validator) are what decode joins: the text whole, a space
    prefix that decode drops at the start aside, specials as their text."""
    model = {"synthetic": small, "spm": spm_folder, "bpe_gguf": bpe_gguf(tmp_path / "bpe.gguf", small, "qwen2"),
             "spm_gguf": spm_gguf(tmp_path / "spm.gguf", small)}[kind]
    tokenizer = load_tokenizer(model)
    pieces = tokenizer.token_bytes()
    assert len(pieces) == tokenizer.vocab_size
    ids = tokenizer.encode(SPECIAL_TEXT)
    joined = b"".join(pieces[i] for i in ids).decode()
    assert joined in (tokenizer.decode(ids), " " + tokenizer.decode(ids))
    split = any(not _whole(pieces[i]) for i in ids)  # pieces that are part of a character were joined too
    assert split or kind == "spm"  # (the SPM-style vocabulary was trained on this text: it has every character)


def _whole(piece: bytes) -> bool:
    try:
        piece.decode()
    except UnicodeDecodeError:
        return False
    return True


def test_a_model_without_tokenizer_is_one_clear_error(tmp_path):
    from moetier.model.synth import write_synthetic

    folder = write_synthetic(tmp_path / "bare", arch="qwen3_moe", preset="tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a checkpoint without its tokenizer
        (folder / name).unlink(missing_ok=True)
    with pytest.raises(TokenizerError, match="no tokenizer.json"):
        load_tokenizer(folder)
    (folder / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="not a readable tokenizer.json"):
        load_tokenizer(folder)


def test_an_unsupported_pre_tokenizer_is_refused_by_name(small, tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'kimi-k2' is not supported"):
        load_tokenizer(bpe_gguf(tmp_path / "k.gguf", small, "kimi-k2"))
