"""Prefix reuse: a request that extends the last one prefills only what follows, with a cold run's logits.

On three kinds of state: attention only (qwen3_moe), Gated DeltaNet linear attention in 3 of 4 layers
(qwen3_next) and KDA + latent attention (glm5_next). The recurrent states cannot be rewound: a prompt that
diverges inside the last generation resumes from the mark at the previous prompt's end; an identical prompt
costs no forward at all.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moetier.engine import Engine, Sampling, generate
from moetier.engine.prefix import PrefixCache
from moetier.engine.stream import StreamStats, stream_tokens
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic

ARCHES = ("qwen3_moe", "qwen3_next", "glm5_next")


@pytest.fixture(scope="module", params=ARCHES)
def engine(request, tmp_path_factory):
    folder = write_synthetic(tmp_path_factory.mktemp("prefix") / request.param, arch=request.param, preset="tiny", seed=1)
    return Engine(open_checkpoint(folder))


def _prompt(engine, n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, engine.spec.vocab_size, n).tolist()


def _cold(engine, prompt: list[int]) -> torch.Tensor:
    return engine.forward(torch.tensor(prompt), engine.new_cache(), all_logits=False)[-1]


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    scale = float(b.abs().max())
    assert float((a - b).abs().max()) <= 2e-5 * max(scale, 1.0), (float((a - b).abs().max()), scale)
    assert int(a.argmax()) == int(b.argmax())


def test_an_extended_prompt_prefills_only_its_new_tokens(engine):
    cache = PrefixCache(engine)
    first = _prompt(engine, 120)
    logits, reused = cache.prefill(first)
    assert reused == 0
    _close(logits, _cold(engine, first))
    second = first + _prompt(engine, 50, seed=1)
    logits, reused = cache.prefill(second)
    assert len(second) - reused == 50
    _close(logits, _cold(engine, second))


def test_after_a_generation_the_next_turn_resumes_where_it_can(engine):
    cache = PrefixCache(engine)
    prompt = _prompt(engine, 80)
    stats = StreamStats()
    generated = list(stream_tokens(engine, prompt, 12, Sampling(), (), cache, stats))
    assert stats.cached_tokens == 0 and cache.ids == prompt + generated[:-1]
    # the agent sends the whole history back with its reply: every cached id is reused, from the live state
    follow = prompt + generated + _prompt(engine, 30, seed=2)
    logits, reused = cache.prefill(follow)
    assert reused == len(prompt) + len(generated) - 1
    _close(logits, _cold(engine, follow))
    # a history that rewrote the generated part: attention rewinds into it, recurrent states restart at the mark
    edited = follow[: len(prompt) + 5] + _prompt(engine, 20, seed=3)
    logits, reused = cache.prefill(edited)
    assert reused == (len(prompt) if cache.recurrent else len(prompt) + 5)
    _close(logits, _cold(engine, edited))


def test_a_repeated_prompt_costs_no_forward_and_a_new_one_starts_cold(engine):
    cache = PrefixCache(engine)
    prompt = _prompt(engine, 60)
    first, _ = cache.prefill(prompt)
    calls = []
    forward = engine.forward
    engine.forward = lambda *a, **k: calls.append(1) or forward(*a, **k)
    try:
        again, reused = cache.prefill(prompt)
    finally:
        engine.forward = forward
    assert reused == len(prompt) and not calls and torch.equal(first, again)
    other = _prompt(engine, 40, seed=9)
    logits, reused = cache.prefill(other)
    assert reused == 0
    _close(logits, _cold(engine, other))


def test_streamed_tokens_equal_generate(engine):
    prompt = _prompt(engine, 30)
    for sampling in (Sampling(), Sampling(temperature=0.8, seed=5)):
        expected = generate(engine, prompt, 16, sampling).ids
        assert list(stream_tokens(engine, prompt, 16, sampling)) == expected
