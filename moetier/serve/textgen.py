"""Text generation: a prompt's ids in, the completion's text out as it is generated.

`generate_text` streams token ids (moetier.engine.stream) through the model's
tokenizer: a stop token (the model's end-of-turn ids) ends the completion and
is not part of its text; a stop string ends it too and is cut off, and text
that could still begin one is held back until it cannot; a character is never
split between two pieces. `on_text` gets each piece; `cancelled` is asked
between tokens, so a generation ends within one token of it turning true.
With `top_logprobs` set, each generated token but a final stop token gets a
`TokenLogprob` (log-softmax of the model's logits for its step, before
penalties, temperature, top-k/top-p and any constraint) and `on_piece` gets
each piece with the entries of the tokens it completes (the last ones with ""
where the text was cut). `json_object` constrains decoding to one JSON object
(moetier.serve.jsonmode), `json_schema` to one value a compiled schema accepts
(moetier.serve.schemaprefix); the generation ends when the value is finished.
With `rank`, the result carries the sum of its tokens' logprobs (best_of's
ranking). `prompt_logprobs` gives echo's entries for the prompt's tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from moetier.engine.generate import Sampling, pick_token
from moetier.engine.prefix import PrefixCache
from moetier.engine.stream import StreamStats, stream_tokens
from moetier.model.tokenizer import StreamDecoder, Tokenizer
from moetier.serve.jsonmode import JsonMode
from moetier.serve.schemaprefix import SchemaPrefix

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class TextParams:
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()  # stop strings
    ignore_eos: bool = False  # run past the model's stop tokens
    top_logprobs: int | None = None  # None: no logprobs; k: each token's logprob and the k likeliest
    json_object: bool = False  # constrain the text to one JSON object
    json_schema: object | None = None  # constrain it to a value this compiled schema accepts (moetier.serve.schema.Node)
    extra_stop_ids: frozenset[int] = frozenset()  # more ids that end it (FIM's pad and separators)
    rank: bool = False  # sum the generated tokens' logprobs (TextResult.cumulative_logprob)


@dataclass(frozen=True)
class TokenLogprob:
    token: int
    logprob: float | None  # log-softmax of the step's raw logits at `token` (None: a prompt's first token)
    top: tuple[tuple[int, float], ...]  # the k likeliest (id, logprob), likeliest first
    offset: int  # characters of the completion's text before this token's


@dataclass
class TextResult:
    prompt_ids: list[int]
    ids: list[int]  # every token generated, a stop token included
    text: str  # the completion, stop token and stop string excluded
    finish_reason: str  # one of FINISH_REASONS
    stats: StreamStats = field(default_factory=StreamStats)
    logprobs: list[TokenLogprob] | None = None  # with top_logprobs: one per generated token, a final stop token aside
    cumulative_logprob: float | None = None  # with rank: over every generated token, a final stop token included

    @property
    def mean_logprob(self) -> float:
        """best_of's score: the generated tokens' mean logprob (-inf for none)."""
        return self.cumulative_logprob / len(self.ids) if self.ids and self.cumulative_logprob is not None else float("-inf")


def choice_params(params: TextParams, index: int) -> TextParams:
    """Choice `index` of a request: choice 0 samples with the request's seed, choice i > 0 with one derived from it
    and i (a hash: the same request gives the same choices)."""
    if index == 0:
        return params
    digest = hashlib.blake2b(f"{params.sampling.seed}:{index}".encode(), digest_size=8).digest()
    return replace(params, sampling=replace(params.sampling, seed=int.from_bytes(digest, "little") >> 1))


def combined_stats(results: list[TextResult]) -> StreamStats:
    """One request's counts over its choices: the prompt (and what was reused of it) once, as the first choice
    prefilled it; completion tokens and seconds summed."""
    first = results[0].stats
    return StreamStats(first.prompt_tokens, first.cached_tokens, sum(r.stats.prefill_s for r in results),
                       sum(r.stats.decode_s for r in results), sum(r.stats.new_tokens for r in results))


def _logprob(logits: torch.Tensor, token: int, k: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
    top = torch.topk(logprobs, k) if k else None
    pairs = tuple(zip(top.indices.tolist(), top.values.tolist())) if top is not None else ()
    return float(logprobs[token]), pairs


class StopStrings:
    """Cuts text at the first stop string; holds back a tail that could begin one."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = tuple(s for s in stops if s)
        self.held = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        """(text now final, whether a stop string was met)."""
        text = self.held + piece
        hits = [(i, s) for s in self.stops if (i := text.find(s)) >= 0]
        if hits:
            self.held = ""
            return text[: min(hits)[0]], True
        hold = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:n]):
                    hold = n
                    break
        self.held = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        held, self.held = self.held, ""
        return held


