"""The native decode step (moetier/engine/native_step.py, cpu_step.h) against the engine's per-layer Python path.

Models: synthetic checkpoints of the three architectures (softmax and sigmoid
routers, router groups, a correction bias, shared experts, dense first layers,
qk-norm, partial rotary, GQA, a sliding window) as HF float32 folders, a bf16
copy, and GGUFs whose experts and trunk matrices are stored in block formats
(tests/gguf_blocks.py), and small random qwen3_next checkpoints written by
transformers (linear attention, gated attention, a gated shared expert;
against transformers too). Both paths decode the same tokens teacher-forced
from the same prefill, each with its own KV cache; the step must give the
Python path's logits to float32 rounding on float weights, and on quantized
ones the same tokens with logits within the few activation quanta a rounding
flip moves. Also: the same bits for any pool size, the linear layers' states
passed between the step and the Python path on one cache, decoding past the
KV cache's first capacity and the window, the router bias and observer, and who takes
the Python path.
"""

from __future__ import annotations

import contextlib
import json

import numpy as np
import pytest
import torch
from gguf_blocks import restored
from reference_checks import decode_both, decode_per_pool_size, pieces_both, python_path
from safetensors.torch import load_file, save_file

from moetier.engine import Engine
from moetier.engine.generate import NonFiniteLogits, generate, greedy_step
from moetier.engine.router_bias import RouterBias
from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("step")
    out = {}
    for arch in ("qwen3_moe", "glm4_moe", "mixtral"):
        out[arch] = write_synthetic(root / arch, arch=arch, preset="tiny", seed=5)
    bf16 = out["bf16"] = root / "bf16"  # a HF bf16 folder: bf16 trunk and experts, float32 activations
    bf16.mkdir()
    (bf16 / "config.json").write_text((out["qwen3_moe"] / "config.json").read_text())
    tensors = load_file(out["qwen3_moe"] / "model.safetensors")
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, bf16 / "model.safetensors")
    blocks = write_synthetic(root / "blocks", arch="qwen3_moe", preset="blocks", seed=6)
    f32 = write_gguf(blocks, root / "blocks.gguf")[0]
    out["blocks-F32"] = f32
    # trunk and experts quantized: the step's projections read K-quants, 32-value blocks and floats in one layer
    out["blocks-mixed"] = restored(f32, root / "mixed.gguf", {"*attn_q.*": "Q4_K", "*attn_k.*": "Q4_K", "*attn_v.*": "Q6_K",
                                                              "*attn_output*": "Q8_0", "*ffn_down_exps*": "Q6_K",
                                                              "*_exps*": "Q4_K", "output.weight": "Q8_0"})
    out["blocks-IQ3_S"] = restored(f32, root / "iq3.gguf", {"*_exps*": "IQ3_S", "*attn_q.*": "Q5_0", "*attn_k.*": "Q4_1",
                                                          "*attn_v.*": "IQ4_NL", "*attn_output*": "IQ4_XS"})
    # llama.cpp's lowest-bit formats, trunk and experts
    out["blocks-low-bit"] = restored(f32, root / "low.gguf", {"*ffn_down_exps*": "IQ1_M", "*_exps*": "IQ2_XXS",
                                                              "*attn_q.*": "IQ2_S", "*attn_k.*": "IQ2_XS",
                                                              "*attn_v.*": "MXFP4", "*attn_output*": "IQ1_S"})
    return out


RNG_IDS = np.random.default_rng(0).integers(0, 200, 40).tolist()


@pytest.mark.parametrize("name", ["qwen3_moe", "glm4_moe", "mixtral", "bf16", "blocks-F32"])
def test_float_weights_give_the_python_paths_logits(models, name):
    native, python = decode_both(Engine(open_checkpoint(models[name])), RNG_IDS, 9)
    scale = np.abs(python).max()
    assert np.abs(native - python).max() <= 1e-5 * scale
    assert (native.argmax(1) == python.argmax(1)).all()


@pytest.mark.parametrize("name", ["blocks-mixed", "blocks-IQ3_S", "blocks-low-bit"])
def test_quantized_weights_give_the_python_paths_tokens(models, name):
    native, python = decode_both(Engine(open_checkpoint(models[name])), RNG_IDS, 9)
    scale = np.abs(python).max()
    assert np.abs(native - python).max() <= 2e-2 * scale
    assert np.median(np.abs(native - python).max(1)) <= 1e-4 * scale
    assert (native.argmax(1) == python.argmax(1)).mean() >= 0.9


