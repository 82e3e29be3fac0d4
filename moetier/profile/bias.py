"""Bias tables (PGO-SGB): a profile's brightness -> a per-expert nudge for the router.

Per MoE layer the hot set is the N brightest experts (ties: lower id first);
hot experts get 0. Cold experts get, by kind:
  graded  max(cap, ln(b / b_edge)), b_edge = brightness of the weakest hot expert
  flat    cap
  hard    -inf (never picked; needs N >= top_k, and for group-limited routers
          enough hot experts in any kept groups)
The table adds to the router's selection score: to the logits of softmax
routers, to the sigmoid scores (probabilities, in [0, 1]) of sigmoid routers.
A probability offset c moves a pick whose score is s like a logit offset of
about c / (s (1 - s)), i.e. 4-10x more, so sigmoid caps are ~10x smaller
(-0.025 where a softmax model takes -0.25); `bias show` prints the space.
Files: safetensors, "bias" float32 [MoE layers, experts] (+ "hot", "b_edge"),
metadata kind, cap, hot-set size, router space, profile and model fingerprints.
Invariant: a table loads only for the model it was built for, finite or -inf.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from moetier.profile.brightness import Profile

KINDS = ("graded", "flat", "hard")
BIAS_MODES = ("selection", "damped")
TABLE_FORMAT, TABLE_VERSION = "moetier-bias", 1


class BiasError(ValueError):
    """A table that cannot be built or used; one line naming the file and what was expected."""


def penalties(brightness: np.ndarray, hot: int, kind: str, cap: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """brightness [L, E] -> (bias [L, E] float32, hot mask [L, E] bool, b_edge [L] float64)."""
    if kind not in KINDS:
        raise BiasError(f"--kind {kind!r} is unknown (expected one of {', '.join(KINDS)})")
    layers, experts = brightness.shape
    if not 1 <= hot <= experts:
        raise BiasError(f"--hot is {hot} (expected 1..{experts}: experts per layer)")
    if kind != "hard" and not (np.isfinite(cap) and cap < 0):
        raise BiasError(f"--cap is {cap} (expected a negative penalty such as -0.5)")
    order = np.argsort(-brightness, axis=1, kind="stable")  # [L, E] brightest first
    hot_mask = np.zeros((layers, experts), dtype=bool)
    np.put_along_axis(hot_mask, order[:, :hot], True, axis=1)
    b_edge = np.take_along_axis(brightness, order[:, hot - 1 : hot], axis=1)[:, 0]  # [L]
    if kind == "hard":
        cold = np.full((layers, experts), -np.inf)
    elif kind == "flat":
        cold = np.full((layers, experts), float(cap))
    else:
        edge = b_edge[:, None]  # [L, 1]
        # a cold expert as bright as the edge ties with it (ln 1 = 0), also when the edge is 0
        ratio = np.divide(np.minimum(brightness, edge), edge, out=np.ones_like(brightness, dtype=np.float64), where=edge > 0)  # [L, E] <= 1
        with np.errstate(divide="ignore"):
            cold = np.maximum(float(cap), np.log(ratio))  # [L, E], ln(0) = -inf -> cap
    bias = np.where(hot_mask, 0.0, cold).astype(np.float32)  # [L, E]
    return bias, hot_mask, b_edge.astype(np.float64)


def check_hard_mask(hot_mask: np.ndarray, top_k: int, n_group: int = 1, topk_group: int = 1) -> None:
    """A hard table must leave every token top_k pickable experts, whatever groups the router keeps."""
    for row, mask in enumerate(hot_mask):
        if mask.sum() < top_k:
            raise BiasError(f"a hard table keeps {int(mask.sum())} experts in MoE layer {row} (expected --hot >= top_k = {top_k})")
        if n_group > 1 and topk_group < n_group:
            per_group = mask.reshape(n_group, -1).sum(axis=1)  # [G] hot experts per group
            # a group with < 2 hot experts scores -inf (its two best), so the router keeps finite groups first
            finite = np.sort(per_group[per_group >= 2])
            if len(finite) < topk_group or finite[:topk_group].sum() < top_k:
                raise BiasError(f"a hard table's hot set in MoE layer {row} ({per_group.tolist()} per group) can leave "
                                f"fewer than top_k = {top_k} pickable experts in the {topk_group} groups the router keeps; "
                                f"raise --hot or use --kind graded")


@dataclass(frozen=True)
class BiasTable:
    bias: np.ndarray  # [L, E] float32, 0 = hot, -inf = never picked
    hot: np.ndarray  # [L, E] bool
    b_edge: np.ndarray  # [L] float64 brightness of each layer's weakest hot expert
    kind: str
    cap: float
    hot_size: int
    router: str  # softmax (logit space) | sigmoid (probability space)
    model_fingerprint: str
    profile_fingerprint: str

    @property
    def space(self) -> str:
        return "probability" if self.router == "sigmoid" else "logit"

    def save(self, path: Path) -> Path:
        from safetensors.numpy import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {"format": TABLE_FORMAT, "version": str(TABLE_VERSION), "kind": self.kind, "cap": repr(float(self.cap)),
                "hot": str(self.hot_size), "router": self.router, "space": self.space,
                "model_fingerprint": self.model_fingerprint, "profile_fingerprint": self.profile_fingerprint}
        partial = path.with_name(path.name + ".partial.safetensors")
        save_file({"bias": np.ascontiguousarray(self.bias, dtype=np.float32), "hot": self.hot.astype(np.uint8),
                   "b_edge": self.b_edge.astype(np.float64)}, str(partial), metadata=meta)
        partial.replace(path)
        return path


def build_table(profile: Profile, hot: int, kind: str = "graded", cap: float = -0.5) -> BiasTable:
    bias, hot_mask, b_edge = penalties(profile.brightness, hot, kind, cap)
    if kind == "hard":
        check_hard_mask(hot_mask, profile.top_k, profile.n_group, profile.topk_group)
    return BiasTable(bias, hot_mask, b_edge, kind, float(cap) if kind != "hard" else float("-inf"), hot,
                     profile.router, profile.model_fingerprint, profile.fingerprint)


def load_table(path: Path, spec=None, model_fingerprint: str | None = None) -> BiasTable:
    """Read a table; with spec / model_fingerprint, refuse one that does not fit that model."""
    path = Path(path)
    if not path.exists():
        raise BiasError(f"{path}: no such bias table (make one with `moetier bias --profile P --hot N --out {path.name}`)")
    try:
        from safetensors import safe_open

        with safe_open(str(path), framework="numpy") as f:
            meta = dict(f.metadata() or {})
            arrays = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as err:  # safetensors raises its own error types for a bad header
        raise BiasError(f"{path}: not a readable safetensors bias table ({type(err).__name__}: {err})") from None
    if meta.get("format") != TABLE_FORMAT:
        raise BiasError(f"{path}: not a {TABLE_FORMAT} table (no format metadata; make tables with `moetier bias`)")
    if "bias" not in arrays:
        raise BiasError(f"{path}: tensor 'bias' is missing (expected float32 [MoE layers, experts])")
    bias = arrays["bias"]
    if bias.dtype != np.float32 or bias.ndim != 2:
        raise BiasError(f"{path}: 'bias' is {bias.dtype} {list(bias.shape)} (expected float32 [MoE layers, experts])")
    if spec is not None and bias.shape != (len(spec.moe_layers), spec.num_experts):
        raise BiasError(f"{path}: table has shape {list(bias.shape)} (expected [{len(spec.moe_layers)}, {spec.num_experts}]: "
                        f"MoE layers x experts of this model)")
    bad = np.argwhere(np.isnan(bias) | (bias == np.inf))
    if len(bad):
        raise BiasError(f"{path}: table has {'NaN' if np.isnan(bias[tuple(bad[0])]) else '+inf'} at MoE layer {bad[0][0]}, "
                        f"expert {bad[0][1]} (expected finite penalties or -inf)")
    if (np.isfinite(bias) & (bias > 0)).any():
        raise BiasError(f"{path}: table has positive entries (expected penalties <= 0)")
    built_for = meta.get("model_fingerprint", "")
    if model_fingerprint is not None and built_for != model_fingerprint:
        raise BiasError(f"{path}: table was built for model {built_for or '(unknown)'}, this model is {model_fingerprint} "
                        f"(build a table from a profile of this model)")
    hot = arrays["hot"].astype(bool) if "hot" in arrays and arrays["hot"].shape == bias.shape else bias == 0
    b_edge = arrays["b_edge"] if "b_edge" in arrays else np.full(bias.shape[0], np.nan)
    try:
        cap, hot_size = float(meta.get("cap", "nan")), int(meta.get("hot", "0"))
    except ValueError:
        raise BiasError(f"{path}: metadata cap / hot are not numbers") from None
    return BiasTable(bias, hot, b_edge, meta.get("kind", "?"), cap, hot_size, meta.get("router", "softmax"),
                     built_for, meta.get("profile_fingerprint", ""))


def summarize(table: BiasTable) -> list[dict]:
    """Per MoE layer: hot-set size, b_edge, and the quantiles of the cold experts' penalties."""
    rows = []
    for row, (bias, hot) in enumerate(zip(table.bias, table.hot)):
        cold = bias[~hot].astype(np.float64)
        finite = cold[np.isfinite(cold)]
        quantiles = np.quantile(finite, [0.0, 0.1, 0.5, 0.9, 1.0]).tolist() if len(finite) else [None] * 5
        rows.append({"moe_layer": row, "hot": int(hot.sum()), "b_edge": float(table.b_edge[row]),
                     "never": int(np.isneginf(cold).sum()), "at_cap": int(np.isclose(finite, table.cap).sum()),
                     "min": quantiles[0], "p10": quantiles[1], "p50": quantiles[2], "p90": quantiles[3], "max": quantiles[4]})
    return rows


