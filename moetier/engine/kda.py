"""GLM-5.3's Kimi Delta Attention (KDA): a linear-attention layer whose state decays per key channel, batch 1.

Shapes: T new tokens, H heads of d dims (keys and values alike), C = 3 H d conv
channels (q, k, v), K conv taps, D hidden.

One layer: x [T, D] -> q, k, v [T, H d] and, from the same x, beta's logits
[T, H], the forget gate's and the output gate's rank-d bottlenecks [T, d] (one
stored projection for all six) -> a causal depthwise convolution over q|k|v
continuing the conv state, silu -> per-head L2 normalisation of q and k (x /
sqrt(sum x^2 + eps), as transformers' KDA computes it), q scaled by d^-1/2 ->
the delta rule with beta = sigmoid(b) and a decay per key channel,
g = lower_bound * sigmoid(exp(A_log) (f + dt_bias)) (or -exp(A_log)
softplus(f + dt_bias) without a bound):

    S <- diag(exp(g)) S;  S <- S + k (beta (v - S^T k))^T;  o = S^T q        (S [d, d] per head)

-> RMSNorm(o) * sigmoid(gate) -> out-projection [T, D]. With the native
kernels (the CPU) every token, prefill too, runs the recurrence in one job
between the projections (cpu_deltanet.h: a head's d x d state stays in L1, so
T tokens cost T small passes; 2.4x faster than the chunked form at 256 tokens
here). Without them decode runs the recurrence in torch ops and prefill the
chunked form transformers' torch reference uses (chunk_kimi_delta_attention:
chunks of 64, the intra-chunk system solved by forward substitution, then the
chunks in turn), with each pair's sum over the channels as a matrix-vector
product. All are the same sums in other orders, within float32 rounding
(tests: logits within 1e-4 of transformers; the native prefill against the
chunked form).
State (moetier.engine.deltanet.DeltaNetState) is float32 and carried across calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.engine.deltanet import DeltaNetState
from moetier.engine.layers import torch_threads
from moetier.engine.linear import StoredLinear
from moetier.model.spec_hybrid import LinearAttention

L2_EPS = 1e-6
# Prefill's chunk: transformers' 64. The chunked form is the same sum for any size and 32 costs less (its
# per-channel decays make every chunk a [c, c, d] tensor per head: the 256-token prefill of synthetic GLM-5.3
# `medium` ran 433 tok/s at 32, 253 at 64), but at 32 the narrow peer case's Q8_0 argmaxes agreed with
# llama.cpp's on 97.7% of positions instead of 99%+ (a quantized model amplifies the last bit): 64 is kept.
# Chunks go in groups of CHUNK_GROUP (256 tokens): what one group holds bounds a long prompt's memory.
CHUNK, CHUNK_GROUP = 64, 4


@dataclass(frozen=True)
class KdaWeights:
    """One KDA layer's weights as the engine holds them."""

    in_proj: StoredLinear  # D -> 3Hd + H + 2d: q|k|v, beta's logits, the forget gate's f_a, the output gate's g_a
    forget_up: StoredLinear  # d -> Hd (f_b_proj)
    gate_up: StoredLinear  # d -> Hd (g_b_proj)
    conv: torch.Tensor  # [3Hd, K] depthwise causal taps of q, k, v
    dt_bias: torch.Tensor  # [Hd]
    decay_rate: torch.Tensor  # [H]: exp(A_log)
    norm: torch.Tensor  # [d] the gated RMSNorm's weight
    out_proj: StoredLinear  # Hd -> D


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] / sqrt(sum x^2 + eps): KDA's normalisation (a sqrt and a division, unlike Gated DeltaNet's rsqrt)."""
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def kda_layer(w: KdaWeights, g: LinearAttention, x: torch.Tensor, state: DeltaNetState, eps: float,
              kernel=None) -> torch.Tensor:
    """x [T, D] (normalised input) -> the layer's output [T, D]; `state` advances by T tokens. `kernel`: the native
    kernels (x on the CPU), which run a decoded token's mixer in one job (DecodeKernel.kda_mix)."""
    new, heads, d = x.shape[0], g.key_heads, g.key_dim
    width = heads * d
    mixed, b, f, gate = w.in_proj(x).split([3 * width, heads, d, d], dim=-1)
    if kernel is not None and d <= 512 and state.conv.is_contiguous() and state.recurrent.is_contiguous():
        # everything between the projections but the gates' own (stored) up-projections, in one native job: the
        # recurrence token by token (a head's d x d state stays in L1; prefill of synthetic GLM-5.3 `medium`'s 12
        # KDA layers, 256 tokens: ~600 ms chunked in torch)
        out = kernel.kda_mix(mixed.contiguous(), b.contiguous(), w.forget_up(f).contiguous(), w.gate_up(gate).contiguous(),
                             state.conv, state.recurrent, w.conv, w.dt_bias, w.decay_rate, w.norm, g.lower_bound, eps)
        return w.out_proj(out)  # [T, D]

    window = torch.cat([state.conv, mixed.t()], dim=1)  # [C, K-1+T]
    state.conv = window[:, window.shape[1] - (g.conv_kernel - 1) :].clone()
    if new == 1:  # one token: each channel's taps times its window (a grouped conv1d costs tens of microseconds)
        conv = F.silu((window * w.conv).sum(dim=-1))[None]  # [1, C]
    else:
        conv = F.silu(F.conv1d(window[None], w.conv[:, None, :], groups=3 * width)[0]).t()  # [T, C]
    q, k, v = (t.reshape(new, heads, d) for t in conv.split(width, dim=-1))

    forget = (w.forget_up(f) + w.dt_bias).view(new, heads, d)  # [T, H, d]
    rate = w.decay_rate[None, :, None]
    if g.lower_bound is not None:  # the safe gate: bounded below by lower_bound
        decay = g.lower_bound * torch.sigmoid(rate * forget)
    else:
        decay = -rate * torch.where(forget > 20.0, forget, torch.log(1.0 + torch.exp(forget)))
    beta = torch.sigmoid(b)  # [T, H]

    q, k = l2norm(q), l2norm(k)
    if new == 1:
        out = _recurrent_step(q[0] * d**-0.5, k[0], v[0], decay[0], beta[0], state)[None]  # [1, H, d]
    else:  # the chunks' big elementwise tensors on every pool thread (the forward holds torch to one)
        with torch_threads(kernel.threads if kernel is not None else None):
            out = _chunked(q, k, v, decay, beta, state)  # [T, H, d]
    gate = w.gate_up(gate).view(new * heads, d)
    out = F.rms_norm(out.reshape(new * heads, d), (d,), w.norm, eps) * torch.sigmoid(gate)
    return w.out_proj(out.reshape(new, width))


