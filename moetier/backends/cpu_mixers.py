"""The native kernels' token mixers: Gated DeltaNet, KDA, hyper-connection weights (cpu_deltanet.h, cpu_hyper.h).

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


class MixerKernels:
    """deltanet_mix, kda_mix and hyper_weights over the host class's `library` and `pool`."""

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
