"""The OpenAI request and response shapes moetier serves: validated requests, chunks, bodies, errors.

Requests are pydantic models with strict types (a number where a number
belongs: "10" is not a max_tokens). Served: `n` choices (1..16), logprobs
(chat: `logprobs` + `top_logprobs` 0..20, each choice's logprobs.content;
completions: `logprobs` 0..5, the legacy tokens / token_logprobs /
top_logprobs / text_offset), response_format text, json_object or
json_schema (the schema compiled by moetier.serve.schema: a keyword it does
not enforce is a 400 naming it); completions' `echo` (max_tokens 0 allowed
with it), `best_of` (n..16; not streamed when above n) and `suffix` (where
the model has FIM tokens, moetier.serve.infill). Refused with a 400 naming the
field: other response formats, echo with suffix, values past those bounds. Unknown fields are ignored,
as clients send vendor extras. A request's phase label for recorded sessions
comes from `metadata.phase` or the X-Moetier-Phase header (session:
`metadata.session` / X-Moetier-Session; held out of profiles: `metadata.profile`
"false"). Errors have OpenAI's body: {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import json
import secrets
import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, field_validator

from moetier.serve.schema import SchemaError, compile_schema

PHASE_HEADER, SESSION_HEADER = "x-moetier-phase", "x-moetier-session"


class ApiError(Exception):
    """A request moetier refuses: an HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: Optional[StrictBool] = False


class FunctionCall(_Request):
    name: StrictStr
    arguments: Union[StrictStr, dict[str, Any]] = "{}"


class ToolCall(_Request):
    id: Optional[StrictStr] = None
    type: Optional[StrictStr] = "function"
    function: FunctionCall


class ContentPart(_Request):
    type: StrictStr
    text: Optional[StrictStr] = None


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: Optional[StrictStr] = None
    tool_calls: Optional[list[ToolCall]] = None
    tool_call_id: Optional[StrictStr] = None
    reasoning_content: Optional[StrictStr] = None


class _Sampling(_Request):
    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[StrictFloat] = Field(None, ge=0, le=2)
    top_p: Optional[StrictFloat] = Field(None, gt=0, le=1)
    top_k: Optional[StrictInt] = Field(None, ge=0)  # an extension (llama.cpp, vLLM)
    seed: Optional[StrictInt] = Field(None, ge=-2**63, lt=2**64)
    stop: Union[StrictStr, list[StrictStr], None] = None
    stream: Optional[StrictBool] = False
    stream_options: Optional[StreamOptions] = None
    n: Optional[StrictInt] = 1
    user: Optional[StrictStr] = None
    metadata: Optional[dict[str, StrictStr]] = None
    presence_penalty: Optional[StrictFloat] = Field(None, ge=-2, le=2)  # over the tokens generated so far
    frequency_penalty: Optional[StrictFloat] = Field(None, ge=-2, le=2)
    ignore_eos: Optional[StrictBool] = False  # an extension (vLLM, llama.cpp)

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        stops = [value] if isinstance(value, str) else (value or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences (got {len(stops)})")
        return stops


class ChatRequest(_Sampling):
    messages: list[Message] = Field(..., min_length=1)
    max_completion_tokens: Optional[StrictInt] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Union[StrictStr, dict[str, Any], None] = None
    parallel_tool_calls: Optional[StrictBool] = None
    logprobs: Optional[StrictBool] = False
    top_logprobs: Optional[StrictInt] = None
    response_format: Optional[dict[str, Any]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None  # an extension (vLLM): e.g. {"enable_thinking": false}


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictStr], list[StrictInt]]
    echo: Optional[StrictBool] = False
    logprobs: Optional[StrictInt] = None
    suffix: Optional[StrictStr] = None
    best_of: Optional[StrictInt] = None


MAX_CHOICES, MAX_TOP_LOGPROBS, MAX_LEGACY_LOGPROBS = 16, 20, 5  # OpenAI's bounds for the logprobs; n's is moetier's


def check_unsupported(request: _Sampling) -> None:
    """400 for what moetier does not do, or a value past its bound, named by the field."""
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise ApiError(400, f"n is {request.n} (expected 1 <= n <= {MAX_CHOICES})", "n")
    if isinstance(request, ChatRequest):
        if request.top_logprobs is not None:
            if not request.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs is {request.top_logprobs} (expected 0 <= top_logprobs <= "
                                    f"{MAX_TOP_LOGPROBS})", "top_logprobs")
        kind = (request.response_format or {}).get("type", "text")
        if kind not in ("text", "json_object", "json_schema"):
            raise ApiError(400, f"response_format {kind!r} is not supported (expected text, json_object or json_schema)",
                           "response_format")
    else:
        if request.logprobs is not None and not 0 <= request.logprobs <= MAX_LEGACY_LOGPROBS:
            raise ApiError(400, f"logprobs is {request.logprobs} (expected 0 <= logprobs <= {MAX_LEGACY_LOGPROBS})",
                           "logprobs")
        if request.echo and request.suffix:
            raise ApiError(400, "echo with suffix is not supported (expected one of them)", "suffix")
        n = request.n or 1
        if request.best_of is not None:
            if not n <= request.best_of <= MAX_CHOICES:
                raise ApiError(400, f"best_of is {request.best_of} (expected n = {n} <= best_of <= {MAX_CHOICES})",
                               "best_of")
            if request.stream and request.best_of > n:
                raise ApiError(400, "best_of > n cannot be streamed (expected stream false, or best_of equal to n)",
                               "best_of")


