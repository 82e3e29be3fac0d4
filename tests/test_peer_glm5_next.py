"""moetier against llama.cpp on GLM-5.3-Flash GGUF files (glm5-next; marker `peer`, `make test-peer`).

Small random Glm5NextForConditionalGeneration checkpoints saved by transformers
(tests/glm5_next_files) are written as F32 GGUF by moetier (the file llama.cpp's
converter writes: tests/test_gguf.py, scripts/gguf_vs_converter.py) and
quantized by llama.cpp's own quantizer; teacher-forced logits over POSITIONS
positions, llama.cpp as in tests/test_peer_llama (F32 KV cache, so the latent
and indexer caches are F32 too; no repacked buffers), against moetier on the
same file and on the HF checkpoint:
  F32        max |dlogit| <= 1e-4 x the logit scale, each side's distance to
             transformers in float64 printed beside it;
  quantized  mean KL(llama.cpp || moetier) <= 1e-3 nats and top-1 >= 99% (below
             it, the test xfails naming the figure and moetier's disagreement
             with itself on the same file, as for Qwen3-Next; the wide
             checkpoint trained until its top token leads, tests/trained_models.py,
             is held to the bar).
The models vary what llama.cpp can run: the indexed / KDA layer pattern, a
"shared" indexer layer, index_topk below the length (a selection among the
pools) and above it, one or two dense layers, groups, one or two shared
experts, a clamp that bites, the forget gate with and without its bound; the
hyper-connections are 4 streams (llama.cpp runs no other count) and the
incomplete pool is always attended (without it llama.cpp's first positions
attend to nothing and are NaN). Where an indexer's top-k falls on pools of
equal score (ReLU makes a pool score exactly 0 when every head's dot product
is <= 0), torch.topk and llama.cpp's std::partial_sort keep different pools:
the "ties" model has such positions, and the F32 test then holds the bar up to
the first of them and xfails naming them (see docs/gguf-glm5-next.md).
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from moetier.engine import Engine, score
from moetier.engine.router_bias import apply_router_options
from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from glm5_next_files import BASE, boundary_ties, save_glm5_next
from test_peer_llama import HYBRID_TRAINED_TYPES, assert_trained_agrees, kl_and_top1, llama_logits, quantize
from test_peer_qwen3_next import torch_path_logits
from trained_models import trained_files

pytestmark = pytest.mark.peer
POSITIONS = 256
INDEXED = ["linear_attention", "indexed_attention", "linear_attention", "indexed_attention", "indexed_attention"]
# wide: hidden, expert and KDA widths 256, so the rows of most matrices are whole K-quant blocks (the rest get
# llama.cpp's fallback types; its quantizer keeps k_b, v_b, kv_a, the indexer, hyper-connection and KDA gate tensors
# as they are); weights at 0.075, the row norms of the narrow ones at 0.15; topk below the length (16 of up to 64
# pools), a shared indexer layer, 16 indexer heads (with 8, two positions of this model tie)
# narrow: hidden 64, six layers, two dense, index_topk above the length, the softplus forget gate, 2 expert groups,
# 2 shared experts, swiglu_limit 0.5; Q8_0 only. ties: narrow rows, topk below the length, 2 indexer heads
MODELS = {
    "wide": (dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, kv_lora_rank=64, q_lora_rank=128,
                  qk_nope_head_dim=64, v_head_dim=64, linear_head_dim=64, index_head_dim=32, index_n_heads=16, index_topk=64,
                  layer_types=INDEXED, indexer_types=["full", "full", "full", "full", "shared"]), 0.075,
             [("Q8_0", 7), ("Q4_K_M", 15)]),  # LLAMA_FTYPE_MOSTLY_*
    "narrow": (dict(num_hidden_layers=6, index_topk=512, index_kpool=8, linear_lower_bound=None, n_group=2, topk_group=1,
                    n_shared_experts=2, swiglu_limit=0.5, index_n_heads=2, layer_types=INDEXED + ["indexed_attention"],
                    indexer_types=["full"] * 5 + ["shared"], mlp_layer_types=["dense", "dense"] + ["sparse"] * 4),
               0.15, [("Q8_0", 7)]),
    "ties": (dict(index_n_heads=2), 0.15, []),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    overrides, std, _ = MODELS[request.param]
    root = tmp_path_factory.mktemp(f"peer-glm5next-{request.param}")
    folder = save_glm5_next(root / "hf", BASE | overrides, seed=3, std=std)
    f32 = write_gguf(folder, root / "model-f32.gguf", "F32")[0]
    ids = np.random.default_rng(7).integers(0, BASE["vocab_size"], POSITIONS).tolist()
    return request.param, root, folder, f32, ids


def moetier_logits(path, ids: list[int]) -> np.ndarray:
    return score(Engine(open_checkpoint(path)), ids)


def float64_logits(folder, ids: list[int]) -> np.ndarray:
    """transformers' Glm5NextForConditionalGeneration in float64 (its eager experts: the grouped kernel takes no float64)."""
    import torch
    import transformers

    reference = transformers.Glm5NextForConditionalGeneration.from_pretrained(folder, experts_implementation="eager")
    with torch.no_grad():
        return reference.double().eval()(torch.tensor([ids])).logits[0].numpy()


