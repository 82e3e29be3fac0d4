"""`moetier serve` as an agent meets it: a real server process on loopback, the real `openai` client.

One server (qwen3_next tiny: Gated DeltaNet in 3 of 4 layers, so prefix reuse goes through recurrent states) with an
API key and a recording folder serves the tests in order: chat and completions, streaming or not; greedy output equal
to `moetier run` (also with presence and frequency penalties); usage; stop sequences; 401 without the key; a 4xx for each bad request with the server answering
after; a client that leaves mid-stream frees the queue; prefix reuse; then the recording goes through
`moetier profile` -> `moetier bias` -> `moetier kl` -> `moetier simulate` -> `moetier serve --bias`.
"""

from __future__ import annotations

import json
import time

import pytest

from cli_runs import moetier, refused
from moetier.model.chat_template import render_chat
from moetier.model.tokenizer import load_tokenizer
from serving import http, server
from tokenizer_files import text_model

KEY = "test-secret"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return text_model(tmp_path_factory.mktemp("serve") / "qwen3_next-tiny", arch="qwen3_next", preset="tiny", seed=2)


@pytest.fixture(scope="module")
def record(tmp_path_factory):
    return tmp_path_factory.mktemp("serve") / "recording"


@pytest.fixture(scope="module")
def url(model, record):
    with server("--model", model, "--host", "127.0.0.1", "--api-key", KEY, "--record", record) as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _chat(client, messages, **kw):
    return client.chat.completions.create(model="m", messages=messages, temperature=0, **kw)


def test_models_and_chat_streaming_or_not(client, model):
    assert [m.id for m in client.models.list().data] == [model.name]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Where is route() defined?"}]
    answer = _chat(client, messages, max_tokens=12)
    tokenizer = load_tokenizer(model)
    prompt = tokenizer.encode(render_chat(tokenizer.chat_template(), messages))
    choice = answer.choices[0]
    assert choice.message.role == "assistant" and choice.message.content and choice.finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens == len(prompt)
    assert answer.usage.completion_tokens == (12 if choice.finish_reason == "length" else answer.usage.completion_tokens)
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    chunks = list(_chat(client, messages, max_tokens=12, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == choice.finish_reason
    assert chunks[-1].usage.completion_tokens == answer.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == len(prompt)  # the same prompt again: all reused


def test_completions_equal_moetier_run(client, model):
    prompt = "def route(logits): the report was found"
    run = moetier("run", "--model", model, "--prompt", prompt, "--max-new-tokens", 16, "--json")
    assert run.returncode == 0, run.stderr
    expected = json.loads(run.stdout)
    answer = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0)
    assert answer.choices[0].text == expected["text"]
    assert answer.choices[0].finish_reason == expected["finish_reason"]
    assert answer.usage.prompt_tokens == len(expected["prompt_ids"])
    assert answer.usage.completion_tokens == len(expected["generated_ids"])
    streamed = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == expected["text"]


def test_penalties_are_applied_as_moetier_run_applies_them(client, model):
    prompt = "def route(logits): the report was found"
    flags = ("--presence-penalty", 1.5, "--frequency-penalty", 1.0, "--ignore-eos")
    run = moetier("run", "--model", model, "--prompt", prompt, "--max-new-tokens", 16, "--json", *flags)
    assert run.returncode == 0, run.stderr
    plain = moetier("run", "--model", model, "--prompt", prompt, "--max-new-tokens", 16, "--json", "--ignore-eos")
    assert json.loads(plain.stdout)["generated_ids"] != json.loads(run.stdout)["generated_ids"]  # they changed something
    answer = client.completions.create(model="m", prompt=prompt, max_tokens=16, temperature=0, presence_penalty=1.5,
                                       frequency_penalty=1.0, extra_body={"ignore_eos": True})
    assert answer.choices[0].text == json.loads(run.stdout)["text"]


def test_stop_sequences_end_the_text_before_them(client):
    prompt = "The quick brown fox"
    full = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True})
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stop=[stop, "never-seen"],
                                    extra_body={"ignore_eos": True})
    assert cut.choices[0].text == text[: text.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0, stop=stop, stream=True,
                                         extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[: text.index(stop)]


def test_a_request_without_the_key_gets_401(client, url):
    import openai

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    status, body = http(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 1})
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert http(f"{url}/health")[0] == 200


def test_a_non_loopback_host_needs_an_api_key(model):
    line = refused(moetier("serve", "--model", model, "--host", "0.0.0.0"))
    assert line.startswith("moetier: error: --host 0.0.0.0 is not a loopback address"), line


