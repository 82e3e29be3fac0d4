"""Qwen3-Next's Gated DeltaNet token mixer: a linear-attention layer with an O(1) recurrent state, batch 1.

Shapes: T new tokens, C conv channels (q, k, v), K conv taps, Hk key heads of
dk dims, Hv value heads of dv dims (each key head serves r = Hv / Hk
consecutive value heads), D hidden.

One layer: x [T, D] -> one stored in-projection to q|k|v (the conv channels,
every key head's q, then k, then every value head's v), z [T, Hv * dv] (the
output gate) and b|a [T, Hk, 2, r] (interleaved per key head, as both file
formats store them) -> a causal depthwise convolution over q|k|v continuing
the layer's conv state, silu -> per-head L2-normalised q and k, q scaled by
dk^-1/2 -> the gated delta rule with beta = sigmoid(b), decay
g = -exp(A_log) * softplus(a + dt_bias):

    S <- S * exp(g);  S <- S + k (beta (v - S^T k))^T;  o = S^T q       (S [dk, dv] per value head)

-> RMSNorm(o) * silu(z) -> out-projection [T, D]. Decode (T = 1) runs that
recurrence (on the CPU, everything between the two projections in one native
job: cpu_deltanet.h's mixer, the decode step's own); prefill (T > 1) runs the chunked form transformers uses (chunks
of 64: the intra-chunk part by one triangular solve, the state carried
between chunks), which is the same function up to float32 rounding. The
arithmetic follows transformers' torch reference (modeling_qwen3_next:
torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule) op for op
where the order matters, so logits agree within float32 rounding; all state
is float32 and carried across calls (prefill in pieces equals one pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.engine.linear import StoredLinear
from moetier.model.spec_hybrid import LinearAttention

CHUNK = 64  # tokens per chunk of the prefill form (transformers' and FLA's default)
L2_EPS = 1e-6  # the q/k L2 normalisation's epsilon (transformers' l2norm)


@dataclass(frozen=True)
class DeltaNetWeights:
    """One linear-attention layer's weights as the engine holds them."""

    in_proj: StoredLinear  # D -> C + Hv*dv + 2*Hv: q|k|v, then z, then b|a (interleaved per key head)
    conv: torch.Tensor  # [C, K] depthwise causal taps
    dt_bias: torch.Tensor  # [Hv]
    decay_rate: torch.Tensor  # [Hv]: -exp(A_log), the rate softplus(a + dt_bias) scales into the log-decay g
    norm: torch.Tensor  # [dv] the gated RMSNorm's weight
    out_proj: StoredLinear  # Hv*dv -> D


