"""`moetier serve`'s HTTP app: OpenAI's /v1/models, /v1/chat/completions and /v1/completions (FastAPI).

A chat is rendered with the model's own template (moetier.model.chat_template)
and tokenized with its tokenizer; a completion's prompt is text (BOS added
where the model asks for it) or token ids. Every request is checked before it
queues (types, limits, the context: 400 with OpenAI's error body), then runs
on the engine's one thread (moetier.serve.worker), its `n` choices (or
best_of candidates, the n with the highest mean logprob kept) one after
another; logprobs, JSON mode and json_schema come from moetier.serve.textgen,
`suffix` prompts from moetier.serve.infill, and `echo` puts the prompt before
each choice's text (its logprobs first). Streaming answers are
server-sent events ending in `data: [DONE]`; when the client goes away its
generation is cancelled, streaming or not. With an API key, every /v1 request
must carry `Authorization: Bearer KEY` (else 401). Responses carry OpenAI's
`usage` (prompt_tokens_details.cached_tokens: the prompt tokens the prefix
cache reused) and, like llama-server, `timings` (prefill_tokens: those
computed). /health answers without a key. (No `from __future__ import annotations`: FastAPI reads the
handlers' annotations, Request among them, as objects.)
"""

import asyncio
import hmac
import json
import logging
import secrets
from dataclasses import dataclass

from moetier.engine.generate import Sampling
from moetier.model.chat_template import ChatTemplateError, render_chat
from moetier.serve import api
from moetier.serve.api import ApiError, ChatRequest, CompletionRequest
from moetier.serve.infill import fim_prompt, fim_tokens
from moetier.serve.tools import ToolCallGate, split_tool_calls
from moetier.serve.textgen import TextParams, combined_stats
from moetier.serve.worker import Busy, Job, Worker

log = logging.getLogger("moetier.serve")
POLL_S = 0.25  # how often a waiting non-streaming request looks for its client


@dataclass
class ServerState:
    worker: Worker
    tokenizer: object
    model_name: str
    fingerprint: str
    context: int
    api_key: str | None = None
    created: int = 0


def _params(state: ServerState, request, prompt_len: int, max_tokens: int | None, extra_stop_ids=frozenset(),
            rank: bool = False) -> TextParams:
    echo = isinstance(request, CompletionRequest) and bool(request.echo)
    if max_tokens is not None and (max_tokens < 0 or max_tokens == 0 and not echo):
        raise ApiError(400, f"max_tokens is {max_tokens} (expected >= 1, or 0 with echo)", "max_tokens")
    if prompt_len >= state.context:
        raise ApiError(400, f"the prompt is {prompt_len} tokens: the model's context is {state.context} tokens "
                            "(expected a shorter prompt)", "messages" if isinstance(request, ChatRequest) else "prompt",
                       "context_length_exceeded")
    max_tokens = max_tokens if max_tokens is not None else state.context - prompt_len
    if prompt_len + max_tokens > state.context:
        raise ApiError(400, f"a {prompt_len}-token prompt + max_tokens {max_tokens} is past the model's context of "
                            f"{state.context} tokens (expected max_tokens <= {state.context - prompt_len})",
                       "max_tokens", "context_length_exceeded")
    seed = request.seed if request.seed is not None else secrets.randbits(63)
    temperature = 1.0 if request.temperature is None else request.temperature
    try:
        sampling = Sampling(temperature=temperature, top_k=request.top_k or 0,
                            top_p=1.0 if request.top_p is None else request.top_p, seed=seed,
                            presence_penalty=request.presence_penalty or 0.0,
                            frequency_penalty=request.frequency_penalty or 0.0)
    except ValueError as err:  # the field constraints catch these first; Sampling's own check, as a 400 all the same
        raise ApiError(400, str(err)) from None
    json_object = isinstance(request, ChatRequest) and (request.response_format or {}).get("type") == "json_object"
    return TextParams(max_tokens, sampling, tuple(request.stop or ()), bool(request.ignore_eos), api.top_logprobs(request),
                      json_object, api.response_schema(request), frozenset(extra_stop_ids), rank)