def test_the_same_bits_whatever_the_pool_size(models):
    runs = decode_per_pool_size(open_checkpoint(models["blocks-mixed"]), RNG_IDS[:20], 5)
    assert all(np.array_equal(runs[0], other) for other in runs[1:])


def test_decoding_past_the_cache_capacity_and_a_sliding_window(models, tmp_path):
    folder = tmp_path / "window"
    folder.mkdir()
    for item in models["mixtral"].iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"sliding_window": 7}))
    engine = Engine(open_checkpoint(folder))
    assert engine.spec.sliding_window == 7
    ids = np.random.default_rng(1).integers(0, 200, 262).tolist()  # 256 cached positions, then growth
    native, python = decode_both(engine, ids, 250)
    assert np.abs(native - python).max() <= 1e-5 * np.abs(python).max()


def test_the_router_bias_and_the_observer_see_what_the_python_path_sees(models):
    engine = Engine(open_checkpoint(models["glm4_moe"]))
    spec = engine.spec
    table = torch.randn(len(spec.moe_layers), spec.num_experts, generator=torch.Generator().manual_seed(3)) * 0.2
    table[:, 0] = float("-inf")  # never picked
    engine.set_router_bias(RouterBias(table))
    seen = {True: [], False: []}
    for native in (True, False):
        engine.observer = lambda layer, route, native=native: seen[native].append((layer, route))
        cache = engine.new_cache()
        with contextlib.nullcontext() if native else python_path(engine):
            engine.forward(torch.tensor(RNG_IDS[:4]), cache)
            del seen[native][:]
            for t in RNG_IDS[4:12]:
                engine.forward(torch.tensor([t]), cache)
    assert [layer for layer, _ in seen[True]] == [layer for layer, _ in seen[False]] == list(spec.moe_layers) * 8
    for (_, a), (_, b) in zip(seen[True], seen[False]):
        assert torch.equal(a.picks, b.picks) and 0 not in a.picks
        torch.testing.assert_close(a.weights, b.weights, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.probs, b.probs, rtol=1e-5, atol=1e-6)
    engine.set_router_bias(RouterBias(table, damped=True))
    assert not engine._native_decode()  # damped weights: the Python router


def test_greedy_decode_picks_what_the_steps_logits_pick(models):
    """Engine.decode_greedy (the cache's held call: no tensor a token) returns the argmax of the very logits forward
    gives for the same token, past the cache's first capacity and the rotary table's first length (256), with a router
    bias; the logits step returns stay the caller's; generate's greedy ids are its keep_logits path's."""
    engine = Engine(open_checkpoint(models["blocks-mixed"]))
    spec = engine.spec
    engine.set_router_bias(RouterBias(torch.randn(len(spec.moe_layers), spec.num_experts,
                                                  generator=torch.Generator().manual_seed(4)) * 0.3))
    ids = np.random.default_rng(2).integers(0, 200, 262).tolist()
    greedy, stepped = engine.new_cache(), engine.new_cache()
    for cache in (greedy, stepped):
        engine.forward(torch.tensor(ids[:4]), cache)
    kept = engine.forward(torch.tensor([ids[4]]), stepped)[0]
    first = kept.clone()
    engine.decode_greedy(ids[4], greedy)
    for token in ids[5:]:
        top, value = engine.decode_greedy(token, greedy)
        logits = engine.forward(torch.tensor([token]), stepped)[0]
        assert top == int(torch.argmax(logits)) and value == float(logits[top])
    assert greedy.length == stepped.length == len(ids) and torch.equal(kept, first)
    fast, kept_logits = (generate(engine, ids[:9], 12, keep_logits=keep) for keep in (False, True))
    assert fast.ids == kept_logits.ids and len(fast.ids) == 12


