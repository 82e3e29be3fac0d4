"""Small checkpoints trained by transformers until their predictions are decisive, for the peer tests' top-1 bars.

A random checkpoint's next-token distribution is nearly flat: the two best
logits of a position are often closer than the last-bit differences between
two correct implementations (activations quantized to Q8_K / Q8_0 flip one
rounding step, a near-tied router picks another expert), so top-1 agreement
on it measures the model's sensitivity, not the arithmetic. A trained language
model's top token usually leads by nats. These checkpoints start from a
synthetic one (`write_synthetic`, any architecture transformers trains) and
take STEPS AdamW steps on sequences of a Markov chain over MARKOV_VOCAB tokens
(each token's successor is one fixed token nine times in ten, another one
otherwise), written with `save_pretrained`. Trained so, the model puts about
0.9 on its top token (`decisive`); teacher-forced on fresh chain sequences
(`markov_ids`) its logits are what a quantized model's agreement is about.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

MARKOV_VOCAB = 256  # the chain's tokens: the first ids of the model's vocabulary
STEPS = 80
_SUCCESSORS = np.random.default_rng(0).integers(0, MARKOV_VOCAB, (MARKOV_VOCAB, 2))  # [V, 2]: likely, then rare


def markov_ids(batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
    """[batch, length] int64 sequences of the chain."""
    ids = np.empty((batch, length), np.int64)
    ids[:, 0] = rng.integers(0, MARKOV_VOCAB, batch)
    for t in range(1, length):
        ids[:, t] = _SUCCESSORS[ids[:, t - 1], (rng.random(batch) < 0.1).astype(np.int64)]
    return ids


def train(folder: Path, out: Path, steps: int = STEPS, seed: int = 0) -> Path:
    """The checkpoint in `folder` (one transformers loads), trained `steps` steps on the chain, saved to `out`."""
    import torch

    from synth_reference import load_reference

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    model = load_reference(folder)[0].train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for _ in range(steps):
        ids = torch.from_numpy(markov_ids(8, 64, rng))  # [8, 64]
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval().save_pretrained(out)
    return out


def trained_files(init: Path, root: Path, positions: int) -> tuple[Path, Path, list[int]]:
    """The checkpoint `init` trained into root/hf, its F32 GGUF (moetier's writer) and `positions` fresh ids of the
    chain: (folder, gguf, ids), what the peer tests' trained fixtures give."""
    from moetier.model.gguf_write import write_gguf

    folder = train(init, root / "hf")
    ids = markov_ids(1, positions, np.random.default_rng(99))[0].tolist()
    return folder, write_gguf(folder, root / "model-f32.gguf", "F32")[0], ids


def decisive(logits: np.ndarray) -> float:
    """The mean probability of each position's top token, logits [T, V]."""
    x = logits.astype(np.float64)
    p = np.exp(x - x.max(axis=1, keepdims=True))
    return float((p.max(axis=1) / p.sum(axis=1)).mean())
