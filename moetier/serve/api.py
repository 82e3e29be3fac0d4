"""The OpenAI request and response shapes moetier serves: validated requests, chunks, bodies, errors.

Requests are pydantic models with strict types (a number where a number
belongs: "10" is not a max_tokens); fields moetier does not implement are
accepted when they ask for nothing (n = 1, logprobs false, a text
response_format) and refused with a 400 otherwise; unknown fields are ignored,
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


def check_unsupported(request: _Sampling) -> None:
    """400 for what moetier does not do, named by the field."""
    if request.n not in (None, 1):
        raise ApiError(400, f"n is {request.n}: moetier serves one choice per request (expected 1)", "n")
    if isinstance(request, ChatRequest):
        if request.logprobs or request.top_logprobs:
            raise ApiError(400, "logprobs are not supported", "logprobs")
        kind = (request.response_format or {}).get("type", "text")
        if kind != "text":
            raise ApiError(400, f"response_format {kind!r} is not supported (expected text)", "response_format")
    else:
        if request.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if request.logprobs:
            raise ApiError(400, "logprobs are not supported", "logprobs")
        if request.suffix:
            raise ApiError(400, "suffix is not supported", "suffix")
        if request.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported (expected 1)", "best_of")


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


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None = None, **extra) -> dict:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}], **extra}


def text_chunk(rid: str, model: str, created: int, text: str, finish: str | None = None, **extra) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}], **extra}


def usage_chunk(rid: str, obj: str, model: str, created: int, stats) -> dict:
    """The last chunk of a stream that asked for usage (stream_options.include_usage): no choices, the usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage(stats)}


def sse(data: dict | str) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n".encode()


def now() -> int:
    return int(time.time())
