"""Trunk layers of a decoder: RMSNorm, rotary embeddings, GQA attention with a KV cache (which also holds the
recurrent states of linear-attention layers).

Shapes: T new tokens, P cached positions, H query heads, G kv heads, d head dim.
Each function computes exactly what the HF reference computes (same op order
where it matters for float32 rounding), for batch 1.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F


@contextlib.contextmanager
def torch_threads(threads: int | None):
    """torch's intra-op thread count set to `threads` inside (None: left as it is), restored after."""
    before = torch.get_num_threads()
    if threads is None or threads == before:
        yield
        return
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] -> weight * x / rms(x), computed in float32 (one fused op)."""
    return F.rms_norm(x, weight.shape, weight, eps)


class RotaryTable:
    """cos/sin for positions 0..n, grown on demand; rotates the first `rotary_dim` dims of each head."""

    def __init__(self, rotary_dim: int, theta: float, device: torch.device):
        self.rotary_dim = rotary_dim
        exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).to(torch.float32) / rotary_dim
        self.inv_freq = 1.0 / (theta ** exponents).to(device)  # [rd/2]
        self.cos = self.sin = torch.empty(0, rotary_dim, device=device)
        self._grow(256)

    def _grow(self, length: int) -> None:
        positions = torch.arange(length, device=self.inv_freq.device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq[None, :]  # [n, rd/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [n, rd]
        self.cos, self.sin = emb.cos(), emb.sin()

    def _reach(self, end: int) -> None:
        """Rows for positions < end (the table doubled, at least, when it is shorter)."""
        if end > self.cos.shape[0]:
            self._grow(max(end, 2 * self.cos.shape[0]))

    def row_addresses(self, position: int) -> tuple[int, int]:
        """The addresses of cos and sin's rows [rd] (float32, in the table's memory) at one position, making no tensor."""
        self._reach(position + 1)
        offset = position * self.rotary_dim * self.cos.element_size()
        return self.cos.data_ptr() + offset, self.sin.data_ptr() + offset

    def rows(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [end - start, rd] for positions start..end-1 (views of the table)."""
        self._reach(end)
        return self.cos[start:end], self.sin[start:end]

    def apply(self, x: torch.Tensor, start: int) -> torch.Tensor:
        """x [heads, T, d] at positions start..start+T -> rotated copy."""
        cos, sin = self.rows(start, start + x.shape[1])  # [T, rd]
        rd = self.rotary_dim
        rot = x[..., :rd]
        half = rd // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        out = rot * cos + rotated * sin
        return out if rd == x.shape[-1] else torch.cat((out, x[..., rd:]), dim=-1)


class KVCache:
    """A sequence's state in every layer: key/value buffers [G, capacity, d] (capacity doubles as it fills) for the
    layers with attention, and a recurrent state (moetier.engine.deltanet.DeltaNetState) for the linear-attention
    layers given in `states` (layer -> state); a layer has one or the other."""

    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, devices: list[torch.device], capacity: int = 256,
                 states: dict[int, Any] | None = None):
        self.length = 0
        self.grown = 0  # buffers replaced so far: addresses taken before a change are stale
        self.native = None  # what the native step keeps of this cache (moetier.engine.native_step), or None
        self.states = states or {}
        self.keys = [None if l in self.states else torch.empty(kv_heads, capacity, head_dim, device=devices[l])
                     for l in range(num_layers)]
        self.values = [None if l in self.states else torch.empty(kv_heads, capacity, head_dim, device=devices[l])
                       for l in range(num_layers)]

    def _resize(self, layer: int, capacity: int, kept: int) -> None:
        """Replace `layer`'s buffers by ones of `capacity` positions, keeping its first `kept` positions."""
        for buffers in (self.keys, self.values):
            grown = buffers[layer].new_empty(buffers[layer].shape[0], capacity, buffers[layer].shape[2])
            grown[:, :kept] = buffers[layer][:, :kept]
            buffers[layer] = grown
        self.grown += 1

    def reserve(self, end: int) -> None:
        """Room for positions < end in every layer, all of one capacity (the native step writes them in place)."""
        most = max(k.shape[1] for k in self.keys if k is not None)
        capacity = most if end <= most else max(end, 2 * most)
        for layer in range(len(self.keys)):
            if self.keys[layer] is not None and self.keys[layer].shape[1] != capacity:
                self._resize(layer, capacity, self.length)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [G, T, d] at start..start+T; return all keys/values so far [G, start+T, d]."""
        end = start + k.shape[1]
        capacity = self.keys[layer].shape[1]
        if end > capacity:
            self._resize(layer, max(end, 2 * capacity), start)
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]


def attention_mask(start: int, new: int, window: int | None, device: torch.device) -> torch.Tensor | None:
    """Boolean mask [T, start+T] (True = attend) for causal, optionally sliding-window, attention."""
    if new == 1 and (window is None or start < window):
        return None  # one query sees every cached key
    query = torch.arange(start, start + new, device=device)[:, None]
    key = torch.arange(start + new, device=device)[None, :]
    mask = key <= query
    if window is not None:
        mask &= key > query - window
    return mask


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """q [H, T, d], k/v [G, P, d] -> [T, H*d] with grouped-query heads."""
    heads, new, head_dim = q.shape
    groups = k.shape[0]
    if new == 1 and mask is None:  # decode: three small kernels beat SDPA's set-up at this size
        q_grouped = q.view(groups, heads // groups, head_dim)  # [G, H/G, d]: query heads sharing a kv head
        scores = torch.bmm(q_grouped, k.transpose(1, 2)).mul_(head_dim**-0.5)  # [G, H/G, P]
        out = torch.bmm(torch.softmax(scores, dim=-1), v)  # [G, H/G, d]
        return out.reshape(1, heads * head_dim)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=groups != heads)  # [H, T, d]
    return out.transpose(0, 1).reshape(new, heads * head_dim)
