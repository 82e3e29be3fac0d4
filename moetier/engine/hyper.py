"""Manifold-constrained hyper-connections (GLM-5.3): the residual stream as N streams, collapsed into each block.

Shapes: T tokens, N streams, D hidden. Before a block (attention or MLP) the
streams [T, N, D] give, through one small projection of their flattened,
RMS-normalised values, three sets of weights: `pre` [T, N] collapses them into
the block's input [T, D]; `post` [T, N] expands the block's output back into N
streams; `comb` [T, N, N], made doubly stochastic by Sinkhorn-Knopp, mixes the
input streams into the output ones:

    out = post (x) block(sum_n pre_n h_n) + comb^T h

The arithmetic is transformers' (Glm5NextTextHyperConnection), op for op; on
the CPU the weights after the projection are one native call (cpu_hyper.h,
within float32 rounding of `hyper_weights`, its torch reference).
After the last layer the streams' mean is the model's hidden state. `Residual`
is the plain residual (h + block(h)) behind the same interface, so the engine
runs one layer loop for both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.model.spec_hybrid import HyperConnections


@dataclass(frozen=True)
class HyperWeights:
    """One block's hyper-connection weights (float32)."""

    fn: torch.Tensor  # [(2 + N) N, N D]
    base: torch.Tensor  # [(2 + N) N]
    scale: torch.Tensor  # [3]: pre, post, comb


class Residual:
    """The plain residual stream h [T, D] behind the interface `Streams` has: a block's input is h, its output is added."""

    post = None

    def __init__(self, h: torch.Tensor):
        self.h = h

    def enter(self, w: None) -> torch.Tensor:
        return self.h

    def leave(self, y: torch.Tensor) -> None:
        self.h = self.h + y

    def late(self, y: torch.Tensor, post: None) -> None:
        self.h = self.h + y

    def to(self, device: torch.device) -> None:
        self.h = self.h.to(device)

    def hidden(self) -> torch.Tensor:
        return self.h


def hyper_weights(mix: torch.Tensor, w: HyperWeights, hyper: HyperConnections) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The streams' projection mix [T, (2 + N) N] -> pre, post [T, N] and comb [T, N, N], in torch ops (the
    reference of cpu_hyper.h, and the path on CUDA or without the native kernels)."""
    n, tokens, eps = hyper.streams, mix.shape[0], hyper.eps
    pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = w.base.split([n, n, n * n])
    pre_scale, post_scale, comb_scale = w.scale.unbind(0)
    pre = torch.sigmoid(pre_w * pre_scale + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * post_scale + post_b)
    comb = torch.softmax(comb_w.view(tokens, n, n) * comb_scale + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(hyper.sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class Streams:
    """The residual streams h [T, N, D] of one forward, with the weights of the block last entered."""

    def __init__(self, h: torch.Tensor, hyper: HyperConnections, rms_eps: float, kernel=None):
        self.h, self.hyper, self.rms_eps = h, hyper, rms_eps
        self.kernel = kernel  # the native kernels, for the weights of blocks whose streams are in host memory; or None
        self.post: torch.Tensor | None = None  # [T, N]
        self.comb: torch.Tensor | None = None  # [T, N, N]

    @classmethod
    def of(cls, x: torch.Tensor, hyper: HyperConnections, rms_eps: float, kernel=None) -> "Streams":
        """x [T, D] copied into every stream."""
        return cls(x[:, None, :].expand(-1, hyper.streams, -1).contiguous(), hyper, rms_eps, kernel)

    def enter(self, w: HyperWeights) -> torch.Tensor:
        """The block's input [T, D]; keeps its post and comb weights for `leave`."""
        n, (tokens, _, hidden) = self.hyper.streams, self.h.shape
        flat = self.h.reshape(tokens, n * hidden)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.rms_eps)
        mix = F.linear(flat, w.fn)  # [T, (2 + N) N]
        if self.kernel is not None and mix.is_cpu and mix.dtype == torch.float32:  # one call, not ~120 torch ops a token
            pre, self.post, self.comb = self.kernel.hyper_weights(mix.contiguous(), w.base, w.scale, n,
                                                                  self.hyper.sinkhorn_iters, self.hyper.eps)
        else:
            pre, self.post, self.comb = hyper_weights(mix, w, self.hyper)
        return (pre.unsqueeze(-1) * self.h).sum(dim=1)

    def leave(self, y: torch.Tensor) -> None:
        """Expand the block's output y [T, D] into the streams, mixed with them by the entered block's comb."""
        self.h = self.post.unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(self.comb.transpose(-1, -2), self.h)

    def late(self, y: torch.Tensor, post: torch.Tensor) -> None:
        """A block output's part that lands after the streams moved on (DEFER_CPU): expanded by that block's post."""
        self.h = self.h + post.unsqueeze(-1) * y.unsqueeze(-2)

    def to(self, device: torch.device) -> None:
        self.h = self.h.to(device)

    def hidden(self) -> torch.Tensor:
        """The model's hidden state [T, D]: the streams' mean."""
        return self.h.mean(dim=1)
