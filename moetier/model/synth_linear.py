"""Gated DeltaNet weights for synthetic qwen3_next checkpoints: a recurrent token mixer that leaves the routing design intact.

The subspace rules are synth_routing's: v and the output gate z read token
identity only, so what the layer writes averages to ~0 over tokens and biases
no router, and the out-projection (synth_routing.writer) writes only into the
computation subspace. q, k and v enter the convolution's silu small (rms
QKV_RMS), where silu is near linear, so v's mean stays small; q and k are
L2-normalised afterwards and the gated RMSNorm divides out o's scale, so that
size costs nothing. Each value head forgets on its own time scale, between
TAU_MIN and TAU_MAX tokens (decay exp(g) ~ exp(-1 / tau) per token).
Invariant: pure functions of (seed, key, dims); no I/O, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moetier.model import synth_routing as design

QKV_RMS = 0.5         # rms of q, k and v before the convolution's silu (silu's mean there: ~0.2 of its rms)
BETA_RMS = 1.0        # rms of b: the write strength beta = sigmoid(b) spreads around 0.5
DECAY_RMS = 0.5       # rms of a: the per-token spread of the decay around its head's time scale
DT_BIAS_STD = 0.5
TAU_MIN, TAU_MAX = 2.0, 64.0   # tokens over which a value head's state decays by 1/e
CONV_SELF = 0.8       # the current token's tap; the K-1 earlier taps ~ N(0, CONV_PAST^2)
CONV_PAST = 0.3


@dataclass(frozen=True)
class LinearDims:
    """Qwen3-Next's linear-attention geometry; each key head serves value_heads / key_heads value heads."""

    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int = 4

    @property
    def conv_channels(self) -> int:
        return 2 * self.key_heads * self.key_head_dim + self.value_heads * self.value_head_dim

    @property
    def value_width(self) -> int:
        return self.value_heads * self.value_head_dim


def _identity_rows(seed: int, key: str, sub: design.Subspaces, rows: int, layer: int, rms: float) -> np.ndarray:
    """[rows, D] float64 reading token identity only, outputs of rms ~`rms` after decoder layer `layer`'s input RMSNorm."""
    return design.reader(design.rng_for(seed, key), sub, rows, 2 * layer, identity_only=True).astype(np.float64) * rms


def in_proj_qkvz(seed: int, key: str, sub: design.Subspaces, dims: LinearDims, layer: int) -> np.ndarray:
    """[2*Hk*dk + 2*Hv*dv, D] float32, rows grouped per key head: its q (dk), k (dk), then its r value heads' v, then their z.

    q and k read the whole hidden state (like attention's), v and z token identity only.
    """
    hidden = sub.family.shape[1]
    qk = 2 * dims.key_heads * dims.key_head_dim
    q_k = design.rng_for(seed, key + ".qk").standard_normal((qk, hidden)) * (QKV_RMS / np.sqrt(hidden))
    v = _identity_rows(seed, key + ".v", sub, dims.value_width, layer, QKV_RMS)
    z = _identity_rows(seed, key + ".z", sub, dims.value_width, layer, 1.0)
    q, k = q_k[: qk // 2], q_k[qk // 2:]
    dk, rv = dims.key_head_dim, dims.value_width // dims.key_heads
    groups = [np.concatenate([q[g * dk:(g + 1) * dk], k[g * dk:(g + 1) * dk], v[g * rv:(g + 1) * rv], z[g * rv:(g + 1) * rv]])
              for g in range(dims.key_heads)]
    return np.concatenate(groups).astype(np.float32)


def in_proj_ba(seed: int, key: str, sub: design.Subspaces, dims: LinearDims, layer: int) -> np.ndarray:
    """[2*Hv, D] float32, per key head: its r value heads' b rows, then their a rows (identity reads)."""
    b = _identity_rows(seed, key + ".b", sub, dims.value_heads, layer, BETA_RMS)
    a = _identity_rows(seed, key + ".a", sub, dims.value_heads, layer, DECAY_RMS)
    r = dims.value_heads // dims.key_heads
    return np.concatenate([np.concatenate([b[g * r:(g + 1) * r], a[g * r:(g + 1) * r]])
                           for g in range(dims.key_heads)]).astype(np.float32)


def conv_weight(seed: int, key: str, dims: LinearDims) -> np.ndarray:
    """[C, 1, K] float32 causal depthwise taps: mostly the current token, a little of the K-1 before it."""
    taps = design.rng_for(seed, key).standard_normal((dims.conv_channels, 1, dims.conv_kernel)) * CONV_PAST
    taps[..., -1] += CONV_SELF
    return taps.astype(np.float32)


def decay(seed: int, key: str, value_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(dt_bias [Hv], A_log [Hv]) float32: g = -exp(A_log) * softplus(a + dt_bias) is -1 / tau_h at a = 0,
    tau_h log-spaced over [TAU_MIN, TAU_MAX] and shuffled over the heads."""
    rng = design.rng_for(seed, key)
    tau = TAU_MIN * (TAU_MAX / TAU_MIN) ** (np.arange(value_heads) / max(1, value_heads - 1))
    tau = tau[rng.permutation(value_heads)]
    dt_bias = (rng.standard_normal(value_heads) * DT_BIAS_STD).astype(np.float32)
    a_log = -np.log(tau * np.logaddexp(0.0, dt_bias.astype(np.float64)))
    return dt_bias, a_log.astype(np.float32)
