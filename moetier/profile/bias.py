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
The table's file format and its loading live beside the router
(moetier.engine.router_bias); this module builds and summarises tables.
"""

from __future__ import annotations

import numpy as np

from moetier.engine.router_bias import BiasError, BiasTable
from moetier.profile.brightness import Profile

KINDS = ("graded", "flat", "hard")


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


def build_table(profile: Profile, hot: int, kind: str = "graded", cap: float = -0.5) -> BiasTable:
    bias, hot_mask, b_edge = penalties(profile.brightness, hot, kind, cap)
    if kind == "hard":
        check_hard_mask(hot_mask, profile.top_k, profile.n_group, profile.topk_group)
    return BiasTable(bias, hot_mask, b_edge, kind, float(cap) if kind != "hard" else float("-inf"), hot,
                     profile.router, profile.model_fingerprint, profile.fingerprint)


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
