"""response_format json_schema: a JSON Schema compiled into the nodes the schema-constrained decoder walks.

`compile_schema(schema)` reads the subset of JSON Schema moetier enforces:
`type` (a name or a list), `enum`, `const`, objects' `properties` /
`required` / `additionalProperties` (false, true, absent or a schema),
arrays' `items` / `minItems` / `maxItems`, `anyOf`, `oneOf` (branches that
provably exclude each other), `$ref` into the same document (`#`,
`#/$defs/...`, `#/definitions/...`; it may recurse) and boolean schemas.
Annotations (title, description, default, ...) are read and have no effect.
Any other keyword is a SchemaError naming it and where it sits: never ignored.
Nodes that accept no value are found (a least fixed point, as refs may
recurse) and each node's `starts` lists only the kinds of value it can
finish, so the decoder never begins a value it cannot end.
Invariant: a value accepted by the node compiled from a schema is valid
under that schema (`accepts` decides it for Python values).
"""

from __future__ import annotations

import json

TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
ALL_TYPES = frozenset(TYPES)
KEYWORDS = frozenset({"type", "enum", "const", "properties", "required", "additionalProperties", "items", "minItems",
                      "maxItems", "anyOf", "oneOf", "$ref"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "$schema", "$id", "deprecated",
                         "readOnly", "writeOnly", "$defs", "definitions", "discriminator"})
MAX_DISJOINT_DEPTH = 6  # how deep oneOf's disjointness proof looks into required properties


class SchemaError(ValueError):
    """A schema moetier does not enforce: the keyword (or None) and the JSON pointer where it sits."""

    def __init__(self, keyword: str | None, where: str, message: str):
        super().__init__(f"{where}: {message}")
        self.keyword, self.where = keyword, where


class Node:
    """One schema, compiled. A literal node (enum/const) accepts its `literals`; a union node (anyOf, oneOf, $ref)
    a value one of its `branches` accepts, of a type in `types`; a typed node a value of a type in `types`, with
    the object and array keywords applied to objects and arrays."""

    __slots__ = ("where", "types", "literals", "properties", "required", "additional", "items", "min_items",
                 "max_items", "branches", "one_of", "starts", "names")

    def __init__(self, where: str, types: frozenset[str] = ALL_TYPES):
        self.where, self.types = where, types
        self.literals: tuple[tuple[object, bytes], ...] | None = None  # (value, its JSON text) for enum / const
        self.properties: dict[str, Node] = {}
        self.required: frozenset[str] = frozenset()
        self.additional: Node | None = None  # a typed node's: ANY where the schema says nothing, EMPTY for false
        self.items: Node | None = None
        self.min_items, self.max_items = 0, None
        self.branches: tuple[Node, ...] | None = None
        self.one_of = False
        self.starts: tuple = ()  # ("lit", texts) | ("typed", node, types): the values this node can begin and end
        self.names: tuple[tuple[bytes, str], ...] = ()  # (a property name's JSON text after its opening quote, name)

    def __repr__(self) -> str:
        return f"Node({self.where})"


ANY = Node("(any)")
ANY.additional = ANY.items = ANY
ANY.starts = (("typed", ANY, ALL_TYPES),)
EMPTY = Node("(none)")
EMPTY.literals = ()


def json_types(value) -> frozenset[str]:
    """The JSON Schema types a Python value (as json.loads gives it) has."""
    if value is None:
        return frozenset({"null"})
    if isinstance(value, bool):
        return frozenset({"boolean"})
    if isinstance(value, int):
        return frozenset({"integer", "number"})
    if isinstance(value, float):
        return frozenset({"integer", "number"}) if value.is_integer() else frozenset({"number"})
    if isinstance(value, str):
        return frozenset({"string"})
    if isinstance(value, list):
        return frozenset({"array"})
    return frozenset({"object"}) if isinstance(value, dict) else frozenset()


def meet(a: frozenset[str], b: frozenset[str]) -> frozenset[str]:
    """The types both allow: "number" includes "integer"."""
    both = a & b
    if ("integer" in a and "number" in b) or ("number" in a and "integer" in b):
        both |= {"integer"}
    return both


def same(a, b) -> bool:
    """JSON equality (enum, const): 1 == 1.0, but true is no number."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def accepts(node: Node, value) -> bool:
    """Whether `value` (as json.loads gives it) is valid under the node."""
    if node.literals is not None:
        return any(same(value, v) for v, _ in node.literals)
    if not json_types(value) & node.types:
        return False
    if node.branches is not None:
        return any(accepts(b, value) for b in node.branches)
    if isinstance(value, dict):
        return node.required <= value.keys() and all(accepts(node.properties.get(k, node.additional), v)
                                                     for k, v in value.items())
    if isinstance(value, list):
        return (node.min_items <= len(value) <= (len(value) if node.max_items is None else node.max_items)
                and all(accepts(node.items, v) for v in value))
    return True


def literal_text(value, where: str) -> bytes:
    """The one spelling the decoder writes an enum / const value in."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        raise SchemaError("enum", where, f"{value!r} is no JSON value") from None


