"""The native kernels' token mixers and their trunk neighbours: Gated DeltaNet, KDA, hyper-connection weights
(cpu_deltanet.h, cpu_hyper.h), and prefill's attention, RMSNorm and rotary (cpu_step.h, cpu_kernels.c).

`MixerKernels` is a mixin of `DecodeKernel` (cpu_kernels.py): its methods run
on the host class's `library` (the loaded ctypes library, its functions
declared there) and `pool` (the native thread pool, by its `handle`), and hold
no state of their own. Every argument is checked here, each refusal one
ValueError line naming the method and the argument; the C validates nothing.
Numerics are the C's: these wrappers only check, allocate the outputs and call.
"""

from __future__ import annotations

import torch

from moetier.backends.cpu_status import status_error


def float_input(what: str, x: torch.Tensor) -> torch.Tensor:
    """x as float32 [T, n] contiguous in host memory, or ValueError."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise ValueError(f"{what}: x must be float32 [T, n] in host memory, got {x.dtype} {list(x.shape)} on {x.device}")
    return x.contiguous()


class MixerKernels:
    """deltanet_mix, kda_mix, hyper_weights, attention, rms_norm and rotary over the host class's `library` and
    `pool`."""

    def deltanet_mix(self, projected: torch.Tensor, conv_state: torch.Tensor, state: torch.Tensor, conv: torch.Tensor,
                     dt_bias: torch.Tensor, decay_rate: torch.Tensor, norm: torch.Tensor, key_heads: int, eps: float) -> torch.Tensor:
        """One token of a Gated DeltaNet layer between its two projections (cpu_deltanet.h's mixer, the decode step's
        own): projected [C + Hv dv + 2 Hv] (q|k|v, z, b|a; its first C values overwritten), conv_state [C, K-1] and
        state [Hv, dk, dv] updated in place, conv [C, K], dt_bias and decay_rate [Hv], norm [dv] -> [Hv dv]. float32,
        contiguous, in host memory. Bad arguments: ValueError, one line."""
        heads, dk, dv = state.shape if state.dim() == 3 else (0, 0, 0)
        channels, taps = conv.shape if conv.dim() == 2 else (0, 0)
        shapes = {"projected": (projected, (channels + heads * dv + 2 * heads,)), "conv_state": (conv_state, (channels, taps - 1)),
                  "state": (state, (heads, dk, dv)), "conv": (conv, (channels, taps)), "dt_bias": (dt_bias, (heads,)),
                  "decay_rate": (decay_rate, (heads,)), "norm": (norm, (dv,))}
        for name, (t, shape) in shapes.items():
            if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"deltanet_mix: {name} must be float32 {list(shape)} contiguous in host memory, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
        if not (key_heads > 0 and heads % key_heads == 0 and channels == 2 * key_heads * dk + heads * dv and 0 < dv <= 512 and taps >= 1):
            raise ValueError(f"deltanet_mix: {key_heads} key heads, state {list(state.shape)}, conv {list(conv.shape)} "
                             "(expected value heads a multiple of key heads, C = 2 Hk dk + Hv dv, dv <= 512)")
        out = torch.empty(heads * dv)
        status_error("deltanet_mix", self.library.moe_deltanet_mix(
            self.pool.handle, projected.data_ptr(), conv_state.data_ptr(), state.data_ptr(), conv.data_ptr(),
            dt_bias.data_ptr(), decay_rate.data_ptr(), norm.data_ptr(), key_heads, heads, dk, dv, taps, float(eps),
            out.data_ptr()))
        return out

    def kda_mix(self, mixed: torch.Tensor, b: torch.Tensor, forget: torch.Tensor, gate: torch.Tensor,
                conv_state: torch.Tensor, state: torch.Tensor, conv: torch.Tensor, dt_bias: torch.Tensor,
                decay_rate: torch.Tensor, norm: torch.Tensor, lower_bound: float | None, eps: float) -> torch.Tensor:
        """T tokens of a KDA layer between its projections, in order (cpu_deltanet.h's kda_mix: the recurrence, a
        granule per head): mixed [T, 3 H d] (q|k|v, overwritten), b [T, H], forget and gate [T, H d] (the gates'
        up-projections), conv_state [3 H d, K-1] and state [H, d, d] updated in place, conv [3 H d, K], dt_bias
        [H d], decay_rate [H] (exp(A_log)), norm [d] -> [T, H d]. float32, contiguous, in host memory. Bad
        arguments: ValueError, one line."""
        heads, d = (state.shape[0], state.shape[1]) if state.dim() == 3 else (0, 0)
        taps = conv.shape[1] if conv.dim() == 2 else 0
        width, tokens = heads * d, mixed.shape[0] if mixed.dim() == 2 else -1
        shapes = {"mixed": (mixed, (tokens, 3 * width)), "b": (b, (tokens, heads)), "forget": (forget, (tokens, width)),
                  "gate": (gate, (tokens, width)), "conv_state": (conv_state, (3 * width, taps - 1)),
                  "state": (state, (heads, d, d)), "conv": (conv, (3 * width, taps)), "dt_bias": (dt_bias, (width,)),
                  "decay_rate": (decay_rate, (heads,)), "norm": (norm, (d,))}
        for name, (t, shape) in shapes.items():
            if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"kda_mix: {name} must be float32 {list(shape)} contiguous in host memory, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
        if not (heads > 0 and 0 < d <= 512 and taps >= 1 and tokens >= 1):
            raise ValueError(f"kda_mix: state {list(state.shape)}, conv {list(conv.shape)}, {tokens} tokens (expected "
                             "heads >= 1, 0 < d <= 512, at least one tap and one token)")
        out = torch.empty(tokens, width)
        status_error("kda_mix", self.library.moe_kda_mix(
            self.pool.handle, mixed.data_ptr(), b.data_ptr(), forget.data_ptr(), gate.data_ptr(), conv_state.data_ptr(),
            state.data_ptr(), conv.data_ptr(), dt_bias.data_ptr(), decay_rate.data_ptr(), norm.data_ptr(), heads, d, taps,
            float("nan") if lower_bound is None else float(lower_bound), float(eps), tokens, out.data_ptr()))
        return out

    def hyper_weights(self, mix: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: int, iters: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """GLM-5.3's hyper-connection weights (cpu_hyper.h): mix [T, (2 + n) n] (the streams' projection), base
        [(2 + n) n], scale [3] -> pre, post [T, n] and comb [T, n, n]; float32, contiguous, in host memory.
        Bad arguments: ValueError, one line."""
        n = int(streams)
        for name, t, shape in (("mix", mix, (mix.shape[0] if mix.dim() == 2 else -1, (2 + n) * n)),
                               ("base", base, ((2 + n) * n,)), ("scale", scale, (3,))):
            if tuple(t.shape) != shape or t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"hyper_weights: {name} must be float32 {list(shape)} contiguous in host memory, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
        if n < 1 or iters < 1:
            raise ValueError(f"hyper_weights: {n} streams, {iters} Sinkhorn rounds (expected at least 1 of each)")
        tokens = mix.shape[0]
        pre, post, comb = torch.empty(tokens, n), torch.empty(tokens, n), torch.empty(tokens, n, n)
        self.library.moe_hyper_weights(mix.data_ptr(), base.data_ptr(), scale.data_ptr(), tokens, n, int(iters),
                                       float(eps), pre.data_ptr(), post.data_ptr(), comb.data_ptr())
        return pre, post, comb

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """y [T, n] float32 = x / rms(x) * weight, row by row on every pool thread (prefill's RMSNorm: torch's
        F.rms_norm runs on one thread here and is ~10x slower). x: float32 [T, n] in host memory (made contiguous);
        weight: float32 [n] or None. The same values as F.rms_norm to float32 rounding. Bad arguments: ValueError."""
        x = float_input("rms_norm", x)
        tokens, n = x.shape
        if n < 1 or eps < 0 or eps != eps:
            raise ValueError(f"rms_norm: x must have at least one column and eps be >= 0, got {list(x.shape)}, eps {eps}")
        if weight is not None:
            if weight.dtype != torch.float32 or weight.device.type != "cpu" or tuple(weight.shape) != (n,):
                raise ValueError(f"rms_norm: weight must be float32 [{n}] in host memory, got {weight.dtype} "
                                 f"{list(weight.shape)} on {weight.device}")
            weight = weight.contiguous()
        y = torch.empty(tokens, n)
        if tokens:
            status_error("rms_norm", self.library.moe_rms_norm(self.pool.handle, x.data_ptr(),
                                                                weight.data_ptr() if weight is not None else None,
                                                                tokens, n, float(eps), y.data_ptr()))
        return y

    def rotary(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """out [heads, T, d] float32: x [T, heads, d] with the first rd dims of each head rotated by the table rows
        cos, sin [T, rd] (HF's x * cos + rotate_half(x) * sin), the rest copied: prefill's rotary and the heads'
        transpose in one pass on every pool thread. x: float32 in host memory whose last two dims are contiguous
        (a slice of the token's projections serves). The same values as RotaryTable.apply to float32 rounding.
        Bad arguments: ValueError, one line."""
        if (x.dim() != 3 or x.dtype != torch.float32 or x.device.type != "cpu" or x.stride(2) != 1
                or x.stride(1) != x.shape[2] or x.stride(0) < x.shape[1] * x.shape[2]):
            raise ValueError(f"rotary: x must be float32 [T, heads, d] in host memory with contiguous heads, got "
                             f"{x.dtype} {list(x.shape)} strides {list(x.stride())} on {x.device}")
        tokens, heads, d = x.shape
        rd = cos.shape[-1] if cos.dim() == 2 else -1
        for name, t in (("cos", cos), ("sin", sin)):
            if (t.dtype != torch.float32 or t.device.type != "cpu" or not t.is_contiguous() or t.dim() != 2
                    or tuple(t.shape) != (tokens, rd)):
                raise ValueError(f"rotary: {name} must be float32 [{tokens}, rd] contiguous in host memory, got "
                                 f"{t.dtype} {list(t.shape)} on {t.device}")
        if rd < 0 or rd > d or rd % 2:
            raise ValueError(f"rotary: the rotated width {rd} must be even and at most the head dim {d}")
        out = torch.empty(heads, tokens, d)
        if out.numel():
            status_error("rotary", self.library.moe_rotary(self.pool.handle, x.data_ptr(), x.stride(0), heads, tokens, d,
                                                            cos.data_ptr(), sin.data_ptr(), rd, out.data_ptr()))
        return out

    def attention(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int, window: int | None) -> torch.Tensor:
        """out [T, H d] = softmax(q k^T / sqrt(d)) v for q [H, T, d] at positions start.. (causal; the last `window`
        keys of each query when window is given) over the KV buffers keys / values [G, capacity, d] (positions below
        start + T written), GQA heads (H a multiple of G); float32, contiguous, in host memory, on every pool thread
        (a granule per head and 16 queries). Bad arguments: ValueError, one line."""
        heads, tokens, d = q.shape if q.dim() == 3 else (0, 0, 0)
        if heads == 0 or keys.dim() != 3 or keys.shape != values.shape or keys.shape[2] != d or heads % keys.shape[0]:
            raise ValueError(f"attention: q [H, T, d] and caches [G, capacity, d] with G dividing H, got {list(q.shape)}, "
                             f"{list(keys.shape)}, {list(values.shape)}")
        groups, capacity = keys.shape[0], keys.shape[1]
        if start < 0 or start + tokens > capacity or (window is not None and window < 1):
            raise ValueError(f"attention: positions {start}..{start + tokens - 1} outside a cache of {capacity}, or window {window}")
        for name, t in (("q", q), ("keys", keys), ("values", values)):
            if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous():
                raise ValueError(f"attention: {name} must be float32 contiguous in host memory, got {t.dtype} on {t.device}")
        out = torch.empty(tokens, heads * d)
        if out.numel():
            status_error("attention", self.library.moe_attention(self.pool.handle, q.data_ptr(), keys.data_ptr(), values.data_ptr(),
                                                                  capacity, heads, groups, d, tokens, start, window or 0, out.data_ptr()))
        return out
