"""Expert reuse between consecutive tokens (moetier.sim.reuse): pairs by hand, and the values measured on the real
traces of shared/traces (skipped when absent) that scripts/reproduce_seed.py takes as its REUSE."""

from __future__ import annotations

import numpy as np
import pytest

from moetier.sim.reuse import consecutive_pairs, excess_overlap
from moetier.sim.traces import RoutingTrace, from_flame, from_qwen15moe


def trace_of(picks, **extra) -> RoutingTrace:
    picks = np.array(picks, np.int16)  # [T, L, k]
    return RoutingTrace(picks=picks, weights=np.ones(picks.shape), num_experts=6, layer_ids=range(picks.shape[1]), extra=extra)


def test_pairs_stay_inside_sequences_and_follow_a_request_between_decode_calls():
    picks = [[[0, 1]]] * 7
    assert consecutive_pairs(trace_of(picks)).tolist() == [[t, t + 1] for t in range(6)]
    assert consecutive_pairs(trace_of(picks, sequence_starts=[0, 3])).tolist() == [[0, 1], [1, 2], [3, 4], [4, 5], [5, 6]]
    # calls: a 3-row prefill (left out), decode calls of 2, 2 and 1 rows (the last: a request finished, order unknown)
    batched = consecutive_pairs(trace_of(picks + [[[0, 1]]], batch_starts=[0, 3, 5, 7]))
    assert batched.tolist() == [[3, 5], [4, 6]]


def test_excess_overlap_is_zero_for_chance_and_one_for_repeats():
    repeats = trace_of([[[0, 1]], [[0, 1]], [[2, 3]], [[2, 3]]], sequence_starts=[0, 2])  # pairs (0, 1), (2, 3)
    assert excess_overlap(repeats) == pytest.approx([1.0])
    # pairs (0, 1) and (2, 3) overlap by 1 each; the marginal (shares 1/2 x 2, 1/4 x 4) overlaps by chance 2/4 + 4/16
    partial = trace_of([[[0, 1]], [[0, 2]], [[3, 4]], [[3, 5]]], sequence_starts=[0, 2])
    assert excess_overlap(partial) == pytest.approx([(1 - 0.75) / (2 - 0.75)])
    everyone = trace_of([[[0, 1]], [[0, 2]], [[0, 3]], [[0, 4]]], sequence_starts=[0, 2])  # expert 0 in every token: chance
    assert excess_overlap(everyone) == pytest.approx([(1 - 1.25) / (2 - 1.25)])  # below it (1 and 2 never repeat: -1/3)


def test_real_consecutive_tokens_share_experts_a_little_more_than_chance(traces_dir):
    """Qwen1.5-MoE decode steps (the value reproduce_seed gives GLM-5.3-Flash's passes) and FLAME-MoE prefill; a
    request's row matched with another request's row in the next call shares only chance."""
    qwen = from_qwen15moe(traces_dir / "qwen15moe_gsm8k_layers_0_8_12_18_23.npz")
    pairs = consecutive_pairs(qwen)
    measured = excess_overlap(qwen, pairs)  # [5]
    assert float(measured.mean()) == pytest.approx(0.045, abs=0.0005) and (measured[1:] > 0.03).all()
    starts = np.array(qwen.extra["batch_starts"] + [qwen.num_tokens])
    call = np.searchsorted(starts, pairs[:, 1], side="right") - 1  # each pair's second row: its call
    size = starts[call + 1] - starts[call]
    shifted = np.stack([pairs[:, 0], starts[call] + (pairs[:, 1] - starts[call] + 1) % size], 1)  # the neighbour's row
    assert np.abs(excess_overlap(qwen, shifted)).max() < 0.015
    flame = excess_overlap(from_flame(traces_dir / "flame_moe_290m_prefill_4x512_layers2-9.npz"))
    assert 0.0 < float(flame.mean()) < 0.02


def test_repeating_the_last_token_at_the_measured_chance_gives_real_decode_passes_their_distinct_experts(traces_dir):
    """Four consecutive decode tokens of one Qwen1.5-MoE request hold fewer distinct experts than four independent
    tokens (13.93 against 14.38 a layer); repeating the previous token's picks with the measured chance rho, as
    sample_trace(reuse=rho) does, gives the real count: E over n = 1 + Binomial(3, 1 - rho) of sum_e 1 - (1 - f_e)^n."""
    qwen = from_qwen15moe(traces_dir / "qwen15moe_gsm8k_layers_0_8_12_18_23.npz")
    starts = list(qwen.extra["batch_starts"]) + [qwen.num_tokens]
    size = np.diff(starts)
    windows = np.array([[starts[j + m] + i for m in range(4)] for j in range(1, len(size) - 3)
                        if len(set(size[j:j + 4])) == 1 for i in range(size[j])])  # [W, 4] rows of one request
    picked = np.zeros((qwen.num_tokens, qwen.num_layers, qwen.num_experts), bool)  # [T, L, E]
    np.put_along_axis(picked, qwen.picks.astype(np.intp), True, -1)
    real = picked[windows].any(1).sum(-1).mean()  # distinct experts per window and layer
    share = picked[np.unique(windows)].mean(0)  # [L, E]
    independent = lambda n: (1 - (1 - share) ** n).sum(-1).mean()  # noqa: E731
    rho = float(excess_overlap(qwen).mean())
    fresh = {1: rho ** 3, 2: 3 * rho ** 2 * (1 - rho), 3: 3 * rho * (1 - rho) ** 2, 4: (1 - rho) ** 3}
    assert real < independent(4) - 0.3
    assert sum(p * independent(n) for n, p in fresh.items()) == pytest.approx(real, rel=0.005)
