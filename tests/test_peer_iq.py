"""moetier against llama.cpp on IQ3_XXS files (marker `peer`), which llama.cpp quantizes only with an importance matrix.

For each architecture a synthetic "blocks" checkpoint (hidden 256, expert width
256: every expert row is whole 256-value blocks) is written as an F32 GGUF,
moetier computes an importance matrix from its own activations on it
(tests/llama_imatrix.py: mean squared input per column, per expert for the
expert stacks, over 128 random tokens other than the ones scored), and
llama.cpp's quantizer makes two IQ3_XXS files with it:
  default  LLAMA_FTYPE_MOSTLY_IQ3_XXS as llama.cpp mixes it for 8-expert models:
           expert stacks and shared experts IQ3_XXS, attn_q IQ2_S, attn_k/v Q8_0,
           attn_output Q5_K, token_embd IQ3_S;
  q        the same with attn_q overridden to IQ3_XXS (llama-quantize's
           --tensor-type): IQ3_XXS in the attention too.
Asserted: the expert stacks of both are stored as IQ3_XXS; over POSITIONS
teacher-forced positions of each file, mean KL(llama.cpp || moetier) <= 1e-3
nats (the default file's IQ2_S attn_q is a trunk tensor, held as IQ2_S blocks
and dotted with Q8_K activations as llama.cpp does). Top-1 agreement is printed, not asserted: that bar is
test_peer_llama's strict xfail (llama.cpp quantizes activations for its
quantized dot products, moetier's reference path does not).

And llama.cpp's lowest-bit file types (IQ2_XXS, IQ2_XS, IQ2_S, IQ2_M, IQ1_S,
IQ1_M) of the qwen3_moe checkpoint, quantized with the same kind of matrix,
and its MXFP4_MOE: their experts in IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M or
MXFP4, the same KL bar.
"""

from __future__ import annotations

import numpy as np
import pytest

from llama_imatrix import activation_imatrix, quantize_with_imatrix
from test_peer_llama import ARCHES, POSITIONS, kl_and_top1, llama_logits, moetier_logits

from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic

pytestmark = pytest.mark.peer
IQ3_XXS = 23  # LLAMA_FTYPE_MOSTLY_IQ3_XXS
GGML_TYPE_IQ3_XXS = 18
ATTN_Q_IQ3_XXS = {r"\.attn_q\.weight$": GGML_TYPE_IQ3_XXS}  # regex -> GGML type



@pytest.fixture(scope="module", params=ARCHES)
def iq3_model(request, tmp_path_factory):
    """arch, {"default": llama.cpp's IQ3_XXS file, "q": the same with attn_q IQ3_XXS}, the ids scored."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"peer-iq-{arch}")
    folder = write_synthetic(root / "hf", arch=arch, preset="blocks", seed=4)
    f32 = write_gguf(folder, root / "model-f32.gguf", "F32")[0]
    imatrix = activation_imatrix(f32)
    files = {"default": quantize_with_imatrix(f32, root / "model-IQ3_XXS.gguf", IQ3_XXS, imatrix),
             "q": quantize_with_imatrix(f32, root / "model-IQ3_XXS-q.gguf", IQ3_XXS, imatrix, ATTN_Q_IQ3_XXS)}
    ids = np.random.default_rng(7).integers(0, open_checkpoint(f32).spec.vocab_size, POSITIONS).tolist()
    return arch, files, ids


def test_expert_stacks_are_stored_as_iq3_xxs(iq3_model):
    import gguf

    arch, files, _ = iq3_model
    for name, path in files.items():
        types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
        stacks = {n: t for n, t in types.items() if n.endswith("_exps.weight")}
        layer1 = sorted(f"{n[6:-7]} {t}" for n, t in types.items() if n.startswith("blk.1.") and t != "F32")
        print(f"{arch} IQ3_XXS {name}, layer 1: {', '.join(layer1)}")
        assert stacks and set(stacks.values()) == {"IQ3_XXS"}, (arch, name, stacks)


def kl_against_llama_cpp(arch: str, name: str, path, ids: list[int]) -> float:
    mine = moetier_logits(path, ids)
    reference = llama_logits(path, ids)
    assert reference.shape == mine.shape == (POSITIONS, open_checkpoint(path).spec.vocab_size)
    kl, top1 = kl_and_top1(reference, mine)
    print(f"{arch} {name}: mean KL(llama.cpp || moetier) {kl:.3g} nats, top-1 agreement {top1:.1%}")
    return kl


def test_iq3_xxs_kl_against_llama_cpp(iq3_model):
    arch, files, ids = iq3_model
    kl = kl_against_llama_cpp(arch, "IQ3_XXS q", files["q"], ids)
    assert kl <= 1e-3, (arch, kl)


def test_llama_cpp_default_iq3_xxs_mix_kl_against_llama_cpp(iq3_model):
    arch, files, ids = iq3_model
    kl = kl_against_llama_cpp(arch, "IQ3_XXS default", files["default"], ids)
    assert kl <= 1e-3, (arch, kl)


# llama.cpp's lowest-bit file types and MXFP4_MOE (LLAMA_FTYPE_MOSTLY_*) -> the type its quantizer gives the experts
LOW_BIT = {"IQ2_XXS": (19, "IQ2_XXS"), "IQ2_XS": (20, "IQ2_XS"), "IQ2_S": (28, "IQ2_XS"), "IQ2_M": (29, "IQ2_S"),
           "IQ1_S": (24, "IQ1_S"), "IQ1_M": (31, "IQ1_M"), "MXFP4_MOE": (38, "MXFP4")}


@pytest.fixture(scope="module")
def low_bit_model(tmp_path_factory):
    """qwen3_moe `blocks` as F32 GGUF, its importance matrix, the ids scored."""
    root = tmp_path_factory.mktemp("peer-low-bit")
    f32 = write_gguf(write_synthetic(root / "hf", arch="qwen3_moe", preset="blocks", seed=4), root / "model-f32.gguf", "F32")[0]
    ids = np.random.default_rng(7).integers(0, open_checkpoint(f32).spec.vocab_size, POSITIONS).tolist()
    return f32, activation_imatrix(f32), ids


@pytest.mark.parametrize("ftype", sorted(LOW_BIT))
def test_llama_cpp_lowest_bit_mixes_kl_against_llama_cpp(low_bit_model, ftype, tmp_path):
    """llama.cpp's IQ2 and IQ1 file types, which put the experts (and most of the trunk) in IQ2_XXS, IQ2_XS, IQ2_S,
    IQ1_S or IQ1_M, and MXFP4_MOE (experts MXFP4, the rest Q8_0): every tensor is held in its stored format and
    dotted with Q8_K (MXFP4: Q8_0) activations as llama.cpp does, mean KL(llama.cpp || moetier) <= 1e-3 nats."""
    import gguf

    f32, imatrix, ids = low_bit_model
    code, stack_type = LOW_BIT[ftype]
    path = quantize_with_imatrix(f32, tmp_path / f"model-{ftype}.gguf", code, imatrix)
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    stacks = {t for n, t in types.items() if n.endswith("_exps.weight")}
    print(f"qwen3_moe {ftype}: {sorted(set(types.values()))}")
    assert stack_type in stacks, (ftype, stacks)
    kl = kl_against_llama_cpp("qwen3_moe", ftype, path, ids)
    assert kl <= 1e-3, (ftype, kl)
