"""Small random GLM-5.3-Flash checkpoints saved by transformers, in the geometry llama.cpp's glm5-next loads.

`save_glm5_next` writes a Glm5NextForConditionalGeneration (its text model in
`text_config`; a vision tower of 10k parameters, written and never read: the
default one is 1.8 GB) with weights drawn
N(0, std), norms N(0, 0.5) and a non-zero e_score_correction_bias, as
tests/test_glm5_next.py draws them. `BASE` is what llama.cpp needs on top of
transformers' rules: 4 hyper-connection streams, KDA heads = attention heads,
pools of more than one position, untied embeddings, dense layers first.
`boundary_ties` finds where an indexer's top-k falls on tied pool scores (a
pool scores exactly 0 when ReLU zeroes every head), the one place moetier and
llama.cpp choose differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

BASE = dict(vocab_size=288, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=32,
            q_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16, index_topk=16, index_head_dim=16, index_n_heads=8,
            linear_head_dim=16, linear_num_heads=4, hc_mult=4, index_kpool=4, pad_token_id=0,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])
VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, projection_intermediate_size=16, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=1, image_size=4)


def save_glm5_next(folder: Path, text: dict[str, Any], seed: int, std: float = 0.15, dtype: str = "float32") -> Path:
    import torch

    model = build_glm5_next(text, seed, std, text.get("tie_word_embeddings", False))
    model.to(getattr(torch, dtype)).save_pretrained(folder)
    return folder


def build_glm5_next(text: dict[str, Any], seed: int, std: float = 0.15, tied: bool = False):
    """A random Glm5NextForConditionalGeneration of this text config (weights N(0, std), norms N(0, 0.5), a non-zero
    correction bias), the small vision tower beside it; `tied`: the top-level tie_word_embeddings."""
    import torch
    import transformers

    config = transformers.Glm5NextConfig(text_config=text, vision_config=VISION | {"out_hidden_size": text["hidden_size"]},
                                         tie_word_embeddings=tied)
    torch.manual_seed(seed)
    model = transformers.Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "visual" not in name:
                param.normal_(0.0, 0.5 if "norm" in name else std)
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.05)
    return model


def boundary_ties(checkpoint, ids: list[int]) -> dict[int, list[int]]:
    """layer -> the positions whose indexer top-k boundary falls on equal pool scores (the k-th and the (k+1)-th best
    within 1e-6 of the largest), as moetier's engine scores the pools in one teacher-forced pass over ids."""
    import torch
    import torch.nn.functional as F

    from moetier.engine import Engine, mla, score

    spec, calls, select = checkpoint.spec, [], mla._select
    index = spec.indexer

    def spy(w, spec, q_resid, head_logits, cache, start):
        new, di, pool = q_resid.shape[0], index.head_dim, index.pool
        q = w.q_up(q_resid).view(new, index.heads, di)
        keys, gates = cache.split([di, di], dim=-1)
        slots = torch.arange(cache.shape[0] // pool * pool).view(-1, pool)
        pooled = ((gates[slots] + w.pool_bias[None]).softmax(dim=1) * keys[slots]).sum(dim=1)
        scores = F.relu(torch.matmul(q, pooled.t().unsqueeze(0)) * di**-0.5)
        pools = torch.matmul((head_logits * index.heads**-0.5).unsqueeze(-2), scores).squeeze(-2)  # [T, n]
        k, tied = index.topk // pool, []
        for t in range(new):
            visible = (start + t + 1) // pool
            if visible > k:
                best = pools[t, :visible].sort(descending=True).values
                if best[k - 1] - best[k] <= 1e-6 * best.abs().max():
                    tied.append(start + t)
        calls.append(tied)
        return select(w, spec, q_resid, head_logits, cache, start)

    mla._select = spy
    try:
        score(Engine(checkpoint), np.asarray(ids))
    finally:
        mla._select = select
    full = [l for l in spec.attention_layers if l not in index.shared_layers]
    return {layer: tied for layer, tied in zip(full, calls) if tied}
