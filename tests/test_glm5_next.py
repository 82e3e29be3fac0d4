"""GLM-5.3-Flash (glm5_next) against transformers' Glm5NextForConditionalGeneration (text input).

Small random checkpoints written by save_pretrained (the vision tower is written
and not read). The configs vary what changes the arithmetic: hc_mult and the
Sinkhorn iterations, the linear / indexed layer pattern, indexer types (a
"shared" layer reusing the previous layer's selection), index_topk below and
above the sequence length, the pool size and whether the incomplete pool is
always attended, kv / q lora ranks, dense layer count, groups, one, two or no
shared experts (none: transformers writes one of width 0), swiglu_limit (small
enough here to clamp), the forget gate with and without its lower bound,
attention biases, tied embeddings (the top-level config decides).
Teacher-forced logits over 80 positions (two KDA chunks) and 16 cached decode
steps after a 70-token prompt within 1e-4 in float32, identical greedy tokens;
`e_score_correction_bias` is drawn non-zero.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glm5_next_files import build_glm5_next
from reference_checks import cached_decode, decode_both, decode_per_pool_size, pieces_both, random_ids, teacher_forced_error

from moetier.engine import Engine
from moetier.model import open_checkpoint
from moetier.model.spec import ModelSpec, SpecError

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
POSITIONS = 80
BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=5,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3, kv_lora_rank=16,
            q_lora_rank=24, qk_nope_head_dim=12, v_head_dim=12, index_topk=8, index_head_dim=8, index_n_heads=2,
            linear_head_dim=8, linear_num_heads=3, hc_mult=2, index_kpool=4, pad_token_id=0,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse", "sparse"])

CASES = {
    "groups-topk-below-length": dict(n_group=2, topk_group=1),
    "shared-indexers-hc4-topk-above-length": dict(
        num_hidden_layers=6, hc_mult=4, index_topk=200, swiglu_limit=0.5,
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention",
                     "indexed_attention", "indexed_attention"],
        indexer_types=["full", "full", "shared", "full", "full", "shared"], mlp_layer_types=["dense"] * 2 + ["sparse"] * 4),
    "softplus-gate-bias-pool1-two-shared": dict(linear_lower_bound=None, attention_bias=True, index_kpool=1, index_topk=5,
                                                hc_sinkhorn_iters=3, n_shared_experts=2, kv_lora_rank=8, q_lora_rank=12),
    "no-tail-k1-nonorm-tied-no-shared": dict(index_kpool_always_select_tail=False, index_kpool=2, index_topk=6,
                                             num_experts_per_tok=1, norm_topk_prob=False, tie_word_embeddings=True,
                                             n_shared_experts=0),  # transformers writes a shared expert of width 0
}


def reference(overrides: dict, seed: int):
    text = BASE | {k: v for k, v in overrides.items() if k != "tie_word_embeddings"}
    return build_glm5_next(text, seed, tied=overrides.get("tie_word_embeddings", False))


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    model = reference(CASES[request.param], seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_spec_reads_the_layers_as_transformers_builds_them(case):
    model, folder = case
    spec = open_checkpoint(folder).spec
    layers = model.model.language_model.layers
    assert spec.linear_layers == tuple(i for i, l in enumerate(layers) if l.block_type == "linear_attention")
    assert spec.moe_layers == tuple(i for i, l in enumerate(layers) if hasattr(l.mlp, "experts"))
    assert spec.indexer.shared_layers == tuple(i for i, l in enumerate(layers)
                                               if l.block_type != "linear_attention" and l.self_attn.indexer is None)
    assert spec.tie_word_embeddings == model.config.tie_word_embeddings


def test_teacher_forced_logits_match_reference(case):
    model, folder = case
    assert teacher_forced_error(model, folder, BASE["vocab_size"], POSITIONS) <= TOLERANCE


def test_cached_decode_after_a_long_prompt_matches_reference(case):
    model, folder = case
    same, error = cached_decode(model, Engine(open_checkpoint(folder)), BASE["vocab_size"], 70, 17)
    assert same and error <= TOLERANCE


@pytest.mark.parametrize("cut", [1, 37, 64])
def test_prefill_in_pieces_matches_the_reference_in_pieces(case, cut):
    """The KDA states, latent and indexer caches carried between two forwards, against transformers fed the same two
    pieces through its cache. (Not against one pass: pieces align KDA's 64-token chunks differently, and that
    rounding can flip an indexer's or a router's near-tie -- transformers' own pieces differ from its one pass by
    0.3 in a logit on this model.)"""
    model, folder = case
    engine = Engine(open_checkpoint(folder))
    ids = torch.arange(3, 3 + POSITIONS) % BASE["vocab_size"]
    with torch.no_grad():
        first = model(ids[None, :cut], use_cache=True)
        second = model(ids[None, cut:], cache=first.past_key_values, use_cache=True)
    expected = torch.cat([first.logits[0], second.logits[0]])
    cache = engine.new_cache()
    pieces = torch.cat([engine.forward(ids[:cut], cache), engine.forward(ids[cut:], cache)])
    assert (pieces - expected).abs().max() <= TOLERANCE


def test_the_vision_tower_is_not_read(case):
    _, folder = case
    checkpoint = open_checkpoint(folder)
    assert checkpoint.names() and not any("visual" in name for name in checkpoint.names())
    assert all(not name.startswith("model.language_model.") for name in checkpoint.names())


def _config(**changes) -> dict:
    text = BASE | changes
    return transformers.Glm5NextConfig(text_config=text).to_dict()


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["linear_attention"] * 3), "layer_types"),
    (dict(indexer_types=["full", "full", "full", "shared", "full"]), "reuse the previous layer's selection"),
    (dict(mlp_layer_types=["dense"] * 4 + ["moe"]), "mlp_layer_types"),
])
def test_bad_configs_are_refused_in_one_line(changes, message):
    config = _config()
    config["text_config"].update(changes)
    with pytest.raises(SpecError, match=message) as error:
        ModelSpec.from_hf_config(config, source="config.json")
    assert "\n" not in str(error.value)


def test_a_config_without_text_config_is_refused():
    with pytest.raises(SpecError, match="text_config"):
        ModelSpec.from_hf_config({"model_type": "glm5_next"}, source="config.json")


DECODE_IDS = random_ids(BASE["vocab_size"], 90, 5).tolist()  # a 70-token prompt, 20 decoded


def test_decode_runs_natively_to_the_python_paths_logits(case):
    """The native step (cpu_step.h: KDA, latent attention and its indexer, the streams; every layer in one call)
    against the per-layer Python path with its mixers and hyper weights in torch ops. (Against transformers, the
    cached-decode test above decodes through the step too.)"""
    _, folder = case
    engine = Engine(open_checkpoint(folder))
    assert engine.decode_path().startswith("native step")
    native, python = decode_both(engine, DECODE_IDS, 70)
    assert np.abs(native - python).max() <= 1e-5 * np.abs(python).max()
    assert (native.argmax(1) == python.argmax(1)).all()


def test_native_decode_breaks_indexer_ties_as_torch_topk_does(case):
    """ReLU's exact zeros tie pool scores at the top-k boundary; the step hands those choices to torch.topk (the
    Python path's and transformers' choice): the cases whose decode meets such ties still give the Python path's
    logits (the test above), and here they are counted, so the tie path is known to run."""
    from moetier.engine.native_step import CHOOSE

    name, folder = case[1].name, case[1]
    engine = Engine(open_checkpoint(folder))
    step, calls = engine.native_step, []
    choose = step._choose_pools
    step._choose = CHOOSE(lambda *args: calls.append(args[1:3]) or choose(*args))
    cache = engine.new_cache()
    engine.forward(torch.tensor(DECODE_IDS[:70]), cache)
    for t in DECODE_IDS[70:]:
        engine.forward(torch.tensor([t]), cache)
    index = engine.spec.indexer
    assert all(k == min(index.topk // index.pool, n) and n > k for n, k in calls)
    if name.startswith("groups-topk-below-length"):  # its indexer scores tie in decode on this draw
        assert calls, "no tied pool scores: the tie path did not run"


def test_native_decode_gives_the_same_bits_whatever_the_pool_size(case):
    runs = decode_per_pool_size(open_checkpoint(case[1]), DECODE_IDS[:80], 70)
    assert all(np.array_equal(runs[0], other) for other in runs[1:])


def test_states_and_caches_pass_between_the_step_and_the_python_path(case):
    """One cache, the two paths in turn (the step writes latents, index rows and KDA states in place; the Python
    path appends rows and replaces the KDA states), against all-Python; past the latent caches' first capacity."""
    engine = Engine(open_checkpoint(case[1]))
    ids = random_ids(BASE["vocab_size"], 262, 6).tolist()
    native, python = pieces_both(engine, ids, [(0, 250), (250, 251), (251, 252), (252, 259), (259, 260), (260, 261), (261, 262)])
    assert (native - python).abs().max() <= 1e-5 * python.abs().max()


