"""GLM-5.3's latent attention (NoPE MLA) over the positions its DSA indexer picks, batch 1.

Shapes: T new tokens at positions start.., P = start + T positions so far, H
heads, q_rank / kv_rank the bottlenecks, dn the key dims and dv the value dims
of a head, Hi indexer heads of di dims, pools of `pool` positions.

One layer: x [T, D] -> (one stored projection) q's bottleneck, the kv latent,
the indexer's key, head weights and pool-gate logits. q = q_b(RMSNorm(q_a x))
[H, T, dn]; the latent RMSNorm(kv_a x) [T, kv_rank] is what the cache keeps;
keys and values are expanded per head from every cached latent by kv_b (a
forward of a few tokens -- decode -- instead folds kv_b into q and into the
output: q kv_b_k . latent scores, and kv_b_v of the weighted latents, the same
products in another order, O(P kv_rank H) rather than O(P kv_rank H (dn + dv));
kv_b is held once as float32 for it). The
indexer scores the complete pools of the cache: a pool's key is the softmax
(gate logits + a learned per-slot bias) weighted sum of its positions' indexer
keys (LayerNorm(wk x)); a query's score of a pool is sum over heads of
w_h relu(q_h . key / sqrt(di)) (q_h from q's bottleneck, w_h = weights_proj x /
sqrt(Hi)); the query attends, causally, to the positions of its topk / pool
best visible pools and of the incomplete last pool (when `select_tail`). A
"shared" layer reuses the previous layer's selection. Attention is softmax
over the selected positions, scaled by dn^-1/2, then o_proj.

Everything follows transformers' Glm5NextTextAttention / Glm5NextTextIndexer
op for op (the selection is torch.topk over the same scores, so ties break the
same way: on the CPU, whatever the engine's device); the cache (`LatentState`) holds each position's latent and indexer
key and gate logits, grown as it fills.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moetier.engine.linear import StoredLinear
from moetier.model.spec import ModelSpec

INDEX_NORM_EPS = 1e-6  # the indexer key's LayerNorm
ABSORB_MAX = 16  # forwards of up to this many tokens attend in the latent space instead of expanding every position


@dataclass(frozen=True)
class IndexerWeights:
    q_up: StoredLinear  # q_rank -> Hi di (wq_b)
    k_norm: tuple[torch.Tensor, torch.Tensor]  # LayerNorm weight, bias [di]
    pool_bias: torch.Tensor  # [pool, di] index_kpool_compress_ape


@dataclass(frozen=True)
class LatentWeights:
    """One latent-attention layer's weights."""

    in_proj: StoredLinear  # D -> q_rank + kv_rank (+ di + Hi + di with an indexer): q_a, kv_a, wk, weights_proj, pool gate
    q_norm: torch.Tensor  # [q_rank]
    q_up: StoredLinear  # q_rank -> H dn
    kv_norm: torch.Tensor  # [kv_rank]
    kv_up: StoredLinear  # kv_rank -> H (dn + dv)
    kv_weight: torch.Tensor  # [H, dn + dv, kv_rank] float32: kv_up's matrix, for the absorbed form of short forwards
    out_proj: StoredLinear  # H dv -> D
    indexer: IndexerWeights | None  # None: a layer that reuses the previous layer's selection