def _recurrent_step(q, k, v, decay, beta, state: DeltaNetState) -> torch.Tensor:
    """One token: q (scaled), k, v, decay [H, d], beta [H] -> o [H, d]; S [H, d, d] updated."""
    s = state.recurrent * decay.exp()[..., None]
    remembered = (s * k[..., None]).sum(dim=-2)  # [H, d]: S^T k
    delta = (v - remembered) * beta[:, None]
    s = s + k.unsqueeze(-1) * delta.unsqueeze(-2)
    state.recurrent = s
    return (s * q.unsqueeze(-1)).sum(dim=-2)


def _chunked(q, k, v, decay, beta, state: DeltaNetState) -> torch.Tensor:
    """T tokens in chunks of CHUNK: q, k, v, decay [T, H, d], beta [T, H] -> o [T, H, d] (transformers' steps)."""
    new, heads, d = k.shape
    q, k, v, decay = (t.transpose(0, 1).contiguous() for t in (q, k, v, decay))  # [H, T, d]
    beta = beta.t().contiguous()  # [H, T]
    pad = (CHUNK - new % CHUNK) % CHUNK
    q = F.pad(q, (0, 0, 0, pad)) * d**-0.5
    k, v, decay = (F.pad(t, (0, 0, 0, pad)) for t in (k, v, decay))
    beta = F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, v, decay, k_beta, v_beta = (t.reshape(heads, -1, CHUNK, d) for t in (q, k, v, decay, k_beta, v_beta))
    decay = decay.cumsum(dim=-2)  # [H, n, c, d]
    diagonal = torch.triu(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), diagonal=0)
    upper = torch.triu(torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device), diagonal=1)
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    s = state.recurrent  # [H, d, d]
    out = torch.empty_like(v)
    for first in range(0, q.shape[1], CHUNK_GROUP):
        group = slice(first, first + CHUNK_GROUP)
        q_g, k_g, kb_g, vb_g, g_g = q[:, group], k[:, group], k_beta[:, group], v_beta[:, group], decay[:, group]
        # k_j exp(g_i - g_j) per channel, zero above the diagonal: [H, G, c, c, d]; each pair's sum over the
        # channels is then a matrix-vector product (no [c, c, d] product of three tensors)
        decays = (g_g.unsqueeze(-2) - g_g.unsqueeze(-3)).masked_fill_(upper[..., None], float("-inf")).exp_()
        decays.mul_(k_g.unsqueeze(-3))
        system = -torch.matmul(decays, kb_g.unsqueeze(-1)).squeeze(-1).masked_fill(diagonal, 0)  # [H, G, c, c]
        intra = torch.matmul(decays, q_g.unsqueeze(-1)).squeeze(-1).masked_fill(upper, 0)
        del decays
        for i in range(1, CHUNK):  # forward substitution, as transformers' reference runs it
            row = system[..., i, :i].clone()
            sub = system[..., :i, :i].clone()
            system[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
        system = system + eye
        values = system @ vb_g
        k_cumdecay = system @ (kb_g * g_g.exp())
        for i in range(q_g.shape[1]):
            q_i, k_i, v_i, g_i = q_g[:, i], k_g[:, i], values[:, i], g_g[:, i]
            v_new = v_i - k_cumdecay[:, i] @ s
            out[:, first + i] = (q_i * g_i.exp()) @ s + intra[:, i] @ v_new
            s = s * g_i[:, -1].exp().unsqueeze(-1) + (k_i * (g_i[:, -1:] - g_i).exp()).transpose(-1, -2) @ v_new
    state.recurrent = s
    return out.reshape(heads, -1, d)[:, :new].transpose(0, 1)