@pytest.mark.gpu
def test_on_cuda_the_engine_matches_reference(case):
    """Every layer on the GPU: KDA, latent attention and its indexer, the streams, the clamped experts in torch."""
    model, folder = case
    same, error = cached_decode(model, Engine(open_checkpoint(folder), device="cuda"), BASE["vocab_size"], 70, 9)
    assert same and error <= TOLERANCE


@pytest.mark.parametrize("streams,tokens,iters", [(4, 1, 20), (2, 7, 1), (3, 5, 5)])
def test_native_hyper_weights_are_the_torch_ops_within_float32_rounding(streams, tokens, iters):
    """cpu_hyper.h against hyper_weights (transformers' ops), on projections large enough to saturate the gates."""
    from moetier.backends import cpu_kernels
    from moetier.engine.hyper import HyperWeights, hyper_weights
    from moetier.model.spec_hybrid import HyperConnections

    kernel = cpu_kernels.decode_kernel()
    if kernel is None:
        pytest.skip(f"no native kernels: {cpu_kernels.status()}")
    g = torch.Generator().manual_seed(streams * 100 + tokens)
    width = (2 + streams) * streams
    w = HyperWeights(torch.empty(0), torch.randn(width, generator=g), torch.rand(3, generator=g) * 3)
    hyper = HyperConnections(streams=streams, sinkhorn_iters=iters, eps=1e-6)
    mix = torch.randn(tokens, width, generator=g) * 4
    native = kernel.hyper_weights(mix, w.base, w.scale, streams, iters, 1e-6)
    for ours, theirs in zip(native, hyper_weights(mix, w, hyper)):
        assert ours.shape == theirs.shape
        assert torch.allclose(ours, theirs, rtol=2e-6, atol=1e-7), float((ours - theirs).abs().max())
    comb = native[2]
    assert torch.allclose(comb.sum(dim=-2), torch.ones(tokens, streams), atol=1e-3)  # the columns' sums: s / (s + eps)
    with pytest.raises(ValueError, match="hyper_weights: mix"):
        kernel.hyper_weights(mix[:, :-1].contiguous(), w.base, w.scale, streams, iters, 1e-6)


