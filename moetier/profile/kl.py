"""Teacher-forced KL: what a router nudge costs in quality, position by position.

The reference is the plain model (all experts resident, no bias, no layout),
scored in one teacher-forced pass. A candidate is the same model with a bias
table, live-cache affinity, a bias mode and/or a tier layout. Its logits come
from one pass too, unless it uses affinity (decode-only by default) or asks
for `stepwise`: then each token is fed alone through the KV cache, as decode
runs. Reported: mean KL(plain || candidate) pooled over positions, per phase
and (synthetic models) per token family of the input token, top-1 agreement,
and the floor: the candidate run twice, so a KL near the floor is noise.
Invariant: KL is computed in float64 from float32 logits; nothing is sampled.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from moetier.profile.sessions import Request, token_family_of


@dataclass(frozen=True)
class Candidate:
    """The configuration measured against the plain model."""

    bias: Path | None = None  # bias table (.safetensors)
    affinity: float = 0.0  # live-cache lambda (needs a layout with a vram tier)
    bias_mode: str = "selection"  # selection | damped
    affinity_prefill: bool = False
    layout: Path | None = None  # cluster.toml; None: all experts resident
    stepwise: bool = False  # feed tokens one at a time even without affinity

    @property
    def decode(self) -> bool:
        return self.stepwise or (self.affinity > 0 and not self.affinity_prefill)

    def label(self) -> str:
        parts = [f"bias={Path(self.bias).name}" if self.bias else "", f"affinity={self.affinity:g}" if self.affinity else "",
                 "damped" if self.bias_mode == "damped" else "", f"layout={Path(self.layout).name}" if self.layout else ""]
        return " ".join(p for p in parts if p) or "plain"


@dataclass
class KLReport:
    candidate: str
    positions: int
    mean_kl: float  # nats per position
    max_kl: float
    p99_kl: float
    top1_agreement: float
    floor_kl: float | None  # mean KL between two runs of the candidate; None when not measured
    per_phase: dict[str, float] = field(default_factory=dict)
    per_family: dict[str, float] = field(default_factory=dict)  # token family of the input token (synthetic models)
    tokens_per_phase: dict[str, int] = field(default_factory=dict)
    tokens_per_family: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)


def kl_per_position(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """logits [T, V] twice -> KL(softmax(reference) || softmax(candidate)) [T] float64, in nats."""
    p_log = torch.log_softmax(torch.as_tensor(reference, dtype=torch.float64), dim=-1)  # [T, V]
    q_log = torch.log_softmax(torch.as_tensor(candidate, dtype=torch.float64), dim=-1)  # [T, V]
    return (p_log.exp() * (p_log - q_log)).sum(dim=-1).clamp_min(0.0).numpy()  # [T]


def stepwise_logits(engine, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """Teacher-forced decode: ids [T] fed one at a time -> (logits [T, V] float32, seconds in forward)."""
    cache = engine.new_cache()
    rows = np.empty((len(ids), engine.spec.vocab_size), dtype=np.float32)  # [T, V]
    step = torch.empty(1, dtype=torch.int64)
    seconds = 0.0
    for t, token in enumerate(np.asarray(ids).tolist()):
        step[0] = int(token)
        begin = time.perf_counter()
        logits = engine.forward(step, cache)[0]  # [V]
        seconds += time.perf_counter() - begin
        rows[t] = logits.float().cpu().numpy()
    return rows, seconds


def candidate_logits(engine, ids: np.ndarray, decode: bool) -> np.ndarray:
    from moetier.engine import score

    return stepwise_logits(engine, ids)[0] if decode else score(engine, ids)


@contextmanager
def open_candidate(checkpoint, candidate: Candidate) -> Iterator[object]:
    """An engine (plain or over the candidate's layout) with the candidate's router options; closed after."""
    from moetier.engine import Engine
    from moetier.engine.router_bias import apply_router_options

    runtime = None
    if candidate.layout is not None:
        from moetier.config import load_layout
        from moetier.engine.runtime import build_runtime

        runtime = build_runtime(load_layout(candidate.layout), checkpoint)
        engine = runtime.engine
    else:
        engine = Engine(checkpoint)
    try:
        # the candidate's settings replace whatever the layout's [router] set
        engine.set_router_bias(None)
        apply_router_options(engine, candidate.bias, candidate.affinity, candidate.bias_mode, candidate.affinity_prefill)
        yield engine
    finally:
        if runtime is not None:
            runtime.close()


def reference_logits(checkpoint, requests: Sequence[Request]) -> list[np.ndarray]:
    """The plain model's teacher-forced logits per request, each [T, V]."""
    from moetier.engine import Engine, score

    engine = Engine(checkpoint)
    return [score(engine, r.ids) for r in requests]


def report(label: str, requests: Sequence[Request], reference: Sequence[np.ndarray], runs: Sequence[Sequence[np.ndarray]],
           family: np.ndarray | None) -> KLReport:
    """KL of the first run against the reference; the floor from the second run against the first."""
    kl = np.concatenate([kl_per_position(r, c) for r, c in zip(reference, runs[0])])  # [N]
    agree = np.concatenate([r.argmax(-1) == c.argmax(-1) for r, c in zip(reference, runs[0])])  # [N]
    phases = np.concatenate([np.full(len(r.ids), r.phase, dtype=object) for r in requests])  # [N]
    floor = None
    if len(runs) > 1:
        floor = float(np.concatenate([kl_per_position(a, b) for a, b in zip(runs[0], runs[1])]).mean())
    result = KLReport(label, int(len(kl)), float(kl.mean()), float(kl.max()), float(np.quantile(kl, 0.99)),
                      float(agree.mean()), floor)
    for name in dict.fromkeys(phases.tolist()):
        chosen = phases == name
        result.per_phase[name], result.tokens_per_phase[name] = float(kl[chosen].mean()), int(chosen.sum())
    if family is not None:
        families = np.concatenate([family[r.ids] for r in requests])  # [N] family of each input token
        for name in sorted(set(families.tolist()) - {""}):
            chosen = families == name
            result.per_family[name], result.tokens_per_family[name] = float(kl[chosen].mean()), int(chosen.sum())
    return result


def measure_kl(checkpoint, requests: Sequence[Request], candidate: Candidate, floor: bool = True,
               reference: Sequence[np.ndarray] | None = None,
               on_request: Callable[[Request], None] | None = None) -> KLReport:
    """Teacher-forced KL(plain || candidate) over every request (held-out ones included)."""
    reference = reference if reference is not None else reference_logits(checkpoint, requests)
    runs = []
    for _ in range(2 if floor else 1):
        with open_candidate(checkpoint, candidate) as engine:
            run = []
            for request in requests:
                run.append(candidate_logits(engine, request.ids, candidate.decode))
                if on_request is not None:
                    on_request(request)
            runs.append(run)
    family = token_family_of(checkpoint.folder, checkpoint.spec.vocab_size)
    return report(candidate.label(), requests, reference, runs, family)