def test_f32_gguf_logits_match_llama_cpp(model):
    name, _, folder, f32, ids = model
    reference = llama_logits(f32, ids)  # [T, V]
    scale = float(np.abs(reference).max())
    ours = {"GGUF": moetier_logits(f32, ids), "HF": moetier_logits(folder, ids)}
    error = {label: np.abs(logits - reference).max(axis=1) for label, logits in ours.items()}  # [T] each
    truth = float64_logits(folder, ids)
    ties = boundary_ties(open_checkpoint(f32), ids)
    first = min((p for positions in ties.values() for p in positions), default=POSITIONS)
    print(f"glm5-next {name} F32: max |dlogit| against llama.cpp " + ", ".join(f"{k} {v.max():.3g}" for k, v in error.items())
          + f"; logit scale {scale:.3g}; against transformers float64: llama.cpp {np.abs(reference - truth).max():.3g}, "
          f"moetier {np.abs(ours['GGUF'] - truth).max():.3g}; indexer ties (layer: positions) {ties or 'none'}")
    assert reference.shape == (POSITIONS, BASE["vocab_size"]) and np.isfinite(reference).all()
    for label, per_position in error.items():
        assert per_position[:first].max() <= 1e-4 * scale, (name, label, per_position[:first].max(), scale)
    if first < POSITIONS:
        worst = {label: float(per_position.max()) for label, per_position in error.items()}
        bad = np.nonzero(error["GGUF"] > 1e-4 * scale)[0]
        assert bad.size == 0 or bad[0] >= first, (name, "a difference before the first tie", bad[0], first)
        before = float(error["GGUF"][:first].max())
        pytest.xfail(f"glm5-next {name}: max |dlogit| {worst} (bar {1e-4 * scale:.3g}) from position {bad[0] if bad.size else '-'}; "
                     f"{before:.3g} over the {first} positions before the first indexer top-k tie {ties}, which torch.topk "
                     "and llama.cpp's std::partial_sort break differently")


@pytest.fixture(scope="module")
def quantized_logits(model):
    """type -> (llama.cpp's logits, moetier's, the file) for each file llama.cpp's quantizer made, once per model."""
    name, root, _, f32, ids = model
    out = {}
    for qtype, ftype in MODELS[name][2]:
        path = quantize(f32, root / f"model-{qtype}.gguf", ftype)
        out[qtype] = llama_logits(path, ids), moetier_logits(path, ids), path
    return out


def test_quantized_gguf_kl_against_llama_cpp(model, quantized_logits):
    """Mean KL(llama.cpp || moetier) <= 1e-3. On `wide` the KDA state and the hyper-connected streams carry a flipped
    rounding on, so the figure moves with the host (Q4_K_M: 1.8e-3 on a Zen 4 host, below 1e-3 on Ice Lake, the same
    commit). Where it exceeds the bar, moetier's own two paths (native kernels, torch; the same numerics summed in
    another order) are the file's floor: llama.cpp must be within twice that of moetier, and the miss is reported
    (xfail) with both figures."""
    if not quantized_logits:
        pytest.skip(f"glm5-next {model[0]}: no quantized file (its F32 test shows the indexer ties)")
    check_kl({f"{model[0]} {qtype}": (reference, mine, path) for qtype, (reference, mine, path) in quantized_logits.items()},
             model[4])