def _chat_prompt(state: ServerState, request: ChatRequest) -> list[int]:
    tokenizer = state.tokenizer
    template = tokenizer.chat_template(tools=bool(request.tools))
    if template is None:
        raise ApiError(400, "the model has no chat template (tokenizer_config.json, chat_template.jinja or GGUF "
                            "tokenizer.chat_template); use /v1/completions", "messages")
    variables = request.chat_template_kwargs or {}
    taken = sorted(set(variables) & {"template", "messages", "tools", "documents", "add_generation_prompt", "special_tokens"})
    if taken:
        raise ApiError(400, f"chat_template_kwargs may not set {taken[0]!r} (the request's own fields do)", "chat_template_kwargs")
    try:
        text = render_chat(template, api.message_dicts(request.messages), tools=request.tools, add_generation_prompt=True,
                           special_tokens=tokenizer.specials.template_tokens, **variables)
    except ChatTemplateError as err:
        raise ApiError(400, str(err), "messages") from None
    return tokenizer.encode(text, add_special=False, parse_special=True)


def _completion_prompt(state: ServerState, request: CompletionRequest) -> tuple[list[int], str, frozenset[int]]:
    """(the prompt's ids, its text as echo shows it, the ids that end a FIM generation besides the model's)."""
    prompt, tokenizer = request.prompt, state.tokenizer
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(400, f"prompt is a list of {len(prompt)} strings (expected one prompt per request)", "prompt")
        prompt = prompt[0]
    if not prompt and not request.suffix:  # fill-in-the-middle may start at the top of a file
        raise ApiError(400, "the prompt is empty", "prompt")
    if not isinstance(prompt, str):
        bad = [i for i in prompt if not 0 <= i < tokenizer.vocab_size]
        if bad:
            raise ApiError(400, f"prompt token id {bad[0]} is outside the vocabulary (expected 0 <= id < "
                                f"{tokenizer.vocab_size})", "prompt")
    if request.suffix:
        fim = fim_tokens(tokenizer)
        if fim is None:
            raise ApiError(400, "suffix needs a model with fill-in-the-middle tokens (GGUF tokenizer.ggml.fim_pre_token_id,"
                                " fim_suf and fim_mid, or special tokens such as <|fim_prefix|>, <|fim_suffix|>, "
                                "<|fim_middle|>); this model has none", "suffix")
        return fim_prompt(tokenizer, fim, prompt, request.suffix), "", fim.stops
    if isinstance(prompt, str):
        return tokenizer.encode(prompt, add_special=True, parse_special=True), prompt, frozenset()
    return list(prompt), tokenizer.decode(list(prompt), skip_special=True) if request.echo else "", frozenset()


async def _parse(request, model):
    """The body as `model`: any content type, JSON inside; 400 naming the first bad field."""
    from pydantic import ValidationError

    raw = await request.body()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err})", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the request body is a JSON {type(data).__name__} (expected an object)")
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise api.validation_error(err.errors()) from None


def _submit(state: ServerState, job: Job) -> None:
    job.loop, job.events = asyncio.get_running_loop(), asyncio.Queue()
    try:
        state.worker.submit(job)
    except Busy as err:
        raise ApiError(503, f"the server is busy: {err}", code="server_busy", kind="server_error") from None


async def _wait(job: Job, request) -> list:
    """The job's TextResults (one per choice) once done; cancels it (and raises ApiError 499) when the client leaves first."""
    while True:
        try:
            event = await asyncio.wait_for(job.events.get(), timeout=POLL_S)
        except asyncio.TimeoutError:
            if await request.is_disconnected():
                job.cancel()
                raise ApiError(499, "the client closed the request") from None
            continue
        if event[0] == "done":
            return event[1]
        if event[0] == "error":
            raise ApiError(event[1], event[2], kind="invalid_request_error" if event[1] < 500 else "server_error")


