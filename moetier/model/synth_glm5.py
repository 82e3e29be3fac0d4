"""GLM-5.3-Flash's token mixers and hyper-connections for synthetic glm5_next checkpoints, keeping the routing design intact.

Every tensor below follows synth_routing's subspace rules: what a block writes
goes through synth_routing.writer (the computation subspace only), and what it
writes is read from token identity only where attention or the recurrence would
otherwise carry it across positions. KDA (Kimi Delta Attention) is synth_linear's
Gated DeltaNet design with a decay per key channel: q and k read the whole hidden
state, v, beta, the forget gate and the output gate token identity. The latent
attention (NoPE MLA) keeps attention's design: its kv latent has a key half that
reads everything and a value half that reads token identity, and kv_b expands
keys from the one, values from the other; the DSA indexer attends over
INDEX_TOPK positions in pools of INDEX_POOL. Hyper-connections are set to act as
a plain residual (see `hyper_base`). Invariant: pure functions of (seed, name,
dims); no I/O, no torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from moetier.model import synth_linear as linear
from moetier.model import synth_routing as design

Spec = tuple[str, tuple[int, ...], Callable[[], np.ndarray]]   # a tensor's name, shape and lazy float32 value

INDEX_TOPK, INDEX_POOL = 64, 8   # positions the indexer keeps, in pools of this many (past 64 tokens it chooses)
STREAMS = 4                      # hc_mult: GLM-5.3's residual streams
SWIGLU_LIMIT = 10.0              # GLM-5.3's clamp; gate / up activations have rms ~1 here, so it never binds
LOWER_BOUND = -5.0               # KDA's safe forget gate: g = LOWER_BOUND * sigmoid(...)
HC_SCALE = (0.2, 0.1, 0.3)       # pre, post, comb: how far the per-token weights move off their base (logits of rms 1)
HC_COMB_SELF = 1.0               # comb's base logit on its diagonal: each stream keeps ~half of itself
DECAY_CHANNEL_SPREAD = 0.25      # std of log tau across one head's key channels (KDA's decay is per channel)
A_LOG_STD = 0.2
VISION_CONFIG = {"depth": 1, "hidden_size": 16, "num_heads": 2, "intermediate_size": 16, "projection_intermediate_size": 16,
                 "patch_size": 2, "image_size": 4, "spatial_merge_size": 2, "temporal_patch_size": 1}


@dataclass(frozen=True)
class Glm5Dims:
    """GLM-5.3's latent-attention, indexer and hyper-connection geometry, and its count of leading dense layers."""

    q_rank: int
    kv_rank: int            # even: a key half and a value half
    index_heads: int
    index_head_dim: int
    dense_layers: int
    index_topk: int = INDEX_TOPK
    index_pool: int = INDEX_POOL
    streams: int = STREAMS


@dataclass(frozen=True)
class Glm5Routing:
    """A preset's glm5_next routing geometry where it differs from the preset's own (the seed's GLM)."""

    num_layers: int
    dense_layers: int
    num_experts: int
    top_k: int