def test_greedy_decode_refuses_a_non_finite_top_logit(models, tmp_path):
    folder = tmp_path / "nan-head"
    folder.mkdir()
    (folder / "config.json").write_text((models["qwen3_moe"] / "config.json").read_text())
    tensors = load_file(models["qwen3_moe"] / "model.safetensors")
    tensors["lm_head.weight"][7] = float("nan")
    save_file(tensors, folder / "model.safetensors")
    engine = Engine(open_checkpoint(folder))
    assert engine.decode_path().startswith("native step")
    cache = engine.new_cache()
    engine.forward(torch.tensor(RNG_IDS[:4]), cache)
    top, value = engine.decode_greedy(RNG_IDS[4], cache)
    assert top == 7 and np.isnan(value)  # a NaN before any number, as torch.argmax
    with pytest.raises(NonFiniteLogits, match="token 7: nan"):
        greedy_step(engine, RNG_IDS[5], cache)  # what generate and stream_tokens decode with


def test_who_takes_the_python_path_and_why(models, monkeypatch):
    checkpoint = open_checkpoint(models["qwen3_moe"])
    engine = Engine(checkpoint)
    assert engine.decode_path().startswith("native step")
    numpy_engine = Engine(checkpoint, backend="numpy")
    assert numpy_engine.native_step is None and "native kernels" in numpy_engine.decode_path()
    monkeypatch.setenv("MOETIER_NATIVE_STEP", "0")
    assert Engine(checkpoint).native_step is None
    for token in (-1, engine.spec.vocab_size):
        with pytest.raises(ValueError, match=rf"token id {token} is outside the vocabulary \[0, {engine.spec.vocab_size}\)"):
            engine.native_step.step(token, engine.new_cache(), 0)


@pytest.mark.parametrize("start, tokens, window, heads, groups, d", [
    (0, 37, None, 6, 2, 24), (20, 5, None, 6, 2, 24), (11, 19, 6, 6, 2, 24), (300, 1, 7, 6, 2, 24), (0, 1, None, 6, 2, 24),
    # one query block over more than 256 keys: its keys cut in ranges, merged after (with a window, from its start)
    (600, 1, None, 16, 2, 128), (700, 9, 500, 6, 3, 20), (3990, 3, None, 4, 1, 24), (1000, 16, 999, 8, 8, 16)])
def test_the_native_attention_is_sdpas(start, tokens, window, heads, groups, d):
    from moetier.backends import cpu_kernels
    from moetier.engine.layers import attend, attention_mask

    kernel = cpu_kernels.decode_kernel(2)
    g = torch.Generator().manual_seed(start + tokens)
    capacity = 4096
    q = torch.randn(heads, tokens, d, generator=g)
    keys, values = torch.randn(groups, capacity, d, generator=g), torch.randn(groups, capacity, d, generator=g)
    end = start + tokens
    expected = attend(q, keys[:, :end], values[:, :end], attention_mask(start, tokens, window, torch.device("cpu")))
    got = kernel.attention(q, keys, values, start, window)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(got, cpu_kernels.decode_kernel(1).attention(q, keys, values, start, window))  # any pool size
    with pytest.raises(ValueError, match="outside a cache of 4096"):
        kernel.attention(q, keys, values, capacity - tokens + 1, window)
    with pytest.raises(ValueError, match="G dividing H"):
        kernel.attention(q[:3], torch.zeros(2, capacity, d), torch.zeros(2, capacity, d), start, window)