class DeltaNetState:
    """One layer's recurrent state for one sequence: the conv inputs of the last K-1 tokens and S per value head."""

    def __init__(self, geometry: LinearAttention, device: torch.device):
        g = geometry
        self.conv = torch.zeros(g.conv_channels, g.conv_kernel - 1, device=device)  # [C, K-1]
        self.recurrent = torch.zeros(g.value_heads, g.key_dim, g.value_dim, device=device)  # [Hv, dk, dv]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] / sqrt(sum x^2 + eps), as transformers' l2norm computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def deltanet_layer(w: DeltaNetWeights, g: LinearAttention, x: torch.Tensor, state: DeltaNetState, eps: float,
                   kernel=None) -> torch.Tensor:
    """x [T, D] (normalised input) -> the layer's output [T, D]; `state` advances by T tokens. `kernel`: the native
    kernels (x on the CPU), which run a decoded token's mixer in one job (DecodeKernel.deltanet_mix)."""
    new = x.shape[0]
    channels, width, heads = g.conv_channels, g.value_width, g.value_heads
    projected = w.in_proj(x)  # [T, C + Hv*dv + 2Hv]
    if new == 1 and kernel is not None and g.value_dim <= 512 and state.conv.is_contiguous() and state.recurrent.is_contiguous():
        # everything between the two projections in one native job (the decode step's mixer)
        mixed = kernel.deltanet_mix(projected[0].contiguous(), state.conv, state.recurrent, w.conv, w.dt_bias,
                                    w.decay_rate, w.norm, g.key_heads, eps)
        return w.out_proj(mixed[None])  # [1, D]
    mixed, z, ba = projected.split([channels, width, 2 * heads], dim=-1)
    ba = ba.reshape(new, g.key_heads, 2, heads // g.key_heads)  # [T, Hk, 2, r]
    b, a = ba[:, :, 0].reshape(new, heads), ba[:, :, 1].reshape(new, heads)  # [T, Hv] each

    # causal depthwise convolution continuing the state: the K-1 earlier inputs, then these
    window = torch.cat([state.conv, mixed.t()], dim=1)  # [C, K-1+T]
    state.conv = window[:, window.shape[1] - (g.conv_kernel - 1) :].clone()
    conv = F.silu(F.conv1d(window[None], w.conv[:, None, :], groups=channels)[0])  # [C, T]
    conv = conv.t()  # [T, C]
    key_width = g.key_heads * g.key_dim
    q = conv[:, :key_width].reshape(new, g.key_heads, g.key_dim)
    k = conv[:, key_width : 2 * key_width].reshape(new, g.key_heads, g.key_dim)
    v = conv[:, 2 * key_width :].reshape(new, heads, g.value_dim)

    beta = b.sigmoid()  # [T, Hv]
    decay = w.decay_rate * F.softplus(a + w.dt_bias)  # [T, Hv], <= 0
    repeat = heads // g.key_heads
    if repeat > 1:  # each key head serves r consecutive value heads
        q, k = q.repeat_interleave(repeat, dim=1), k.repeat_interleave(repeat, dim=1)  # [T, Hv, dk]
    # [Hv, T, ...] from here on
    q, k, v = l2norm(q.transpose(0, 1)), l2norm(k.transpose(0, 1)), v.transpose(0, 1).contiguous()
    q = q * g.key_dim**-0.5
    beta, decay = beta.t().contiguous(), decay.t().contiguous()  # [Hv, T]
    if new == 1:
        out = _recurrent_step(q, k, v, decay, beta, state)
    else:
        out = _chunked(q, k, v, decay, beta, state)  # [Hv, T, dv]
    out = out.transpose(0, 1).reshape(new * heads, g.value_dim)  # [T*Hv, dv]
    out = F.rms_norm(out, (g.value_dim,), w.norm, eps) * F.silu(z.reshape(new * heads, g.value_dim))
    return w.out_proj(out.reshape(new, width))  # [T, D]


def _recurrent_step(q, k, v, decay, beta, state: DeltaNetState) -> torch.Tensor:
    """One token: q, k [Hv, 1, dk], v [Hv, 1, dv], decay, beta [Hv, 1] -> o [Hv, 1, dv]; S updated in place."""
    s = state.recurrent  # [Hv, dk, dv]
    s.mul_(decay.exp()[:, :, None])
    k_t = k[:, 0]  # [Hv, dk]
    remembered = (s * k_t[:, :, None]).sum(dim=1)  # [Hv, dv]: S^T k
    delta = (v[:, 0] - remembered) * beta  # [Hv, dv]
    s.add_(k_t[:, :, None] * delta[:, None, :])
    return (s * q[:, 0, :, None]).sum(dim=1)[:, None]  # [Hv, 1, dv]


def _chunked(q, k, v, decay, beta, state: DeltaNetState) -> torch.Tensor:
    """T tokens in chunks of CHUNK: q, k [Hv, T, dk], v [Hv, T, dv], decay, beta [Hv, T] -> o [Hv, T, dv]."""
    heads, new, dv = v.shape
    pad = (CHUNK - new % CHUNK) % CHUNK
    q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
    beta, decay = F.pad(beta, (0, pad)), F.pad(decay, (0, pad))
    chunks = (new + pad) // CHUNK
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (t.reshape(heads, chunks, CHUNK, t.shape[-1]) for t in (q, k, k_beta, v_beta))
    decay = decay.reshape(heads, chunks, CHUNK).cumsum(dim=-1)  # [Hv, n, c]: log of the decay since the chunk began
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, n, c, c]
    system = (k_beta @ k.transpose(-1, -2)) * pairwise  # unit lower-triangular system of the intra-chunk updates
    intra = (q @ k.transpose(-1, -2)) * pairwise
    decayed_k_beta = k_beta * decay.exp()[..., None]
    new_values = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [Hv, n, c, dv]
    k_cumdecay = torch.linalg.solve_triangular(system, decayed_k_beta, upper=False, unitriangular=True)  # [Hv, n, c, dk]
    s = state.recurrent  # [Hv, dk, dv]
    out = torch.zeros_like(new_values)
    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [Hv, n, 1, 1]
    for i in range(chunks):
        v_new = new_values[:, i] - k_cumdecay[:, i] @ s  # [Hv, c, dv]
        out[:, i] = q[:, i] @ s + intra[:, i] @ v_new
        s = s * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    state.recurrent = s
    return out.reshape(heads, chunks * CHUNK, dv)[:, :new]
