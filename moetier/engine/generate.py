"""Generation and teacher-forced scoring on top of `Engine.forward`.

`generate` prefills the prompt in one forward, then decodes one token per
step with the KV cache; greedy when temperature is 0, else seeded sampling
(temperature, top-k, top-p; `Sampling` refuses values outside their ranges),
after OpenAI's presence and frequency penalties over the tokens generated so
far, never past the model's context; `pick_allowed` is pick_token restricted to a
set of tokens (greedy, or the Gumbel-max trick). `score` returns float32 logits for every position
of a sequence in one teacher-forced pass. Timings use perf_counter around
whole phases; prefill and decode are reported separately.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import torch

from moetier.engine.core import Engine


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int]  # new tokens only
    prefill_s: float
    decode_s: float  # time of the decode steps (tokens after the first)
    logits: np.ndarray | None = field(default=None, repr=False)  # [n_new, V]: row i produced ids[i]

    @property
    def prefill_tok_per_s(self) -> float:
        return len(self.prompt_ids) / self.prefill_s if self.prefill_s > 0 else float("inf")

    @property
    def decode_tok_per_s(self) -> float:
        steps = len(self.ids) - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = all
    top_p: float = 1.0
    seed: int | None = None
    presence_penalty: float = 0.0  # subtracted from the logit of every token generated so far
    frequency_penalty: float = 0.0  # times the number of times it was generated

    @property
    def penalised(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def greedy(self) -> bool:
        """The argmax of the logits as they are (what pick_token does then), so decode_greedy can pick."""
        return self.temperature == 0 and not self.penalised

    def __post_init__(self) -> None:
        """Refuse what would sample garbage or crash torch (named as the CLI's flags)."""
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature is {self.temperature} (expected a finite number >= 0; 0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"--top-k is {self.top_k} (expected >= 0; 0 = all tokens)")
        if not 0 < self.top_p <= 1:  # also refuses nan
            raise ValueError(f"--top-p is {self.top_p} (expected 0 < top-p <= 1)")
        if self.seed is not None and not -2**63 <= self.seed < 2**64:
            raise ValueError(f"--seed is {self.seed} (expected an integer that fits in 64 bits)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2 <= value <= 2):  # OpenAI's range
                raise ValueError(f"--{name.replace('_', '-')} is {value} (expected -2 <= it <= 2; 0 = none)")


class NonFiniteLogits(ValueError):
    """The model computed NaN or infinite logits: its weights or config overflow float32 (bad input, not a result)."""


def penalise(logits: torch.Tensor, sampling: Sampling, generated: list[int]) -> torch.Tensor:
    """logits [V] minus OpenAI's penalties for the tokens generated so far: presence_penalty once for each token
    that occurs, frequency_penalty times its count (a new tensor; the same one when there is nothing to take off)."""
    if not sampling.penalised or not generated:
        return logits
    counts = torch.bincount(torch.tensor(generated, dtype=torch.int64), minlength=logits.shape[0])[:logits.shape[0]]
    counts = counts.to(logits.dtype)
    return logits - sampling.frequency_penalty * counts - sampling.presence_penalty * (counts > 0).to(logits.dtype)


def finite_top(top: int, value: float) -> int:
    """top, the id of the largest logit `value`; NonFiniteLogits when it is NaN or infinite (argmax and max see a NaN)."""
    if not math.isfinite(value):
        raise NonFiniteLogits(f"the model's logits are not finite (token {top}: {value}); its weights "
                              "or config overflow float32 (expected finite logits)")
    return top


def greedy_step(engine: Engine, token: int, cache) -> int:
    """Feed `token` at cache.length; -> the next token as pick_token picks it greedily (Engine.decode_greedy: no
    tensor made per token on the native step)."""
    return finite_top(*engine.decode_greedy(token, cache))


def pick_token(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
               generated: list[int] | None = None) -> int:
    """logits [V] -> next token id, after the penalties for `generated` (the tokens generated so far);
    NonFiniteLogits when the top logit is NaN or infinite (argmax and max see a NaN)."""
    logits, top, greedy = _penalised_top(logits, sampling, generated)
    if greedy:
        return top
    # shifted so the largest is 0 first: a tiny temperature then sends the rest to -inf, not the top to +inf (nan)
    scaled = _top_k((logits - logits[top]) / sampling.temperature, sampling)
    return int(torch.multinomial(_nucleus(scaled, sampling), 1, generator=generator))


def _penalised_top(logits: torch.Tensor, sampling: Sampling, generated: list[int] | None) -> tuple[torch.Tensor, int, bool]:
    """logits [V] -> (penalised logits, their largest's id, checked finite, whether the pick is greedy: a
    temperature of 0, or one the logits' dtype rounds to 0, its limit)."""
    logits = penalise(logits, sampling, generated or [])
    top = int(torch.argmax(logits))
    finite_top(top, float(logits[top]))
    return logits, top, sampling.temperature <= 0 or bool(torch.tensor(sampling.temperature, dtype=logits.dtype) == 0)


def _top_k(scaled: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """scaled logits [V] with all but the top_k largest at -inf (unchanged when top_k is off)."""
    if 0 < sampling.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, sampling.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    return scaled


def _nucleus(scaled: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """scaled logits [V] (top-k applied) -> the probabilities pick_token samples from: top_p's nucleus, the rest 0."""
    probs = torch.softmax(scaled, dim=-1)
    if sampling.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # drop tokens once the mass before them already exceeds top_p (the first always stays)
        drop = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > sampling.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs


def pick_allowed(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None,
                 generated: list[int] | None, allowed: Callable[[int], bool],
                 candidates: torch.Tensor | None = None) -> int | None:
    """pick_token restricted to the ids `allowed` accepts (None when it accepts none); candidates [V] bool, a
    superset of them, spares asking about the rest. Greedy: the largest penalised logit among them (the lowest id
    of equals, as argmax). Sampling, by the Gumbel-max trick: the largest log p + Gumbel noise among them is a
    sample of pick_token's distribution (temperature, top-k, top-p) restricted to them; where none of them is in
    that distribution's support, of the distribution without top-k and top-p, so restricted."""
    logits, top, greedy = _penalised_top(logits, sampling, generated)
    if greedy:
        passes = [logits.float()]
    else:
        full = (logits - logits[top]).float() / sampling.temperature
        scaled = _top_k(full, sampling)
        gumbel = -torch.log(-torch.log(torch.rand(scaled.shape, generator=generator).clamp_(min=1e-20)))  # [V]
        restricted = torch.log(_nucleus(scaled, sampling)) + gumbel  # [V], -inf off the support
        passes = [restricted, (full + gumbel).masked_fill(torch.isfinite(restricted), float("-inf"))]
    for scores in passes:
        if candidates is not None:
            scores = scores.masked_fill(~candidates, float("-inf"))
        order = torch.argsort(scores, descending=True, stable=True)  # [V]
        finite = int(torch.isfinite(scores).sum())
        for token in order[:finite].tolist():
            if allowed(token):
                return token
    return None


def check_request(engine: Engine, prompt_ids: list[int], max_new_tokens: int) -> None:
    """A request's checks, as one-line ValueErrors: a non-empty prompt, max_new_tokens >= 1, within the model's
    context, every id in the vocabulary (generate's and stream_tokens')."""
    if not prompt_ids:
        raise ValueError("the prompt is empty (expected at least one token id)")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens is {max_new_tokens} (expected >= 1)")
    context = engine.spec.max_position_embeddings
    if context is not None and len(prompt_ids) + max_new_tokens > context:
        raise ValueError(f"a {len(prompt_ids)}-token prompt + max_new_tokens {max_new_tokens} is past the model's context "
                         f"(expected at most max_position_embeddings = {context} tokens in all)")
    _check_ids(engine, prompt_ids)


def generate(
    engine: Engine,
    prompt_ids: list[int],
    max_new_tokens: int,
    sampling: Sampling = Sampling(),
    keep_logits: bool = False,
    stop_ids: tuple[int, ...] = (),
    before_decode: Callable[[], None] | None = None,
) -> Generation:
    """before_decode runs between prefill and the first decode step (e.g. to reset counters)."""
    check_request(engine, prompt_ids, max_new_tokens)
    generator = None
    if sampling.temperature > 0:
        generator = torch.Generator().manual_seed(sampling.seed if sampling.seed is not None else 0)
    cache = engine.new_cache()
    rows: list[np.ndarray] = []

    begin = time.perf_counter()
    logits = engine.forward(torch.tensor(prompt_ids, dtype=torch.int64), cache, all_logits=False)[-1].cpu()  # [V] (sampled on the host)
    new_ids = [pick_token(logits, sampling, generator)]
    prefill_s = time.perf_counter() - begin
    if keep_logits:
        rows.append(logits.numpy().copy())

    if before_decode is not None:
        before_decode()
    begin = time.perf_counter()
    step = torch.empty(1, dtype=torch.int64)
    greedy = sampling.greedy and not keep_logits
    while len(new_ids) < max_new_tokens and new_ids[-1] not in stop_ids:
        if greedy:
            new_ids.append(greedy_step(engine, new_ids[-1], cache))
            continue
        step[0] = new_ids[-1]
        logits = engine.forward(step, cache)[0].cpu()  # [V]
        new_ids.append(pick_token(logits, sampling, generator, new_ids))
        if keep_logits:
            rows.append(logits.numpy().copy())
    decode_s = time.perf_counter() - begin
    return Generation(list(prompt_ids), new_ids, prefill_s, decode_s, np.stack(rows) if keep_logits else None)


def score(engine: Engine, ids: np.ndarray | list[int]) -> np.ndarray:
    """Teacher-forced logits: ids [T] -> float32 [T, V]; row t predicts token t+1."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if not ids:
        raise ValueError("score: no token ids (expected a non-empty 1-D sequence)")
    _check_ids(engine, ids)
    logits = engine.forward(torch.tensor(ids, dtype=torch.int64), engine.new_cache()).cpu().numpy().astype(np.float32, copy=False)
    bad = np.flatnonzero(~np.isfinite(logits).all(axis=1))
    if len(bad):
        raise NonFiniteLogits(f"score: the model's logits are not finite at position {bad[0]} of {len(ids)}; its weights "
                              "or config overflow float32 (expected finite logits)")
    return logits


def _check_ids(engine: Engine, ids: list[int]) -> None:
    vocab = engine.spec.vocab_size
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (expected 0 <= id < {vocab})")