def test_chunked_kda_over_several_chunk_groups_is_the_recurrence():
    """A 300-token prefill crosses two chunk groups (and pads its last chunk): the chunked form's outputs and final
    state equal the one-token recurrence's, starting from a non-zero state."""
    from types import SimpleNamespace

    from moetier.engine import kda

    g = torch.Generator().manual_seed(3)
    T, H, d = 300, 2, 8
    assert T > kda.CHUNK * kda.CHUNK_GROUP
    q, k = (kda.l2norm(torch.randn(T, H, d, generator=g)) for _ in range(2))
    v = torch.randn(T, H, d, generator=g)
    decay = -0.3 * torch.rand(T, H, d, generator=g)  # log decays in (-0.3, 0]
    beta = torch.sigmoid(torch.randn(T, H, generator=g))
    start = torch.randn(H, d, d, generator=g) * 0.1
    chunked = SimpleNamespace(recurrent=start.clone())
    out = kda._chunked(q, k, v, decay, beta, chunked)
    stepped, steps = SimpleNamespace(recurrent=start.clone()), []
    for t in range(T):
        steps.append(kda._recurrent_step(q[t] * d**-0.5, k[t], v[t], decay[t], beta[t], stepped))
    assert torch.allclose(out, torch.stack(steps), atol=2e-5), float((out - torch.stack(steps)).abs().max())
    assert torch.allclose(chunked.recurrent, stepped.recurrent, atol=2e-5)


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_native_kda_prefill_is_the_chunked_form_within_float32_rounding(lower_bound):
    """A 150-token prefill through the native mixer (the recurrence, token by token) against kda_layer's torch
    chunked form, from non-zero conv and delta-rule states: outputs and both final states."""
    from moetier.backends import cpu_kernels
    from moetier.engine.deltanet import DeltaNetState
    from moetier.engine.kda import KdaWeights, kda_layer
    from moetier.engine.linear import StoredLinear
    from moetier.model.spec_hybrid import LinearAttention

    kernel = cpu_kernels.decode_kernel()
    if kernel is None:
        pytest.skip(f"no native kernels: {cpu_kernels.status()}")
    g = torch.Generator().manual_seed(11)
    H, d, K, D, T = 3, 16, 4, 40, 150
    geometry = LinearAttention(H, H, d, d, K, kind="kda", lower_bound=lower_bound)
    linear = lambda rows, cols: StoredLinear([(torch.randn(rows, cols, generator=g) * 0.2, 0)], None, False, "cpu")  # noqa: E731
    w = KdaWeights(in_proj=linear(3 * H * d + H + 2 * d, D), forget_up=linear(H * d, d), gate_up=linear(H * d, d),
                   conv=torch.randn(3 * H * d, K, generator=g) * 0.5, dt_bias=torch.randn(H * d, generator=g) * 0.1,
                   decay_rate=torch.rand(H, generator=g) + 0.5, norm=torch.rand(d, generator=g) + 0.5, out_proj=linear(D, H * d))
    x = torch.randn(T, D, generator=g)
    states = []
    for native in (kernel, None):
        state = DeltaNetState(geometry, torch.device("cpu"))
        state.conv, state.recurrent = torch.randn(state.conv.shape, generator=torch.Generator().manual_seed(1)), \
            torch.randn(state.recurrent.shape, generator=torch.Generator().manual_seed(2)) * 0.1
        states.append((kda_layer(w, geometry, x, state, 1e-5, native), state))
    (got, mine), (want, theirs) = states
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), float((got - want).abs().max())
    assert torch.allclose(mine.recurrent, theirs.recurrent, rtol=1e-4, atol=1e-5)
    assert torch.equal(mine.conv, theirs.conv)


