"""Router bias: moetier's nudges to the router (a table and live-cache affinity), the table's file format, and its loading.

A table is float32 [MoE layers, experts] added to the router's selection
scores (logits of softmax routers, probabilities of sigmoid routers); -inf
never picks. Files: safetensors, "bias" (+ "hot", "b_edge"), metadata kind,
cap, hot-set size, router space, profile and model fingerprints. Invariant: a
table loads only for the model it was built for, finite or -inf; with no
table (or an all-zero one) and affinity 0 the engine gets no RouterBias at
all, so off means the reference router. moetier.profile.bias builds tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from moetier.model.output import new_file

BIAS_MODES = ("selection", "damped")
TABLE_FORMAT, TABLE_VERSION = "moetier-bias", 1


class BiasError(ValueError):
    """A table that cannot be built or used; one line naming the file and what was expected."""


@dataclass(frozen=True)
class RouterBias:
    """moetier's router nudges: a table [MoE layers, E] (zeros for none) and live-cache affinity."""

    table: torch.Tensor  # [L_moe, E] float32, added to selection scores; -inf = never picked
    damped: bool = False  # weights from the biased scores too
    affinity: float = 0.0  # lambda added to the experts resident now
    affinity_prefill: bool = False  # also during prefill (decode only by default)


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
        meta = {"format": TABLE_FORMAT, "version": str(TABLE_VERSION), "kind": self.kind, "cap": repr(float(self.cap)),
                "hot": str(self.hot_size), "router": self.router, "space": self.space,
                "model_fingerprint": self.model_fingerprint, "profile_fingerprint": self.profile_fingerprint}
        with new_file(path, ".safetensors") as partial:  # whole file or nothing
            save_file({"bias": np.ascontiguousarray(self.bias, dtype=np.float32), "hot": self.hot.astype(np.uint8),
                       "b_edge": self.b_edge.astype(np.float64)}, str(partial), metadata=meta)
        return path


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


def apply_router_options(engine, bias_path: Path | None = None, affinity: float | None = None,
                         bias_mode: str | None = None, affinity_prefill: bool | None = None):
    """Set the engine's router nudges; None leaves a setting as it is (e.g. from cluster.toml).

    With no table (or an all-zero one) and affinity 0 the engine gets no RouterBias at all:
    off means the reference router, unnudged. Returns the RouterBias set (or None).
    """
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
    if affinity > 0 and not engine.executor.live_cache:
        raise BiasError("affinity follows the live expert cache, and this engine has none (run with a --layout that has a vram tier)")
    if (table is None or not bool(table.any())) and affinity == 0:
        engine.set_router_bias(None)
        return None
    if table is None:
        table = torch.zeros(len(engine.spec.moe_layers), engine.spec.num_experts)  # [L, E]
    bias = RouterBias(table.to(engine.device), damped=damped, affinity=float(affinity), affinity_prefill=prefill)
    engine.set_router_bias(bias)
    return bias