class LatentState:
    """One latent-attention layer's cache for one sequence: per position the kv latent and the indexer's key and
    pool-gate logits, in buffers whose capacity doubles as they fill."""

    def __init__(self, spec: ModelSpec, device: torch.device, capacity: int = 256):
        self.latents = torch.empty(capacity, spec.latent_attention.kv_rank, device=device)  # [capacity, kv_rank]
        self.index = torch.empty(capacity, 2 * spec.indexer.head_dim, device=device)  # [capacity, key | gate logits]

    def reserve(self, end: int) -> None:
        """Room for positions < end (the buffers replaced, their rows kept, when they are too short)."""
        if end > self.latents.shape[0]:
            capacity = max(end, 2 * self.latents.shape[0])
            for name in ("latents", "index"):
                old = getattr(self, name)
                grown = old.new_empty(capacity, old.shape[1])
                grown[: old.shape[0]] = old
                setattr(self, name, grown)

    def append(self, latents: torch.Tensor, index: torch.Tensor | None, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store rows at start..start+T; -> every latent and index row so far ([P, kv_rank], [P, 2 di])."""
        end = start + latents.shape[0]
        self.reserve(end)
        self.latents[start:end] = latents
        if index is not None:
            self.index[start:end] = index
        return self.latents[:end], self.index[:end]


def latent_layer(w: LatentWeights, spec: ModelSpec, x: torch.Tensor, state: LatentState, start: int,
                 selection: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D] (normalised input) -> (output [T, D], the selection [T, P] bool it attended with); `selection` is
    the previous layer's, which a shared layer reuses."""
    mla, index, heads = spec.latent_attention, spec.indexer, spec.num_heads
    eps, new = spec.rms_norm_eps, x.shape[0]
    sizes = [mla.q_rank, mla.kv_rank] + ([index.head_dim, index.heads, index.head_dim] if w.indexer else [])
    parts = w.in_proj(x).split(sizes, dim=-1)
    q_resid = F.rms_norm(parts[0], (mla.q_rank,), w.q_norm, eps)  # [T, q_rank]
    latent = F.rms_norm(parts[1], (mla.kv_rank,), w.kv_norm, eps)  # [T, kv_rank]
    index_rows = None
    if w.indexer is not None:
        key = F.layer_norm(parts[2], (index.head_dim,), *w.indexer.k_norm, INDEX_NORM_EPS)  # [T, di]
        index_rows = torch.cat([key, parts[4]], dim=-1)  # [T, 2 di]: key, pool-gate logits
    latents, index_cache = state.append(latent, index_rows, start)
    if w.indexer is not None:
        selection = _select(w.indexer, spec, q_resid, parts[3], index_cache, start)
    elif selection is None:
        raise ValueError("a shared latent-attention layer needs the previous layer's selection")
    q = w.q_up(q_resid).view(new, heads, mla.key_dim).transpose(0, 1)  # [H, T, dn]
    if new <= ABSORB_MAX:  # decode: scores and values in the latent space, O(P kv_rank H) rather than O(P kv_rank H (dn + dv))
        key_up, value_up = w.kv_weight.split([mla.key_dim, mla.value_dim], dim=1)  # [H, dn, r], [H, dv, r]
        scores = torch.matmul(torch.matmul(q, key_up), latents.t()) * mla.key_dim**-0.5  # [H, T, P]
        # a query that selected nothing (no complete pool, no tail) attends to nothing: zeros, as SDPA gives it
        weights = scores.masked_fill(~selection, float("-inf")).softmax(dim=-1).nan_to_num(0.0)
        out = torch.matmul(torch.matmul(weights, latents), value_up.transpose(1, 2))  # [H, T, dv]
    else:  # prefill: keys and values expanded per head from every latent, as transformers does
        kv = w.kv_up(latents).view(-1, heads, mla.key_dim + mla.value_dim).transpose(0, 1)  # [H, P, dn + dv]
        keys, values = kv.split([mla.key_dim, mla.value_dim], dim=-1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=selection, scale=mla.key_dim**-0.5)  # [H, T, dv]
    return w.out_proj(out.transpose(0, 1).reshape(new, heads * mla.value_dim)), selection


def _top_pools(pool_scores: torch.Tensor, k: int) -> torch.Tensor:
    """pool_scores [T, n] -> the indices [T, k] of each query's k best pools, as torch.topk picks them on the CPU.

    The scores tie exactly and often (a pool whose every head's relu is zero scores 0), and which of the tied
    pools topk keeps differs between the CPU and CUDA kernels; transformers' reference runs on the CPU, so on a
    GPU the small [T, n] score matrix comes to the host for the pick (the engine syncs per layer for routing
    anyway)."""
    if pool_scores.is_cpu:
        return pool_scores.topk(k, dim=-1).indices
    return pool_scores.cpu().topk(k, dim=-1).indices.to(pool_scores.device)


def _select(w: IndexerWeights, spec: ModelSpec, q_resid: torch.Tensor, head_logits: torch.Tensor,
            index_cache: torch.Tensor, start: int) -> torch.Tensor:
    """The positions each query attends to [T, P] bool, as Glm5NextTextIndexer picks them (batch 1, no padding)."""
    index = spec.indexer
    new, total, pool, di = q_resid.shape[0], index_cache.shape[0], index.pool, index.head_dim
    device = q_resid.device
    q = w.q_up(q_resid).view(new, index.heads, di)  # [T, Hi, di]
    keys, gates = index_cache.split([di, di], dim=-1)  # [P, di] each
    positions = start + torch.arange(new, device=device)  # [T]
    visible = torch.arange(total, device=device)[None, :] <= positions[:, None]  # [T, P]
    complete = total // pool  # pools whose every position exists: the only candidates
    if complete:
        slots = torch.arange(complete * pool, device=device).view(complete, pool)  # [n, pool]
        logits = gates[slots] + w.pool_bias[None]  # [n, pool, di]
        pool_keys = (logits.softmax(dim=1) * keys[slots]).sum(dim=1)  # [n, di]
        scores = F.relu(torch.matmul(q, pool_keys.t().unsqueeze(0)) * di**-0.5)  # [T, Hi, n]
        weights = head_logits * index.heads**-0.5  # [T, Hi]
        pool_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)  # [T, n]
        candidates = visible.gather(1, slots[:, -1][None, :].expand(new, -1))  # a pool is visible once its end is
        pool_scores = pool_scores.masked_fill(~candidates, torch.finfo(pool_scores.dtype).min)
        chosen = _top_pools(pool_scores, min(index.topk // pool, complete))  # [T, k]
        chosen_ok = candidates.gather(1, chosen)
        picked = slots[chosen].masked_fill(~chosen_ok[..., None], -1).flatten(1)  # [T, k pool]
    else:
        picked = torch.full((new, 0), -1, dtype=torch.long, device=device)
    if index.select_tail and pool > 1:  # the incomplete pool a query sits in, position by position
        seen = positions + 1  # visible positions of each query
        tail_start = seen - seen.remainder(pool)
        offsets = torch.arange(pool - 1, device=device)
        tail = tail_start[:, None] + offsets  # [T, pool - 1]
        tail_ok = (offsets[None, :] < seen.remainder(pool)[:, None]) & (tail < total)
        picked = torch.cat([picked, tail.masked_fill(~tail_ok, -1)], dim=1)
    selection = torch.zeros(new, total, dtype=torch.int32, device=device)
    selection.scatter_add_(1, picked.clamp(0, total - 1), (picked >= 0).to(torch.int32))
    return selection.ne(0)
