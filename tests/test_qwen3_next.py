"""Qwen3-Next (qwen3_next) against transformers' Qwen3NextForCausalLM on small random checkpoints.

The configs vary what changes the arithmetic of the hybrid layers: linear key /
value heads (grouped and equal) and their head dims, the conv kernel, where the
full-attention layers sit (`layer_types`, `full_attention_interval`), the
shared expert's width, top-k, norm_topk_prob, dense and sparse-step layers,
attention biases, tied embeddings, MHA. Sequences are longer than one prefill
chunk (64 tokens) so the state is carried between chunks, and decode starts
after a prompt that crosses a chunk: teacher-forced logits over 80 positions
and 16 cached decode steps within 1e-4 in float32, identical greedy tokens;
prefill in pieces equals one pass. (The weights are drawn at 0.1 / 0.5 for
norms: see tests/test_engine.reference_model for why.)
"""

from __future__ import annotations

import pytest
import torch

from moetier.engine import Engine
from moetier.model import open_checkpoint
from moetier.model.spec import ModelSpec, SpecError
from reference_checks import cached_decode, teacher_forced_error

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
POSITIONS = 80
BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, shared_expert_intermediate_size=32,
            num_experts=8, num_experts_per_tok=3, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12)

CASES = {
    # the default geometry in small: value heads grouped two per key head, full attention every 4th layer
    "grouped-heads": dict(),
    "equal-heads-kernel3-sparse-step": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12,
                                            linear_value_head_dim=8, linear_conv_kernel_dim=3, decoder_sparse_step=2,
                                            num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=True),
    "layer-types-mha-bias-dense": dict(num_hidden_layers=5, layer_types=["full_attention", "linear_attention",
                                                                         "linear_attention", "full_attention",
                                                                         "linear_attention"],
                                       num_key_value_heads=4, attention_bias=True, mlp_only_layers=[2],
                                       shared_expert_intermediate_size=8, num_experts_per_tok=4,
                                       linear_num_value_heads=6, linear_value_head_dim=8),
}


def reference(overrides: dict, seed: int):
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**(BASE | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    model = reference(CASES[request.param], seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_spec_reads_the_layer_kinds_as_transformers_builds_them(case):
    model, folder = case
    spec = open_checkpoint(folder).spec
    layers = model.model.layers
    assert spec.linear_layers == tuple(i for i, l in enumerate(layers) if hasattr(l, "linear_attn"))
    assert spec.moe_layers == tuple(i for i, l in enumerate(layers) if hasattr(l.mlp, "experts"))
    assert spec.rotary_dim == model.model.rotary_emb.inv_freq.numel() * 2


def test_teacher_forced_logits_match_reference(case):
    model, folder = case
    assert teacher_forced_error(model, folder, BASE["vocab_size"], POSITIONS) <= TOLERANCE


def test_cached_decode_after_a_long_prompt_matches_reference(case):
    """A 70-token prompt (two prefill chunks) then 16 decode steps on the carried conv and recurrent states."""
    model, folder = case
    same, error = cached_decode(model, Engine(open_checkpoint(folder)), BASE["vocab_size"], 70, 17)
    assert same and error <= TOLERANCE


@pytest.mark.parametrize("cut", [1, 37, 64, 79])
def test_prefill_in_pieces_equals_one_pass(case, cut):
    """The states carried between forwards (mid-chunk, on a chunk edge, one token then the rest) give one pass's logits,
    within float32 rounding: pieces align the 64-token chunks differently, so the sums run in another order
    (2.5e-5 at most here)."""
    _, folder = case
    engine = Engine(open_checkpoint(folder))
    ids = torch.arange(3, 3 + POSITIONS) % BASE["vocab_size"]
    whole = engine.forward(ids, engine.new_cache())
    cache = engine.new_cache()
    pieces = torch.cat([engine.forward(ids[:cut], cache), engine.forward(ids[cut:], cache)])
    assert (pieces - whole).abs().max() <= TOLERANCE


def test_cache_holds_states_for_linear_layers_and_kv_for_the_rest(case):
    _, folder = case
    engine = Engine(open_checkpoint(folder))
    spec, cache = engine.spec, engine.new_cache()
    g = spec.linear_attention
    engine.forward(torch.arange(10), cache)
    for layer in range(spec.num_layers):
        if spec.is_linear(layer):
            assert cache.keys[layer] is None
            assert tuple(cache.states[layer].recurrent.shape) == (g.value_heads, g.key_dim, g.value_dim)
            assert tuple(cache.states[layer].conv.shape) == (g.conv_channels, g.conv_kernel - 1)
        else:
            assert layer not in cache.states and cache.keys[layer].shape[0] == spec.num_kv_heads
    assert engine.decode_path().startswith("native step")  # a decoded token runs every layer natively (test_native_step)


def _config(**changes) -> dict:
    return transformers.Qwen3NextConfig(**(BASE | changes)).to_dict()


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["linear_attention", "full_attention"]), "layer_types"),
    (dict(linear_num_key_heads=3, linear_num_value_heads=4), "linear_num_value_heads 4 is not a multiple of linear_num_key_heads 3"),
    (dict(linear_conv_kernel_dim=0), "linear_conv_kernel_dim"),
    (dict(shared_expert_intermediate_size=0), "shared_expert_intermediate_size"),
])
def test_bad_configs_are_refused_in_one_line(changes, message):
    config = _config()
    config.update(changes)
    with pytest.raises(SpecError, match=message) as error:
        ModelSpec.from_hf_config(config, source="config.json")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("key_heads, value_heads, dk, dv", [(2, 4, 8, 12), (16, 32, 128, 128), (3, 3, 5, 7)])
