"""Routing traces: which experts each token picked at each MoE layer, as one compressed npz.

A `RoutingTrace` holds picks int16 [T, L, k], gate weights float16 [T, L, k], optionally the
router's probabilities (or sigmoid scores) float16 [T, L, E] and a phase label int8 [T], and
metadata stored as one JSON string entry: model, top_k, experts per layer, the model's layer
ids that the trace's layer axis maps to, source, free-form extras. A trace `moetier run --layout
--trace` writes labels its prompt's rows "prefill" and the rest "decode" (RUN_PHASES), which
`warmup_tokens` finds. Invariant: a RoutingTrace that exists is valid (shapes agree, ids in
range, a token's picks at a layer are distinct); `load` turns any violation into one ValueError
that names the file. Adapters read the real
traces in shared/traces (FLAME-MoE, Qwen1.5-MoE); `load_counts` reads the expert-count files
(OLMoE, Mixtral, Switch), which are profiles, not traces. `synthetic_trace` makes skewed,
temporally and cross-layer correlated traces for tests and benchmarks.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

FORMAT = "moetier.routing_trace"
VERSION = 1
RUN_PHASES = ("prefill", "decode")  # a `moetier run --layout --trace` trace: its prompt's rows, then the decoded tokens'
QWEN15_MOE_EXPERTS = 60  # Qwen1.5-MoE-A2.7B config.json num_experts (the published trace does not store it)


@dataclass(frozen=True, eq=False)
class RoutingTrace:
    picks: np.ndarray  # [T, L, k] int16 expert ids, each token's k picks per layer
    weights: np.ndarray  # [T, L, k] float16 gate weights of the picks
    num_experts: int  # experts per MoE layer (E)
    layer_ids: tuple[int, ...]  # [L] the model's layer index of each trace layer
    model: str = ""  # model name or fingerprint
    source: str = ""  # where the trace came from (file, run)
    probs: np.ndarray | None = None  # [T, L, E] float16 router probabilities / scores
    phase: np.ndarray | None = None  # [T] int8 index into phase_names
    phase_names: tuple[str, ...] = ()
    extra: dict = field(default_factory=dict)  # JSON-able metadata

    def __post_init__(self):
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731
        picks = np.asarray(self.picks)
        if picks.ndim != 3 or not np.issubdtype(picks.dtype, np.integer) or min(picks.shape) == 0:
            raise ValueError(f"picks: expected non-empty integer [tokens, layers, k], got shape {picks.shape} dtype {picks.dtype}")
        T, L, k = picks.shape
        E = int(self.num_experts)
        if not 1 <= E <= np.iinfo(np.int16).max:
            raise ValueError(f"num_experts: expected 1..32767, got {self.num_experts}")
        if k > E:
            raise ValueError(f"picks: k = {k} picks per token but only {E} experts")
        lo, hi = int(picks.min()), int(picks.max())
        if lo < 0 or hi >= E:
            raise ValueError(f"picks: expert ids must be in [0, {E}), found {lo if lo < 0 else hi}")
        set_("picks", picks.astype(np.int16, copy=False))
        if k > 1:
            ordered = np.sort(self.picks, axis=-1)  # [T, L, k]
            dup = np.argwhere(ordered[..., 1:] == ordered[..., :-1])
            if len(dup):
                t, l, _ = dup[0]
                raise ValueError(f"picks: token {t} picks an expert twice at layer {l}: {self.picks[t, l].tolist()}")
        weights = np.asarray(self.weights)
        if weights.shape != picks.shape:
            raise ValueError(f"weights: expected shape {picks.shape} like picks, got {weights.shape}")
        set_("weights", weights.astype(np.float16, copy=False))
        set_("num_experts", E)
        layer_ids = tuple(int(i) for i in self.layer_ids)
        if len(layer_ids) != L:
            raise ValueError(f"layer_ids: expected {L} ids (one per trace layer), got {len(layer_ids)}")
        set_("layer_ids", layer_ids)
        if self.probs is not None:
            probs = np.asarray(self.probs)
            if probs.shape != (T, L, E):
                raise ValueError(f"probs: expected shape {(T, L, E)} [tokens, layers, experts], got {probs.shape}")
            set_("probs", probs.astype(np.float16, copy=False))
        names = tuple(str(n) for n in self.phase_names)
        set_("phase_names", names)
        if self.phase is not None:
            phase = np.asarray(self.phase)
            if phase.shape != (T,) or not np.issubdtype(phase.dtype, np.integer):
                raise ValueError(f"phase: expected integer [{T}], got shape {phase.shape} dtype {phase.dtype}")
            if len(phase) and (phase.min() < 0 or phase.max() >= len(names)):
                raise ValueError(f"phase: labels must index phase_names ({len(names)} names), found {phase.min()}..{phase.max()}")
            set_("phase", phase.astype(np.int8, copy=False))
        elif names:
            raise ValueError("phase_names given without phase labels")
        json.dumps(self.extra)  # must be JSON-able: fail now, not in save

    @property
    def num_tokens(self) -> int:
        return self.picks.shape[0]

    @property
    def num_layers(self) -> int:
        return self.picks.shape[1]

    @property
    def top_k(self) -> int:
        return self.picks.shape[2]

    def warmup_tokens(self, given: int | None = None) -> int:
        """The leading tokens that only warm caches before a replay counts: `given`, else the prompt's rows (a `run
        --layout --trace` trace's "prefill" phase, RUN_PHASES; a `serve` trace's extra["prefill_tokens"]), else 0."""
        if given is not None:
            return given
        if self.phase is not None and tuple(self.phase_names) == RUN_PHASES:
            decoded = np.flatnonzero(self.phase != 0)
            return int(decoded[0]) if len(decoded) else len(self.phase)
        return int(self.extra.get("prefill_tokens", 0))

    def tokens(self, start: int, stop: int | None = None) -> "RoutingTrace":
        """The sub-trace of tokens [start, stop)."""
        cut = slice(start, stop)
        phase = None if self.phase is None else self.phase[cut]
        probs = None if self.probs is None else self.probs[cut]
        return replace(self, picks=self.picks[cut], weights=self.weights[cut], probs=probs, phase=phase)

    def counts(self) -> np.ndarray:
        """[L, E] int64: how often each expert was picked per layer (a profile)."""
        L, E = self.num_layers, self.num_experts
        flat = (np.arange(L)[:, None] * E + self.picks).ravel()  # [T * L * k]
        return np.bincount(flat, minlength=L * E).reshape(L, E)

    def meta(self) -> dict:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "top_k": self.top_k,
            "num_experts": self.num_experts, "layer_ids": list(self.layer_ids), "source": self.source,
            "phase_names": list(self.phase_names), "extra": self.extra,
        }

    def save(self, path: str | os.PathLike) -> None:
        """Write a compressed npz atomically (a temporary file beside `path`, then rename)."""
        path = Path(path)
        arrays = {"picks": self.picks, "weights": self.weights, "meta": np.array(json.dumps(self.meta()))}
        if self.probs is not None:
            arrays["probs"] = self.probs
        if self.phase is not None:
            arrays["phase"] = self.phase
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            np.savez_compressed(f, **arrays)
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "RoutingTrace":
        """Read a trace written by `save`; any problem is a ValueError naming the file."""
        path = Path(path)
        try:
            with np.load(path, allow_pickle=False) as z:
                missing = {"picks", "weights", "meta"} - set(z.files)
                if missing:
                    raise ValueError(f"missing entries {sorted(missing)} (has {sorted(z.files)})")
                meta = json.loads(str(z["meta"]))
                if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                    raise ValueError(f"meta: expected format {FORMAT!r} version {VERSION}, got {meta.get('format')!r} {meta.get('version')!r}")
                trace = cls(
                    picks=z["picks"], weights=z["weights"], num_experts=meta["num_experts"],
                    layer_ids=meta["layer_ids"], model=meta.get("model", ""), source=meta.get("source", ""),
                    probs=z["probs"] if "probs" in z.files else None, phase=z["phase"] if "phase" in z.files else None,
                    phase_names=meta.get("phase_names", ()), extra=meta.get("extra", {}),
                )
        except (OSError, zipfile.BadZipFile, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
            kind = "missing meta key " if isinstance(e, KeyError) else ""
            raise ValueError(f"{path}: not a valid routing trace: {kind}{e}") from e
        if meta["top_k"] != trace.top_k:
            raise ValueError(f"{path}: not a valid routing trace: meta top_k {meta['top_k']} != picks k {trace.top_k}")
        return trace


def from_flame(path: str | os.PathLike) -> RoutingTrace:
    """FLAME-MoE-290M prefill trace (shared/traces/flame_moe_290m_prefill_*.npz): 4 x 512 tokens, 8 layers."""
    path = Path(path)
    with np.load(path, allow_pickle=False) as z:
        pos = z["pos"]
        return RoutingTrace(
            picks=z["topk_ids"].transpose(1, 0, 2),  # [L, T, k] -> [T, L, k]
            weights=z["topk_scores"].transpose(1, 0, 2),
            probs=np.ascontiguousarray(z["dense_scores"].transpose(1, 0, 2)),  # [T, L, E]; only the picks are non-zero
            num_experts=z["dense_scores"].shape[2], layer_ids=z["layers"].tolist(),
            model="FLAME-MoE-290M", source=f"flame:{path.name}",
            extra={"sequence_starts": np.flatnonzero(pos == 0).tolist()},
        )


def from_qwen15moe(path: str | os.PathLike) -> RoutingTrace:
    """Qwen1.5-MoE GSM8K trace: rows with batch_id >= 3 (drops vLLM's dummy and warm-up batches)."""
    path = Path(path)
    with np.load(path, allow_pickle=False) as z:
        keep = z["batch_id"] >= 3  # [rows]
        batch = z["batch_id"][keep]
        model = json.loads(str(z["meta"])).get("model_id", "Qwen1.5-MoE-A2.7B") if "meta" in z.files else "Qwen1.5-MoE-A2.7B"
        return RoutingTrace(
            picks=z["topk_ids"][:, keep].transpose(1, 0, 2),  # [T, L, k]
            weights=z["topk_weights"][:, keep].transpose(1, 0, 2),
            num_experts=QWEN15_MOE_EXPERTS, layer_ids=z["layers"].tolist(), model=model,
            source=f"qwen15moe:{path.name}",
            extra={"batch_starts": np.flatnonzero(np.diff(batch, prepend=-1)).tolist()},  # first row of each forward call
        )


@dataclass(frozen=True, eq=False)
class ExpertCounts:
    counts: np.ndarray  # [L, E] int64 picks per expert per layer
    layer_ids: tuple[int, ...]
    key: str  # the entry read from the file ("" for a bare .npy)
    source: str


def load_counts(path: str | os.PathLike, key: str | None = None) -> ExpertCounts:
    """Per-layer expert counts from a .npy [L, E] or an .npz (entry `counts`, or `key`).

    Layer ids come from an entry `layers`, else from `layers_<i>_<j>...` in the file name,
    else 0..L-1. An npz with several count entries needs `key`; the error lists them.
    """
    path = Path(path)
    named = re.search(r"layers((?:_\d+)+)", path.stem)
    try:
        if path.suffix == ".npy":
            counts, layers, key = np.load(path, allow_pickle=False), None, ""
        else:
            with np.load(path, allow_pickle=False) as z:
                entries = [f for f in z.files if f != "layers"]
                if key is None:
                    key = "counts" if "counts" in entries else (entries[0] if len(entries) == 1 else None)
                if key not in entries:
                    raise ValueError(f"choose key= one of {entries}")
                counts, layers = z[key], (z["layers"].tolist() if "layers" in z.files else None)
    except (OSError, zipfile.BadZipFile) as e:
        raise ValueError(f"{path}: not an expert-count file: {e}") from e
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e
    counts = np.asarray(counts)
    if counts.ndim != 2 or not np.issubdtype(counts.dtype, np.integer) or (counts < 0).any():
        raise ValueError(f"{path}: {key or 'array'}: expected non-negative integer counts [layers, experts], got {counts.shape} {counts.dtype}")
    if layers is None:
        layers = [int(i) for i in named.group(1).split("_")[1:]] if named else list(range(len(counts)))
    if len(layers) != len(counts):
        raise ValueError(f"{path}: {len(layers)} layer ids for {len(counts)} rows of counts")
    return ExpertCounts(counts.astype(np.int64), tuple(layers), key, str(path))


def synthetic_trace(
    tokens: int, layers: int, experts: int, top_k: int, seed: int = 0,
    classes: int = 256, topics: int = 8, stay: float = 0.3, topic_switch: float = 0.005,
    popularity: float = 0.6, class_strength: float = 1.5, topic_strength: float = 1.0,
) -> RoutingTrace:
    """A skewed, temporally and cross-layer correlated trace (no probs), e.g. Qwen3-Next-like 48 x 512, top-10.

    Each token has a latent class (Zipf over `classes`; repeats the previous one with
    probability `stay`) shared by all layers, and the stream has a topic that switches with
    probability `topic_switch` per token. A layer's logits = Zipf(`popularity`) log-weights of
    its experts + class preference (std `class_strength`) + topic preference (std
    `topic_strength`) + unit noise; picks are the top-k, weights a softmax over them.
    """
    rng = np.random.default_rng(seed)
    zipf = lambda n, s: -s * np.log(np.arange(1, n + 1))  # noqa: E731  log-weights of ranks 1..n
    cls = rng.choice(classes, size=tokens, p=np.exp(zipf(classes, 1.0)) / np.exp(zipf(classes, 1.0)).sum())  # [T]
    repeat = rng.random(tokens) < stay
    idx = np.where(repeat, 0, np.arange(tokens))
    cls = cls[np.maximum.accumulate(idx)]  # a repeat keeps the last fresh class
    topic = np.cumsum(rng.random(tokens) < topic_switch) % topics  # [T]
    picks = np.empty((tokens, layers, top_k), np.int16)
    weights = np.empty((tokens, layers, top_k), np.float16)
    for layer in range(layers):
        pop = zipf(experts, popularity)[rng.permutation(experts)].astype(np.float32)  # [E]
        pref_class = rng.standard_normal((classes, experts), dtype=np.float32) * class_strength  # [C, E]
        pref_topic = rng.standard_normal((topics, experts), dtype=np.float32) * topic_strength  # [S, E]
        logits = pop + pref_class[cls] + pref_topic[topic]  # [T, E]
        logits += rng.standard_normal(logits.shape, dtype=np.float32)
        top = np.argpartition(logits, experts - top_k, axis=1)[:, -top_k:]  # [T, k]
        val = np.take_along_axis(logits, top, 1)
        order = np.argsort(-val, axis=1)
        picks[:, layer] = np.take_along_axis(top, order, 1)
        val = np.take_along_axis(val, order, 1)
        w = np.exp(val - val[:, :1])
        weights[:, layer] = w / w.sum(1, keepdims=True)
    return RoutingTrace(picks=picks, weights=weights, num_experts=experts, layer_ids=tuple(range(layers)),
                        model="synthetic", source=f"synthetic_trace(seed={seed})")
