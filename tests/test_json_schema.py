"""json_schema mode's parts: the schema compiler and the schema-constrained prefix validator, against a reference.

Random schemas of the supported subset and random values: the validator calls the compact text of a value complete
exactly when the reference validator (tests/json_schema_reference.py) accepts the value; random walks through the
validator's allowed bytes never reach a dead end, and every text they complete parses and validates.
"""

from __future__ import annotations

import json
import random

import pytest

from json_schema_reference import valid
from moetier.serve.schema import SchemaError, compile_schema
from moetier.serve.schemaprefix import MAX_DIGITS, MAX_INDENT, SchemaPrefix

NAMES = ["a", "b", "id", "näme", 'q"t', "x y"]
STRINGS = ["", "a", "x y", "é", "日本", 'q"t', "\n", "b"]
SCALARS = [None, True, False, 0, 1, -7, 42, 0.5, -2.25, *STRINGS]
TYPES = ["object", "array", "string", "number", "integer", "boolean", "null"]


def _state(node, text: str):
    return SchemaPrefix(node).advanced(text.encode())


def _complete(node, text: str) -> bool:
    state = _state(node, text)
    return state is not None and state.complete


def random_schema(rng: random.Random, depth: int, defs: dict) -> dict | bool:
    kind = rng.choice(["type", "type", "enum", "const", "object", "object", "array", "anyOf", "oneOf", "ref", "bool"]
                      if depth > 0 else ["type", "enum", "const", "bool"])
    if kind == "type":
        types = rng.sample(TYPES, rng.choice([1, 1, 2]))
        return {"type": types[0] if len(types) == 1 and rng.random() < 0.7 else types}
    if kind == "enum":
        schema = {"enum": rng.sample(SCALARS, rng.randint(1, 4))}
        return {**schema, "type": rng.choice(TYPES[2:])} if rng.random() < 0.2 else schema
    if kind == "const":
        return {"const": rng.choice(SCALARS), "description": "annotations are read and have no effect"}
    if kind == "bool":
        return rng.random() < 0.8
    if kind == "object":
        names = rng.sample(NAMES, rng.randint(0, 3))
        schema = {"type": "object", "properties": {n: random_schema(rng, depth - 1, defs) for n in names}}
        schema["required"] = [n for n in names if rng.random() < 0.5]
        extra = rng.choice([False, True, None, "schema"])
        if extra == "schema":
            schema["additionalProperties"] = random_schema(rng, depth - 1, defs)
        elif extra is not None:
            schema["additionalProperties"] = extra
        return schema
    if kind == "array":
        schema = {"type": "array", "items": random_schema(rng, depth - 1, defs)}
        if rng.random() < 0.5:
            schema["minItems"] = rng.randint(0, 2)
        if rng.random() < 0.5:
            schema["maxItems"] = rng.randint(schema.get("minItems", 0), 3)
        return schema
    if kind == "anyOf":
        return {"anyOf": [random_schema(rng, depth - 1, defs) for _ in range(rng.randint(1, 3))]}
    if kind == "oneOf":  # branches of distinct types, or objects told apart by a const tag
        if rng.random() < 0.5:
            return {"oneOf": [{"type": t} for t in rng.sample(["string", "boolean", "null", "array", "integer"], 2)]}
        return {"oneOf": [{"type": "object", "properties": {"kind": {"const": tag},
                                                            "v": random_schema(rng, depth - 1, defs)},
                           "required": ["kind"], "additionalProperties": False} for tag in ("p", "q")]}
    name = f"d{len(defs)}"
    defs[name] = {}  # filled after, so the definition may refer to itself
    target = random_schema(rng, depth - 1, defs)
    defs[name].update({"anyOf": [{"type": "null"}, {"type": "array", "items": {"$ref": f"#/$defs/{name}"}, "maxItems": 2}]}
                      if rng.random() < 0.3 or not isinstance(target, dict) else target)
    return {"$ref": f"#/$defs/{name}"}


def random_value(rng: random.Random, depth: int):
    kind = rng.random()
    if depth <= 0 or kind < 0.5:
        return rng.choice(SCALARS)
    if kind < 0.8:
        return {n: random_value(rng, depth - 1) for n in rng.sample(NAMES + ["kind", "v"], rng.randint(0, 3))}
    return [random_value(rng, depth - 1) for _ in range(rng.randint(0, 3))]


