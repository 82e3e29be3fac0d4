"""The router: from gate logits to each token's k experts and their weights.

softmax routers (Qwen3-MoE, Mixtral): probabilities over all experts, top-k,
optional renormalisation over the k. sigmoid routers (GLM-4 MoE, DeepSeek-V3):
scores = sigmoid(logits); selection uses score + e_score_correction_bias,
limited to the top `topk_group` groups (a group's score = its two best);
weights are the unbiased scores of the picks, renormalised and scaled by
routed_scaling_factor. `route` is exactly the reference's arithmetic, so
routing with no extra bias reproduces it bit for bit. `route_gate` also
applies the gate; for one token in host memory it makes the whole decision in
one call of the native kernel (the same arithmetic, float32, the gate's dot
products summed in another order) instead of about six torch ops.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from moetier.backends import cpu_kernels
from moetier.model.spec import ModelSpec


class Route(NamedTuple):  # a tuple: one per MoE layer per forward, on the hot path
    logits: torch.Tensor  # [T, E] raw gate logits
    probs: torch.Tensor  # [T, E] softmax probabilities, or sigmoid scores for sigmoid routers
    picks: torch.Tensor  # [T, k] int64 expert ids
    weights: torch.Tensor  # [T, k] float32 gate weights applied to each pick


def _nudge(bias: torch.Tensor | None, affinity: torch.Tensor | None) -> torch.Tensor | None:
    """What moves the selection scores: bias + affinity [E], either alone, or None."""
    return bias if affinity is None else (affinity if bias is None else bias + affinity)


def route_gate(
    spec: ModelSpec,
    x: torch.Tensor,
    gate: torch.Tensor,
    correction_bias: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    affinity: torch.Tensor | None = None,
    damped: bool = False,
) -> Route:
    """x [T, D], gate [E, D] -> route(spec, x @ gate.T, ...), natively for one undamped token on the CPU."""
    if x.shape[0] == 1 and not damped and _host_f32(x) and _host_f32(gate) and spec.n_group <= 64:
        kernel = cpu_kernels.decode_kernel()
        nudge = _nudge(bias, affinity)
        if kernel is not None and (correction_bias is None or _host_f32(correction_bias)) and (nudge is None or _host_f32(nudge)):
            return Route(*kernel.route(spec, gate, x, correction_bias, nudge))
    return route(spec, F.linear(x, gate), correction_bias, bias, affinity, damped)


def _host_f32(t: torch.Tensor) -> bool:
    """float32, contiguous, in host memory: what the native router reads in place."""
    return t.dtype is torch.float32 and t.is_cpu and t.is_contiguous()


def route(
    spec: ModelSpec,
    logits: torch.Tensor,
    correction_bias: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    affinity: torch.Tensor | None = None,
    damped: bool = False,
) -> Route:
    """logits [T, E] -> Route.

    correction_bias [E]: the checkpoint's e_score_correction_bias (sigmoid routers).
    bias [E]: moetier's router bias (profile table), added to the selection score: to the
    logits of softmax routers, to the probabilities of sigmoid routers; -inf never picks.
    affinity [E]: lambda on experts resident now, 0 elsewhere; added like `bias`.
    damped: the weights come from the biased scores too (else from the unbiased router).
    With bias and affinity None this is exactly the reference router.
    """
    nudge = _nudge(bias, affinity)
    if spec.router == "softmax":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)  # [T, E]
        if nudge is None:
            weights, picks = torch.topk(probs, spec.top_k, dim=-1)  # [T, k]
        else:
            picks = torch.topk(logits + nudge, spec.top_k, dim=-1)[1]  # [T, k]
            source = torch.softmax(logits + nudge, dim=-1, dtype=torch.float32) if damped else probs
            weights = source.gather(1, picks)
        if spec.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return Route(logits, probs, picks, weights)

    scores = logits.sigmoid()  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias  # [T, E]
    if nudge is not None:
        choice = choice + nudge
    if spec.n_group > 1 and spec.topk_group < spec.n_group:
        tokens = choice.shape[0]
        grouped = choice.view(tokens, spec.n_group, -1)  # [T, n_group, E/n_group]
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)  # [T, n_group]
        keep = torch.topk(group_scores, spec.topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
        choice = grouped.masked_fill(~group_mask[..., None], float("-inf")).view(tokens, -1)
    picks = torch.topk(choice, spec.top_k, dim=-1, sorted=False)[1]  # [T, k]
    source = (scores + nudge).clamp_min(0.0) if damped and nudge is not None else scores
    weights = source.gather(1, picks)  # [T, k]
    if spec.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Route(logits, scores, picks, weights * spec.routed_scaling_factor)