def response_schema(request: _Sampling):
    """A chat request's json_schema, compiled (moetier.serve.schema.Node), or None; a 400 for what is not enforced."""
    response_format = getattr(request, "response_format", None) or {}
    if response_format.get("type") != "json_schema":
        return None
    wrapper = response_format.get("json_schema")
    if not isinstance(wrapper, dict) or "schema" not in wrapper:
        raise ApiError(400, "response_format json_schema needs {\"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
    if not isinstance(wrapper.get("name", ""), str) or not isinstance(wrapper.get("strict", False), (bool, type(None))):
        raise ApiError(400, "response_format.json_schema: name must be a string and strict a boolean", "response_format")
    try:
        return compile_schema(wrapper["schema"])
    except SchemaError as err:
        raise ApiError(400, f"response_format.json_schema.schema {err}", "response_format",
                       "unsupported_schema" if err.keyword else "invalid_schema") from None


def top_logprobs(request: _Sampling) -> int | None:
    """How many likeliest tokens each token's logprobs list (None: no logprobs)."""
    if isinstance(request, ChatRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _token(piece: bytes) -> str:
    """A token's text as OpenAI writes it: bytes that are no whole UTF-8 character as \\xNN."""
    return piece.decode("utf-8", errors="backslashreplace")


def chat_logprobs(entries, pieces: list[bytes]) -> dict:
    """A chat choice's (or chunk's) logprobs: {"content": [{token, logprob, bytes, top_logprobs}], "refusal"}."""
    def one(token: int, logprob: float) -> dict:
        return {"token": _token(pieces[token]), "logprob": logprob, "bytes": list(pieces[token])}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, lp) for t, lp in e.top]} for e in entries],
            "refusal": None}


def text_logprobs(entries, pieces: list[bytes], shift: int = 0) -> dict:
    """A completion's legacy logprobs: tokens, token_logprobs, top_logprobs (the k likeliest and the chosen token,
    text -> logprob; None for an echoed prompt's first token), text_offset (characters of the choice's text before
    each token; `shift`: characters before the entries' own text, an echoed prompt's)."""
    return {"tokens": [_token(pieces[e.token]) for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {_token(pieces[t]): lp for t, lp in (*e.top, (e.token, e.logprob))}
                             for e in entries],
            "text_offset": [e.offset + shift for e in entries]}


def validation_error(errors: list[dict]) -> ApiError:
    """A pydantic / FastAPI validation failure as one 400, naming the first bad field."""
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return ApiError(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first.get('msg'))})",
                        code="invalid_json")
    where = ".".join(loc) or "body"
    return ApiError(400, f"{where}: {first.get('msg', 'invalid')}", loc[0] if loc else None)


def message_dicts(messages: list[Message]) -> list[dict]:
    """Messages as a chat template reads them: text parts joined, tool-call arguments as objects."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        if isinstance(m.content, list):
            d["content"] = "".join(p.text or "" for p in m.content if p.type == "text")
        for call in d.get("tool_calls", []):
            arguments = call["function"].get("arguments")
            if isinstance(arguments, str):
                try:
                    call["function"]["arguments"] = json.loads(arguments) if arguments.strip() else {}
                except json.JSONDecodeError:
                    raise ApiError(400, f"tool call {call['function']['name']!r}: arguments are not JSON",
                                   "messages") from None
        if d["role"] == "developer":  # OpenAI's newer name for the system message
            d["role"] = "system"
        out.append(d)
    return out


def request_label(metadata: dict | None, headers) -> tuple[str, str, bool]:
    """(phase, session, counts in profiles) for a recorded session."""
    metadata = metadata or {}
    phase = (metadata.get("phase") or headers.get(PHASE_HEADER) or "unlabelled").strip() or "unlabelled"
    session = metadata.get("session") or headers.get(SESSION_HEADER) or ""
    return phase, session, str(metadata.get("profile", "true")).lower() != "false"


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


def usage(stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None, index: int = 0,
               logprobs: dict | None = None, **extra) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}], **extra}


def text_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None, index: int = 0,
               logprobs: dict | None = None, **extra) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}], **extra}


def usage_chunk(rid: str, obj: str, model: str, created: int, stats) -> dict:
    """The last chunk of a stream that asked for usage (stream_options.include_usage): no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(stats)}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def now() -> int:
    return int(time.time())
