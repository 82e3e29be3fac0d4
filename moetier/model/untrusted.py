"""Reading files moetier did not write (config.json, safetensors headers, a shard index): the data, or one error line.

`open_regular` opens only a regular file (a FIFO would block the open, a link
to /dev/zero would fill memory). `parse_json` takes UTF-8 JSON nesting at most
MAX_DEPTH levels; the nesting is measured before `json.loads` sees the text, in
one linear scan without recursion, so a file of 100,000 '[' is refused instead
of exhausting the interpreter's recursion limit (here, or in a later
`json.dumps` of what was read). Every failure is raised as the caller's error
type (SpecError, CheckpointError: ValueErrors the CLI prints as one line)
naming the file; the shape of what was parsed is the caller's to check.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

MAX_DEPTH = 32  # config.json and safetensors headers nest 2-4 levels deep
MAX_JSON_FILE_BYTES = 100 * 1024 * 1024  # as a safetensors header; a real config.json or index is at most megabytes

# a JSON string (to the end, if unterminated), or a run of characters that neither open nor close a level
_NOT_NESTING = re.compile(r'"(?:[^"\\]|\\.)*+"?|[^\[\]{}"]++')


def open_regular(path: Path, error: type[ValueError]) -> BinaryIO:
    """`path` opened for binary reading; `error` naming it when it is missing, unreadable or not a regular file."""
    try:
        handle = open(path, "rb", opener=lambda name, flags: os.open(name, flags | os.O_NONBLOCK))  # noqa: SIM115 (returned); a FIFO: no wait
    except FileNotFoundError:
        raise error(f"{path}: no such file") from None
    except OSError as err:
        raise error(f"{path}: cannot read ({err.strerror})") from None
    if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
        handle.close()
        raise error(f"{path}: not a regular file")
    return handle


def read_json(path: Path, error: type[ValueError]) -> Any:
    """The value a JSON file holds, as `parse_json` takes it; files over MAX_JSON_FILE_BYTES are refused."""
    with open_regular(path, error) as handle:
        try:
            raw = handle.read(MAX_JSON_FILE_BYTES + 1)
        except OSError as err:
            raise error(f"{path}: cannot read ({err.strerror})") from None
    if len(raw) > MAX_JSON_FILE_BYTES:
        raise error(f"{path}: larger than {MAX_JSON_FILE_BYTES} bytes (expected a JSON file)")
    return parse_json(raw, path, error)


def parse_json(raw: bytes, source: str | Path, error: type[ValueError]) -> Any:
    """The value `raw` holds; `error` naming `source` when it is not UTF-8 JSON nesting at most MAX_DEPTH deep."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise error(f"{source}: not valid UTF-8 (byte {err.start}; expected UTF-8 JSON)") from None
    depth = 0
    for mark in _NOT_NESTING.sub("", text):
        depth += 1 if mark in "[{" else -1
        if depth > MAX_DEPTH:
            raise error(f"{source}: JSON nests deeper than {MAX_DEPTH} levels (expected a flat object)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise error(f"{source}: not valid JSON ({err.msg} at line {err.lineno})") from None
    except ValueError as err:  # an integer of more digits than Python converts
        raise error(f"{source}: not valid JSON ({err})") from None
