"""response_format json_schema: an incremental validator of text against a compiled schema (moetier.serve.schema).

`SchemaPrefix` extends jsonmode's byte state machine with the schema: it is a
pushdown automaton whose stack holds one frame per open value (the root, an
object with the keys it has seen, an array with its item count, a string, a
number, a literal being matched), each knowing the node it must satisfy. An
anyOf or a type list may leave several readings of the same text open, so the
state is a set of stacks (at most MAX_READINGS; keeping fewer only narrows
what may be written). Objects write only declared keys when
additionalProperties is false (each once, spelled as json.dumps spells them),
and close once every required key is in; arrays hold minItems..maxItems
items; enum and const values are written as json.dumps spells them; integers
take no fraction or exponent; a number's digit runs (MAX_DIGITS) and the
whitespace between tokens are bounded as llama.cpp's JSON-schema grammars
bound them: nothing, one space, or one or two newlines and up to MAX_INDENT
spaces or tabs, so a model cannot spend max_tokens on layout; none before
the value. Invariant: every prefix of accepted text can still be
completed, and text that is `complete` parses to a value the schema accepts.
"""

from __future__ import annotations

import json
from typing import NamedTuple

from moetier.serve.jsonmode import (DIGITS, N_DOT, N_E, N_INT, N_MINUS, N_ZERO, NUMBER_ENDS, STRING_END, WHITESPACE,
                                    number_step, string_step)
from moetier.serve.schema import Node

MAX_READINGS = 64  # readings of the text kept at once
MAX_DIGITS = 16  # digits in a row in a number (llama.cpp's JSON-schema grammars write at most 16)
MAX_INDENT = 20  # spaces or tabs after a newline between two tokens
SPACED, NEWLINES = -1, 2  # a gap's state: 0 nothing yet, SPACED one space, 1-2 newlines, 2 + k: k spaces / tabs after them
O_FIRST, O_KEY, O_IN_KEY, O_COLON, O_VALUE, O_AFTER = range(6)  # after "{", after ",", in a key, a key read, ":" read,
A_FIRST, A_VALUE, A_AFTER = range(3)  # after "[", after ",", after an item                    # after a member's value
LITERALS = ((b"true", "boolean"), (b"false", "boolean"), (b"null", "null"))


class Root(NamedTuple):
    node: Node
    done: bool


class Obj(NamedTuple):
    node: Node
    phase: int
    seen: frozenset  # keys written so far
    key: bytes = b""  # the key's bytes after its opening quote, while in it
    lex: int = 0  # the key's string sub-state (jsonmode.string_step)
    value: Node | None = None  # the node of the value that follows the key


class Arr(NamedTuple):
    node: Node
    phase: int
    count: int  # items written


class Str(NamedTuple):
    lex: int


class Num(NamedTuple):
    integer: bool
    state: int  # jsonmode's number sub-state
    run: int  # digits in the current run


class Lit(NamedTuple):
    texts: tuple  # the texts still matching
    pos: int  # bytes matched


def _closed(frames: tuple) -> tuple:
    """The frames once the value above `frames` (its parent on top) has ended."""
    parent = frames[-1]
    if type(parent) is Root:
        return frames[:-1] + (Root(parent.node, True),)
    if type(parent) is Obj:
        return frames[:-1] + (parent._replace(phase=O_AFTER, value=None),)
    return frames[:-1] + (parent._replace(phase=A_AFTER, count=parent.count + 1),)


def _more_keys(obj: Obj) -> bool:
    return bool(obj.node.additional.starts) or any(name not in obj.seen for _, name in obj.node.names)


def _begin(frames: tuple, starts: tuple, b: int, out: list) -> None:
    """Byte b begins a value of one of `starts` above `frames`."""
    for start in starts:
        if start[0] == "lit":
            texts = tuple(t for t in start[1] if t[0] == b)
            if texts:
                _literal(frames, Lit(texts, 0), b, out)
            continue
        _, node, types = start
        if b == 0x7B and "object" in types:  # {
            out.append((frames + (Obj(node, O_FIRST, frozenset()),), 0))
        elif b == 0x5B and "array" in types:  # [
            out.append((frames + (Arr(node, A_FIRST, 0),), 0))
        elif b == 0x22 and "string" in types:
            out.append((frames + (Str(0),), 0))
        elif (b == 0x2D or b in DIGITS) and ("number" in types or "integer" in types):
            state = N_MINUS if b == 0x2D else N_ZERO if b == 0x30 else N_INT
            out.append((frames + (Num("number" not in types, state, 0 if b == 0x2D else 1),), 0))
        else:
            texts = tuple(t for t, kind in LITERALS if t[0] == b and kind in types)
            if texts:
                _literal(frames, Lit(texts, 0), b, out)


def _literal(frames: tuple, lit: Lit, b: int, out: list) -> None:
    """Byte b against a literal's texts: on along those it continues; where one has ended, the value ends before b."""
    texts = tuple(t for t in lit.texts if len(t) > lit.pos and t[lit.pos] == b)
    if texts:
        if all(len(t) == lit.pos + 1 for t in texts):
            out.append((_closed(frames), 0))  # nothing longer matches: the value has ended
        else:
            out.append((frames + (Lit(texts, lit.pos + 1),), 0))
    if lit.pos and any(len(t) == lit.pos for t in lit.texts):
        _structural(_closed(frames), 0, b, out)


