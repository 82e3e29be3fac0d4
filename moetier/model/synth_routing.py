"""Weight design that gives synthetic MoE checkpoints a realistic routing skew.

The hidden space has three orthogonal parts: one direction per token family
(common, explore, edit, verify, second_language), token identity, and
computation. Embeddings live in the first two; attention and experts write only
into computation, which the lm_head reads, so logits depend on context and
experts while the family signal survives every layer. Per MoE layer, expert sets
(popular core, favourites per family, tail) and a target router mass per family
are drawn, and router rows reproduce that mass from the family direction, plus
noise read from identity and context. Invariant: pure functions of (seed, dims),
bit-identical on any BLAS or thread count (exact_matmul); no I/O, no torch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from types import MappingProxyType

import numpy as np

FAMILIES = ("common", "explore", "edit", "verify", "second_language")
PHASE_FAMILIES = ("explore", "edit", "verify")
SPECIAL_TOKENS = {"pad": 0, "bos": 1, "eos": 2}

# Default token shares of a session phase: "phase" is the phase's own family.
SESSION_MIX = MappingProxyType({"phase": 0.70, "common": 0.22, "second_language": 0.08})
# Share of the vocabulary per family (specials excluded).
VOCAB_SHARE = {"common": 0.2, "explore": 0.2, "edit": 0.2, "verify": 0.2, "second_language": 0.2}
# Share of a family's router mass per expert set: "core" (popular with everyone),
# "own" (the family's own favourites), "phase_favs" (the favourites of the phase
# families other than this one), "second_language" (that family's set), "tail".
MASS = {
    "common": {"core": 0.86, "phase_favs": 0.05, "second_language": 0.01, "tail": 0.08},
    "phase": {"core": 0.66, "own": 0.27, "phase_favs": 0.02, "second_language": 0.01, "tail": 0.04},
    "second_language": {"core": 0.06, "own": 0.84, "phase_favs": 0.02, "tail": 0.08},
}
# Zipf exponent of popularity inside one expert set (others: uniform); the
# second_language set is flatter, so that none of its experts turns hot when pooled.
ZIPF_EXPERT = {"core": 0.8, "explore": 0.8, "edit": 0.8, "verify": 0.8, "second_language": 0.3}
EMBED_SIGNAL = 0.8    # family share of an embedding's norm (identity share: sqrt(1 - a^2))
ROUTER_NOISE = 0.4    # std of the router-logit noise read from token identity
ROUTER_CONTEXT = 0.15 # std of the router-logit noise read from context (computation subspace)
UPDATE_RMS = 0.2      # rms of each attention / MLP write, relative to the embedding's rms
LOGIT_SELF = 5.0      # logit of a token given its own embedding (same family: ~LOGIT_SELF * a^2)
LOGIT_CONTEXT = 1.5   # std of the logits' part read from the computation subspace
# what out-projections read, for writer's sizing:
SILU_GLU_RMS = 0.6    # rms of silu(g) * u for g, u ~ N(0, 1)
ATTN_MIX_RMS = 0.25   # rms of an attention-weighted mean of zero-mean value vectors (measured)
GATE_LOGIT_RMS = 0.5  # sigmoid gates (on attention or linear-attention outputs, a shared expert): rms of the logit
GATE_SIGMOID_RMS = 0.514  # rms of sigmoid(x) for x ~ N(0, GATE_LOGIT_RMS^2)


def rng_for(seed: int, key: str) -> np.random.Generator:
    """An independent generator per (seed, key), so values do not depend on write order."""
    return np.random.default_rng([seed, zlib.crc32(key.encode())])


def normal(seed: int, key: str, shape: tuple[int, ...], std: float) -> np.ndarray:
    """N(0, std^2) float32 values that depend only on (seed, key)."""
    return rng_for(seed, key).standard_normal(shape, dtype=np.float32) * np.float32(std)


def family_of_tokens(vocab: int, seed: int) -> np.ndarray:
    """Family index per token id; -1 for the special tokens."""
    n = vocab - len(SPECIAL_TOKENS)
    shares = np.array([VOCAB_SHARE[f] for f in FAMILIES])
    counts = np.floor(shares / shares.sum() * n).astype(int)
    counts[0] += n - counts.sum()
    labels = np.repeat(np.arange(len(FAMILIES)), counts)      # [V - specials]
    rng_for(seed, "families").shuffle(labels)
    return np.concatenate([np.full(len(SPECIAL_TOKENS), -1), labels])  # [V]


def family_tokens(family: np.ndarray, seed: int) -> dict[str, np.ndarray]:
    """Token ids per family, in frequency-rank order (first = most frequent)."""
    out = {}
    for i, name in enumerate(FAMILIES):
        ids = np.flatnonzero(family == i)
        out[name] = rng_for(seed, f"rank.{name}").permutation(ids)
    return out


GRID_BITS = 16         # operands of exact_matmul are rounded to multiples of 2^-GRID_BITS


def _grid(x: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(x, dtype=np.float64) * 2.0**GRID_BITS) / 2.0**GRID_BITS


def exact_matmul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """a @ b in float64 with the same bits on any BLAS, thread count or CPU.

    Both operands are rounded to multiples of 2^-16, so every product is a multiple
    of 2^-32; while every partial sum stays below 2^20 it is exact in float64, and
    the summation order (which BLAS picks per thread count) cannot change the result.
    """
    a, b = _grid(a), _grid(b)
    bound = np.abs(a).sum(axis=-1).max(initial=0.0) * np.abs(b).max(initial=0.0)
    if bound >= 2.0**20:
        raise ValueError(f"exact_matmul: partial sums up to {bound:.3g} would not be exact")
    return a @ b


@dataclass(frozen=True)
class Subspaces:
    family: np.ndarray     # [F+1, D] one direction per family, the last for special tokens
    identity: np.ndarray   # [A, D] token identity (embeddings, router noise)
    compute: np.ndarray    # [B, D] where attention and experts write; the lm_head reads it


def subspaces(hidden: int, seed: int) -> Subspaces:
    q, r = np.linalg.qr(rng_for(seed, "basis").standard_normal((hidden, hidden)))
    q *= np.where(np.diag(r) < 0, -1.0, 1.0)                  # the unique QR: diag(R) > 0
    rows = _grid(q.T)                                           # [D, D] orthonormal rows (to 2^-16)
    nf = len(FAMILIES) + 1
    na = (hidden - nf) // 2
    return Subspaces(rows[:nf], rows[nf:nf + na], rows[nf + na:])


def _unit_rows(rng: np.random.Generator, rows: int, basis: np.ndarray) -> np.ndarray:
    """Random unit-norm rows [N, D] (float64) inside the span of basis [K, D]."""
    c = rng.standard_normal((rows, basis.shape[0]))                         # [N, K]
    c /= np.linalg.norm(c, axis=1, keepdims=True)
    return exact_matmul(c, basis)


def context_rms(sublayers: int) -> float:
    """Expected rms (relative to the embedding) of the computation part after n sublayer writes."""
    return UPDATE_RMS * np.sqrt(sublayers)


def embeddings(family: np.ndarray, sub: Subspaces, seed: int) -> np.ndarray:
    """Token embeddings [V, D] float32 with rms 1: family direction + token identity."""
    hidden = sub.family.shape[1]
    emb = _unit_rows(rng_for(seed, "embed"), len(family), sub.identity)   # [V, D]
    emb *= np.sqrt(hidden * (1.0 - EMBED_SIGNAL**2))
    emb += (np.sqrt(hidden) * EMBED_SIGNAL * sub.family)[np.where(family < 0, len(FAMILIES), family)]
    return emb.astype(np.float32)


def reader(rng: np.random.Generator, sub: Subspaces, rows: int, sublayers_before: int,
           identity_only: bool = False) -> np.ndarray:
    """Input projection [rows, D] float32 that ignores the family subspace, outputs of rms ~1.

    Value and expert-input projections read token identity (and, for experts, the
    context), so what they write averages to ~0 over tokens and biases no router.
    Values read identity only: context is correlated across positions, so attention
    re-reading it would grow layer by layer. After RMSNorm the part read has rms
    sqrt(b^2 + r^2) / sqrt(1 + r^2) (b: identity share, r: context so far), divided out here.
    """
    hidden = sub.family.shape[1]
    r2 = context_rms(sublayers_before) ** 2
    if identity_only:
        w = exact_matmul(rng.standard_normal((rows, sub.identity.shape[0])), sub.identity)
        read2 = 1.0 - EMBED_SIGNAL**2
    else:
        w = _grid(rng.standard_normal((rows, hidden)))                     # [N, D]
        w -= exact_matmul(exact_matmul(w, sub.family.T), sub.family)
        read2 = 1.0 - EMBED_SIGNAL**2 + r2
    return (w * np.sqrt((1.0 + r2) / (hidden * read2))).astype(np.float32)


def writer(rng: np.random.Generator, sub: Subspaces, inputs: int, input_rms: float,
           scale: float = 1.0) -> np.ndarray:
    """Output projection [D, inputs] float32 that writes only into the computation subspace.

    Sized so that an input vector with per-entry rms input_rms gives an output with
    rms scale * UPDATE_RMS over all D entries.
    """
    hidden, nb = sub.compute.shape[1], sub.compute.shape[0]
    std = scale * UPDATE_RMS * np.sqrt(hidden / nb) / (input_rms * np.sqrt(inputs))
    g = rng.standard_normal((nb, inputs))                                  # [B, in]
    return (exact_matmul(sub.compute.T, g) * std).astype(np.float32)      # [D, in]


def lm_head(emb: np.ndarray, sub: Subspaces, num_layers: int, seed: int) -> np.ndarray:
    """Output rows [V, D] float32: along the token's embedding (its own family scores high)
    plus a part read from the computation subspace, through which context and experts move logits."""
    vocab, hidden = emb.shape
    r = context_rms(2 * num_layers)
    head = _unit_rows(rng_for(seed, "lm_head"), vocab, sub.compute)        # [V, D]
    head *= LOGIT_CONTEXT * np.sqrt(sub.compute.shape[0] * (1 + r * r)) / (r * np.sqrt(hidden))
    unit = emb / np.linalg.norm(emb.astype(np.float64), axis=1, keepdims=True)
    head += (LOGIT_SELF / np.sqrt(hidden)) * unit
    head[SPECIAL_TOKENS["eos"]] *= 0.25     # keep generation from stopping at once
    return head.astype(np.float32)


def expert_roles(experts: int, top_k: int, layer: int, seed: int, n_group: int = 1) -> dict[str, np.ndarray]:
    """Expert ids per set for one MoE layer: "core", one set per family other than
    common (its favourites), "tail"; the sets are disjoint and cover all experts.

    The second_language set has more than top_k experts so that its tokens can be
    served entirely off the popular core. With n_group > 1 (group-limited routers)
    the roles are laid out in role order over whole groups, so that each family's
    favourites sit in few groups, as group-limited routing needs.
    """
    n_core = max(1, round(0.11 * experts))
    n_second = max(top_k + 1, round(0.16 * experts))
    rng = rng_for(seed, f"roles.{layer}")
    if n_group > 1:
        size = experts // n_group
        groups = rng.permutation(n_group)
        perm = np.concatenate([g * size + rng.permutation(size) for g in groups])
    else:
        perm = rng.permutation(experts)
    roles, at = {}, 0
    for name, n in [("core", n_core)] + [(f, n_core) for f in PHASE_FAMILIES] + [("second_language", n_second)]:
        roles[name] = perm[at:at + n]
        at += n
    roles["tail"] = perm[at:]
    return roles


def _zipf(n: int, exponent: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** exponent
    return w / w.sum()


def target_mass(roles: dict[str, np.ndarray], experts: int) -> np.ndarray:
    """Designed router mass [F, E] per family over experts; each row sums to 1."""
    q = np.zeros((len(FAMILIES), experts))
    for i, fam in enumerate(FAMILIES):
        for role, share in MASS.get(fam, MASS["phase"]).items():
            if role == "phase_favs":
                ids = np.concatenate([roles[f] for f in PHASE_FAMILIES if f != fam])
                weights = np.full(len(ids), 1.0 / len(ids))
            else:
                name = fam if role == "own" else role
                ids = roles[name]
                weights = _zipf(len(ids), ZIPF_EXPERT.get(name, 0.0))
            q[i, ids] += share * weights
    return q / q.sum(axis=1, keepdims=True)


def router_logit_targets(q: np.ndarray, kind: str, top_k: int) -> np.ndarray:
    """Logits [F, E] per family whose expected router output, under the token and context
    noise the router adds, reproduces q: softmax(z + n) for softmax routers; for sigmoid
    routers sigmoid(z + n) = q * S, with S per family so that the hot picks sit near 0.5-0.9."""
    sigma = np.hypot(ROUTER_NOISE, ROUTER_CONTEXT)
    noise = sigma * np.random.default_rng(0).standard_normal((512, 1, q.shape[1]))   # [M, 1, E]
    if kind == "softmax":
        z = np.log(q)
        for _ in range(40):     # fixed point: z += log q - log E[softmax(z + n)]
            p = np.exp(z + noise - (z + noise).max(-1, keepdims=True))
            z += np.log(q) - np.log((p / p.sum(-1, keepdims=True)).mean(0))
        return z - z.mean(axis=1, keepdims=True)                # [F, E]
    target = q * np.minimum(0.6 * top_k, 0.9 / q.max(axis=1, keepdims=True))      # [F, E]
    z = np.log(target) - np.log1p(-target)
    for _ in range(40):         # fixed point on the logit of E[sigmoid(z + n)]
        m = (1.0 / (1.0 + np.exp(-(z + noise)))).mean(0)
        z += (np.log(target) - np.log1p(-target)) - (np.log(m) - np.log1p(-m))
    return z


def router_weight(q: np.ndarray, sub: Subspaces, layer: int, kind: str, top_k: int, seed: int) -> np.ndarray:
    """Router rows [E, D] for the MoE block of decoder layer `layer`."""
    hidden = sub.family.shape[1]
    z = router_logit_targets(q, kind, top_k)                    # [F, E]
    # Sublayers before this router wrote 2*layer+1 times into the computation
    # subspace; RMSNorm then shrinks the family part, so the rows are scaled up.
    r = context_rms(2 * layer + 1)
    gain = np.sqrt(1.0 + r * r)
    rows = exact_matmul(z.T, sub.family[: len(FAMILIES)]) * (gain / (EMBED_SIGNAL * np.sqrt(hidden)))  # [E, D]
    b = np.sqrt(1.0 - EMBED_SIGNAL**2)
    ident = _unit_rows(rng_for(seed, f"router.{layer}.identity"), q.shape[1], sub.identity)
    rows += gain * ROUTER_NOISE * np.sqrt(sub.identity.shape[0]) / (b * np.sqrt(hidden)) * ident
    ctx = _unit_rows(rng_for(seed, f"router.{layer}.context"), q.shape[1], sub.compute)
    rows += gain * ROUTER_CONTEXT * np.sqrt(sub.compute.shape[0]) / (r * np.sqrt(hidden)) * ctx
    return rows.astype(np.float32)


def correction_bias(q: np.ndarray, mix: np.ndarray) -> np.ndarray:
    """GLM e_score_correction_bias [E]: small, favours cold experts like load balancing does."""
    pooled = (mix[:, None] * q).sum(axis=0)                     # [E], no BLAS: ties stay ties
    rank = np.argsort(np.argsort(pooled, kind="stable"), kind="stable")   # 0 = coldest
    return 0.04 * (0.5 - rank / max(1, len(pooled) - 1))


def session_family_mix() -> np.ndarray:
    """Expected family shares [F] of session tokens under SESSION_MIX, phases equal."""
    mix = np.zeros(len(FAMILIES))
    for name, share in SESSION_MIX.items():
        for f in PHASE_FAMILIES if name == "phase" else (name,):
            mix[FAMILIES.index(f)] += share / (len(PHASE_FAMILIES) if name == "phase" else 1)
    return mix
