"""Prefix reuse: one sequence's state kept between requests, recomputing only what follows the longest common prefix.

An agent resends its whole history with every request. `PrefixCache` keeps
the KVCache of the last request and the ids it holds (the prompt, then each
generated token fed back). For a new prompt it finds the longest common prefix
with those ids and prefills only the rest:
- attention layers' keys and values (and latent-attention rows) are stored per
  position, so they rewind by setting the cache's length;
- a linear-attention layer's state (Gated DeltaNet / KDA: the conv inputs and
  the delta-rule state) summarises every position and cannot be rewound. The
  cache therefore keeps *marks*: after each prefill, a clone of those states
  (on their device) with the logits of the prompt's last position. A new
  prompt resumes from the live state when it extends every cached id, else
  from the latest mark inside the common prefix (copied back in place, so the
  native step's addresses stay valid), else from nothing.
A prompt equal to a marked one is not recomputed at all: its mark holds the
logits. Invariant: `prefill` returns the logits a cold prefill of the same
prompt gives (up to the float rounding of a prefill split in two), and
`ids == prompt` after it. Not thread-safe: one generation at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.engine.core import Engine
from moetier.engine.deltanet import DeltaNetState
from moetier.engine.generate import greedy_step


@dataclass
class Mark:
    position: int  # the state after ids[:position]
    logits: torch.Tensor  # [V] of position - 1 (what picks the next token)
    states: dict[int, tuple[torch.Tensor, torch.Tensor]]  # layer -> (conv, recurrent) clones; {} without linear layers


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class PrefixCache:
    """See the module docstring. `keep`: marks held at most (the oldest go first)."""

    def __init__(self, engine: Engine, keep: int = 4):
        if keep < 1:
            raise ValueError(f"prefix cache: keep is {keep} (expected >= 1 marks)")
        self.engine = engine
        self.keep = keep
        self.cache = engine.new_cache()
        self.ids: list[int] = []
        self.marks: list[Mark] = []
        self.recurrent = [layer for layer, state in self.cache.states.items() if isinstance(state, DeltaNetState)]

    def reset(self) -> None:
        self.cache = self.engine.new_cache()
        self.ids, self.marks = [], []

    @torch.inference_mode()  # the states are inference tensors (written inside Engine.forward)
    def _snapshot(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        states = self.cache.states
        return {layer: (states[layer].conv.clone(), states[layer].recurrent.clone()) for layer in self.recurrent}

    @torch.inference_mode()
    def _restore(self, mark: Mark) -> None:
        for layer, (conv, recurrent) in mark.states.items():
            state = self.cache.states[layer]
            state.conv.copy_(conv)
            state.recurrent.copy_(recurrent)
        self.cache.length = mark.position
        self.ids = self.ids[: mark.position]

    def _resume_point(self, prompt: list[int]) -> tuple[int, Mark | None]:
        """(where computing starts, the mark to restore first or None), for a prompt of at least one token."""
        common = common_prefix(self.ids, prompt)
        target = min(common, len(prompt) - 1)  # the prompt's last token is computed: its logits pick the next one
        if not self.recurrent:
            return target, None  # everything rewinds
        if common == len(self.ids) and target == common:
            return common, None  # the live state: every cached id is a prefix of the prompt
        usable = [m for m in self.marks if m.position <= target]
        if usable:
            return usable[-1].position, usable[-1]
        return 0, None

    def prefill(self, prompt: list[int]) -> tuple[torch.Tensor, int]:
        """Bring the cache to `prompt`; -> (logits [V] of its last position, on the host; ids reused, not computed)."""
        if not prompt:
            raise ValueError("prefix cache: the prompt is empty (expected at least one token id)")
        prompt = [int(i) for i in prompt]
        common = common_prefix(self.ids, prompt)
        self.marks = [m for m in self.marks if m.position <= common]  # later marks lie on the old branch
        exact = next((m for m in self.marks if m.position == len(prompt)), None)
        if exact is not None:  # this very prompt was prefilled before
            if self.recurrent or self.cache.length != exact.position:
                self._restore(exact)
            self.ids = list(prompt)
            return exact.logits.clone(), len(prompt)
        start, mark = self._resume_point(prompt)
        if mark is not None:
            self._restore(mark)
        elif self.recurrent and start == 0:
            self.reset()
        self.cache.length = start
        self.ids = self.ids[:start]
        logits = self.engine.forward(torch.tensor(prompt[start:], dtype=torch.int64), self.cache, all_logits=False)[-1].cpu()
        self.ids = list(prompt)
        self.marks.append(Mark(len(prompt), logits.clone(), self._snapshot()))
        self.marks = self.marks[-self.keep:]
        return logits, start

    def next_token(self, token: int) -> int:
        """Feed one token after the cached ones; -> the greedy pick after it (generate.greedy_step)."""
        top = greedy_step(self.engine, int(token), self.cache)
        self.ids.append(int(token))
        return top

    def step(self, token: int) -> torch.Tensor:
        """Feed one token after the cached ones; -> logits [V] (on the host)."""
        step = torch.tensor([int(token)], dtype=torch.int64)
        logits = self.engine.forward(step, self.cache)[0].cpu()
        self.ids.append(int(token))
        return logits
