"""Profiles: which experts a workload uses, per MoE layer and phase, and its brightness.

`profile_requests(engine, requests)` runs each request teacher-forced through
`score` with a route observer and adds up, per phase, each expert's router
mass (softmax probabilities; for sigmoid routers the scores normalised per
token, so every token adds one unit per layer) and how often it was picked.
Brightness b[l][e] is the phase-balanced share: the mean over phases of each
phase's share of the layer's mass, so every phase has an equal vote whatever
its token count, and each layer's brightness sums to 1. Invariant: the engine
profiled is the plain model (no router bias), so a profile never feeds on its
own table.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from moetier.profile.sessions import Request

PROFILE_FORMAT, PROFILE_VERSION = "moetier-profile", 1


class ProfileError(ValueError):
    """A profile file that cannot be used; names the file and what was expected."""


@dataclass(frozen=True)
class Profile:
    phases: tuple[str, ...]
    mass: np.ndarray  # [P, L, E] float64 router mass per phase
    picks: np.ndarray  # [P, L, E] int64 times each expert was picked, per phase
    tokens: np.ndarray  # [P] int64 tokens per phase
    model_fingerprint: str
    router: str  # softmax | sigmoid
    top_k: int
    n_group: int
    topk_group: int
    moe_layers: tuple[int, ...]
    model: str = ""  # the folder profiled (information only)

    @property
    def brightness(self) -> np.ndarray:
        """[L, E] float64: the mean over phases of each phase's share of the layer's mass."""
        totals = self.mass.sum(axis=-1, keepdims=True)  # [P, L, 1]
        return (self.mass / np.where(totals > 0, totals, 1.0)).mean(axis=0)  # [L, E]

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256()
        digest.update(json.dumps([self.phases, self.model_fingerprint, list(self.tokens.tolist())]).encode())
        for array in (self.mass, self.picks):
            digest.update(np.ascontiguousarray(array).tobytes())
        return digest.hexdigest()[:16]

    def metadata(self) -> dict[str, str]:
        fields = {"format": PROFILE_FORMAT, "version": PROFILE_VERSION, "phases": list(self.phases),
                  "model_fingerprint": self.model_fingerprint, "router": self.router, "top_k": self.top_k,
                  "n_group": self.n_group, "topk_group": self.topk_group, "moe_layers": list(self.moe_layers),
                  "model": self.model, "profile_fingerprint": self.fingerprint}
        return {key: json.dumps(value) for key, value in fields.items()}

    def save(self, path: Path) -> Path:
        """.npz (compressed) or .safetensors, chosen by the suffix; written whole or not at all."""
        from moetier.model.output import new_file

        path = Path(path)
        if path.suffix not in (".npz", ".safetensors"):
            raise ProfileError(f"{path}: unknown profile suffix {path.suffix!r} (expected .npz or .safetensors)")
        arrays = {"mass": self.mass.astype(np.float64), "picks": self.picks.astype(np.int64),
                  "tokens": self.tokens.astype(np.int64), "brightness": self.brightness}
        with new_file(path, path.suffix) as partial:
            if path.suffix == ".safetensors":
                from safetensors.numpy import save_file

                save_file({k: np.ascontiguousarray(v) for k, v in arrays.items()}, str(partial), metadata=self.metadata())
            else:
                np.savez_compressed(partial, metadata=np.array(json.dumps(self.metadata())), **arrays)
        return path

    @classmethod
    def load(cls, path: Path) -> "Profile":
        path = Path(path)
        if not path.exists():
            raise ProfileError(f"{path}: no such profile (make one with `moetier profile --model M SESSIONS --out {path.name}`)")
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open

                with safe_open(str(path), framework="numpy") as f:
                    raw_meta = dict(f.metadata() or {})
                    arrays = {k: f.get_tensor(k) for k in f.keys()}
            else:
                with np.load(path, allow_pickle=False) as f:
                    arrays = {k: f[k] for k in f.files if k != "metadata"}
                    raw_meta = json.loads(str(f["metadata"])) if "metadata" in f.files else {}
            meta = {k: json.loads(v) for k, v in raw_meta.items()}
        except Exception as err:  # a corrupt file may fail in numpy, zipfile, json or safetensors
            raise ProfileError(f"{path}: not a readable profile ({type(err).__name__}: {err})") from None
        if meta.get("format") != PROFILE_FORMAT or meta.get("version") != PROFILE_VERSION:
            raise ProfileError(f"{path}: not a {PROFILE_FORMAT} v{PROFILE_VERSION} file (made by `moetier profile`)")
        missing = [k for k in ("phases", "model_fingerprint", "router", "top_k", "n_group", "topk_group", "moe_layers") if k not in meta]
        if missing:
            raise ProfileError(f"{path}: metadata {missing[0]!r} is missing")
        for name in ("mass", "picks", "tokens"):
            if name not in arrays:
                raise ProfileError(f"{path}: array {name!r} is missing")
        mass, picks, tokens = arrays["mass"], arrays["picks"], arrays["tokens"]
        phases = tuple(meta["phases"])
        if mass.ndim != 3 or mass.shape != picks.shape or tokens.shape != (mass.shape[0],) or len(phases) != mass.shape[0]:
            raise ProfileError(f"{path}: mass {list(mass.shape)}, picks {list(picks.shape)}, tokens {list(tokens.shape)} "
                               f"for {len(phases)} phases (expected [P, L, E], [P, L, E], [P])")
        if not np.isfinite(mass).all() or (mass < 0).any():
            raise ProfileError(f"{path}: router mass has NaN, inf or negative values")
        profile = cls(phases, mass.astype(np.float64), picks.astype(np.int64), tokens.astype(np.int64),
                      meta["model_fingerprint"], meta["router"], int(meta["top_k"]), int(meta["n_group"]),
                      int(meta["topk_group"]), tuple(meta["moe_layers"]), meta.get("model", ""))
        if meta.get("profile_fingerprint") not in (None, profile.fingerprint):
            raise ProfileError(f"{path}: contents do not match the stored profile fingerprint (the file was altered)")
        return profile


def profile_requests(engine, requests: Sequence[Request], on_request: Callable[[Request], None] | None = None) -> Profile:
    """Run every request with profile=True teacher-forced; see the module docstring."""
    from moetier.engine import score

    chosen = [r for r in requests if r.profile]
    if not chosen:
        raise ProfileError("no request votes in the profile (every record has \"profile\": false)")
    if engine.router_bias is not None:
        raise ProfileError("the engine has a router bias set; profile the plain model")
    spec = engine.spec
    phases = tuple(dict.fromkeys(r.phase for r in chosen))  # first-seen order
    layers, experts = len(spec.moe_layers), spec.num_experts
    mass = np.zeros((len(phases), layers, experts))  # [P, L, E]
    picks = np.zeros((len(phases), layers, experts), dtype=np.int64)  # [P, L, E]
    tokens = np.zeros(len(phases), dtype=np.int64)  # [P]
    current = [0]

    def observe(layer: int, decision) -> None:
        probs = decision.probs.double()  # [T, E]
        if spec.router == "sigmoid":
            probs = probs / probs.sum(dim=-1, keepdim=True).clamp_min(1e-30)
        row = engine.moe_index[layer]
        mass[current[0], row] += probs.sum(dim=0).cpu().numpy()
        picks[current[0], row] += np.bincount(decision.picks.reshape(-1).cpu().numpy(), minlength=experts)

    previous = engine.observer
    engine.observer = observe
    try:
        for request in chosen:
            current[0] = phases.index(request.phase)
            score(engine, request.ids)
            tokens[current[0]] += len(request.ids)
            if on_request is not None:
                on_request(request)
    finally:
        engine.observer = previous
    checkpoint = engine.checkpoint
    return Profile(phases, mass, picks, tokens, checkpoint.fingerprint, spec.router, spec.top_k, spec.n_group,
                   spec.topk_group, tuple(spec.moe_layers), str(checkpoint.folder))


def summary_rows(profile: Profile, top: int = 4) -> list[dict]:
    """Per MoE layer: the brightest experts and the share of the top_k brightest (for `profile` output)."""
    brightness = profile.brightness  # [L, E]
    rows = []
    for i, layer in enumerate(profile.moe_layers):
        order = np.argsort(-brightness[i], kind="stable")
        rows.append({"layer": int(layer), "brightest": [int(e) for e in order[:top]],
                     "top_k_share": float(brightness[i][order[: profile.top_k]].sum()),
                     "max_brightness": float(brightness[i][order[0]])})
    return rows