BAD_REQUESTS = {
    "malformed JSON": ("completions", b'{"prompt": "x", "max_tokens": '),
    "not an object": ("completions", b'["x"]'),
    "max_tokens of the wrong type": ("completions", {"prompt": "x", "max_tokens": "ten"}),
    "max_tokens < 1": ("completions", {"prompt": "x", "max_tokens": 0}),
    "temperature of the wrong type": ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}),
    "stop of the wrong type": ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "stop": 5}),
    "no messages": ("chat/completions", {"messages": []}),
    "an unknown role": ("chat/completions", {"messages": [{"role": "robot", "content": "x"}]}),
    "a prompt longer than the context": ("completions", {"prompt": [5] * 5000, "max_tokens": 1}),
    "max_tokens past the context": ("completions", {"prompt": [5] * 100, "max_tokens": 4000}),
    "a token id outside the vocabulary": ("completions", {"prompt": [5, 99999], "max_tokens": 1}),
    "n > 16": ("completions", {"prompt": "x", "n": 17}),
    "top_logprobs > 20": ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21}),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_requests_get_a_4xx_and_the_server_keeps_serving(case, url):
    endpoint, body = BAD_REQUESTS[case]
    headers = {"authorization": f"Bearer {KEY}"}
    status, answer = http(f"{url}/v1/{endpoint}", body, headers)
    assert 400 <= status < 500, answer
    error = answer["error"]
    assert error["message"] and error["type"] == "invalid_request_error"
    if "context" in case:
        assert error["code"] == "context_length_exceeded"
    status, ok = http(f"{url}/v1/completions", {"prompt": "x", "max_tokens": 2, "unknown_field": [1]}, headers)
    assert status == 200 and ok["usage"]["completion_tokens"] >= 1


def test_a_client_that_leaves_mid_stream_frees_the_queue(client, url, record):
    stream = client.completions.create(model="m", prompt="Stream a long answer", max_tokens=3900, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True, "metadata": {"phase": "cancelled"}})
    for _, _ in zip(range(3), stream):
        pass
    stream.close()
    begin = time.perf_counter()
    answer = client.completions.create(model="m", prompt="next", max_tokens=4, temperature=0)
    assert answer.usage.completion_tokens >= 1 and time.perf_counter() - begin < 3.0
    records = [json.loads(line) for line in (record / "sessions.jsonl").read_text().splitlines()]
    left = [r for r in records if r["phase"] == "cancelled"]
    assert left and left[0]["meta"]["finish_reason"] == "cancelled" and left[0]["meta"]["completion_tokens"] < 1000


def test_prefix_reuse_prefills_only_what_follows(client, model):
    from moetier.engine import Engine, Sampling
    from moetier.model import open_checkpoint
    from moetier.serve.textgen import TextParams, generate_text

    history = [(7 * i) % 500 + 3 for i in range(300)]
    first = client.completions.create(model="m", prompt=history, max_tokens=8, temperature=0)
    assert first.usage.prompt_tokens == 300
    extended = history + [(11 * i) % 500 + 3 for i in range(50)]
    second = client.completions.create(model="m", prompt=extended, max_tokens=8, temperature=0)
    timings = second.model_extra["timings"]
    assert timings["prefill_tokens"] == 50 and second.usage.prompt_tokens_details.cached_tokens == 300
    engine = Engine(open_checkpoint(model))
    cold = generate_text(engine, load_tokenizer(model), extended, TextParams(8, Sampling()))
    assert second.choices[0].text == cold.text  # the reused state gives the cold run's greedy tokens
    # a chat turn that resends the history: at most the reply (its text may tokenize otherwise) and the new message
    # are computed; the whole earlier prompt is reused, from the mark at its end
    messages = [{"role": "user", "content": "List the files of the engine, with a word on what each one does."}]
    reply = _chat(client, messages, max_tokens=10)
    messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                 {"role": "user", "content": "Now explain the prefix cache of the server in one or two sentences."}]
    follow = _chat(client, messages, max_tokens=4)
    assert follow.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    assert follow.model_extra["timings"]["prefill_tokens"] == follow.usage.prompt_tokens - follow.usage.prompt_tokens_details.cached_tokens


def test_recorded_sessions_go_through_profile_bias_kl_simulate_and_serve_bias(client, model, record, tmp_path):
    from layouts import cache_layout

    for phase, text in [("explore", "Where is the router?"), ("edit", "def route(x):\n    return x"),
                        ("verify", "assert route(1) == 1"), ("explore", "Which module holds the cache?")]:
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=16,
                                       temperature=0, extra_headers={"X-Moetier-Phase": phase})
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                   metadata={"phase": "edit", "session": "s9"})
    sessions = record / "sessions.jsonl"
    records = [json.loads(line) for line in sessions.read_text().splitlines()]
    assert {"explore", "edit", "verify"} <= {r["phase"] for r in records}
    assert any(r["session"] == "s9" for r in records)
    profile, table = tmp_path / "profile.npz", tmp_path / "bias.safetensors"
    result = moetier("profile", sessions, "--out", profile, "--model", model, "--json")
    assert result.returncode == 0, result.stderr
    assert {"explore", "edit", "verify"} <= set(json.loads(result.stdout)["phases"])
    result = moetier("bias", "--profile", profile, "--hot", 4, "--out", table)
    assert result.returncode == 0, result.stderr
    result = moetier("kl", "--model", model, "--sessions", sessions, "--bias", table, "--no-floor", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["mean_kl"] >= 0
    traced = next(r for r in records if r["meta"]["trace"])
    layout = tmp_path / "layout.toml"
    layout.write_text(cache_layout(slots=4))
    result = moetier("simulate", "--layout", layout, "--trace", record / traced["meta"]["trace"], "--model", model, "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["warmup_tokens"] == traced["meta"]["prefill_tokens"]  # the prompt warms the cache
    with server("--model", model, "--bias", table) as (base, _):
        status, answer = http(f"{base}/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_tokens": 4, "temperature": 0})
        assert status == 200 and answer["choices"][0]["message"]["role"] == "assistant"
