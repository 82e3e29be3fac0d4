"""A small reference JSON Schema validator for tests, written apart from moetier.serve.schema.

It reads raw schema dicts as JSON Schema 2020-12 does for the keywords moetier enforces (type, enum, const,
properties, required, additionalProperties, items, minItems, maxItems, anyOf, oneOf — exactly one branch —,
$ref as a JSON pointer into the document, boolean schemas) and ignores annotations. Integers are JSON numbers with
no fraction (1.0 is one); true and false are no numbers.
"""

from __future__ import annotations


def _equal(a, b) -> bool:
    if isinstance(a, bool) != isinstance(b, bool):
        return False
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_equal(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _is(value, kind: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"null": value is None, "boolean": isinstance(value, bool), "string": isinstance(value, str),
            "array": isinstance(value, list), "object": isinstance(value, dict), "number": number,
            "integer": number and float(value).is_integer()}[kind]


def _resolve(root, ref: str):
    target = root
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        target = target[int(part)] if isinstance(target, list) else target[part]
    return target


def valid(value, schema, root=None) -> bool:
    """Whether `value` (as json.loads gives it) is valid under `schema`."""
    root = schema if root is None else root
    if schema is True or schema is False:
        return schema
    if "$ref" in schema and not valid(value, _resolve(root, schema["$ref"]), root):
        return False
    if "type" in schema:
        kinds = [schema["type"]] if isinstance(schema["type"], str) else schema["type"]
        if not any(_is(value, k) for k in kinds):
            return False
    if "enum" in schema and not any(_equal(value, v) for v in schema["enum"]):
        return False
    if "const" in schema and not _equal(value, schema["const"]):
        return False
    if "anyOf" in schema and not any(valid(value, s, root) for s in schema["anyOf"]):
        return False
    if "oneOf" in schema and sum(valid(value, s, root) for s in schema["oneOf"]) != 1:
        return False
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        if not all(k in value for k in schema.get("required", [])):
            return False
        for k, v in value.items():
            sub = properties[k] if k in properties else schema.get("additionalProperties", True)
            if not valid(v, sub, root):
                return False
    if isinstance(value, list):
        if len(value) < schema.get("minItems", 0) or len(value) > schema.get("maxItems", len(value)):
            return False
        if not all(valid(v, schema.get("items", True), root) for v in value):
            return False
    return True