def test_the_native_mixer_is_the_torch_mixer(key_heads, value_heads, dk, dv):
    """One decoded token of a Gated DeltaNet layer between its projections: cpu_deltanet.h's mixer against the torch
    path of deltanet_layer (transformers' recurrence), from the same random states: float32 rounding apart, states
    too, and bit for bit whatever the pool size (each key head is one thread's)."""
    from moetier.backends import cpu_kernels
    from moetier.engine.deltanet import DeltaNetState, DeltaNetWeights, deltanet_layer
    from moetier.model.spec_hybrid import LinearAttention

    kernel = cpu_kernels.decode_kernel()
    if kernel is None:
        pytest.skip(f"no native kernels here: {cpu_kernels.status()}")
    g = LinearAttention(key_heads, value_heads, dk, dv, 4)
    gen = torch.Generator().manual_seed(dv)

    class Identity:  # the projections left out: the mixer's input and output as they are
        def __call__(self, x):
            return x

    w = DeltaNetWeights(Identity(), torch.randn(g.conv_channels, 4, generator=gen) * 0.5,
                        torch.randn(value_heads, generator=gen), -torch.rand(value_heads, generator=gen),
                        torch.randn(dv, generator=gen), Identity())
    projected = torch.randn(1, g.conv_channels + g.value_width + 2 * value_heads, generator=gen)
    start = DeltaNetState(g, torch.device("cpu"))
    start.conv, start.recurrent = torch.randn(*start.conv.shape, generator=gen), torch.randn(*start.recurrent.shape, generator=gen)

    def run(kernel):
        state = DeltaNetState(g, torch.device("cpu"))
        state.conv, state.recurrent = start.conv.clone(), start.recurrent.clone()
        return deltanet_layer(w, g, projected.clone(), state, 1e-6, kernel), state

    (expected, reference), (got, state), (again, other) = run(None), run(kernel), run(cpu_kernels.decode_kernel(1))
    assert (got - expected).abs().max() <= 1e-5 * max(1.0, expected.abs().max().item())
    assert (state.recurrent - reference.recurrent).abs().max() <= 1e-5 and torch.equal(state.conv, reference.conv)
    assert torch.equal(got, again) and torch.equal(state.recurrent, other.recurrent)
    with pytest.raises(ValueError, match="deltanet_mix: projected must be float32"):
        kernel.deltanet_mix(projected[0].double(), state.conv, state.recurrent, w.conv, w.dt_bias, w.decay_rate, w.norm,
                            key_heads, 1e-6)


def test_the_per_layer_decode_path_matches_reference(case):
    """Decoding layer by layer from Python (as under a layout, or with the step timer on: the native mixer between
    the projections) against transformers, and its breakdown names the linear layers' time."""
    from moetier.engine.timing import StepTimes

    model, folder = case
    engine = Engine(open_checkpoint(folder))
    engine.times = StepTimes()
    same, error = cached_decode(model, engine, BASE["vocab_size"], 70, 9, seed=3)
    assert same and error <= TOLERANCE
    assert engine.times.seconds["linear attention"] > 0


@pytest.mark.gpu
def test_on_cuda_the_engine_matches_reference(case):
    """Every layer on the GPU (the torch path of the DeltaNet layers, the stored trunk dequantized on the device)."""
    model, folder = case
    same, error = cached_decode(model, Engine(open_checkpoint(folder), device="cuda"), BASE["vocab_size"], 70, 9)
    assert same and error <= TOLERANCE
