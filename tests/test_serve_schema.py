"""`moetier serve`'s response_format json_schema, through the real `openai` client against a real server process.

The server runs the qwen3_next tiny model of test_serve_logprobs.py. Greedy picks are checked against the highest
logit, among the tokens the schema-constrained validator allows, of a cold teacher-forced forward; every output that
ends "stop" parses and validates under the reference validator (tests/json_schema_reference.py); a schema with a
keyword moetier does not enforce is a 400 naming it, and the server keeps serving.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from json_schema_reference import valid
from moetier.model.chat_template import render_chat
from moetier.model.tokenizer import load_tokenizer
from moetier.serve.schema import compile_schema
from moetier.serve.schemaprefix import SchemaPrefix
from serve_checks import client, cold_logprobs, entry_ids, model, url  # noqa: F401 (client, model, url: fixtures)
from serving import http

MESSAGES = [{"role": "user", "content": "Where is route() defined? Answer as JSON."}]
LOCATION = {"type": "object", "properties": {
    "file": {"enum": ["engine/router.py", "engine/core.py"]}, "line": {"type": "integer"}, "found": {"type": "boolean"},
    "kinds": {"type": "array", "items": {"enum": ["def", "call"]}, "minItems": 1, "maxItems": 3},
    "note": {"anyOf": [{"type": "null"}, {"const": "n/a"}]}},
    "required": ["file", "line", "found", "kinds", "note"], "additionalProperties": False}
# what pydantic writes for a model with a nested model, an optional field and a discriminated union
PYDANTIC = {
    "$defs": {
        "Edit": {"properties": {"kind": {"const": "edit", "title": "Kind"}, "path": {"title": "Path", "type": "string"}},
                 "required": ["kind", "path"], "title": "Edit", "type": "object", "additionalProperties": False},
        "Run": {"properties": {"kind": {"const": "run", "title": "Kind"}, "argv": {"items": {"type": "string"},
                                                                                   "maxItems": 2, "type": "array"}},
                "required": ["kind", "argv"], "title": "Run", "type": "object", "additionalProperties": False}},
    "properties": {"step": {"discriminator": {"propertyName": "kind"}, "oneOf": [{"$ref": "#/$defs/Edit"},
                                                                               {"$ref": "#/$defs/Run"}]},
                   "done": {"anyOf": [{"type": "boolean"}, {"type": "null"}], "default": None, "title": "Done"}},
    "required": ["step", "done"], "title": "Plan", "type": "object", "additionalProperties": False}


def _format(schema: dict, name: str = "answer") -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


def test_greedy_json_schema_takes_the_highest_allowed_logit_and_validates(client, model):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=600, logprobs=True,
                                            response_format=_format(LOCATION))
    choice = answer.choices[0]
    assert choice.finish_reason == "stop"
    assert valid(json.loads(choice.message.content), LOCATION)
    tokenizer = load_tokenizer(model)
    ids = entry_ids(tokenizer, choice.logprobs.content)
    prompt = tokenizer.encode(render_chat(tokenizer.chat_template(), MESSAGES))
    rows = cold_logprobs(model)(prompt + ids)[len(prompt) - 1 : -1]
    pieces, state, overridden = tokenizer.token_bytes(), SchemaPrefix(compile_schema(LOCATION)), 0
    control = tokenizer.specials.control_ids | tokenizer.stop_ids
    for token, row in zip(ids, rows):
        allowed = [i for i, p in enumerate(pieces) if p and i not in control and state.advanced(p) is not None]
        assert token == allowed[int(np.argmax(row[allowed]))]
        overridden += token != int(np.argmax(row))
        state = state.advanced(pieces[token])
    assert state.finished and overridden > 0
    streamed = client.chat.completions.create(model="m", messages=MESSAGES, temperature=0, max_tokens=600, stream=True,
                                              response_format=_format(LOCATION))
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == choice.message.content


@pytest.mark.parametrize("schema", [LOCATION, PYDANTIC], ids=["location", "pydantic"])
def test_sampled_outputs_validate_or_are_live_prefixes(client, schema):
    answer = client.chat.completions.create(model="m", messages=MESSAGES, temperature=1.0, seed=4, n=8, max_tokens=400,
                                            response_format=_format(schema))
    node, stopped = compile_schema(schema), 0
    for choice in answer.choices:
        if choice.finish_reason == "stop":
            assert valid(json.loads(choice.message.content), schema), choice.message.content
            stopped += 1
        else:
            assert choice.finish_reason == "length"
            assert SchemaPrefix(node).advanced(choice.message.content.encode()) is not None
    assert stopped >= 2, [c.message.content for c in answer.choices]  # free strings may run to max_tokens


BAD = {
    "pattern": ({"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}}, "'pattern'"),
    "minimum": ({"type": "integer", "minimum": 3}, "'minimum'"),
    "overlapping oneOf": ({"oneOf": [{"type": "number"}, {"type": "integer"}]}, "oneOf"),
    "remote $ref": ({"$ref": "https://example.com/schema.json"}, "$ref"),
    "no value": ({"type": "object", "required": ["a"], "additionalProperties": False}, "accepts no value"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_schemas_moetier_does_not_enforce_get_a_400_naming_the_keyword(case, url):
    schema, words = BAD[case]
    status, answer = http(f"{url}/v1/chat/completions", {"messages": MESSAGES, "response_format": _format(schema)})
    assert status == 400 and answer["error"]["param"] == "response_format", answer
    assert words in answer["error"]["message"]
    status, answer = http(f"{url}/v1/chat/completions", {"messages": MESSAGES, "response_format": {"type": "json_schema"}})
    assert status == 400 and answer["error"]["param"] == "response_format"
    status, ok = http(f"{url}/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2})
    assert status == 200 and ok["usage"]["completion_tokens"] >= 1