def glm5_dims(hidden: int, heads: int, head_dim: int, dense_layers: int) -> Glm5Dims:
    """GLM-5.3's proportions on small matrices: q rank 3/8 of hidden, kv rank 1/4 (GLM: 1/8 of 4096, too few here
    to halve), indexer heads half the attention heads at half their width."""
    return Glm5Dims(q_rank=3 * hidden // 8, kv_rank=2 * max(8, hidden // 8), index_heads=max(1, heads // 2),
                    index_head_dim=max(8, head_dim // 2), dense_layers=dense_layers)


def layer_types(num_layers: int) -> list[str]:
    """GLM-5.3's schedule: every 4th layer latent attention ("indexed_attention"), the rest KDA ("linear_attention")."""
    return ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(num_layers)]


def norm(seed: int, name: str, n: int, centre: float = 1.0, std: float = 0.05) -> Spec:
    """A norm weight near `centre` (not exactly, so that swapped norms show in parity tests)."""
    return name, (n,), lambda: centre + design.normal(seed, name, (n,), std)


def _identity(seed: int, key: str, sub: design.Subspaces, rows: int, layer: int, rms: float) -> np.ndarray:
    """[rows, D] float32 reading token identity only: outputs of rms ~`rms` after decoder layer `layer`'s input norm."""
    return design.reader(design.rng_for(seed, key), sub, rows, 2 * layer, identity_only=True) * np.float32(rms)


def _gauss(seed: int, name: str, shape: tuple[int, int], std: float) -> Spec:
    """A matrix of N(0, std^2) entries: std = rms_out / sqrt(inputs) reads inputs of rms 1 at rms_out."""
    return name, shape, lambda: design.normal(seed, name, shape, std)


def _reads_identity(seed: int, name: str, sub: design.Subspaces, rows: int, layer: int, rms: float) -> Spec:
    return name, (rows, sub.family.shape[1]), lambda: _identity(seed, name, sub, rows, layer, rms)


def _writes(seed: int, name: str, sub: design.Subspaces, inputs: int, input_rms: float) -> Spec:
    """An out-projection [D, inputs] into the computation subspace, writing UPDATE_RMS from inputs of rms input_rms."""
    return name, (sub.family.shape[1], inputs), lambda: design.writer(design.rng_for(seed, name), sub, inputs, input_rms)


# --- hyper-connections -----------------------------------------------------------

def hyper_base(streams: int) -> np.ndarray:
    """[(2 + N) N] float32: pre's logits at logit(1/N), so that the collapse is the streams' mean; post's at 0, so
    that 2 sigmoid(0) = 1 expands a block's output into every stream unscaled; comb's HC_COMB_SELF on the diagonal.
    comb is doubly stochastic (Sinkhorn), so on equal streams it returns them whatever its values: with these bases
    equal streams stay equal and h <- h + block(h), the plain residual. The per-token terms (fn, HC_SCALE) move
    each pre by ~15% (their sum, the collapse's scale, which the block's RMSNorm divides out, by ~8%) and post by
    ~5%: the streams drift apart by ~1% and comb pulls them back together."""
    n = streams
    comb = np.eye(n) * HC_COMB_SELF
    return np.concatenate([np.full(n, -np.log(n - 1.0)), np.zeros(n), comb.ravel()]).astype(np.float32)


def hyper(seed: int, prefix: str, sub: design.Subspaces, streams: int, sublayers_before: int) -> list[Spec]:
    """`{prefix}fn` [(2 + N) N, N D], `base`, `scale` [3] of one block's hyper-connection (prefix: `...hc_attn_`)."""
    hidden, n = sub.family.shape[1], streams
    rows = (2 + n) * n

    def fn() -> np.ndarray:
        # The flattened streams are RMS-normalised as one vector; equal streams make each copy RMSNorm(h), so each
        # stream's part reads identity at rms 1 and the N parts sum to logits of rms 1 (1/sqrt(N) each).
        parts = [design.reader(design.rng_for(seed, f"{prefix}fn.{i}"), sub, rows, sublayers_before, identity_only=True)
                 for i in range(n)]
        return np.concatenate(parts, axis=1) * np.float32(n**-0.5)                        # [(2 + N) N, N D]
    return [(prefix + "fn", (rows, n * hidden), fn), (prefix + "base", (rows,), lambda: hyper_base(n)),
            (prefix + "scale", (3,), lambda: np.array(HC_SCALE, dtype=np.float32))]


# --- KDA ------------------------------------------------------------------------

def kda_decay(seed: int, key: str, heads: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """(dt_bias [H d], A_log [H]) float32: at f = 0, g = LOWER_BOUND * sigmoid(exp(A_log) dt_bias) = -1 / tau, tau a
    head's time scale (log-spaced over synth_linear's TAU_MIN..TAU_MAX, shuffled) spread per key channel."""
    rng = design.rng_for(seed, key)
    tau = linear.TAU_MIN * (linear.TAU_MAX / linear.TAU_MIN) ** (np.arange(heads) / max(1, heads - 1))
    tau = tau[rng.permutation(heads)][:, None] * np.exp(DECAY_CHANNEL_SPREAD * rng.standard_normal((heads, head_dim)))
    tau = np.clip(tau, 1.0, 2 * linear.TAU_MAX)                                            # [H, d]
    a_log = (rng.standard_normal(heads) * A_LOG_STD).astype(np.float32)
    share = 1.0 / (-LOWER_BOUND * tau)                                                     # sigmoid's target
    dt_bias = (np.log(share) - np.log1p(-share)) / np.exp(a_log.astype(np.float64))[:, None]
    return dt_bias.reshape(-1).astype(np.float32), a_log


def kda(seed: int, prefix: str, sub: design.Subspaces, lin: linear.LinearDims, layer: int) -> list[Spec]:
    """Every tensor of a KDA layer (prefix: `...self_attn.`), heads lin.value_heads of lin.key_head_dim."""
    s, hidden = seed, sub.family.shape[1]
    heads, d = lin.value_heads, lin.key_head_dim
    width = heads * d

    def conv(i: int) -> np.ndarray:     # one of q | k | v's taps, out of synth_linear's [3 H d, 1, K]
        return linear.conv_weight(s, prefix + "conv1d", lin)[i * width:(i + 1) * width]

    def decay(i: int) -> np.ndarray:
        return kda_decay(s, prefix + "decay", heads, d)[i]

    def forget_up() -> np.ndarray:
        # f = f_b f_a x moves the gate's logit, exp(A_log) (f + dt_bias), by ~synth_linear.DECAY_RMS per token
        rate = np.exp(decay(1).astype(np.float64))                                         # [H]
        w = design.normal(s, prefix + "f_b_proj", (heads, d, d), d**-0.5) * (linear.DECAY_RMS / rate)[:, None, None]
        return w.reshape(width, d).astype(np.float32)
    return [
        _gauss(s, prefix + "q_proj.weight", (width, hidden), linear.QKV_RMS / hidden**0.5),
        _gauss(s, prefix + "k_proj.weight", (width, hidden), linear.QKV_RMS / hidden**0.5),
        _reads_identity(s, prefix + "v_proj.weight", sub, width, layer, linear.QKV_RMS),
        *[(f"{prefix}{n}_conv1d.weight", (width, 1, lin.conv_kernel), lambda i=i: conv(i)) for i, n in enumerate("qkv")],
        _reads_identity(s, prefix + "f_a_proj.weight", sub, d, layer, 1.0),
        (prefix + "f_b_proj.weight", (width, d), forget_up),
        (prefix + "dt_bias", (width,), lambda: decay(0)),
        (prefix + "A_log", (heads,), lambda: decay(1)),
        _reads_identity(s, prefix + "b_proj.weight", sub, heads, layer, linear.BETA_RMS),
        _reads_identity(s, prefix + "g_a_proj.weight", sub, d, layer, 1.0),
        _gauss(s, prefix + "g_b_proj.weight", (width, d), design.GATE_LOGIT_RMS / d**0.5),
        norm(s, prefix + "o_norm.weight", d),
        _writes(s, prefix + "o_proj.weight", sub, width, design.GATE_SIGMOID_RMS),   # RMSNorm(o) * sigmoid(gate)
    ]


# --- latent attention and its indexer --------------------------------------------

def latent_attention(seed: int, prefix: str, sub: design.Subspaces, dims: Glm5Dims, heads: int, head_dim: int,
                     layer: int) -> list[Spec]:
    """Every tensor of a NoPE latent-attention layer and its DSA indexer (prefix: `...self_attn.`); keys and values
    are head_dim wide. Queries and keys come out of their norms at rms ~1, as attention's do."""
    s, hidden, q_rank, kv_rank = seed, sub.family.shape[1], dims.q_rank, dims.kv_rank
    half = kv_rank // 2

    def kv_a() -> np.ndarray:       # [kv_rank, D]: the key half reads everything, the value half token identity
        keys = design.normal(s, prefix + "kv_a.keys", (half, hidden), hidden**-0.5)
        return np.concatenate([keys, _identity(s, prefix + "kv_a.values", sub, half, layer, 1.0)])

    def kv_b() -> np.ndarray:       # [H (dn + dv), kv_rank]: per head its key rows on the key half, value rows on the other
        w = np.zeros((heads, 2 * head_dim, kv_rank), dtype=np.float32)
        w[:, :head_dim, :half] = design.normal(s, prefix + "kv_b.keys", (heads, head_dim, half), half**-0.5)
        w[:, head_dim:, half:] = design.normal(s, prefix + "kv_b.values", (heads, head_dim, half), half**-0.5)
        return w.reshape(2 * heads * head_dim, kv_rank)
    hi, di = dims.index_heads * dims.index_head_dim, dims.index_head_dim
    index = prefix + "indexer."
    return [
        _gauss(s, prefix + "q_a_proj.weight", (q_rank, hidden), hidden**-0.5),
        norm(s, prefix + "q_a_layernorm.weight", q_rank),
        _gauss(s, prefix + "q_b_proj.weight", (heads * head_dim, q_rank), q_rank**-0.5),
        (prefix + "kv_a_proj_with_mqa.weight", (kv_rank, hidden), kv_a),
        norm(s, prefix + "kv_a_layernorm.weight", kv_rank),
        (prefix + "kv_b_proj.weight", (2 * heads * head_dim, kv_rank), kv_b),
        _writes(s, prefix + "o_proj.weight", sub, heads * head_dim, design.ATTN_MIX_RMS),
        # the indexer: its own query and key, per-head weights, and a pool's softmax gate (bias per slot)
        _gauss(s, index + "wq_b.weight", (hi, q_rank), q_rank**-0.5),
        _gauss(s, index + "wk.weight", (di, hidden), hidden**-0.5),
        norm(s, index + "k_norm.weight", di),
        norm(s, index + "k_norm.bias", di, centre=0.0),
        _gauss(s, index + "weights_proj.weight", (dims.index_heads, hidden), hidden**-0.5),
        _gauss(s, index + "index_kpool_compress_ape", (dims.index_pool, di), 0.1),
        _gauss(s, index + "index_kpool_compress_gate", (di, hidden), 0.5 * hidden**-0.5),
    ]