class _Compiler:
    def __init__(self, root):
        self.root = root
        self.memo: dict[int, Node] = {}  # id(schema dict) -> node: a $ref back to a schema being compiled finds it
        self.nodes: list[Node] = []
        self.enums: list[tuple[Node, list, str]] = []

    def node(self, schema, where: str) -> Node:
        if schema is True:
            return ANY
        if schema is False:
            return EMPTY
        if not isinstance(schema, dict):
            raise SchemaError(None, where, f"expected a schema (an object or a boolean), got {json.dumps(schema)}")
        if id(schema) in self.memo:
            return self.memo[id(schema)]
        node = self.memo[id(schema)] = Node(where)
        self.nodes.append(node)
        self._fill(node, schema, where)
        return node

    def _fill(self, node: Node, schema: dict, where: str) -> None:
        unknown = sorted(k for k in schema if k not in KEYWORDS and k not in ANNOTATIONS)
        if unknown:
            raise SchemaError(unknown[0], where, f"keyword {unknown[0]!r} is not supported (moetier enforces type, enum, "
                              "const, properties, required, additionalProperties, items, minItems, maxItems, anyOf, "
                              "oneOf, $ref)")
        node.types = _types(schema["type"], where) if "type" in schema else ALL_TYPES
        combined = [k for k in ("anyOf", "oneOf", "$ref") if k in schema]
        if combined:
            beside = [k for k in schema if k in KEYWORDS and k not in ("type", "enum", "const", combined[0])]
            if beside:
                raise SchemaError(beside[0], where, f"{beside[0]!r} beside {combined[0]!r} is not supported (move it "
                                                    "into the branches)")
            if combined[0] == "$ref":
                node.branches = (self._ref(schema["$ref"], where),)
            else:
                branches = schema[combined[0]]
                if not isinstance(branches, list) or not branches:
                    raise SchemaError(combined[0], where, f"{combined[0]} must be a non-empty list of schemas")
                node.branches = tuple(self.node(b, f"{where}/{combined[0]}/{i}") for i, b in enumerate(branches))
                node.one_of = combined[0] == "oneOf"
        else:
            self._structure(node, schema, where)
        if "enum" in schema or "const" in schema:
            values = schema.get("enum", [])
            if "enum" in schema and (not isinstance(values, list) or not values):
                raise SchemaError("enum", where, "enum must be a non-empty list")
            if "const" in schema:
                values = [v for v in values if same(v, schema["const"])] if "enum" in schema else [schema["const"]]
            self.enums.append((node, values, where))

    def _structure(self, node: Node, schema: dict, where: str) -> None:
        properties = schema.get("properties", {})
        if not isinstance(properties, dict):
            raise SchemaError("properties", where, "properties must be an object of schemas")
        node.properties = {name: self.node(s, f"{where}/properties/{name}") for name, s in properties.items()}
        required = schema.get("required", [])
        if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
            raise SchemaError("required", where, "required must be a list of property names")
        node.required = frozenset(required)
        node.additional = self.node(schema.get("additionalProperties", True), f"{where}/additionalProperties")
        items = schema.get("items", True)
        if isinstance(items, list):
            raise SchemaError("items", where, "items as a list of schemas (tuple validation) is not supported")
        node.items = self.node(items, f"{where}/items")
        node.min_items = _count(schema, "minItems", where, 0)
        node.max_items = _count(schema, "maxItems", where, None)

    def _ref(self, ref, where: str) -> Node:
        if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
            raise SchemaError("$ref", where, f"$ref {ref!r} is not supported (expected #, #/$defs/NAME or "
                                             "#/definitions/NAME: a reference inside the schema)")
        target = self.root
        for part in ref[2:].split("/") if ref != "#" else ():
            part = part.replace("~1", "/").replace("~0", "~")
            if isinstance(target, dict) and part in target:
                target = target[part]
            elif isinstance(target, list) and part.isdigit() and int(part) < len(target):
                target = target[int(part)]
            else:
                raise SchemaError("$ref", where, f"$ref {ref!r} points at nothing in the schema")
        return self.node(target, ref)

    def finish(self, root: Node) -> Node:
        for node, values, where in reversed(self.enums):  # inner schemas were compiled after their parents
            kept = [v for v in values if accepts(node, v)]
            node.literals = tuple((v, literal_text(v, where)) for v in kept)
            node.branches = None
        nonempty: set[int] = set()
        changed = True
        while changed:  # least fixed point: a node is non-empty once it has a finite value
            changed = False
            for node in self.nodes:
                if id(node) not in nonempty and _starts(node, ALL_TYPES, nonempty, ()):
                    nonempty.add(id(node))
                    changed = True
        nonempty.add(id(ANY))
        for node in self.nodes:
            node.starts = tuple(_starts(node, ALL_TYPES, nonempty, ()))
        for node in self.nodes:
            node.names = tuple((literal_text(name, node.where)[1:], name) for name, sub in node.properties.items()
                               if sub.starts)
        for node in self.nodes:
            if node.one_of:
                _check_one_of(node)
        if not root.starts:
            raise SchemaError(None, root.where, "the schema accepts no value")
        return root