def create_app(state: ServerState):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException

    app = FastAPI(title="moetier", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_, err: ApiError):
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_, err: RequestValidationError):
        error = api.validation_error(err.errors())
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def _http(_, err: HTTPException):
        error = ApiError(err.status_code, str(err.detail), code="not_found" if err.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=err.status_code)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        if state.api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            scheme, _, token = given.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), state.api_key.encode()):
                error = ApiError(401, "missing or wrong API key (expected the header Authorization: Bearer KEY)",
                                 code="invalid_api_key")
                return JSONResponse(error.body(), status_code=401)
        try:
            return await call_next(request)
        except Exception as err:  # noqa: BLE001 - one request's bug must not stop the server
            log.exception("request failed")
            error = ApiError(500, f"{type(err).__name__}: {err}", kind="server_error")
            return JSONResponse(error.body(), status_code=500)

    @app.get("/health")
    async def health():
        worker = state.worker
        return {"status": "ok", "model": state.model_name, "running": worker.running is not None,
                "waiting": worker.waiting, "served": worker.served}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": state.created,
                                            "owned_by": "moetier", "fingerprint": state.fingerprint,
                                            "context_length": state.context}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await _parse(request, ChatRequest)
        api.check_unsupported(body)
        prompt = await asyncio.to_thread(_chat_prompt, state, body)
        params = _params(state, body, len(prompt),
                         body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens)
        phase, session, profile = api.request_label(body.metadata, request.headers)
        rid, created = api.new_id("chatcmpl"), api.now()
        job = Job(rid, "chat", prompt, params, phase, session, profile, body.n or 1)
        _submit(state, job)
        tools = bool(body.tools)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_chat_stream(state, job, created, tools, usage), media_type="text/event-stream")
        results = await _wait(job, request)
        choices = []
        for index, result in enumerate(results):
            content, calls = split_tool_calls(result.text) if tools else (result.text, [])
            message = {"role": "assistant", "content": content}
            if calls:
                message["tool_calls"] = calls
            logprobs = api.chat_logprobs(result.logprobs, state.tokenizer.token_bytes()) if result.logprobs is not None else None
            choices.append({"index": index, "message": message, "logprobs": logprobs,
                            "finish_reason": "tool_calls" if calls else result.finish_reason})
        stats = combined_stats(results)
        return {"id": rid, "object": "chat.completion", "created": created, "model": state.model_name,
                "system_fingerprint": state.fingerprint, "choices": choices,
                "usage": api.usage(stats), "timings": stats.to_dict()}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await _parse(request, CompletionRequest)
        api.check_unsupported(body)
        prompt, prompt_text, fim_stops = await asyncio.to_thread(_completion_prompt, state, body)
        n = body.n or 1
        best_of = body.best_of or n
        params = _params(state, body, len(prompt), body.max_tokens if body.max_tokens is not None else 16, fim_stops,
                         rank=best_of > n)
        phase, session, profile = api.request_label(body.metadata, request.headers)
        rid, created = api.new_id("cmpl"), api.now()
        echo = prompt_text if body.echo else ""
        scored = params.top_logprobs if body.echo else None  # echo with logprobs: the prompt's too
        job = Job(rid, "completions", prompt, params, phase, session, profile, best_of, prompt_logprobs=scored)
        _submit(state, job)
        if body.stream:
            usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_text_stream(state, job, created, usage, echo, bool(body.echo)),
                                     media_type="text/event-stream")
        results = await _wait(job, request)
        kept = sorted(range(len(results)), key=lambda i: -results[i].mean_logprob)[:n] if best_of > n else range(len(results))
        pieces = state.tokenizer.token_bytes()
        choices = []
        for index, i in enumerate(kept):
            result = results[i]
            logprobs = None
            if result.logprobs is not None:
                logprobs = api.text_logprobs(result.logprobs, pieces, len(echo))
                if job.prompt_entries is not None:
                    logprobs = _joined(api.text_logprobs(job.prompt_entries, pieces), logprobs)
            choices.append({"index": index, "text": echo + result.text, "finish_reason": result.finish_reason,
                            "logprobs": logprobs})
        stats = combined_stats(results)  # every candidate's tokens: best_of's too
        return {"id": rid, "object": "text_completion", "created": created, "model": state.model_name,
                "system_fingerprint": state.fingerprint, "choices": choices,
                "usage": api.usage(stats), "timings": stats.to_dict()}

    return app


