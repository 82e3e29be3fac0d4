"""Drawn configs of the seed's two families against transformers: what "other configs than yours" will try.

Each case draws one small random `qwen3_next` or `glm5_next` config from a fixed seed (sizes, head counts, the
layer patterns, conv kernel, rope share, groups, shared experts including none, pool sizes, index_topk around
the length, hc_mult and Sinkhorn iterations, swiglu_limit, scaling, epsilons, tied embeddings), writes it with
save_pretrained and compares moetier with transformers as the per-family tests do:

- teacher-forced logits over 70 positions: moetier within 1e-4 (or within transformers' own float32 distance)
  of transformers run in float64, and max |dlogit| <= 1e-4 against transformers in float32 unless float32
  itself is that coarse on the draw (transformers' float32 over 5e-5 from its float64): two of 28 qwen3_next
  models drawn while writing this put transformers' float32 1.0e-4 and 5.4e-5 from its float64 logits
  (moetier 1.2e-4 and 1.1e-4 from transformers, 2.1e-5 and 8.7e-5 from float64);
- a 40-token prompt and 12 greedy steps (the native decode step): identical tokens, max |dlogit| <= 1e-4 at
  every step; on glm5_next, where they part, the first step that parts must be a position whose indexer top-k
  boundary falls on tied pool scores (glm5_next_files.boundary_ties). There torch.topk's choice among exactly
  tied scores depends on the other scores' last bits (it partitions by them), which float32 sums in another
  order do not keep. One draw of the first 24 parts so (seed 5: at its first step, 0.33 in a logit); transformers'
  own full forward over the same tokens parts from its cached decode there by up to 0.68 (docs/kernels.md).

40 draws of each family: 4 in the fast suite (~2 s), the rest slow (~35 s on 2 cores). And, marked `peer`, 10
draws of each moved into what llama.cpp runs (for_llama_cpp), written as F32 GGUF by moetier and run by both; and
one widened to whole blocks in llama.cpp's IQ3_XXS (its IQ2_S attn_q included).
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from glm5_next_files import boundary_ties, build_glm5_next
from qwen3_next_files import build_qwen3_next, save_qwen3_next
from reference_checks import random_ids

from moetier.engine import Engine, generate, score
from moetier.model import open_checkpoint

transformers = pytest.importorskip("transformers")

TOLERANCE = 1e-4
POSITIONS, PROMPT, STEPS = 70, 40, 12


def draw_glm5_next(rng: random.Random) -> dict:
    layers = rng.randint(2, 6)
    types = [rng.choice(["linear_attention", "indexed_attention"]) for _ in range(layers)]
    indexers = ["full"] * layers
    for i in range(1, layers):  # transformers hands a selection on only from a full indexed layer right before
        if types[i] == types[i - 1] == "indexed_attention" and indexers[i - 1] == "full" and rng.random() < 0.4:
            indexers[i] = "shared"
    experts = rng.choice([4, 6, 8, 12])
    groups = rng.choice([g for g in (1, 2, 4) if experts % g == 0 and experts // g >= 2])  # top-2 per group
    k = rng.randint(1, min(4, experts))
    topk_group = max(rng.randint(1, groups), -(-k * groups // experts))
    pool = rng.choice([1, 2, 4, 16])
    dense = rng.randint(0, layers - 1)
    return dict(vocab_size=rng.choice([64, 97, 128]), hidden_size=rng.choice([32, 48, 64]),
                intermediate_size=rng.choice([40, 80]), moe_intermediate_size=rng.choice([16, 24, 36]),
                num_hidden_layers=layers, num_attention_heads=(heads := rng.choice([1, 2, 3, 4])), num_key_value_heads=heads,
                n_routed_experts=experts, num_experts_per_tok=k, n_group=groups, topk_group=topk_group,
                kv_lora_rank=rng.choice([8, 16, 24]), q_lora_rank=rng.choice([12, 24]),
                qk_nope_head_dim=rng.choice([8, 12, 16]), v_head_dim=rng.choice([8, 12, 16]),
                index_head_dim=rng.choice([4, 8, 16]), index_n_heads=rng.choice([1, 2, 4]),
                linear_head_dim=rng.choice([8, 16]), linear_num_heads=rng.choice([1, 2, 3, 5]),
                linear_conv_kernel_dim=rng.choice([2, 3, 4, 5]), hc_mult=rng.choice([1, 2, 3, 4]),
                hc_sinkhorn_iters=rng.choice([1, 3, 20]), index_kpool=pool, index_topk=pool * rng.choice([1, 2, 3, 5, 20]),
                index_kpool_always_select_tail=rng.random() < 0.7, pad_token_id=0, layer_types=types,
                indexer_types=indexers, mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
                n_shared_experts=rng.choice([0, 1, 2]), swiglu_limit=rng.choice([0.5, 10.0, 100.0]),
                routed_scaling_factor=rng.choice([1.0, 2.5, 0.7]), norm_topk_prob=rng.random() < 0.7,
                linear_lower_bound=rng.choice([None, -5.0, -1.0]), attention_bias=rng.random() < 0.3,
                rms_norm_eps=rng.choice([1e-5, 1e-6]), hc_eps=rng.choice([1e-6, 1e-3]),
                tie_word_embeddings=rng.random() < 0.3)


def draw_qwen3_next(rng: random.Random) -> dict:
    layers = rng.randint(2, 6)
    kv, lk = rng.choice([1, 2, 4]), rng.choice([1, 2, 3])
    types = [rng.choice(["linear_attention", "full_attention"]) for _ in range(layers)]
    types[rng.randrange(layers)] = "full_attention"  # transformers' generate wants one attention layer in its cache
    experts = rng.choice([4, 8, 12])
    return dict(vocab_size=rng.choice([64, 97]), hidden_size=rng.choice([32, 48, 64]), intermediate_size=rng.choice([40, 64]),
                num_hidden_layers=layers, num_attention_heads=kv * rng.choice([1, 2, 3]), num_key_value_heads=kv,
                head_dim=rng.choice([8, 16, 32]), moe_intermediate_size=rng.choice([16, 24]),
                shared_expert_intermediate_size=rng.choice([8, 32]), num_experts=experts,
                num_experts_per_tok=rng.randint(1, min(6, experts)), linear_num_key_heads=lk,
                linear_num_value_heads=lk * rng.choice([1, 2, 3]), linear_key_head_dim=rng.choice([8, 16]),
                linear_value_head_dim=rng.choice([8, 12, 16]), linear_conv_kernel_dim=rng.choice([2, 3, 4, 5]),
                layer_types=types, mlp_only_layers=sorted(rng.sample(range(1, layers), rng.randint(0, 1))),
                norm_topk_prob=rng.random() < 0.7, attention_bias=rng.random() < 0.3, rms_norm_eps=rng.choice([1e-6, 1e-5]),
                tie_word_embeddings=rng.random() < 0.3,
                rope_parameters={"rope_theta": rng.choice([10000.0, 1e6, 500.0]),
                                 "partial_rotary_factor": rng.choice([0.25, 0.5, 1.0]), "rope_type": "default"})


def for_llama_cpp(family: str, config: dict) -> dict:
    """The draw moved into what llama.cpp runs as transformers does (what moetier's GGUF writer refuses otherwise:
    moetier.model.gguf_write): one linear and one attention layer at least; qwen3next: every layer MoE, renormalised
    top-k, equal DeltaNet key and value widths, eps 1e-6, no biases; glm5-next: 4 streams, pools of 2 or more with
    the incomplete one attended, untied, no biases, KDA heads = attention heads, a shared expert, fewer groups kept than there are (or no groups)."""
    config = dict(config, layer_types=list(config["layer_types"]))
    kinds = ("linear_attention", "indexed_attention" if family == "glm5_next" else "full_attention")
    for at, kind in enumerate(kinds):
        if kind not in config["layer_types"]:
            config["layer_types"][at] = kind
    if family == "qwen3_next":
        return config | dict(mlp_only_layers=[], norm_topk_prob=True, linear_value_head_dim=config["linear_key_head_dim"],
                             rms_norm_eps=1e-6, attention_bias=False)
    config["indexer_types"] = ["shared" if t == "shared" and i and config["layer_types"][i - 1] == config["layer_types"][i] == kinds[1]
                               and config["indexer_types"][i - 1] == "full" else "full"
                               for i, t in enumerate(config["indexer_types"])]
    pool = max(2, config["index_kpool"])
    return config | dict(hc_mult=4, index_kpool=pool, index_topk=config["index_topk"] // config["index_kpool"] * pool,
                         index_kpool_always_select_tail=True, tie_word_embeddings=False, attention_bias=False,
                         linear_num_heads=config["num_attention_heads"], n_shared_experts=max(1, config["n_shared_experts"]),
                         **(dict(n_group=1, topk_group=1) if config["topk_group"] >= config["n_group"] else {}))


def build(family: str, seed: int, llama_cpp: bool = False):
    """(the transformers model of the seed's draw, its class, its vocabulary size); llama_cpp: for_llama_cpp's."""
    if family == "glm5_next":
        config = draw_glm5_next(random.Random(seed))
        config = for_llama_cpp(family, config) if llama_cpp else config
        tied = config.pop("tie_word_embeddings")
        return build_glm5_next(config, seed, tied=tied), transformers.Glm5NextForConditionalGeneration, config["vocab_size"]
    config = draw_qwen3_next(random.Random(seed))
    config = for_llama_cpp(family, config) if llama_cpp else config
    return build_qwen3_next(config, seed), transformers.Qwen3NextForCausalLM, config["vocab_size"]


FAST = 4  # draws in the fast suite; the rest are slow


@pytest.mark.parametrize("seed", [pytest.param(s, marks=[pytest.mark.slow] if s >= FAST else []) for s in range(40)])
@pytest.mark.parametrize("family", ["qwen3_next", "glm5_next"])
def test_a_drawn_config_matches_transformers(family, seed, tmp_path):
    model, cls, vocab = build(family, 1000 + seed)
    model.save_pretrained(tmp_path)
    checkpoint = open_checkpoint(tmp_path)

    ids = random_ids(vocab, POSITIONS, seed)
    with torch.no_grad():
        expected = model(ids[None]).logits[0].numpy()  # [T, V]
    got = score(Engine(checkpoint), ids.numpy())
    exact = cls.from_pretrained(tmp_path, experts_implementation="eager", dtype=torch.float64).eval()
    with torch.no_grad():
        truth = exact(ids[None]).logits[0].numpy()  # [T, V] float64
    error, own = float(np.abs(got - expected).max()), float(np.abs(expected - truth).max())
    assert float(np.abs(got - truth).max()) <= max(TOLERANCE, own)  # as near the float64 logits as transformers
    assert error <= TOLERANCE or own > TOLERANCE / 2, (error, own)  # past 1e-4 only where float32 is that coarse

    prompt = random_ids(vocab, PROMPT, seed + 1)
    with torch.no_grad():
        out = model.generate(prompt[None], max_new_tokens=STEPS, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
    reference, tokens = torch.stack(out.logits)[:, 0].numpy(), out.sequences[0, PROMPT:].tolist()  # [STEPS, V]
    engine = Engine(checkpoint)
    assert engine.decode_path().startswith("native step")
    result = generate(engine, prompt.tolist(), STEPS, keep_logits=True)
    error = np.abs(result.logits - reference[: len(result.logits)]).max(axis=1)  # [steps] per step
    apart = [i for i in range(STEPS) if i >= len(result.ids) or result.ids[i] != tokens[i] or error[i] > TOLERANCE]
    if apart and family == "glm5_next":  # it may part only where an indexer's top-k boundary ties (the docstring)
        ties = {p for tied in boundary_ties(checkpoint, prompt.tolist() + tokens).values() for p in tied}
        assert PROMPT - 1 + apart[0] in ties, (apart[0], sorted(ties))
    else:
        assert not apart, (apart, error.max())


@pytest.mark.peer
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("family", ["qwen3_next", "glm5_next"])
def test_a_drawn_config_runs_as_llama_cpp_runs_its_gguf(family, seed, tmp_path):
    """The draw within what llama.cpp runs (for_llama_cpp), written as F32 GGUF by moetier: teacher-forced logits over
    64 positions within 1e-4 of the logit scale of llama.cpp's (tests/test_peer_llama.llama_logits) -- on glm5_next
    up to the first position whose indexer top-k boundary ties, where std::partial_sort and torch.topk keep
    different pools (docs/gguf-glm5-next.md)."""
    from test_peer_llama import llama_logits

    from moetier.model.gguf_write import write_gguf

    model, _, vocab = build(family, 2000 + seed, llama_cpp=True)
    model.save_pretrained(tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", tmp_path / "model.gguf", "F32")[0]
    ids = random_ids(vocab, 64, seed).tolist()
    reference = llama_logits(path, ids)  # [T, V]
    error = np.abs(score(Engine(open_checkpoint(path)), np.asarray(ids)) - reference).max(axis=1)  # [T]
    scale = float(np.abs(reference).max())
    apart = np.flatnonzero(error > 1e-4 * scale)
    if apart.size and family == "glm5_next":
        ties = {p for tied in boundary_ties(open_checkpoint(path), ids).values() for p in tied}
        assert int(apart[0]) in ties, (int(apart[0]), sorted(ties))
    else:
        assert not apart.size, (error.max(), scale)


@pytest.mark.peer
@pytest.mark.parametrize("mix", ["attn_q IQ3_XXS", "llama.cpp's IQ3_XXS mix"])
def test_a_drawn_qwen3_next_in_iq3_xxs_against_llama_cpp(mix, tmp_path):
    """A drawn qwen3_next widened to whole 256-value blocks (hidden and widths 256), quantized by llama.cpp to IQ3_XXS
    (a uniform importance matrix): mean KL(llama.cpp || moetier) over 64 positions <= 1e-3, in llama.cpp's own mix
    (attn_q in IQ2_S, a stored format dotted with Q8_K activations as llama.cpp does: 2.6e-4 on this draw, 2.0e-2
    when moetier held it as float32 values) and with attn_q IQ3_XXS too (llama-quantize's --tensor-type, 2.4e-4)."""
    import gguf
    from llama_imatrix import quantize_with_imatrix, uniform_imatrix
    from test_peer_llama import kl_and_top1, llama_logits

    from moetier.model.gguf_write import write_gguf

    config = for_llama_cpp("qwen3_next", draw_qwen3_next(random.Random(9500))) | dict(hidden_size=256, intermediate_size=256,
                                                                                   moe_intermediate_size=256)
    f32 = write_gguf(save_qwen3_next(tmp_path / "hf", config, seed=0, std=0.05), tmp_path / "f32.gguf", "F32")[0]
    overrides = {r"\.attn_q\.weight$": 18} if mix == "attn_q IQ3_XXS" else None  # GGML_TYPE_IQ3_XXS
    path = quantize_with_imatrix(f32, tmp_path / "iq3_xxs.gguf", 23, uniform_imatrix(f32), overrides)  # LLAMA_FTYPE_MOSTLY_IQ3_XXS
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["blk.0.ffn_up_exps.weight"] == "IQ3_XXS"
    ids = random_ids(config["vocab_size"], 64, 0).tolist()
    kl, _ = kl_and_top1(llama_logits(path, ids), score(Engine(open_checkpoint(path)), np.asarray(ids)))
    attn_q = {types[n] for n in types if n.endswith("attn_q.weight")}
    assert attn_q == ({"IQ3_XXS"} if overrides else {"IQ2_S"}), attn_q
    assert kl <= 1e-3, (mix, attn_q, kl)
