"""`moetier serve`'s logprobs, n choices and JSON mode, through the real `openai` client against a real server process.

The server runs the same qwen3_next tiny model as test_serve.py. Logprobs are checked against a cold teacher-forced
forward of prompt + completion computed here (moetier.engine.generate.score); JSON mode's greedy picks against the
highest valid logit of that forward, token by token; n choices for their count, usage, determinism and prefix reuse.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from moetier.model.chat_template import render_chat
from moetier.model.tokenizer import load_tokenizer
from moetier.serve.jsonmode import JsonPrefix
from serve_checks import client, cold_logprobs, entry_ids, model, url  # noqa: F401 (client, model, url: fixtures)
from serving import http

MESSAGES = [{"role": "user", "content": "Answer in JSON: where is route() defined?"}]


@pytest.fixture(scope="module")
def tokenizer(model):
    return load_tokenizer(model)


@pytest.fixture(scope="module")
def cold(model):
    return cold_logprobs(model)


def _chat_prompt(tokenizer) -> list[int]:
    return tokenizer.encode(render_chat(tokenizer.chat_template(), MESSAGES))


def test_chat_logprobs_equal_a_cold_forward(client, tokenizer, cold):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=12, logprobs=True,
                                            top_logprobs=5, extra_body={"ignore_eos": True})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 12
    ids = entry_ids(tokenizer, content)
    prompt = _chat_prompt(tokenizer)
    rows = cold(prompt + ids)[len(prompt) - 1 : -1]  # [12, V]: row i predicts completion token i
    for entry, token, row in zip(content, ids, rows):
        assert abs(entry.logprob - row.max()) < 1e-4 and abs(entry.logprob - row[token]) < 1e-4  # greedy: the top
        assert len(entry.top_logprobs) == 5 and entry.top_logprobs[0].token == entry.token
        assert np.allclose([t.logprob for t in entry.top_logprobs], np.sort(row)[::-1][:5], atol=1e-4)
        assert entry.token == bytes(entry.bytes).decode("utf-8", errors="backslashreplace")
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == answer.choices[0].message.content
    streamed = list(client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=12,
                                                   logprobs=True, top_logprobs=5, stream=True,
                                                   extra_body={"ignore_eos": True}))
    entries = [e for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in entries] == [(e.token, round(e.logprob, 5)) for e in content]


def test_sampled_completion_logprobs_are_the_chosen_tokens(client, tokenizer, cold):
    prompt = [(7 * i) % 500 + 3 for i in range(40)]
    answer = client.completions.create(model="m", prompt=prompt, temperature=1.5, seed=5, max_tokens=16, logprobs=2,
                                       extra_body={"ignore_eos": True})
    logprobs = answer.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 16
    by_text = {}
    for i, piece in enumerate(tokenizer.token_bytes()):
        by_text.setdefault(piece.decode("utf-8", errors="backslashreplace"), []).append(i)
    ids = [by_text[t][0] for t in logprobs.tokens]
    assert all(len(by_text[t]) == 1 for t in logprobs.tokens)
    rows = cold(prompt + ids)[len(prompt) - 1 : -1]
    assert np.allclose(logprobs.token_logprobs, [row[t] for row, t in zip(rows, ids)], atol=1e-4)
    assert any(row[t] < row.max() - 1e-3 for row, t in zip(rows, ids))  # sampled: not always the top token
    for top, token, logprob, row in zip(logprobs.top_logprobs, logprobs.tokens, logprobs.token_logprobs, rows):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the 2 likeliest and the chosen one
        assert max(top.values()) == pytest.approx(row.max(), abs=1e-4)
    text, offsets = answer.choices[0].text, logprobs.text_offset
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(text)
    for token, offset in zip(logprobs.tokens, offsets):
        if "\\x" not in token:  # a whole-character token's text lies at its offset
            assert text[offset : offset + len(token)] == token
    streamed = list(client.completions.create(model="m", prompt=prompt, temperature=1.5, seed=5, max_tokens=16,
                                              logprobs=2, stream=True, extra_body={"ignore_eos": True}))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    assert tokens == logprobs.tokens


def test_n_choices_are_seeded_counted_once_and_reuse_the_prompt(client):
    prompt = [(13 * i) % 400 + 5 for i in range(60)]
    kw = dict(model="m", prompt=prompt, temperature=1.0, seed=7, max_tokens=10, extra_body={"ignore_eos": True})
    answer = client.completions.create(n=4, **kw)
    assert [c.index for c in answer.choices] == [0, 1, 2, 3]
    texts = [c.text for c in answer.choices]
    assert len(set(texts)) > 1  # each choice has its own seed
    assert answer.usage.prompt_tokens == 60 and answer.usage.completion_tokens == 40
    assert answer.usage.total_tokens == 100
    assert [c.text for c in client.completions.create(n=4, **kw).choices] == texts  # the same seed, the same choices
    assert client.completions.create(n=1, **kw).choices[0].text == texts[0]  # choice 0 samples with the seed itself
    fresh = [(17 * i) % 400 + 9 for i in range(60)]
    chunks = list(client.completions.create(n=3, stream=True, stream_options={"include_usage": True},
                                            **{**kw, "prompt": fresh}))
    finished = {c.choices[0].index: c.model_extra["timings"] for c in chunks if c.choices and c.choices[0].finish_reason}
    assert sorted(finished) == [0, 1, 2]
    assert finished[0]["prefill_tokens"] == 60 and finished[1]["prefill_tokens"] == finished[2]["prefill_tokens"] == 0
    assert chunks[-1].usage.completion_tokens == 30 and chunks[-1].usage.prompt_tokens == 60
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == [c.text for c in client.completions.create(n=3, **{**kw, "prompt": fresh}).choices]
    chat = client.chat.completions.create(model="m", messages=MESSAGES, n=3, temperature=1.0, seed=2, max_tokens=6,
                                          stream=True, extra_body={"ignore_eos": True})
    assert {c.choices[0].index for c in chat if c.choices} == {0, 1, 2}


def test_json_object_greedy_takes_the_highest_valid_logit(client, tokenizer, cold):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=40, logprobs=True,
                                            response_format={"type": "json_object"})
    choice = answer.choices[0]
    text = choice.message.content
    final = JsonPrefix().advanced(text.encode())
    assert final is not None and choice.finish_reason == ("stop" if final.complete else "length")
    if final.complete:
        assert isinstance(json.loads(text), dict)
    ids = entry_ids(tokenizer, choice.logprobs.content)
    prompt = _chat_prompt(tokenizer)
    rows = cold(prompt + ids)[len(prompt) - 1 : -1]
    pieces, state, overridden = tokenizer.token_bytes(), JsonPrefix(), 0
    control = tokenizer.specials.control_ids | tokenizer.stop_ids
    for token, row, entry in zip(ids, rows, choice.logprobs.content):
        valid = [i for i, p in enumerate(pieces) if p and i not in control and state.advanced(p) is not None]
        assert token == valid[int(np.argmax(row[valid]))]  # the highest logit among the valid tokens
        assert abs(entry.logprob - row[token]) < 1e-4  # the model's own logprob, not the constrained one
        overridden += token != int(np.argmax(row))
        state = state.advanced(pieces[token])
    assert overridden > 0  # the constraint changed picks
    streamed = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=40, stream=True,
                                              response_format={"type": "json_object"})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == text


def test_json_object_samples_are_objects_or_valid_prefixes(client):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.5, seed=3, n=16, max_tokens=80,
                                            response_format={"type": "json_object"})
    assert len(answer.choices) == 16
    stopped = [c for c in answer.choices if c.finish_reason == "stop"]
    assert stopped  # some objects close within 80 tokens
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert isinstance(json.loads(choice.message.content), dict)
        else:
            assert choice.finish_reason == "length" and JsonPrefix().advanced(choice.message.content.encode()) is not None


BAD = {
    "top_logprobs > 20": ("chat/completions", {"messages": MESSAGES, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    "top_logprobs without logprobs": ("chat/completions", {"messages": MESSAGES, "top_logprobs": 2}, "top_logprobs"),
    "completion logprobs > 5": ("completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    "n > 16": ("completions", {"prompt": "x", "n": 17}, "n"),
    "n = 0": ("chat/completions", {"messages": MESSAGES, "n": 0}, "n"),
    "json_schema": ("chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                                                    "json_schema": {"name": "x"}}},
                    "response_format"),
    "echo with suffix": ("completions", {"prompt": "x", "echo": True, "suffix": "y"}, "suffix"),
    "best_of < n": ("completions", {"prompt": "x", "n": 3, "best_of": 2}, "best_of"),
    "best_of > 16": ("completions", {"prompt": "x", "best_of": 17}, "best_of"),
    "best_of > n streamed": ("completions", {"prompt": "x", "best_of": 2, "stream": True}, "best_of"),
    "max_tokens 0 without echo": ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_out_of_bounds_requests_get_a_400_naming_the_field(case, url):
    endpoint, body, field = BAD[case]
    status, answer = http(f"{url}/v1/{endpoint}", body)
    assert status == 400 and answer["error"]["param"] == field and answer["error"]["type"] == "invalid_request_error"
    status, ok = http(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] >= 1
