"""`moetier serve`'s /v1/completions extras: echo, best_of and suffix (fill-in-the-middle), through the real `openai`
client against real server processes.

The servers run the qwen3_next tiny model of test_serve_logprobs.py, and a copy whose tokenizer.json names three of its
tokens <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|> (Qwen2.5-Coder's spelling). An echoed prompt's logprobs are
checked against a cold teacher-forced forward; best_of against the mean logprobs of the same candidates asked for as
n choices; a suffix request against the same prompt laid out by hand.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from moetier.model.tokenizer import load_tokenizer
from moetier.serve.infill import FimTokens, fim_tokens
from serve_checks import client, cold_logprobs, model, url  # noqa: F401 (client, model, url: fixtures)
from serving import http, server
from tokenizer_files import _close, _header, bpe_gguf

PROMPT = "def route(logits):\n    return"
FIM = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>")


def with_fim_tokens(folder, out):
    """A copy of a synthetic model whose tokenizer.json turns three merged tokens no other merge uses into FIM special
    tokens (their merges dropped): the same ids, so the model's vocabulary is unchanged."""
    shutil.copytree(folder, out)
    data = json.loads((out / "tokenizer.json").read_text())
    bpe = data["model"]
    merges = [m if isinstance(m, list) else m.split(" ") for m in bpe["merges"]]
    used = {part for m in merges for part in m}
    leaves = [m for m in merges if "".join(m) not in used][-3:]
    bpe["merges"] = [m for m in merges if m not in leaves]
    for name, merge in zip(FIM, leaves):
        token_id = bpe["vocab"].pop("".join(merge))
        bpe["vocab"][name] = token_id
        data["added_tokens"].append({"id": token_id, "content": name, "single_word": False, "lstrip": False,
                                     "rstrip": False, "normalized": False, "special": True})
    (out / "tokenizer.json").write_text(json.dumps(data))
    return out


def test_echo_puts_the_prompt_before_the_text(client):
    plain = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=8)
    echoed = client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=8, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens
    chunks = list(client.completions.create(model="m", prompt=PROMPT, temperature=0, max_tokens=8, echo=True, n=2,
                                            stream=True))
    for index in range(2):
        texts = [c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index]
        assert texts[0] == PROMPT and "".join(texts) == echoed.choices[0].text