def _schemas(count: int, seed: int):
    rng = random.Random(seed)
    for _ in range(count):
        defs: dict = {}
        schema = random_schema(rng, 3, defs)
        if defs and isinstance(schema, dict):
            schema = {**schema, "$defs": defs} if "$ref" not in schema else {"$ref": schema["$ref"], "$defs": defs}
        try:
            yield schema, compile_schema(schema), rng
        except SchemaError as err:  # a random schema may accept nothing; nothing else is refused
            assert "accepts no value" in str(err) or "never reaches a value" in str(err), (schema, err)


def test_the_validator_agrees_with_the_reference_on_random_schemas_and_values():
    compared = valid_count = 0
    for schema, node, rng in _schemas(400, seed=0):
        values = [random_value(rng, 3) for _ in range(60)] + [{"kind": rng.choice("pq"), "v": random_value(rng, 2)}]
        for value in values:
            text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
            expected = valid(value, schema)
            assert _complete(node, text) == expected, (schema, text)
            if expected:  # every prefix is live, and spaces or indents between tokens are text too
                assert all(_state(node, text[:i]) is not None for i in range(len(text)))
                for layout in ({"separators": (", ", ": ")}, {"indent": 2}):
                    spaced = json.dumps(value, ensure_ascii=False, **layout)
                    assert _complete(node, spaced) or "enum" in json.dumps(schema) or "const" in json.dumps(schema), (
                        schema, spaced)
            compared += 1
            valid_count += expected
    assert compared > 10000 and valid_count > 1500, (compared, valid_count)


def _walk(node, rng: random.Random, limit: int = 400) -> str | None:
    """Random bytes the validator allows (closing ones favoured) until the text is complete and the walk stops."""
    state, text = SchemaPrefix(node), b""
    while len(text) < limit:
        if state.complete and (state.finished or rng.random() < 0.3):
            return text.decode()
        choices = [b for b in range(256) if state.advanced(bytes([b])) is not None]
        assert choices, ("a dead end", text)
        weights = [30 if b in b'"}],' else 4 if b in b"0123456789tfn{[:" else 0.2 if b >= 0x80 else 1 for b in choices]
        b = rng.choices(choices, weights)[0]
        state, text = state.advanced(bytes([b])), text + bytes([b])
    return None


def test_random_walks_never_dead_end_and_complete_texts_validate():
    completed = 0
    for schema, node, rng in _schemas(200, seed=1):
        for _ in range(2):
            text = _walk(node, rng)
            if text is not None:
                assert valid(json.loads(text), schema), (schema, text)
                completed += 1
    assert completed > 300, completed


def test_objects_keys_arrays_and_literals():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"enum": ["x", "y z", 1, [1, 2]]},
                                               "c": {"type": "array", "items": {"type": ["string", "null"]},
                                                     "minItems": 1, "maxItems": 2}},
              "required": ["a", "b"], "additionalProperties": False}
    node = compile_schema(schema)
    assert _complete(node, '{"a": 1, "b": "y z"}') and _complete(node, '{"b":[1,2],"a":-3}')
    assert _complete(node, '{"a":1,"b":1,"c":["s",null]}')
    for text in ['{"a": 1.5', '{"a": 1e3', '{"a": 01', '{"b": "x"}', '{"a":1,"a"', '{"a":1,"b":12', '{"e"',
                 '{"a":1,"b":1,"c":[]', '{"a":1,"b":1,"c":[1', '{"a":1,"b":1,"c":["",null,', '{"a":1,"b":"x",}']:
        assert _state(node, text) is None, text
    assert _state(node, '{"a": 1, "b": "x"').complete is False and _state(node, '{"a": 1, "b": "x"}').finished
    free = compile_schema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["z"]})
    assert _complete(free, '{"z": {"any": [true]}, "n": 2}') and _state(free, '{"n": "s"') is None
    assert _state(free, '{"z": 1, "z"') is None and not _complete(free, '{"n": 2}')  # a key once; required z
    assert _state(free, '{"\\u007a": 1, "z"') is None  # the same key, escaped: seen already


