"""Text generation and the text commands: stop strings, tool calls, `moetier run --prompt`, `moetier chat`."""

from __future__ import annotations

import json

import pytest

from cli_runs import moetier, refused
from moetier.engine import Engine, Sampling
from moetier.model import open_checkpoint
from moetier.model.tokenizer import load_tokenizer
from moetier.serve.textgen import StopStrings, TextParams, generate_text
from moetier.serve.tools import ToolCallGate, split_tool_calls
from tokenizer_files import text_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return text_model(tmp_path_factory.mktemp("text") / "tiny", preset="tiny", seed=4)


def test_stop_strings_hold_back_what_could_begin_one():
    stops = StopStrings(("END", "<|x|>"))
    assert stops.feed("abc E") == ("abc ", False)
    assert stops.feed("N") == ("", False)
    assert stops.feed("x") == ("ENx", False)
    assert stops.feed("<|") == ("", False)
    assert stops.feed("x|> tail") == ("", True)
    fresh = StopStrings(("END",))
    assert fresh.feed("aEND b") == ("a", True)
    assert StopStrings(()).feed("anything") == ("anything", False)


def test_generate_text_ends_on_a_stop_string_and_counts_every_token(model):
    engine, tokenizer = Engine(open_checkpoint(model)), load_tokenizer(model)
    prompt = tokenizer.encode("The report")
    full = generate_text(engine, tokenizer, prompt, TextParams(20, Sampling(), ignore_eos=True))
    assert full.finish_reason == "length" and len(full.ids) == 20
    assert full.text == tokenizer.decode(full.ids, skip_special=True)
    stop = full.text[len(full.text) // 2 :][:2]
    pieces = []
    cut = generate_text(engine, tokenizer, prompt, TextParams(20, Sampling(), (stop,), ignore_eos=True), on_text=pieces.append)
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)] == "".join(pieces)
    cancelled = generate_text(engine, tokenizer, prompt, TextParams(20, Sampling(), ignore_eos=True), cancelled=lambda: True)
    assert cancelled.finish_reason == "cancelled" and len(cancelled.ids) == 1


def test_tool_calls_in_both_formats():
    hermes = 'Let me look.\n<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
    content, calls = split_tool_calls(hermes)
    assert content == "Let me look." and calls[0]["function"]["name"] == "read_file"
    assert json.loads(calls[0]["function"]["arguments"]) == {"path": "a.py"}
    glm = "<tool_call>grep\n<arg_key>pattern</arg_key>\n<arg_value>route</arg_value>\n<arg_key>max</arg_key>\n" \
          "<arg_value>3</arg_value>\n</tool_call><tool_call>{\"name\": \"ls\", \"arguments\": {}}</tool_call>"
    content, calls = split_tool_calls(glm)
    assert content is None and [c["function"]["name"] for c in calls] == ["grep", "ls"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"pattern": "route", "max": 3}
    assert split_tool_calls("no calls <tool_call>not json{") == ("no calls <tool_call>not json{", [])
    gate = ToolCallGate()
    assert gate.feed("text <tool") == "text " and gate.feed("_call>{") == "" and gate.held == "<tool_call>{"
    assert ToolCallGate().feed("a < b") == "a < b"


def test_run_streams_the_json_text(model):
    as_json = json.loads(moetier("run", "--model", model, "--prompt", "def route(x):", "--max-new-tokens", 10, "--json").stdout)
    streamed = moetier("run", "--model", model, "--prompt", "def route(x):", "--max-new-tokens", 10)
    assert streamed.returncode == 0, streamed.stderr
    assert streamed.stdout == as_json["text"] + "\n"
    assert streamed.stderr.startswith("def route(x):") and "decode" in streamed.stderr
    assert as_json["prompt"] == "def route(x):" and as_json["prompt_ids"] == load_tokenizer(model).encode("def route(x):")


def test_run_refuses_text_for_a_model_without_tokenizer(tmp_path):
    from moetier.model.synth import write_synthetic

    folder = write_synthetic(tmp_path / "bare", arch="qwen3_moe", preset="tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a checkpoint without its tokenizer
        (folder / name).unlink(missing_ok=True)
    refused(moetier("run", "--model", folder, "--prompt", "hi", "--max-new-tokens", 2), "tokenizer")  # after the engine is built


def test_chat_answers_each_turn_and_reuses_the_history(model):
    result = moetier("chat", "--model", model, "--temperature", 0, "--max-tokens", 8, "--system", "Be brief.",
                     stdin="Where is the router?\nAnd the cache?\n/exit\n")
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2  # one answer a turn
    turns = [line for line in result.stderr.splitlines() if "reused" in line]
    assert len(turns) == 2 and "(0 reused)" in turns[0] and "(0 reused)" not in turns[1]


def test_penalties_take_openai_s_amounts_off_the_generated_tokens():
    """presence once per token that occurs, frequency times its count; none on the others; greedy follows them."""
    import torch

    from moetier.engine.generate import penalise, pick_token

    logits = torch.tensor([1.0, 4.0, 3.5, 0.0, -1.0])
    sampling = Sampling(presence_penalty=0.25, frequency_penalty=0.5)
    out = penalise(logits, sampling, [1, 1, 3, 1])
    assert torch.equal(out, torch.tensor([1.0, 4.0 - 0.25 - 1.5, 3.5, 0.0 - 0.25 - 0.5, -1.0]))
    assert pick_token(logits, sampling, None, [1, 1, 3, 1]) == 2 and pick_token(logits, sampling, None, []) == 1
    assert pick_token(logits, Sampling(), None, [1, 1, 1]) == 1  # no penalty: the generated tokens change nothing
    negative = Sampling(presence_penalty=-2.0)  # a negative one favours repeats
    assert pick_token(torch.tensor([3.0, 2.0]), negative, None, [1]) == 1


def test_generate_and_stream_tokens_penalise_alike(tmp_path):
    """A strong frequency penalty changes a greedy run that repeats, and stream_tokens picks what generate picks."""
    from moetier.engine import generate
    from moetier.engine.stream import stream_tokens
    from moetier.model.synth import write_synthetic

    engine = Engine(open_checkpoint(write_synthetic(tmp_path / "m", preset="tiny", seed=0)))
    prompt = [5, 6, 7, 8]
    plain = generate(engine, prompt, 24).ids
    assert len(set(plain)) < len(plain)  # a tiny random model repeats itself greedily
    sampling = Sampling(frequency_penalty=2.0, presence_penalty=2.0)
    penalised = generate(engine, prompt, 24, sampling).ids
    assert penalised != plain and len(set(penalised)) > len(set(plain))
    assert list(stream_tokens(engine, prompt, 24, sampling)) == penalised
