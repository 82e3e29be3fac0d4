"""The comparisons every architecture's tests make against transformers, written once.

`teacher_forced_error` and `cached_decode` run moetier and a transformers model (already built, its folder saved)
on the same random ids and return the max |dlogit| (and whether the greedy tokens agree); each test file asserts
them against its bar. Prompts draw no token 0: transformers' generate takes it for padding with pad_token_id=0.
"""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from moetier.engine import Engine, generate, score
from moetier.model import open_checkpoint


def random_ids(vocab: int, length: int, seed: int) -> torch.Tensor:
    """[length] int64 token ids in 1..vocab-1 (no 0: see the module docstring)."""
    return torch.randint(1, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def teacher_forced_error(model, folder, vocab: int, positions: int, seed: int = 1) -> float:
    """max |dlogit| of moetier against `model` over `positions` teacher-forced positions."""
    ids = random_ids(vocab, positions, seed)
    with torch.no_grad():
        expected = model(ids[None]).logits[0].numpy()  # [T, V]
    got = score(Engine(open_checkpoint(folder)), ids.numpy())
    assert got.dtype == np.float32 and got.shape == expected.shape
    return float(np.abs(got - expected).max())


def cached_decode(model, engine: Engine, vocab: int, prompt: int, steps: int, seed: int = 2) -> tuple[bool, float]:
    """(greedy tokens equal, max |dlogit|) over a `prompt`-token prefill and `steps` - 1 cached decode steps."""
    ids = random_ids(vocab, prompt, seed)
    with torch.no_grad():
        out = model.generate(ids[None], max_new_tokens=steps, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    expected = torch.stack(out.logits)[:, 0].numpy()  # [steps, V]: prefill, then the cached decode steps
    result = generate(engine, ids.tolist(), steps, keep_logits=True)
    return result.ids == out.sequences[0, prompt:].tolist(), float(np.abs(result.logits - expected).max())


@contextlib.contextmanager
def python_path(engine: Engine):
    """The engine's per-layer Python path with its token mixers and hyper-connection weights in torch ops (a decoded
    token's would otherwise run the native step's own mixers, cpu_deltanet.h and cpu_hyper.h, and a comparison with
    the step would not test them)."""
    from moetier.engine import core

    step, engine.native_step = engine.native_step, None
    deltanet, kda, streams = core.deltanet_layer, core.kda_layer, core.Streams.__dict__["of"]
    core.deltanet_layer = lambda w, g, x, state, eps, kernel=None: deltanet(w, g, x, state, eps, None)
    core.kda_layer = lambda w, g, x, state, eps, kernel=None: kda(w, g, x, state, eps, None)
    core.Streams.of = classmethod(lambda cls, x, hyper, rms_eps, kernel=None: streams.__func__(cls, x, hyper, rms_eps, None))
    try:
        yield
    finally:
        engine.native_step, core.deltanet_layer, core.kda_layer, core.Streams.of = step, deltanet, kda, streams


def decode_both(engine: Engine, ids: list[int], prefix: int) -> tuple[np.ndarray, np.ndarray]:
    """Teacher-forced decode of ids[prefix:] after a prefill of ids[:prefix], by the native step and by the Python
    path -> logits [steps, V] each."""
    assert engine.native_step is not None, engine.decode_path()
    out = []
    for native in (True, False):
        cache = engine.new_cache()
        with contextlib.nullcontext() if native else python_path(engine):
            engine.forward(torch.tensor(ids[:prefix]), cache)
            out.append(np.stack([engine.forward(torch.tensor([t]), cache)[0].numpy() for t in ids[prefix:]]))
    return out[0], out[1]


def decode_per_pool_size(checkpoint, ids: list[int], prefix: int, lanes=(1, 2, 3)) -> list[np.ndarray]:
    """Teacher-forced decode of ids[prefix:] after a prefill of ids[:prefix] on one engine per native pool size
    (each decoding through the native step) -> the logits [steps, V] of each."""
    from moetier.backends.torch_backend import TorchBackend

    runs = []
    for threads in lanes:
        engine = Engine(checkpoint, backend=TorchBackend("cpu", lanes=threads))
        assert engine.native_step is not None and engine.native_step.kernel.threads == threads
        cache = engine.new_cache()
        engine.forward(torch.tensor(ids[:prefix]), cache)
        runs.append(np.stack([engine.forward(torch.tensor([t]), cache)[0].numpy() for t in ids[prefix:]]))
    return runs


def pieces_both(engine: Engine, ids: list[int], pieces: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """ids forwarded in `pieces` (a, b) on one cache (one-token pieces decode natively), by the engine as it runs and
    all on the Python path -> the last logits of each piece [pieces, V], each way."""
    logits = {}
    for native in (True, False):
        cache = engine.new_cache()
        with contextlib.nullcontext() if native else python_path(engine):
            logits[native] = torch.cat([engine.forward(torch.tensor(ids[a:b]), cache)[-1:] for a, b in pieces])
    return logits[True], logits[False]