def _types(value, where: str) -> frozenset[str]:
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, list) or not names or not all(isinstance(n, str) for n in names):
        raise SchemaError("type", where, "type must be a type name or a non-empty list of them")
    bad = [n for n in names if n not in ALL_TYPES]
    if bad:
        raise SchemaError("type", where, f"type {bad[0]!r} is not a JSON Schema type (expected one of {', '.join(TYPES)})")
    return frozenset(names)


def _count(schema: dict, keyword: str, where: str, default):
    value = schema.get(keyword, default)
    if value is default:
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SchemaError(keyword, where, f"{keyword} must be a non-negative integer")
    return value


def _typed_ok(node: Node, kind: str, nonempty: set[int]) -> bool:
    """Whether the node has a value of `kind` (a container's required properties, minItems, can be met)."""
    if kind == "object":
        return all(id(node.properties.get(r, node.additional)) in nonempty for r in node.required)
    if kind == "array":
        return (node.max_items is None or node.min_items <= node.max_items) and (
            node.min_items == 0 or id(node.items) in nonempty)
    return True


def _starts(node: Node, mask: frozenset[str], nonempty: set[int], path: tuple) -> list:
    """The kinds of value the node can begin and finish, among the types in `mask`, by the non-empty nodes so far."""
    if node is ANY:
        return [("typed", ANY, mask)]
    if node.literals is not None:
        texts = tuple(text for value, text in node.literals if json_types(value) & mask)
        return [("lit", texts)] if texts else []
    mask = meet(mask, node.types)
    if node.branches is not None:
        if id(node) in path:
            raise SchemaError("$ref", node.where, "a $ref cycle that never reaches a value")
        return [s for b in node.branches for s in _starts(b, mask, nonempty, path + (id(node),))]
    types = frozenset(t for t in mask if _typed_ok(node, t, nonempty))
    return [("typed", node, types)] if types else []


def _disjoint(a: tuple, b: tuple, depth: int) -> bool:
    """Whether no value is accepted by both lists of starts (False where it cannot be shown)."""
    return all(_starts_disjoint(x, y, depth) for x in a for y in b)


def _starts_disjoint(x: tuple, y: tuple, depth: int) -> bool:
    if x[0] == "typed" and y[0] == "lit":
        x, y = y, x
    if x[0] == "lit":
        values = [json.loads(t) for t in x[1]]
        if y[0] == "lit":
            return not any(same(v, json.loads(t)) for v in values for t in y[1])
        return not any(json_types(v) & y[2] and accepts(y[1], v) for v in values)
    both = meet(x[2], y[2])
    if not both:
        return True
    if both != {"object"} or depth >= MAX_DISJOINT_DEPTH:
        return False
    a, b = x[1], y[1]
    for first, second in ((a, b), (b, a)):
        for name in first.required:
            other = second.properties.get(name, second.additional)
            if not other.starts:
                return True  # required by one, forbidden by the other
            if name in second.required and _disjoint(first.properties.get(name, first.additional).starts,
                                                     other.starts, depth + 1):
                return True
    return False


def _check_one_of(node: Node) -> None:
    branches = node.branches or ()
    for i, a in enumerate(branches):
        for j in range(i + 1, len(branches)):
            if not _disjoint(a.starts, branches[j].starts, 0):
                raise SchemaError("oneOf", node.where, f"oneOf branches {i} and {j} may both match one value; moetier "
                                  "enforces a oneOf whose branches exclude each other (other types, enums or consts, or "
                                  "a required property whose values differ); use anyOf")


def compile_schema(schema) -> Node:
    """See the module docstring; SchemaError for what it does not enforce."""
    compiler = _Compiler(schema)
    try:
        return compiler.finish(compiler.node(schema, "#"))
    except RecursionError:
        raise SchemaError("$ref", "#", "the schema nests or refers to itself too deeply") from None