def test_two_threads_decode_two_sequences_on_one_engine(models):
    """Each call's stream, routes and cache addresses are its own: two sequences decoded at once on one engine give
    the logits they give one after the other."""
    import threading

    engine = Engine(open_checkpoint(models["qwen3_moe"]))
    prompts = [RNG_IDS[:6], RNG_IDS[10:17]]

    def decode(prompt, out):
        cache = engine.new_cache()
        engine.forward(torch.tensor(prompt), cache)
        out.extend(engine.forward(torch.tensor([t]), cache)[0].numpy() for t in RNG_IDS[20:40])

    alone = [[], []]
    for prompt, out in zip(prompts, alone):
        decode(prompt, out)
    together = [[], []]
    threads = [threading.Thread(target=decode, args=(p, o)) for p, o in zip(prompts, together)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(np.array_equal(np.stack(a), np.stack(b)) for a, b in zip(alone, together))


# -- qwen3_next: Gated DeltaNet linear attention, gated full attention, a gated shared expert --------------------------
# small random checkpoints written by transformers (drawn as tests/test_qwen3_next.py draws them): value heads grouped
# two to a key head or one each, value head dims 12 and 7 (not multiples of 8: the vector loops' tails), a 3-tap conv,
# attention biases and MHA, dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step), tied embeddings
NEXT = dict(vocab_size=96, hidden_size=48, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=24, shared_expert_intermediate_size=32,
            num_experts=8, num_experts_per_tok=3, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=12)
NEXT_CASES = {
    "grouped": dict(),
    "equal-tied-sparse": dict(linear_num_key_heads=3, linear_num_value_heads=3, linear_key_head_dim=12,
                              linear_value_head_dim=7, linear_conv_kernel_dim=3, decoder_sparse_step=2,
                              norm_topk_prob=False, tie_word_embeddings=True),
    "bias-mha-dense": dict(num_hidden_layers=5, layer_types=["full_attention", "linear_attention", "linear_attention",
                                                             "full_attention", "linear_attention"],
                           num_key_value_heads=4, attention_bias=True, mlp_only_layers=[2], linear_num_value_heads=6,
                           linear_value_head_dim=8),
}
NEXT_IDS = np.random.default_rng(4).integers(0, NEXT["vocab_size"], 86).tolist()  # a 70-token prompt, 16 decoded


def next_reference(overrides: dict, seed: int):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**(NEXT | overrides))).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.normal_(0.0, 0.5 if "norm" in name else 0.1)
    return model


@pytest.fixture(scope="module", params=sorted(NEXT_CASES))
def next_case(request, tmp_path_factory):
    model = next_reference(NEXT_CASES[request.param], seed=len(request.param))
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    return model, folder


def test_qwen3_next_decodes_natively_to_the_python_paths_logits(next_case):
    """Prefill (Python, the chunked rule) then the step's decode, against prefill and decode both in Python."""
    engine = Engine(open_checkpoint(next_case[1]))
    assert engine.decode_path().startswith("native step")
    native, python = decode_both(engine, NEXT_IDS, 70)
    assert np.abs(native - python).max() <= 1e-5 * np.abs(python).max()  # 8.5e-6 at a logit scale of 3.2 at most here
    assert (native.argmax(1) == python.argmax(1)).all()


def test_qwen3_next_greedy_decode_matches_transformers(next_case):
    from moetier.engine import generate

    model, folder = next_case
    prompt = torch.tensor(NEXT_IDS[:70])
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=17, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    engine = Engine(open_checkpoint(folder))
    assert engine.native_step is not None
    result = generate(engine, prompt.tolist(), 17, keep_logits=True)
    assert result.ids == out.sequences[0, 70:].tolist()
    assert np.abs(result.logits - torch.stack(out.logits)[:, 0].numpy()).max() <= 1e-4


def test_qwen3_next_states_pass_between_the_step_and_the_python_path(next_case):
    """One cache, the two paths in turn: native decode, a Python forward of several tokens, native again (each reads
    the states the other left: the step updates them in place, the Python path replaces them), against all-Python."""
    engine = Engine(open_checkpoint(next_case[1]))
    native, python = pieces_both(engine, NEXT_IDS, [(0, 70), (70, 71), (71, 72), (72, 79), (79, 80), (80, 81)])
    assert (native - python).abs().max() <= 1e-5 * python.abs().max()


def test_qwen3_next_the_same_bits_whatever_the_pool_size(next_case):
    runs = decode_per_pool_size(open_checkpoint(next_case[1]), NEXT_IDS[:80], 70)
    assert all(np.array_equal(runs[0], other) for other in runs[1:])


def test_qwen3_next_refusals_and_state_checks(next_case):
    import dataclasses

    from moetier.engine.native_step import NativeStep

    engine = Engine(open_checkpoint(next_case[1]))
    cache = engine.new_cache()
    engine.forward(torch.tensor(NEXT_IDS[:5]), cache)
    layer = engine.spec.linear_layers[0]
    state = cache.states[layer]
    state.recurrent = state.recurrent.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides
    with pytest.raises(ValueError, match=rf"layer {layer}'s recurrent state must be float32 .* contiguous"):
        engine.forward(torch.tensor([3]), cache)
    spec = engine.spec
    engine.spec = dataclasses.replace(spec, linear_attention=dataclasses.replace(spec.linear_attention, value_dim=520))
    assert "value heads of 520 dims" in NativeStep.why_not(engine)
