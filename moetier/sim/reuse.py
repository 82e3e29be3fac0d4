"""Expert reuse between consecutive tokens: measured on real traces, reproduced when profiles are sampled.

`excess_overlap` is the share of a token's k picks that repeat the previous token's beyond chance:
(O - O_ind) / (k - O_ind) per layer, O the mean overlap of consecutive pairs, O_ind = sum_e f_e^2 what two
tokens drawn independently from the layer's own marginal share (f_e: the share of tokens that pick e).
0: independent tokens; 1: every token repeats the previous one. Under `sample_trace(reuse=rho)` (a token
repeats the previous token's picks with chance rho, else draws afresh) it is rho at any expert count, top-k
or profile: the reason a value measured on a 60-expert trace can be given to a 288-expert model.
`consecutive_pairs` finds the (t, t+1) rows of one sequence in the published traces (moetier.sim.traces).
"""

from __future__ import annotations

import numpy as np

from moetier.sim.traces import RoutingTrace


def consecutive_pairs(trace: RoutingTrace) -> np.ndarray:
    """[P, 2] rows (t, t + 1) of one sequence. FLAME: neighbours inside each of its sequences. Qwen1.5-MoE under
    continuous batching: a request's row in one decode call and the next when both calls have the same size (no
    request finished, so each keeps its place); its first call, the concatenated prompts, is left out (their
    boundaries are not stored). Any other trace: every pair of neighbouring rows."""
    T = trace.num_tokens
    if "batch_starts" in trace.extra:
        starts = list(trace.extra["batch_starts"]) + [T]
        sizes = np.diff(starts)
        pairs = [(starts[j] + i, starts[j + 1] + i) for j in range(1, len(sizes) - 1) if sizes[j] == sizes[j + 1]
                 for i in range(sizes[j])]
        return np.array(pairs, np.intp).reshape(-1, 2)
    first = np.arange(T - 1)
    if "sequence_starts" in trace.extra:
        first = first[~np.isin(first + 1, trace.extra["sequence_starts"])]  # no pair across a sequence's start
    return np.stack([first, first + 1], 1)


def excess_overlap(trace: RoutingTrace, pairs: np.ndarray | None = None) -> np.ndarray:
    """[L] per layer: the share of a token's picks that repeat the previous token's beyond chance (module
    docstring), over `pairs` [P, 2] of rows (default: `consecutive_pairs`)."""
    pairs = consecutive_pairs(trace) if pairs is None else np.asarray(pairs, np.intp)
    if len(pairs) == 0:
        raise ValueError(f"trace {trace.source or ''}: no consecutive pairs to measure reuse on")
    k, E = trace.top_k, trace.num_experts
    onehot = np.zeros((trace.num_tokens, trace.num_layers, E), bool)  # [T, L, E] picked
    np.put_along_axis(onehot, trace.picks.astype(np.intp), True, -1)
    overlap = (onehot[pairs[:, 0]] & onehot[pairs[:, 1]]).sum(-1).mean(0)  # [L] mean |S_t & S_t+1|
    share = onehot[np.unique(pairs)].mean(0)  # [L, E] the paired rows' marginal
    chance = (share ** 2).sum(-1)  # [L]
    return (overlap - chance) / (k - chance)


def distinct_per_window(trace: RoutingTrace, rows: int) -> float:
    """Mean distinct experts per layer over windows of `rows` neighbouring rows (a verify pass's token rows)."""
    windows = trace.num_tokens // rows
    picks = trace.picks[: windows * rows].reshape(windows, rows, trace.num_layers, -1)  # [W, rows, L, k]
    ordered = np.sort(picks.transpose(0, 2, 1, 3).reshape(windows, trace.num_layers, -1), -1)  # [W, L, rows * k]
    return float((1 + (ordered[..., 1:] != ordered[..., :-1]).sum(-1)).mean())
