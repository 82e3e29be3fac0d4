"""Text generation: a prompt's ids in, the completion's text out as it is generated.

`generate_text` streams token ids (moetier.engine.stream) through the model's
tokenizer: a stop token (the model's end-of-turn ids) ends the completion and
is not part of its text; a stop string ends it too and is cut off, and text
that could still begin one is held back until it cannot; a character is never
split between two pieces. `on_text` gets each piece; `cancelled` is asked
between tokens, so a generation ends within one token of it turning true.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from moetier.engine.generate import Sampling
from moetier.engine.prefix import PrefixCache
from moetier.engine.stream import StreamStats, stream_tokens
from moetier.model.tokenizer import StreamDecoder, Tokenizer

FINISH_REASONS = ("stop", "length", "cancelled")


@dataclass(frozen=True)
class TextParams:
    max_tokens: int
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()  # stop strings
    ignore_eos: bool = False  # run past the model's stop tokens


@dataclass
class TextResult:
    prompt_ids: list[int]
    ids: list[int]  # every token generated, a stop token included
    text: str  # the completion, stop token and stop string excluded
    finish_reason: str  # one of FINISH_REASONS
    stats: StreamStats = field(default_factory=StreamStats)


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
                  before_decode: Callable[[], None] | None = None) -> TextResult:
    """See the module docstring."""
    stop_ids = frozenset() if params.ignore_eos else tokenizer.stop_ids
    stats = StreamStats()
    decoder, stops = StreamDecoder(tokenizer), StopStrings(params.stop)
    ids: list[int] = []
    pieces: list[str] = []
    finish = None

    def emit(text: str) -> None:
        if text:
            pieces.append(text)
            if on_text is not None:
                on_text(text)

    cut = False  # ended by a stop string: what follows it is dropped
    for token in stream_tokens(engine, prompt_ids, params.max_tokens, params.sampling, stop_ids, prefix, stats, before_decode):
        ids.append(token)
        if token in stop_ids:
            finish = "stop"
            break
        text, cut = stops.feed(decoder.push(token))
        emit(text)
        if cut:
            finish = "stop"
            break
        if cancelled is not None and cancelled():
            finish = "cancelled"
            break
    if not cut:  # what the decoder and the stop strings still hold (an incomplete character, a stop string's start)
        text, cut = stops.feed(decoder.flush())
        emit(text if cut else text + stops.flush())
        finish = "stop" if cut else finish
    return TextResult(list(prompt_ids), ids, "".join(pieces), finish or "length", stats)
