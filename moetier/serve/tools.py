"""Tool calls read out of a completion's text, in the two formats chat templates ask models for.

Hermes / Qwen: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
GLM: `<tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...</tool_call>`
(a value that parses as JSON is taken as JSON, else as a string).
`split_tool_calls(text)` -> (the text outside the calls or None, OpenAI tool_calls);
a block that parses as neither stays in the text. `ToolCallGate` is for streaming:
text passes until a call may begin, then is held for `split_tool_calls` at the end.
"""

from __future__ import annotations

import json
import re
import secrets

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_GLM_ARG = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_NAME = re.compile(r"[A-Za-z_][\w.\-]*")


def _call(name: str, arguments: dict) -> dict:
    return {"id": f"call_{secrets.token_hex(12)}", "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _parse(body: str) -> dict | None:
    body = body.strip()
    if body.startswith("{"):
        try:
            data = json.loads(body)
        except json.JSONDecodeError:
            return None
        if isinstance(data, dict) and isinstance(data.get("name"), str):
            arguments = data.get("arguments", data.get("parameters", {}))
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    return None
            return _call(data["name"], arguments if isinstance(arguments, dict) else {"value": arguments})
        return None
    name, _, rest = body.partition("\n")
    name = name.strip()
    if not _NAME.fullmatch(name) or not (rest.strip() == "" or _GLM_ARG.search(rest)):
        return None
    arguments = {}
    for key, value in _GLM_ARG.findall(rest):
        try:
            arguments[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            arguments[key.strip()] = value
    return _call(name, arguments)


def split_tool_calls(text: str) -> tuple[str | None, list[dict]]:
    """(content outside the tool calls, stripped, or None when empty; the calls in order)."""
    calls, kept, last = [], [], 0
    for match in _BLOCK.finditer(text):
        call = _parse(match.group(1))
        if call is None:
            continue
        calls.append(call)
        kept.append(text[last:match.start()])
        last = match.end()
    if not calls:
        return text, []
    content = ("".join(kept) + text[last:]).strip()
    return content or None, calls


class ToolCallGate:
    """Streaming text up to the first possible tool call; everything from there on is held."""

    def __init__(self):
        self.held = ""
        self.closed = False  # a call began: nothing more streams

    def feed(self, piece: str) -> str:
        if self.closed:
            self.held += piece
            return ""
        text = self.held + piece
        at = text.find(OPEN)
        if at >= 0:
            self.closed, self.held = True, text[at:]
            return text[:at]
        hold = next((n for n in range(min(len(OPEN) - 1, len(text)), 0, -1) if text.endswith(OPEN[:n])), 0)
        self.held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold]