def check_kl(files: dict, ids: list[int]) -> None:
    """files: label -> (llama.cpp's logits, moetier's, the file). Mean KL(llama.cpp || moetier) <= 1e-3, or, above it,
    within twice the KL between moetier's own native and torch paths on the file (then reported as xfail)."""
    at_floor = {}
    for label, (reference, mine, path) in files.items():
        kl, top1 = kl_and_top1(reference, mine)
        print(f"glm5-next {label}: mean KL(llama.cpp || moetier) {kl:.3g} nats, top-1 agreement {top1:.1%}")
        if kl > 1e-3:
            floor = kl_and_top1(mine, torch_path_logits(path, ids))[0]
            assert kl <= 2 * floor, (label, kl, floor)
            at_floor[label] = f"KL {kl:.2g}, moetier's native and torch paths {floor:.2g}"
    if at_floor:
        pytest.xfail(f"glm5-next: above 1e-3 at the file's float32 floor: {at_floor}")


@pytest.mark.parametrize("mix, ftype", [("IQ3_XXS", 23), ("IQ2_XXS", 19)])
def test_low_bit_mixes_against_llama_cpp(mix, ftype, tmp_path):
    """The seed's kind of file: `wide` in llama.cpp's IQ3_XXS mix (experts IQ3_XXS, attn IQ2_S / IQ3_S, the rest Q5_K /
    Q8_0) and its IQ2_XXS one (experts IQ2_XXS, Q2_K / Q4_K beside), quantized with a uniform importance matrix: KL as
    test_quantized_gguf_kl_against_llama_cpp (on a Zen 4 host 3.0e-4 and 2.1e-3, the latter at its floor 2.2e-3)."""
    from llama_imatrix import quantize_with_imatrix, uniform_imatrix

    overrides, std, _ = MODELS["wide"]
    f32 = write_gguf(save_glm5_next(tmp_path / "hf", BASE | overrides, seed=3, std=std), tmp_path / "f32.gguf", "F32")[0]
    path = quantize_with_imatrix(f32, tmp_path / f"{mix}.gguf", ftype, uniform_imatrix(f32))
    assert mix in {t.tensor_type.name for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")}
    ids = np.random.default_rng(7).integers(0, BASE["vocab_size"], POSITIONS).tolist()
    check_kl({f"wide {mix} mix": (llama_logits(path, ids), moetier_logits(path, ids), path)}, ids)


def test_quantized_top1_agrees_with_llama_cpp(model, quantized_logits):
    """top-1 >= 99%. As in Qwen3-Next (tests/test_peer_qwen3_next.py): the two agree to rounding until an activation
    lands on the other side of a block-quantization step in one of them, and the KDA state and the hyper-connected
    streams carry that on (and a near-tie of the router's scores turns it into another expert); moetier's own two
    paths (native kernels, torch) part the same way on the same file, which the xfail reports."""
    if not quantized_logits:
        pytest.skip(f"glm5-next {model[0]}: no quantized file")
    below = {qtype: top1 for qtype, (reference, mine, _) in quantized_logits.items()
             if (top1 := kl_and_top1(reference, mine)[1]) < 0.99}
    if below:
        selves = {}
        for qtype, agreement in below.items():
            reference, mine, path = quantized_logits[qtype]
            torch_path = torch_path_logits(path, model[4])
            kl, top1 = kl_and_top1(mine, torch_path)
            llama_kl, llama_top1 = kl_and_top1(reference, torch_path)
            selves[qtype] = (f"{agreement:.1%} (moetier native vs torch path: top-1 {top1:.1%}, KL {kl:.2g}; llama.cpp vs the "
                             f"torch path: top-1 {llama_top1:.1%}, KL {llama_kl:.2g})")
        pytest.xfail(f"glm5-next {model[0]}: top-1 below 99% on {selves}")


def test_one_head_quantized_by_llama_cpp_is_read_as_its_metadata_says(tmp_path):
    """One attention head and one indexer head: llama.cpp's quantizer writes a tensor with ggml_n_dims dims, so
    attn_k_b {r, d, 1} is stored {r, d} and indexer.proj {D, 1} as {D}; moetier refused the file (shape) until it
    read such a tensor as its metadata says, as llama.cpp's loader does. Q8_0, teacher-forced: mean KL(llama.cpp ||
    moetier) <= 1e-3 up to the first tied indexer boundary (index_topk above the length here: none)."""
    folder = save_glm5_next(tmp_path / "hf", BASE | dict(num_attention_heads=1, num_key_value_heads=1, linear_num_heads=1,
                                                          index_n_heads=1, index_topk=512, index_kpool=8), seed=4)
    path = quantize(write_gguf(folder, tmp_path / "f32.gguf", "F32")[0], tmp_path / "q8.gguf", 7)
    stored = {t.name: [int(n) for n in t.shape] for t in gguf.GGUFReader(path).tensors}
    assert len(stored["blk.3.attn_k_b.weight"]) == 2 and len(stored["blk.3.indexer.proj.weight"]) == 1  # as it writes them
    ids = np.random.default_rng(8).integers(0, BASE["vocab_size"], 96).tolist()
    kl, top1 = kl_and_top1(llama_logits(path, ids), moetier_logits(path, ids))
    print(f"glm5-next one head Q8_0: mean KL {kl:.3g}, top-1 {top1:.1%}")
    assert kl <= 1e-3


def test_llama_cpp_routes_a_baked_gguf_as_moetier_routes_the_table(tmp_path):
    """`bias write` on a glm5-next GGUF: each MoE layer's exp_probs_b plus the table; llama.cpp on the copy computes
    what moetier computes on the original with the table (index_topk above the length: no indexer ties)."""
    from moetier.profile.bias import build_table
    from moetier.profile.brightness import profile_requests
    from moetier.profile.sessions import load_sessions
    from moetier.profile.write import write_biased_checkpoint

    folder = save_glm5_next(tmp_path / "hf", BASE | dict(index_topk=512, index_kpool=8), seed=2)
    source = write_gguf(folder, tmp_path / "f32.gguf", "F32")[0]
    original = open_checkpoint(source)
    rng = np.random.default_rng(3)
    sessions = tmp_path / "s.jsonl"
    sessions.write_text("".join(json.dumps({"phase": phase, "ids": rng.integers(1, BASE["vocab_size"], 96).tolist()}) + "\n"
                                for phase in ("explore", "edit")))
    requests = load_sessions(sessions, None, original.spec.vocab_size)
    table = build_table(profile_requests(Engine(original), requests), 4, "graded", -0.2).save(tmp_path / "t.safetensors")
    write_biased_checkpoint(source, table, tmp_path / "biased.gguf")
    ids = [int(t) for t in requests[0].ids]
    engine = Engine(original)
    apply_router_options(engine, table)
    ours, theirs, unbiased = score(engine, np.array(ids)), llama_logits(tmp_path / "biased.gguf", ids), llama_logits(source, ids)
    scale = np.abs(theirs).max()
    print(f"glm5-next bias write: max |dlogit| {np.abs(ours - theirs).max():.3g} (scale {scale:.3g}); the table moves "
          f"llama.cpp's logits by {np.abs(unbiased - theirs).max():.3g}")
    assert np.abs(ours - theirs).max() <= 1e-4 * scale
    assert np.abs(unbiased - theirs).max() > 1e-2 * scale  # the table changes llama.cpp's routing


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The wide checkpoint trained until its top token leads (tests/trained_models.py), its F32 GGUF, 256 positions
    of the chain it learned."""
    root = tmp_path_factory.mktemp("trained-glm5next")
    overrides, std, _ = MODELS["wide"]
    return root, *trained_files(save_glm5_next(root / "init", BASE | overrides, seed=3, std=std), root, POSITIONS)


def test_quantized_gguf_of_a_trained_model_agrees_with_llama_cpp(trained):
    """The bars of the random checkpoints' xfail, met where the top token leads (a trained model): Q8_0, Q4_K_M and
    Q6_K top-1 >= 99% and KL <= 1e-3 against llama.cpp, the F32 GGUF and the checkpoint within 1e-4 of its F32."""
    root, folder, f32, ids = trained
    assert_trained_agrees("glm5next", root, folder, f32, ids, HYBRID_TRAINED_TYPES)


def test_the_seeds_iq3_xxs_mix_of_a_trained_model_agrees_with_llama_cpp(trained):
    """The seed's kind of file on the trained checkpoint: llama.cpp's IQ3_XXS mix (experts IQ3_XXS; attn_q and the
    rest IQ2_S, IQ3_S, Q5_K, Q8_0; a uniform importance matrix) top-1 >= 99% and mean KL <= 1e-3 against llama.cpp."""
    from llama_imatrix import quantize_with_imatrix, uniform_imatrix

    root, _, f32, ids = trained
    path = quantize_with_imatrix(f32, root / "model-IQ3_XXS.gguf", 23, uniform_imatrix(f32))  # LLAMA_FTYPE_MOSTLY_IQ3_XXS
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    kl, top1 = kl_and_top1(llama_logits(path, ids), moetier_logits(path, ids))
    print(f"trained glm5next IQ3_XXS mix ({', '.join(sorted(types))}): mean KL(llama.cpp || moetier) {kl:.3g} nats, top-1 {top1:.1%}")
    assert {"IQ3_XXS", "IQ2_S"} <= types, types
    assert top1 >= 0.99 and kl <= 1e-3, (top1, kl)
