"""moetier against llama.cpp on Qwen3-Next GGUF files (marker `peer`; `make test-peer` installs llama-cpp-python).

Small random Qwen3NextForCausalLM checkpoints saved by transformers
(tests/qwen3_next_files) are written as F32 GGUF by moetier (the file
llama.cpp's converter writes: tests/test_gguf.py) and quantized by llama.cpp's
own quantizer; teacher-forced logits over POSITIONS positions (four 64-token
prefill chunks of the linear layers), llama.cpp as in tests/test_peer_llama
(F32 KV cache, no repacked buffers), against moetier on the same file and on
the HF checkpoint:
  F32        max |dlogit| <= 1e-4 x the logit scale (also on the fused ssm_in
             layout older converters wrote), with each side's distance to
             transformers in float64 printed beside it;
  quantized  mean KL(llama.cpp || moetier) <= 1e-3 nats and top-1 >= 99%.
The top-1 bar is not always met on these random checkpoints, for a reason the
recurrent state brings (see test_quantized_top1_agrees_with_llama_cpp): below
it, the test xfails naming the figure and moetier's disagreement with itself
on the same file. On the wide checkpoint trained until its top token leads
(tests/trained_models.py), as a user's model's does, the bars are asserted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moetier.engine import Engine, score
from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from qwen3_next_files import legacy_in_projection, save_qwen3_next
from test_peer_llama import HYBRID_TRAINED_TYPES, assert_trained_agrees, kl_and_top1, llama_logits, quantize
from trained_models import trained_files

pytestmark = pytest.mark.peer
POSITIONS = 256
BASE = dict(vocab_size=288, num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=3,
            linear_num_key_heads=2, linear_num_value_heads=4, bos_token_id=1, eos_token_id=2)
# wide: hidden 256, so the rows of every matrix reading the hidden state are whole K-quant blocks (the narrower
# down, attn_output and ssm_out rows get llama.cpp's fallback types: a file of mixed types); weights at 0.05, the
# row norms of the narrow checkpoint's at 0.1. narrow: hidden 64, key heads = value heads, a 3-tap conv, full
# attention first and fourth, MHA, tied embeddings; Q8_0 only (no row is a whole K-quant block)
MODELS = {
    "wide": (dict(hidden_size=256, intermediate_size=256, num_hidden_layers=4, head_dim=64, moe_intermediate_size=64,
                  shared_expert_intermediate_size=128, linear_key_head_dim=64, linear_value_head_dim=64), 0.05,
             [("Q8_0", 7), ("Q4_K_M", 15)]),  # LLAMA_FTYPE_MOSTLY_*
    "narrow": (dict(hidden_size=64, intermediate_size=64, num_hidden_layers=5, head_dim=16, moe_intermediate_size=32,
                    shared_expert_intermediate_size=32, linear_key_head_dim=16, linear_value_head_dim=16,
                    linear_num_key_heads=4, linear_conv_kernel_dim=3, num_key_value_heads=4, tie_word_embeddings=True,
                    layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention", "linear_attention"]),
               0.1, [("Q8_0", 7)]),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    overrides, std, _ = MODELS[request.param]
    root = tmp_path_factory.mktemp(f"peer-qwen3next-{request.param}")
    folder = save_qwen3_next(root / "hf", BASE | overrides, seed=3, std=std)
    f32 = write_gguf(folder, root / "model-f32.gguf", "F32")[0]
    ids = np.random.default_rng(7).integers(0, BASE["vocab_size"], POSITIONS).tolist()
    return request.param, root, folder, f32, ids


def moetier_logits(path: Path, ids: list[int]) -> np.ndarray:
    return score(Engine(open_checkpoint(path)), ids)


def float64_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """transformers' Qwen3NextForCausalLM in float64 (its eager experts: the grouped kernel takes no float64)."""
    import torch
    import transformers

    reference = transformers.Qwen3NextForCausalLM.from_pretrained(folder, experts_implementation="eager").double().eval()
    with torch.no_grad():
        return reference(torch.tensor([ids])).logits[0].numpy()