def _number(frames: tuple, num: Num, b: int, out: list) -> None:
    state = number_step(num.state, b)
    if state is not None and not (num.integer and state in (N_DOT, N_E)):
        run = (num.run + 1 if num.state in NUMBER_ENDS else 1) if b in DIGITS else 0
        if run <= MAX_DIGITS:
            out.append((frames + (Num(num.integer, state, run),), 0))
    elif num.state in NUMBER_ENDS:  # b is no part of the number: it ends before b
        _structural(_closed(frames), 0, b, out)


def _key(frames: tuple, obj: Obj, b: int, out: list) -> None:
    """Byte b inside a key: any new string where additionalProperties allows one, else a declared key's text."""
    node, key = obj.node, obj.key + bytes([b])
    if node.additional.starts:
        lex = string_step(obj.lex, b)
        if lex is None:
            return
        if lex != STRING_END:
            out.append((frames + (obj._replace(key=key, lex=lex),), 0))
            return
        try:
            name = json.loads(b'"' + key)
        except (ValueError, UnicodeDecodeError):
            return
        value = node.properties.get(name, node.additional)
        if name not in obj.seen and value.starts:
            out.append((frames + (Obj(node, O_COLON, obj.seen | {name}, value=value),), 0))
        return
    for text, name in node.names:
        if name not in obj.seen and text.startswith(key):
            if len(text) == len(key):  # the closing quote: no other name's text goes on past it
                out.append((frames + (Obj(node, O_COLON, obj.seen | {name}, value=node.properties[name]),), 0))
            else:
                out.append((frames + (obj._replace(key=key),), 0))
            return


def _gap(state: int, b: int) -> int | None:
    """A whitespace gap's state after byte b (see SPACED), or None when b cannot come next."""
    if state == 0:
        return SPACED if b == 0x20 else 1 if b == 0x0A else None
    if state == 1 and b == 0x0A:
        return NEWLINES
    if state >= 1 and b in (0x20, 0x09) and state - NEWLINES < MAX_INDENT:
        return max(state, NEWLINES) + 1
    return None


def _structural(frames: tuple, run: int, b: int, out: list) -> None:
    """Byte b where whitespace, a value, a key, ":", "," or a closing bracket may come."""
    top = frames[-1]
    if b in WHITESPACE:
        gap = _gap(run, b)
        if gap is not None and (type(top) is not Root or top.done):  # the text begins with its value
            out.append((frames, gap))
        return
    if type(top) is Root:
        if not top.done:
            _begin(frames, top.node.starts, b, out)
    elif type(top) is Obj:
        if top.phase in (O_FIRST, O_KEY) and b == 0x22 and _more_keys(top):
            out.append((frames[:-1] + (top._replace(phase=O_IN_KEY, key=b"", lex=0),), 0))
        elif top.phase in (O_FIRST, O_AFTER) and b == 0x7D and top.node.required <= top.seen:  # }
            out.append((_closed(frames[:-1]), 0))
        elif top.phase == O_COLON and b == 0x3A:  # :
            out.append((frames[:-1] + (top._replace(phase=O_VALUE),), 0))
        elif top.phase == O_VALUE:
            _begin(frames, top.value.starts, b, out)
        elif top.phase == O_AFTER and b == 0x2C and _more_keys(top):  # ,
            out.append((frames[:-1] + (top._replace(phase=O_KEY),), 0))
    else:  # Arr
        node, room = top.node, top.node.max_items is None or top.count < top.node.max_items
        if b == 0x5D:  # ]
            if top.phase != A_VALUE and top.count >= node.min_items:
                out.append((_closed(frames[:-1]), 0))
        elif top.phase in (A_FIRST, A_VALUE) and room:
            _begin(frames, node.items.starts, b, out)
        elif top.phase == A_AFTER and b == 0x2C and room:
            out.append((frames[:-1] + (top._replace(phase=A_VALUE),), 0))


def _step(frames: tuple, run: int, b: int, out: list) -> None:
    """The readings after byte b, appended to `out` as (frames, the whitespace gap's state)."""
    top = frames[-1]
    if type(top) is Str:
        lex = string_step(top.lex, b)
        if lex is not None:
            out.append((_closed(frames[:-1]) if lex == STRING_END else frames[:-1] + (Str(lex),), 0))
    elif type(top) is Num:
        _number(frames[:-1], top, b, out)
    elif type(top) is Lit:
        _literal(frames[:-1], top, b, out)
    elif type(top) is Obj and top.phase == O_IN_KEY:
        _key(frames[:-1], top, b, out)
    else:
        _structural(frames, run, b, out)


def _complete(frames: tuple) -> bool:
    """Whether the text read so far is a whole value the schema accepts."""
    top = frames[-1]
    if type(top) is Root:
        return top.done
    return len(frames) == 2 and (type(top) is Num and top.state in NUMBER_ENDS
                                 or type(top) is Lit and any(len(t) == top.pos for t in top.texts))


class SchemaPrefix:
    """A point of the text under a schema: its readings, each (frames, whitespace gap state). Immutable."""

    __slots__ = ("readings",)

    def __init__(self, node: Node | None = None, readings: tuple | None = None):
        self.readings = readings if readings is not None else (((Root(node, False),), 0),)

    @property
    def complete(self) -> bool:
        return any(_complete(frames) for frames, _ in self.readings)

    @property
    def finished(self) -> bool:
        """Complete in every reading, with nothing but whitespace allowed after it."""
        return all(type(frames[-1]) is Root and frames[-1].done for frames, _ in self.readings)

    def advanced(self, data: bytes) -> SchemaPrefix | None:
        readings = self.readings
        for b in data:
            out: list = []
            for frames, run in readings:
                _step(frames, run, b, out)
            if not out:
                return None
            readings = tuple(dict.fromkeys(out))[:MAX_READINGS]
        return SchemaPrefix(readings=readings)