def generate_text(engine, tokenizer: Tokenizer, prompt_ids: list[int], params: TextParams, prefix: PrefixCache | None = None,
                  on_text: Callable[[str], None] | None = None, cancelled: Callable[[], bool] | None = None,
                  before_decode: Callable[[], None] | None = None,
                  on_piece: Callable[[str, list[TokenLogprob]], None] | None = None) -> TextResult:
    """See the module docstring."""
    stop_ids = frozenset() if params.ignore_eos else tokenizer.stop_ids | params.extra_stop_ids
    stats = StreamStats()
    decoder, stops = StreamDecoder(tokenizer), StopStrings(params.stop)
    ids: list[int] = []
    pieces: list[str] = []
    finish = None
    json_mode = None
    if params.json_schema is not None:
        json_mode = JsonMode(tokenizer.token_bytes(), stop_ids, tokenizer.specials.control_ids,
                             SchemaPrefix(params.json_schema), "json_schema")
    elif params.json_object:
        json_mode = JsonMode(tokenizer.token_bytes(), stop_ids, tokenizer.specials.control_ids)
    steps: list[tuple[float, tuple]] = []  # each step's (logprob of the pick, top k), in order
    cumulative = [0.0]
    entries: list[TokenLogprob] = []
    pending: list[TokenLogprob] = []  # entries whose tokens' text is not out yet
    produced = 0  # characters the decoder has given so far

    def pick(logits, generator, generated):
        if json_mode is not None:
            token = json_mode.pick(logits, params.sampling, generator, generated)
        else:
            token = pick_token(logits, params.sampling, generator, generated)
        if params.top_logprobs is not None or params.rank:
            step = _logprob(logits, token, params.top_logprobs or 0)
            steps.append(step)
            cumulative[0] += step[0]
        return token

    custom = json_mode is not None or params.top_logprobs is not None or params.rank

    def emit(text: str, final: bool = False) -> None:
        if text:
            pieces.append(text)
            if on_text is not None:
                on_text(text)
        if text or (final and pending):
            if on_piece is not None:
                on_piece(text, list(pending))
            pending.clear()

    cut = False  # ended by a stop string: what follows it is dropped
    for token in stream_tokens(engine, prompt_ids, params.max_tokens, params.sampling, stop_ids, prefix, stats, before_decode,
                               pick if custom else None):
        ids.append(token)
        if token in stop_ids:
            finish = "stop"
            break
        if params.top_logprobs is not None:  # the offset: the text of the tokens before, a held character's included
            logprob, top = steps[len(ids) - 1]
            entries.append(TokenLogprob(token, logprob, top, produced + len(decoder.pending())))
            pending.append(entries[-1])
        piece = decoder.push(token)
        produced += len(piece)
        text, cut = stops.feed(piece)
        emit(text)
        if cut or (json_mode is not None and json_mode.finished):
            finish = "stop"
            break
        if cancelled is not None and cancelled():
            finish = "cancelled"
            break
    if not cut:  # what the decoder and the stop strings still hold (an incomplete character, a stop string's start)
        text, cut = stops.feed(decoder.flush())
        emit(text if cut else text + stops.flush(), final=True)
        finish = "stop" if cut else finish
    else:
        emit("", final=True)
    return TextResult(list(prompt_ids), ids, "".join(pieces), finish or "length", stats,
                      entries if params.top_logprobs is not None else None, cumulative[0] if params.rank else None)


def prompt_logprobs(engine, tokenizer: Tokenizer, prompt_ids: list[int], k: int, chunk: int = 512) -> list[TokenLogprob]:
    """echo's entries for the prompt: the first token's logprob None (nothing predicts it), each other's the
    log-softmax of a cold teacher-forced forward of the prompt (in chunks, on a cache of its own: the prefix cache is
    left as it is); offsets are characters of the prompt's text before each token."""
    cache, rows = engine.new_cache(), []
    for start in range(0, len(prompt_ids) - 1, chunk):
        logits = engine.forward(torch.tensor(prompt_ids[start : start + chunk], dtype=torch.int64), cache)  # [t, V]
        for offset, row in enumerate(logits.cpu()):
            if start + offset + 1 < len(prompt_ids):
                rows.append(_logprob(row, prompt_ids[start + offset + 1], k))
    decoder, produced, entries = StreamDecoder(tokenizer), 0, []
    for i, token in enumerate(prompt_ids):
        logprob, top = rows[i - 1] if i else (None, ())
        entries.append(TokenLogprob(token, logprob, top, produced + len(decoder.pending())))
        produced += len(decoder.push(token))
    return entries