def test_f32_gguf_logits_match_llama_cpp(model):
    name, root, folder, f32, ids = model
    s = open_checkpoint(folder).spec
    g = s.linear_attention
    legacy = legacy_in_projection(f32, root / "model-f32-ssm_in.gguf", g.key_heads, g.key_dim, g.value_width)
    reference = llama_logits(f32, ids)  # [T, V]
    scale = float(np.abs(reference).max())
    truth = float64_logits(folder, ids)
    errors = {"GGUF": moetier_logits(f32, ids), "HF": moetier_logits(folder, ids)}
    errors = {label: float(np.abs(logits - reference).max()) for label, logits in errors.items()}
    errors["ssm_in GGUF"] = float(np.abs(moetier_logits(legacy, ids) - llama_logits(legacy, ids)).max())
    print(f"qwen3next {name} F32: max |dlogit| against llama.cpp " + ", ".join(f"{k} {v:.3g}" for k, v in errors.items())
          + f"; logit scale {scale:.3g}; against transformers float64: llama.cpp {np.abs(reference - truth).max():.3g}, "
          f"moetier {np.abs(moetier_logits(f32, ids) - truth).max():.3g}")
    assert reference.shape == (POSITIONS, s.vocab_size)
    for label, error in errors.items():
        assert error <= 1e-4 * scale, (name, label, error, scale)


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
    for qtype, (reference, mine, _) in quantized_logits.items():
        kl, top1 = kl_and_top1(reference, mine)
        print(f"qwen3next {model[0]} {qtype}: mean KL(llama.cpp || moetier) {kl:.3g} nats, top-1 agreement {top1:.1%}")
        assert kl <= 1e-3, (model[0], qtype, kl)


def torch_path_logits(path: Path, ids: list[int]) -> np.ndarray:
    """moetier's logits on its torch path (MOETIER_NATIVE=0, read once per process: a child process): the same
    activation conversions and block products as the native kernels, summed in another order."""
    code = ("import sys, numpy as np; from moetier.engine import Engine, score; from moetier.model import open_checkpoint; "
            "np.save(sys.argv[2], score(Engine(open_checkpoint(sys.argv[1])), np.load(sys.argv[3])))")
    out, ids_file = path.with_suffix(".torch.npy"), path.with_suffix(".ids.npy")
    np.save(ids_file, np.array(ids))
    subprocess.run([sys.executable, "-c", code, str(path), str(out), str(ids_file)], check=True, timeout=600,
                   env=os.environ | {"MOETIER_NATIVE": "0"})
    return np.load(out)


def test_quantized_top1_agrees_with_llama_cpp(model, quantized_logits):
    """top-1 >= 99%. The two agree to rounding until, at some position, an activation lands on the other side of
    a block-quantization step in one of them (they round the float parts, norms and the DeltaNet recurrence, in
    different orders); in a model with attention alone the difference stays at that position, but here it enters
    the linear layers' recurrent state, which carries it on, and from then on the two quantize many activations
    differently. moetier's own two paths (native kernels, torch) part the same way on the same file, which the
    xfail reports: the figure is how sensitive the model is, not a difference in what is computed."""
    name = model[0]
    below = {qtype: top1 for qtype, (reference, mine, _) in quantized_logits.items()
             if (top1 := kl_and_top1(reference, mine)[1]) < 0.99}
    if below:
        ids = model[4]
        selves = {}
        for qtype, agreement in below.items():
            _, mine, path = quantized_logits[qtype]
            kl, top1 = kl_and_top1(mine, torch_path_logits(path, ids))
            selves[qtype] = f"{agreement:.1%} (moetier native vs torch path: top-1 {top1:.1%}, KL {kl:.2g})"
        pytest.xfail(f"qwen3next {name}: top-1 below 99% on {selves}")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The wide checkpoint trained until its top token leads (tests/trained_models.py), its F32 GGUF, 256 positions
    of the chain it learned."""
    root = tmp_path_factory.mktemp("trained-qwen3next")
    overrides, std, _ = MODELS["wide"]
    return root, *trained_files(save_qwen3_next(root / "init", BASE | overrides, seed=3, std=std), root, POSITIONS)


def test_quantized_gguf_of_a_trained_model_agrees_with_llama_cpp(trained):
    """The bars of the random checkpoints' xfail, met where the top token leads (a trained model): Q8_0, Q4_K_M and
    Q6_K top-1 >= 99% and KL <= 1e-3 against llama.cpp, the F32 GGUF and the checkpoint within 1e-4 of its F32."""
    root, folder, f32, ids = trained
    assert_trained_agrees("qwen3next", root, folder, f32, ids, HYBRID_TRAINED_TYPES)