async def _events(job: Job):
    """The job's events until it ends; cancels it when the consumer stops early (a client that left)."""
    try:
        while True:
            event = await job.events.get()
            yield event
            if event[0] in ("done", "error"):
                return
    finally:
        job.cancel()


async def _chat_stream(state: ServerState, job: Job, created: int, tools: bool, include_usage: bool):
    """Each choice's chunks carry its index; a chunk's logprobs are those of the tokens whose text it carries (held
    text's, while a tool call may begin, with the text they come out with)."""
    rid, model, pieces = job.request_id, state.model_name, state.tokenizer.token_bytes()
    logprobs = job.params.top_logprobs is not None
    gates = [ToolCallGate() if tools else None for _ in range(job.n)]
    held: list[list] = [[] for _ in range(job.n)]  # logprob entries not sent yet, per choice

    def chunk(index: int, delta: dict, finish: str | None = None, entries=None, **extra) -> bytes:
        shown = api.chat_logprobs(entries, pieces) if logprobs and entries else None
        return api.sse(api.chat_chunk(rid, model, created, delta, finish, index, shown, **extra))

    for index in range(job.n):
        yield chunk(index, {"role": "assistant", "content": ""})
    async for event in _events(job):
        if event[0] == "text":
            _, index, text, entries = event
            gate = gates[index]
            piece = gate.feed(text) if gate is not None else text
            held[index] += entries
            if piece:
                yield chunk(index, {"content": piece}, entries=held[index])
                held[index] = []
        elif event[0] == "choice":
            _, index, result = event
            finish, gate = result.finish_reason, gates[index]
            if gate is not None and gate.held:
                content, calls = split_tool_calls(gate.held)
                if content:
                    yield chunk(index, {"content": content}, entries=held[index])
                    held[index] = []
                if calls:
                    deltas = [{"index": i, **call} for i, call in enumerate(calls)]
                    yield chunk(index, {"tool_calls": deltas}, entries=held[index])
                    held[index] = []
                    finish = "tool_calls"
            if held[index]:  # tokens whose text was cut (a stop string) or held as an unparsed call
                yield chunk(index, {"content": ""}, entries=held[index])
                held[index] = []
            yield chunk(index, {}, finish, timings=result.stats.to_dict())
        elif event[0] == "done":
            if include_usage:
                yield api.sse(api.usage_chunk(rid, "chat.completion.chunk", model, created, combined_stats(event[1])))
        else:
            yield api.sse(ApiError(event[1], event[2]).body())
    yield api.sse("[DONE]")


def _joined(first: dict, then: dict) -> dict:
    """Two runs of legacy logprobs as one (an echoed prompt's, then the completion's)."""
    return {key: first[key] + then[key] for key in first}


async def _text_stream(state: ServerState, job: Job, created: int, include_usage: bool, echo: str = "",
                       echoed: bool = False):
    """With echo, each choice's first chunk is the prompt's text (with its logprobs, once the worker has them)."""
    rid, model, pieces = job.request_id, state.model_name, state.tokenizer.token_bytes()
    logprobs = job.params.top_logprobs is not None

    def echoes(shown: dict | None):
        for index in range(job.n):
            yield api.sse(api.text_chunk(rid, model, created, echo, None, index, shown))

    if echoed and job.prompt_logprobs is None:
        for chunk in echoes(None):
            yield chunk
    async for event in _events(job):
        if event[0] == "prompt":
            for chunk in echoes(api.text_logprobs(event[1], pieces)):
                yield chunk
        elif event[0] == "text":
            _, index, text, entries = event
            shown = api.text_logprobs(entries, pieces, len(echo)) if logprobs else None
            yield api.sse(api.text_chunk(rid, model, created, text, None, index, shown))
        elif event[0] == "choice":
            _, index, result = event
            yield api.sse(api.text_chunk(rid, model, created, "", result.finish_reason, index,
                                         timings=result.stats.to_dict()))
        elif event[0] == "done":
            if include_usage:
                yield api.sse(api.usage_chunk(rid, "text_completion", model, created, combined_stats(event[1])))
        else:
            yield api.sse(ApiError(event[1], event[2]).body())
    yield api.sse("[DONE]")