def describe(table: BiasTable) -> dict:
    return {"kind": table.kind, "cap": table.cap, "hot": table.hot_size, "router": table.router, "space": table.space,
            "model_fingerprint": table.model_fingerprint, "profile_fingerprint": table.profile_fingerprint,
            "shape": list(table.bias.shape)}


def apply_router_options(engine, bias_path: Path | None = None, affinity: float | None = None,
                         bias_mode: str | None = None, affinity_prefill: bool | None = None):
    """Set the engine's router nudges; None leaves a setting as it is (e.g. from cluster.toml).

    With no table (or an all-zero one) and affinity 0 the engine gets no RouterBias at all:
    off means the reference router, unnudged. Returns the RouterBias set (or None).
    """
    import torch

    from moetier.engine.core import RouterBias

    if bias_path is None and affinity is None and bias_mode is None and affinity_prefill is None:
        return engine.router_bias
    current = engine.router_bias
    if bias_mode is not None and bias_mode not in BIAS_MODES:
        raise BiasError(f"bias mode {bias_mode!r} is unknown (expected one of {', '.join(BIAS_MODES)})")
    if affinity is not None and not (np.isfinite(affinity) and affinity >= 0):
        raise BiasError(f"affinity is {affinity} (expected a lambda >= 0, e.g. 0.25)")
    table = None
    if bias_path is not None:
        table = torch.from_numpy(load_table(bias_path, engine.spec, engine.checkpoint.fingerprint).bias.copy())  # [L, E]
    elif current is not None:
        table = current.table
    affinity = affinity if affinity is not None else (current.affinity if current is not None else 0.0)
    damped = bias_mode == "damped" if bias_mode is not None else (current is not None and current.damped)
    prefill = affinity_prefill if affinity_prefill is not None else (current is not None and current.affinity_prefill)
    if affinity > 0 and getattr(engine.executor, "resident_mask", None) is None:
        raise BiasError("affinity follows the live expert cache, and this engine has none (run with a --layout that has a vram tier)")
    if (table is None or not bool(table.any())) and affinity == 0:
        engine.set_router_bias(None)
        return None
    if table is None:
        table = torch.zeros(len(engine.spec.moe_layers), engine.spec.num_experts)  # [L, E]
    bias = RouterBias(table.to(engine.device), damped=damped, affinity=float(affinity), affinity_prefill=prefill)
    engine.set_router_bias(bias)
    return bias