def test_scalar_roots_numbers_and_whitespace():
    number = compile_schema({"type": "number"})
    assert _state(number, "12").complete and not _state(number, "12").finished  # more digits may follow
    assert _complete(number, "-0.5e+3") and _state(number, "1" * MAX_DIGITS + "1") is None
    assert _complete(number, "1" * MAX_DIGITS + ".5")
    integer = compile_schema({"type": "integer"})
    assert _state(integer, "1.") is None and _state(integer, "1e") is None and _complete(integer, "-12")
    assert _state(compile_schema({"const": "ok"}), '"ok"').finished
    spaced = compile_schema({"type": "object"})  # between tokens: nothing, a space, or 1-2 newlines and an indent
    assert _complete(spaced, '{ "a" : [ 1 , 2 ] }') and _complete(spaced, '{\n\n\t"a":\n  1\n}')
    assert _state(spaced, "{\n" + " " * MAX_INDENT) is not None and _state(spaced, "{\n" + " " * (MAX_INDENT + 1)) is None
    for gap in ("  ", "\n\n\n", " \n", "\t", "\r\n", "\n \n"):
        assert _state(spaced, "{" + gap) is None, gap
    assert _state(compile_schema(True), '[1, {"a": null}]').finished


def test_refs_recurse_and_one_of_branches_must_exclude_each_other():
    tree = {"$defs": {"T": {"type": "object", "properties": {"v": {"type": "integer"},
                                                             "kids": {"type": "array", "items": {"$ref": "#/$defs/T"}}},
                            "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/T"}
    assert _complete(compile_schema(tree), '{"v":1,"kids":[{"v":2,"kids":[]},{"v":3}]}')
    tagged = {"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}, "x": {"type": "string"}}, "required": ["t"]},
                        {"type": "object", "properties": {"t": {"const": "b"}}, "required": ["t"]}]}
    node = compile_schema(tagged)
    assert _complete(node, '{"t":"a","x":"s"}') and _complete(node, '{"t":"b"}') and not _complete(node, '{"x":"s"}')
    with pytest.raises(SchemaError) as err:
        compile_schema({"oneOf": [{"type": "number"}, {"type": "integer"}]})
    assert err.value.keyword == "oneOf"
    legacy = {"definitions": {"Kind": {"enum": ["a", "b"]}}, "type": "array", "items": {"$ref": "#/definitions/Kind"}}
    assert _complete(compile_schema(legacy), '["a","b","a"]') and _state(compile_schema(legacy), '["c') is None


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "string", "pattern": "^a"}, "pattern"), ({"type": "string", "minLength": 2}, "minLength"),
    ({"type": "number", "minimum": 0}, "minimum"), ({"type": "string", "format": "date-time"}, "format"),
    ({"allOf": [{"type": "object"}]}, "allOf"), ({"type": "object", "patternProperties": {}}, "patternProperties"),
    ({"type": "array", "prefixItems": [True]}, "prefixItems"), ({"type": "array", "uniqueItems": True}, "uniqueItems"),
    ({"$ref": "https://example.com/s.json"}, "$ref"), ({"anyOf": [True], "required": ["a"]}, "required"),
    ({"type": "strng"}, "type"), ({"type": "array", "items": [True]}, "items"), ({"type": "array", "maxItems": -1}, "maxItems"),
    ({"not": {"type": "null"}}, "not"), ({"type": "object", "properties": {"a": {"if": True}}}, "if"),
])
def test_unsupported_keywords_are_refused_by_name(schema, keyword):
    with pytest.raises(SchemaError) as err:
        compile_schema(schema)
    assert err.value.keyword == keyword and keyword in str(err.value)


def test_schemas_that_accept_nothing_are_refused():
    for schema in [False, {"type": "string", "enum": [1]}, {"type": "object", "required": ["a"], "additionalProperties": False},
                   {"type": "array", "minItems": 2, "maxItems": 1}, {"type": "array", "items": False, "minItems": 1}]:
        with pytest.raises(SchemaError, match="accepts no value"):
            compile_schema(schema)
    # a branch that accepts nothing is never begun
    node = compile_schema({"anyOf": [{"type": "object", "required": ["a"], "additionalProperties": False}, {"type": "null"}]})
    assert _state(node, "{") is None and _complete(node, "null")
