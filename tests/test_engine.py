"""The engine against the transformers reference implementation.

Small random checkpoints written by transformers' own save_pretrained (per-expert
layout) and re-saved fused; teacher-forced logits, 16 cached decode steps and
greedy tokens must match within 1e-4 in float32. Configs vary the things that
change the arithmetic: top-k, norm_topk_prob, groups, shared experts, dense
first layers, qk-norm, attention biases, partial rotary, tied embeddings, GQA, and
Qwen3-Next's hybrid layers (tests/test_qwen3_next.py has more of those).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moetier.engine import Engine, generate, score
from moetier.model import open_checkpoint

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
BASE = dict(vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=12, moe_intermediate_size=24)

CASES = {
    "qwen3-norm-k4": ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=4, norm_topk_prob=True)),
    "qwen3-nonorm-k2-bias-mlp-only": ("qwen3_moe", dict(num_experts=6, num_experts_per_tok=2, norm_topk_prob=False,
                                                        attention_bias=True, mlp_only_layers=[1])),
    "qwen3-sparse-step-tied-mha": ("qwen3_moe", dict(num_experts=5, num_experts_per_tok=3, decoder_sparse_step=2,
                                                     tie_word_embeddings=True, num_key_value_heads=4)),
    "glm4-groups-shared-dense": ("glm4_moe", dict(n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                                                  n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5,
                                                  use_qk_norm=True, attention_bias=True, norm_topk_prob=True)),
    "glm4-nogroups-nonorm-2shared": ("glm4_moe", dict(n_routed_experts=8, num_experts_per_tok=2, n_group=1, topk_group=1,
                                                      n_shared_experts=2, first_k_dense_replace=0, norm_topk_prob=False,
                                                      partial_rotary_factor=1.0)),
    "glm4-groups-k1-two-dense": ("glm4_moe", dict(n_routed_experts=12, num_experts_per_tok=1, n_group=3, topk_group=1,
                                                  n_shared_experts=1, first_k_dense_replace=2, routed_scaling_factor=1.8)),
    "qwen3next-kh2-vh4-k3": ("qwen3_next", dict(num_experts=8, num_experts_per_tok=3, shared_expert_intermediate_size=32,
                                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                                                linear_value_head_dim=12, num_hidden_layers=4, head_dim=16)),
    "qwen3next-interval2-nonorm-mlp-only-bias": ("qwen3_next", dict(
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1], attention_bias=True,
        shared_expert_intermediate_size=16, linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12,
        linear_value_head_dim=8, full_attention_interval=2, num_hidden_layers=4, partial_rotary_factor=0.5)),
    "mixtral-k2": ("mixtral", dict(num_local_experts=8, num_experts_per_tok=2)),
    "mixtral-k3-window": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=3, sliding_window=6)),
}

CLASSES = {
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
}


def reference_model(arch: str, overrides: dict, seed: int):
    config_cls, model_cls = (getattr(transformers, name) for name in CLASSES[arch])
    kwargs = dict(BASE, **overrides)
    if arch == "mixtral":
        kwargs["intermediate_size"] = kwargs.pop("moe_intermediate_size")
    if "partial_rotary_factor" in kwargs:
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0,
                                     "partial_rotary_factor": kwargs.pop("partial_rotary_factor")}
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).eval()
    # larger than the default init, so routing and attention are not trivial; Qwen3-Next's somewhat smaller: at these
    # scales transformers' own float32 logits of its hybrid layers are ~1e-4 from its float64 ones (measured over four
    # seeds: 4e-5 to 1.1e-4), so the 1e-4 bar would judge float32 rounding, not the arithmetic (at 0.5 / 0.1: ~2e-5)
    norm_std, std = (0.5, 0.1) if arch == "qwen3_next" else (1.0, 0.15)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, norm_std if "norm" in name else std)
        for name, buffer in model.named_buffers():
            if "e_score_correction_bias" in name:
                buffer.normal_(0.0, 0.05)
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    arch, overrides = CASES[request.param]
    model = reference_model(arch, overrides, seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_teacher_forced_logits_match_reference(case):
    model, folder = case
    ids = torch.randint(0, BASE["vocab_size"], (24,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids[None]).logits[0].numpy()  # [T, V]
    got = score(Engine(open_checkpoint(folder)), ids.numpy())
    assert got.dtype == np.float32 and got.shape == expected.shape
    assert np.abs(got - expected).max() <= TOLERANCE


def test_cached_decode_and_greedy_tokens_match_reference(case):
    model, folder = case
    prompt = torch.randint(0, BASE["vocab_size"], (7,), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=17, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    expected_logits = torch.stack(out.logits)[:, 0].numpy()  # [17, V]: prefill, then 16 cached decode steps
    result = generate(Engine(open_checkpoint(folder)), prompt.tolist(), 17, keep_logits=True)
    assert result.ids == out.sequences[0, 7:].tolist()
    assert np.abs(result.logits - expected_logits).max() <= TOLERANCE


def fuse_experts(folder, out):
    """Rewrite a per-expert checkpoint with fused experts.gate_up_proj [E, 2I, D] / down_proj [E, D, I]."""
    checkpoint = open_checkpoint(folder)
    spec, tensors = checkpoint.spec, {}
    mlp = "block_sparse_moe" if spec.arch == "mixtral" else "mlp"
    for name in checkpoint.names():
        if ".experts." not in name or ".shared_experts." in name:
            tensors[name] = checkpoint.tensor(name).clone()
    for layer in spec.moe_layers:
        experts = [checkpoint.expert(layer, e) for e in range(spec.num_experts)]
        tensors[f"model.layers.{layer}.{mlp}.experts.gate_up_proj"] = torch.stack([w.gate_up for w in experts])
        tensors[f"model.layers.{layer}.{mlp}.experts.down_proj"] = torch.stack([w.down for w in experts])
    out.mkdir()
    save_file(tensors, out / "model.safetensors")
    (out / "config.json").write_text((folder / "config.json").read_text())
    return out


def test_fused_layout_gives_identical_logits(case, tmp_path):
    _, folder = case
    ids = np.arange(20) % BASE["vocab_size"]
    plain = score(Engine(open_checkpoint(folder)), ids)
    fused = score(Engine(open_checkpoint(fuse_experts(folder, tmp_path / "fused"))), ids)
    assert np.array_equal(plain, fused)


def test_numpy_backend_engine_matches_torch(case):
    _, folder = case
    ids = np.arange(3, 23) % BASE["vocab_size"]
    checkpoint = open_checkpoint(folder)
    torch_logits = score(Engine(checkpoint, backend="torch"), ids)
    numpy_logits = score(Engine(checkpoint, backend="numpy"), ids)
    assert np.abs(torch_logits - numpy_logits).max() <= 1e-5


def test_sampling_is_seeded_and_in_vocab(case):
    _, folder = case
    engine = Engine(open_checkpoint(folder))
    from moetier.engine import Sampling

    runs = [generate(engine, [1, 2, 3], 12, Sampling(temperature=1.0, top_p=0.9, top_k=20, seed=s)).ids for s in (5, 5, 6)]
    assert runs[0] == runs[1]
    assert all(0 <= t < BASE["vocab_size"] for t in runs[2])


def test_prefill_in_chunks_equals_one_pass(case):
    """A prompt fed in two forwards through the cache gives the same logits as one pass."""
    _, folder = case
    engine = Engine(open_checkpoint(folder))
    ids = torch.arange(5, 25) % BASE["vocab_size"]
    whole = engine.forward(ids, engine.new_cache())
    cache = engine.new_cache()
    first = engine.forward(ids[:11], cache)
    second = engine.forward(ids[11:], cache)
    assert torch.allclose(torch.cat([first, second]), whole, atol=1e-5)


def test_router_observer_sees_every_moe_layer(case):
    _, folder = case
    engine = Engine(open_checkpoint(folder))
    seen = []
    engine.observer = lambda layer, r: seen.append((layer, tuple(r.picks.shape), tuple(r.probs.shape)))
    score(engine, np.arange(9))
    spec = engine.spec
    assert [s[0] for s in seen] == list(spec.moe_layers)
    assert all(s[1] == (9, spec.top_k) and s[2] == (9, spec.num_experts) for s in seen)


def test_spec_agrees_with_reference_on_layer_kinds(case):
    """Which layers are MoE, and the routing constants, as transformers built them."""
    model, folder = case
    spec = open_checkpoint(folder).spec
    reference_moe = tuple(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    assert spec.moe_layers == reference_moe
    assert spec.top_k == model.config.num_experts_per_tok