def test_echo_logprobs_cover_the_prompt_as_a_cold_forward_scores_it(client, model):
    prompt = [(11 * i) % 480 + 3 for i in range(30)]
    echoed = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=5, echo=True, logprobs=2,
                                       extra_body={"ignore_eos": True})
    plain = client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=5, logprobs=2,
                                      extra_body={"ignore_eos": True})
    logprobs, completion = echoed.choices[0].logprobs, plain.choices[0].logprobs
    assert len(logprobs.tokens) == 35 and logprobs.tokens[30:] == completion.tokens
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    rows = cold_logprobs(model)(prompt)  # [30, V]: row i predicts token i + 1
    expected = [rows[i - 1][prompt[i]] for i in range(1, 30)]
    assert np.allclose(logprobs.token_logprobs[1:30], expected, atol=1e-4)
    for i in range(1, 30):
        top = logprobs.top_logprobs[i]
        assert 2 <= len(top) <= 3 and max(top.values()) == pytest.approx(rows[i - 1].max(), abs=1e-4)
    assert np.allclose(logprobs.token_logprobs[30:], completion.token_logprobs, atol=1e-5)
    text, echo_chars = echoed.choices[0].text, len(echoed.choices[0].text) - len(plain.choices[0].text)
    assert text.endswith(plain.choices[0].text) and logprobs.text_offset[0] == 0
    assert logprobs.text_offset[30:] == [o + echo_chars for o in completion.text_offset]
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    scored = client.completions.create(model="m", prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert scored.choices[0].text == text[:echo_chars] and scored.usage.completion_tokens == 0
    assert np.allclose(scored.choices[0].logprobs.token_logprobs[1:], expected, atol=1e-4)
    streamed = list(client.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=5, echo=True,
                                              logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in streamed if c.choices and c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == logprobs.tokens and offsets == logprobs.text_offset


def test_best_of_keeps_the_candidates_with_the_highest_mean_logprob(client):
    kw = dict(model="m", prompt=PROMPT, temperature=1.2, seed=11, max_tokens=8, logprobs=0, extra_body={"ignore_eos": True})
    candidates = client.completions.create(n=5, **kw).choices  # best_of's candidates are the n choices of its seed
    means = [np.mean(c.logprobs.token_logprobs) for c in candidates]
    best = client.completions.create(n=2, best_of=5, **kw)
    order = sorted(range(5), key=lambda i: -means[i])
    assert [c.text for c in best.choices] == [candidates[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1]
    assert best.usage.completion_tokens == 40  # every candidate's tokens
    same = list(client.completions.create(n=2, best_of=2, stream=True, **kw))  # best_of == n: nothing to rank
    assert {c.choices[0].index for c in same if c.choices} == {0, 1}


def test_suffix_without_fim_tokens_is_a_400_naming_it(client, model):
    status, answer = http(f"{client.base_url}completions", {"prompt": "x", "suffix": "y"})
    assert status == 400 and answer["error"]["param"] == "suffix" and "fill-in-the-middle" in answer["error"]["message"]
    assert client.completions.create(model="m", prompt="x", suffix="", max_tokens=2).usage.completion_tokens >= 1
    assert fim_tokens(load_tokenizer(model)) is None


def test_suffix_fills_in_the_middle_with_the_model_fim_tokens(model, tmp_path):
    from openai import OpenAI

    fim_model = with_fim_tokens(model, tmp_path / "fim")
    tokenizer = load_tokenizer(fim_model)
    fim = fim_tokens(tokenizer)
    assert fim is not None and [tokenizer.token_bytes()[i].decode() for i in (fim.prefix, fim.suffix, fim.middle)] == list(FIM)
    prefix, suffix = "def route(logits):\n", "\n    return picks\n"
    ids = ([fim.prefix] + tokenizer.encode(prefix, parse_special=False) + [fim.suffix]
           + tokenizer.encode(suffix, parse_special=False) + [fim.middle])
    with server("--model", fim_model, "--host", "127.0.0.1") as (base, _):
        client = OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120)
        infill = client.completions.create(model="m", prompt=prefix, suffix=suffix, temperature=0, max_tokens=12)
        by_hand = client.completions.create(model="m", prompt=ids, temperature=0, max_tokens=12)
        assert infill.choices[0].text == by_hand.choices[0].text and infill.usage.prompt_tokens == len(ids)
        assert client.completions.create(model="m", prompt="", suffix=suffix, max_tokens=2).usage.prompt_tokens == (
            len(ids) - len(tokenizer.encode(prefix, parse_special=False)))


def test_gguf_fim_keys_name_the_fim_tokens(model, tmp_path):
    import gguf

    from moetier.model.synth_tokenizer import add_gguf_vocabulary, gguf_vocabulary

    plain = load_tokenizer(bpe_gguf(tmp_path / "plain.gguf", model, "qwen2"))
    assert fim_tokens(plain) is None
    writer = gguf.GGUFWriter(str(tmp_path / "fim.gguf"), "llama")
    _header(writer)
    add_gguf_vocabulary(writer, gguf_vocabulary(model, "qwen2"))
    for key, token_id in (("fim_pre", 7), ("fim_suf", 8), ("fim_mid", 9), ("fim_pad", 10)):
        writer.add_uint32(f"tokenizer.ggml.{key}_token_id", token_id)
    _close(writer)
    assert fim_tokens(load_tokenizer(tmp_path / "fim.gguf")) == FimTokens(7, 8, 9, frozenset({10}))


def test_prompt_logprobs_in_chunks_equal_one_forward(model):
    from moetier.engine import Engine
    from moetier.model import open_checkpoint
    from moetier.serve.textgen import prompt_logprobs

    engine, tokenizer = Engine(open_checkpoint(model)), load_tokenizer(model)
    prompt = [(7 * i) % 490 + 3 for i in range(40)]
    whole, chunked = (prompt_logprobs(engine, tokenizer, prompt, 3, chunk) for chunk in (512, 7))
    assert whole[0].logprob is None and [e.token for e in chunked] == prompt
    assert np.allclose([e.logprob for e in whole[1:]], [e.logprob for e in chunked[1:]], atol=1e-4)
    assert [e.offset for e in whole] == [e.offset for e in chunked] and [len(e.top) for e in chunked[1:]] == [3] * 39