def test_native_kda_mixer_refuses_what_it_cannot_read():
    from moetier.backends import cpu_kernels

    kernel = cpu_kernels.decode_kernel()
    if kernel is None:
        pytest.skip(f"no native kernels: {cpu_kernels.status()}")
    H, d, K, T = 2, 8, 4, 3
    args = dict(mixed=torch.zeros(T, 3 * H * d), b=torch.zeros(T, H), forget=torch.zeros(T, H * d), gate=torch.zeros(T, H * d),
                conv_state=torch.zeros(3 * H * d, K - 1), state=torch.zeros(H, d, d), conv=torch.zeros(3 * H * d, K),
                dt_bias=torch.zeros(H * d), decay_rate=torch.ones(H), norm=torch.ones(d), lower_bound=-5.0, eps=1e-5)
    assert kernel.kda_mix(**args).shape == (T, H * d)
    for name, bad in (("forget", torch.zeros(T, H * d + 1)), ("state", torch.zeros(H, d, d).transpose(1, 2)),
                      ("b", torch.zeros(T, H).double()), ("gate", torch.zeros(T + 1, H * d)), ("mixed", torch.zeros(3 * H * d))):
        with pytest.raises(ValueError, match=f"kda_mix: {name}") as err:
            kernel.kda_mix(**{**args, name: bad})
        assert "\n" not in str(err.value)
