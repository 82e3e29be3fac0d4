"""The server tests' shared parts: a tiny qwen3_next model served on loopback with a client (module fixtures: import
`model`, `url`, `client` into a test module), logprob entries read back as token ids, a cold teacher-forced forward."""

from __future__ import annotations

import pytest

from serving import server
from tokenizer_files import text_model


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return text_model(tmp_path_factory.mktemp("serve") / "qwen3_next-tiny", arch="qwen3_next", preset="tiny", seed=2)


@pytest.fixture(scope="module")
def url(model):
    with server("--model", model, "--host", "127.0.0.1") as (base, _):
        yield base


@pytest.fixture(scope="module")
def client(url):
    from openai import OpenAI

    return OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)


def entry_ids(tokenizer, entries) -> list[int]:
    """The ids of chat logprob entries, by their bytes (each must name one id)."""
    by_bytes: dict[bytes, list[int]] = {}
    for i, piece in enumerate(tokenizer.token_bytes()):
        by_bytes.setdefault(piece, []).append(i)
    ids = []
    for entry in entries:
        found = by_bytes[bytes(entry.bytes)]
        assert len(found) == 1, entry
        ids.append(found[0])
    return ids


def cold_logprobs(model):
    """prompt ids + completion ids -> log-softmax [T, V] of one cold teacher-forced forward of `model`."""
    import torch

    from moetier.engine import Engine
    from moetier.engine.generate import score
    from moetier.model import open_checkpoint

    engine = Engine(open_checkpoint(model))
    return lambda ids: torch.log_softmax(torch.from_numpy(score(engine, ids)), dim=-1).numpy()
