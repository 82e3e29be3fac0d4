"""Tokenizer parity with llama.cpp (marker peer): moetier's GGUF tokenizer gives `Llama.tokenize`'s ids for the same file.

Vocabulary-only GGUFs (tests/tokenizer_files.py): the synthetic byte-level BPE under every distinct pre-tokenizer
moetier supports, and a SentencePiece-style one; the mixed text with and without special tokens, with and without BOS.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from moetier.model.tokenizer import load_tokenizer
from test_tokenizer import SPECIAL_TEXT, distinct_pre_tokenizers
from tokenizer_files import bpe_gguf, spm_gguf, text_model
from tokenizer_text import MIXED_TEXT

pytestmark = pytest.mark.peer


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return text_model(tmp_path_factory.mktemp("tok") / "small", preset="small")


def _compare(path, texts) -> int:
    from llama_cpp import Llama

    llama = Llama(str(path), vocab_only=True, verbose=False)
    ours = load_tokenizer(path)
    compared = 0
    for text, special in texts:
        for add_bos in (False, True):
            expected = llama.tokenize(text.encode(), add_bos=add_bos, special=special)
            got = ours.encode(text, add_special=add_bos, parse_special=special)
            first = next((i for i, (a, b) in enumerate(zip(expected, got)) if a != b), min(len(expected), len(got)))
            assert got == expected, f"{path.name} special={special} bos={add_bos}: first difference at token {first}"
            compared += len(expected)
    return compared


@pytest.mark.parametrize("pre", distinct_pre_tokenizers())
def test_bpe_ids_equal_llama_cpp(pre, small, tmp_path):
    path = bpe_gguf(tmp_path / f"{pre}.gguf", small, pre)
    assert _compare(path, [(MIXED_TEXT, False), (SPECIAL_TEXT, True), (SPECIAL_TEXT, False)]) > 10_000


def test_spm_ids_equal_llama_cpp(small, tmp_path):
    path = spm_gguf(tmp_path / "spm.gguf", small)
    texts = [(MIXED_TEXT, False), (MIXED_TEXT + "<s>x</s> <tool>y<|im_end|>\n", True), (MIXED_TEXT + " <tool>z", False)]
    assert _compare(path, texts) > 10_000


VOCABS = os.environ.get("MOETIER_LLAMA_VOCABS")  # llama.cpp's models/ folder: its ggml-vocab-*.gguf test vocabularies


@pytest.mark.skipif(not VOCABS, reason="set MOETIER_LLAMA_VOCABS to llama.cpp's models/ folder (ggml-vocab-*.gguf)")
def test_real_vocabularies_equal_llama_cpp():
    """Qwen2, Qwen3.5, Llama 3 and 2, GPT-2, DeepSeek, Falcon, Command-R, Phi-3, ... (scripts/tokenizer_parity.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from tokenizer_parity import compare

    rows = [compare(path) for path in sorted(Path(VOCABS).glob("ggml-vocab-*.gguf"))]
    compared = [r for r in rows if "refused" not in r]
    assert len(compared) >= 10
    assert all(r["equal"] and r["round_trip"] for r in compared), [r for r in compared if not r["equal"]]
