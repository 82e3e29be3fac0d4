"""Token streaming: `generate` one token at a time, over a kept prefix cache, stoppable between any two tokens.

`stream_tokens` yields each new token id as soon as it is picked (the stop id
that ends a generation too); the caller stops it by not asking for more. It
prefills through a `PrefixCache` (moetier.engine.prefix), a new one unless
given, so a server's next request recomputes only what follows the common
prefix. Sampling is `generate`'s (the same seeded generator, the same
pick_token), so greedy and seeded outputs equal `generate`'s for a prompt;
a caller's picker may take its place (logprobs, constrained decoding).
`StreamStats` counts what ran: prompt tokens, those reused, seconds of
prefill and of decode.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from moetier.engine.core import Engine
from moetier.engine.generate import Sampling, check_request, pick_token
from moetier.engine.prefix import PrefixCache


@dataclass
class StreamStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose state came from the prefix cache
    prefill_s: float = 0.0
    decode_s: float = 0.0  # the decode steps (tokens after the first)
    new_tokens: int = 0

    @property
    def prefill_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens

    def to_dict(self) -> dict:
        steps = max(self.new_tokens - 1, 0)
        return {"prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "prefill_tokens": self.prefill_tokens, "prefill_ms": 1000 * self.prefill_s,
                "prefill_tok_per_s": self.prefill_tokens / self.prefill_s if self.prefill_s > 0 else 0.0,
                "decode_tokens": self.new_tokens, "decode_ms": 1000 * self.decode_s,
                "decode_tok_per_s": steps / self.decode_s if steps and self.decode_s > 0 else 0.0}


# (logits [V] as the model gives them, the seeded generator or None, the tokens generated so far) -> the next token
Picker = Callable[[torch.Tensor, "torch.Generator | None", list[int]], int]


def stream_tokens(engine: Engine, prompt_ids: list[int], max_new_tokens: int, sampling: Sampling = Sampling(),
                  stop_ids: frozenset[int] | tuple[int, ...] = (), prefix: PrefixCache | None = None,
                  stats: StreamStats | None = None, before_decode: Callable[[], None] | None = None,
                  pick: Picker | None = None) -> Iterator[int]:
    """Each new token id, as it is picked (see the module docstring). `pick` stands in for pick_token (it sees every
    step's logits, so greedy decoding then takes them too, not Engine.decode_greedy's argmax)."""
    fast = sampling.greedy and pick is None
    if pick is None:
        pick = lambda logits, generator, generated: pick_token(logits, sampling, generator, generated)  # noqa: E731
    prompt = [int(i) for i in prompt_ids]
    check_request(engine, prompt, max_new_tokens)
    prefix = prefix if prefix is not None else PrefixCache(engine)
    stats = stats if stats is not None else StreamStats()
    stats.prompt_tokens = len(prompt)
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
    begin = time.perf_counter()
    logits, stats.cached_tokens = prefix.prefill(prompt)
    token = pick(logits, generator, [])
    stats.prefill_s = time.perf_counter() - begin
    stats.new_tokens = 1
    if before_decode is not None:
        before_decode()
    yield token
    decoded = 0.0
    generated = [token]
    while stats.new_tokens < max_new_tokens and token not in stop_ids:
        begin = time.perf_counter()
        token = prefix.next_token(token) if fast else pick(prefix.step(token), generator, generated)
        generated.append(token)
        decoded += time.perf_counter() - begin
        stats.decode_s = decoded
        stats.new_tokens += 1
        yield token
