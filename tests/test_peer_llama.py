"""moetier against llama.cpp on the same GGUF files (marker `peer`; `make test-peer` installs llama-cpp-python).

llama.cpp is the oracle for what a GGUF means. For each architecture moetier
reads from GGUF (qwen3moe, glm4moe with dense first layers and shared experts,
llama-architecture Mixtral) and three sizes (tiny: Q8_0; small: Q4_K_M, Q6_K,
IQ3_S, with llama.cpp's fallback types on rows that are no whole K-quant
block, so the files mix types; blocks: BF16, Q2_K, Q3_K_M, Q5_K_M, IQ4_XS,
IQ4_NL, Q4_0, Q4_1, Q5_0, Q5_1), a synthetic HF checkpoint is written as an F32
GGUF by moetier (the conventions of llama.cpp's converter), and quantized by
llama.cpp's own quantizer. Teacher-forced logits over POSITIONS positions,
llama.cpp with an F32 KV cache (`type_k = type_v = 0`), no mmap and no
repacked weight buffers (`use_extra_bufts = False`: they crashed on an
AVX-512 host), against moetier on the same file and on the HF checkpoint the
file came from:
  F32        max |dlogit| <= 1e-4 x the logit scale (max |logit|);
  quantized  top-1 agreement >= 99% and mean KL(llama.cpp || moetier) <= 1e-3 nats.
The random checkpoints' top-1 is near-tied (see the top-1 test); the top-1 bar is held on checkpoints trained
until their top token leads (tests/trained_models.py), as a user's model's does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cli_runs import moetier
from moetier.engine import Engine, score
from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic
from trained_models import decisive, trained_files

pytestmark = pytest.mark.peer
POSITIONS = 256
ARCHES = ("qwen3_moe", "glm4_moe", "mixtral")


def llama_logits(path: Path, ids: list[int]) -> np.ndarray:
    """llama.cpp's teacher-forced logits [T, V] float32 for ids, F32 KV cache, one batch."""
    import llama_cpp
    from llama_cpp import Llama

    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False  # the repacked K-quant buffers crashed on the AVX-512 host
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        llm = Llama(str(path), logits_all=True, type_k=0, type_v=0, use_mmap=False, n_ctx=len(ids) + 16,
                    n_batch=len(ids), n_ubatch=len(ids), n_threads=2, verbose=False)
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default
    try:
        llm.eval(ids)
        return np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def quantize(source: Path, out: Path, ftype: int) -> Path:
    """llama.cpp's own quantizer: source GGUF -> out with file type `ftype` (LLAMA_FTYPE_MOSTLY_*)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return out


def moetier_logits(path: Path, ids: list[int]) -> np.ndarray:
    return score(Engine(open_checkpoint(path)), ids)


def kl_and_top1(reference: np.ndarray, other: np.ndarray) -> tuple[float, float]:
    """mean KL(reference || other) in nats per position, and the share of positions with the same argmax."""
    def log_softmax(x):
        x = x.astype(np.float64)
        x = x - x.max(axis=1, keepdims=True)
        return x - np.log(np.exp(x).sum(axis=1, keepdims=True))

    p, q = log_softmax(reference), log_softmax(other)
    kl = (np.exp(p) * (p - q)).sum(axis=1)
    return float(kl.mean()), float((reference.argmax(axis=1) == other.argmax(axis=1)).mean())


# tiny: every row a whole Q8_0 block; small: hidden 256, so gate/up rows are whole K-quant blocks and the
# down rows (96 wide) get the fallback type llama.cpp's quantizer picks: a file of mixed types
# blocks: hidden and expert width 256, every expert row whole blocks of any type: the other types (Q2_K and
# Q3_K_M mix two K-quants, Q5_K_M Q5_K with Q6_K)
QUANTIZED = {"tiny": [("Q8_0", 7)], "small": [("Q4_K_M", 15), ("Q6_K", 18), ("IQ3_S", 26)],  # LLAMA_FTYPE_MOSTLY_*
             "blocks": [("BF16", 32), ("Q2_K", 10), ("Q3_K_M", 12), ("Q5_K_M", 17), ("IQ4_XS", 30), ("IQ4_NL", 25),
                        ("Q4_0", 2), ("Q4_1", 3), ("Q5_0", 8), ("Q5_1", 9)]}


@pytest.fixture(scope="module", params=[(arch, preset) for preset in QUANTIZED for arch in ARCHES], ids="-".join)
def model(request, tmp_path_factory):
    arch, preset = request.param
    root = tmp_path_factory.mktemp(f"peer-{arch}-{preset}")
    folder = write_synthetic(root / "hf", arch=arch, preset=preset, seed=4)
    f32 = write_gguf(folder, root / "model-f32.gguf", "F32")[0]
    spec = open_checkpoint(folder).spec
    ids = np.random.default_rng(7).integers(0, spec.vocab_size, POSITIONS).tolist()
    return arch, preset, root, folder, f32, ids


def test_f32_gguf_logits_match_llama_cpp(model):
    arch, preset, root, folder, f32, ids = model
    reference = llama_logits(f32, ids)  # [T, V]
    scale = float(np.abs(reference).max())
    on_gguf = moetier_logits(f32, ids)
    on_hf = moetier_logits(folder, ids)
    assert reference.shape == on_gguf.shape == (POSITIONS, open_checkpoint(folder).spec.vocab_size)
    gguf_error = float(np.abs(on_gguf - reference).max())
    hf_error = float(np.abs(on_hf - reference).max())
    print(f"{arch} {preset} F32: max |dlogit| GGUF {gguf_error:.3g}, HF {hf_error:.3g}, logit scale {scale:.3g}")
    assert gguf_error <= 1e-4 * scale, (arch, gguf_error, scale)
    assert hf_error <= 1e-4 * scale, (arch, hf_error, scale)


@pytest.fixture(scope="module")
def quantized_logits(model):
    """name -> (llama.cpp's logits, moetier's, the file) for each file llama.cpp's quantizer made, once per model."""
    arch, preset, root, folder, f32, ids = model
    out = {}
    for name, ftype in QUANTIZED[preset]:
        path = quantize(f32, root / f"model-{name}.gguf", ftype)
        out[name] = llama_logits(path, ids), moetier_logits(path, ids), path
    return out


def test_quantized_gguf_kl_against_llama_cpp(model, quantized_logits):
    for name, (reference, mine, path) in quantized_logits.items():
        kl, top1 = kl_and_top1(reference, mine)
        print(f"{model[0]} {model[1]} {name}: mean KL(llama.cpp || moetier) {kl:.3g} nats, top-1 agreement {top1:.1%}")
        assert kl <= 1e-3, (model[0], name, kl)


def test_quantized_experts_are_their_stored_bytes_and_dequantize_as_gguf_does(model, quantized_logits):
    """Every expert of the first MoE layer, read through moetier, is the stored bytes of its slice of the stacks,
    and moetier's two dequantizers (native C, torch) of those bytes equal gguf.quants.dequantize bit for bit,
    whatever types llama.cpp's quantizer chose."""
    import gguf
    import torch

    from moetier.backends.cpu_kernels import decode_kernel
    from moetier.backends.torch_dequant import dequantize
    from moetier.model.gguf_spec import EXPERT_STACKS

    kernel = decode_kernel()
    assert kernel is not None
    for name, (_, _, path) in quantized_logits.items():
        checkpoint = open_checkpoint(path)
        layer = checkpoint.spec.moe_layers[0]
        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        types = set()
        for part, stack in EXPERT_STACKS.items():
            t = tensors[f"blk.{layer}.{stack}"]
            types.add(t.tensor_type.name)
            values = gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)])  # [E, rows, cols]
            for e in range(checkpoint.spec.num_experts):
                w = checkpoint.expert(layer, e)
                stored = {"gate": w.gate, "up": w.up, "down": w.down}[part]
                assert np.array_equal(stored.contiguous().view(torch.uint8).numpy().reshape(-1), np.asarray(t.data[e]).view(np.uint8).reshape(-1))
                qtype, cols = int(t.tensor_type), values.shape[-1]
                for got in (kernel.dequantize(stored.contiguous(), qtype, cols), dequantize(stored.contiguous(), qtype, cols)):
                    assert np.array_equal(got.numpy().view(np.uint32), values[e].view(np.uint32)), (name, part, e)
        print(f"{model[0]} {model[1]} {name}: expert stacks stored as {sorted(types)}")


def test_dequantizers_equal_ggml_s_own(tmp_path):
    """moetier's two dequantizers (native C, torch) and the gguf package's equal ggml's own dequantize_row_* (the C
    llama.cpp computes with, from its libggml-base) bit for bit, on random valid blocks of every block format."""
    import ctypes
    import os

    import gguf
    import llama_cpp
    import torch

    from moetier.backends.cpu_kernels import decode_kernel
    from moetier.backends.torch_dequant import dequantize
    from quant_blocks import BLOCK_FORMATS, random_rows

    ggml = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    kernel, rng = decode_kernel(), np.random.default_rng(0)
    for fmt in BLOCK_FORMATS:
        to_float = getattr(ggml, f"dequantize_row_{fmt.name.lower().replace('_k', '_K')}")
        to_float.argtypes, to_float.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None
        rows = random_rows(fmt, 6, 1024, rng)  # [6, row bytes]
        theirs = np.empty((6, 1024), np.float32)
        to_float(rows.ctypes.data, theirs.ctypes.data, theirs.size)
        data = torch.from_numpy(rows)
        for name, ours in (("gguf", gguf.quants.dequantize(rows, fmt.id)), ("native", kernel.dequantize(data, fmt.id, 1024).numpy()),
                           ("torch", dequantize(data, fmt.id, 1024).numpy())):
            assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), (fmt.name, name)


def test_quantized_gguf_top1_agrees_with_llama_cpp(model, quantized_logits):
    """top-1 >= 99%: moetier converts every product's activations as llama.cpp does (Q8_K, Q8_0, Q8_1, F16, BF16)
    and sums the same integer block products, so what is left is float32 summation order. Met on tiny (Q8_0 files:
    KL ~1e-14, the same argmaxes) and on most blocks files; on small (48 experts, top-6) 94-98%: there moetier's
    native kernels against its own float64 numpy reference (the same conversions and products) agree on only
    96.9% (qwen3moe Q4_K_M), so summation order alone moves near-tied routing. Recorded as an xfail naming the
    files."""
    arch, preset = model[0], model[1]
    below = {name: f"{top1:.1%}" for name, (reference, mine, _) in quantized_logits.items()
             if (top1 := kl_and_top1(reference, mine)[1]) < 0.99}
    if preset == "tiny":
        assert not below, (arch, below)
    elif below:
        pytest.xfail(f"{arch} {preset}: top-1 below 99% on {below}")


@pytest.mark.parametrize("arch", ARCHES + ("qwen3_next", "glm5_next"))
def test_synth_gguf_of_every_arch_loads_in_llama_cpp(arch, tmp_path):
    """`moetier synth --format gguf` with its default preset (tiny) writes a file llama.cpp loads and runs as moetier
    does: F32 logits within 1e-4 of the logit scale over 64 positions (the real command, a real process)."""
    path = tmp_path / f"{arch}.gguf"
    result = moetier("synth", "--arch", arch, "--format", "gguf", "--out", path)
    assert result.returncode == 0, result.stderr
    spec = open_checkpoint(path).spec
    ids = np.random.default_rng(5).integers(0, spec.vocab_size, 64).tolist()
    reference = llama_logits(path, ids)  # [T, V]
    error, scale = float(np.abs(moetier_logits(path, ids) - reference).max()), float(np.abs(reference).max())
    print(f"{arch} synth tiny F32: max |dlogit| {error:.3g}, logit scale {scale:.3g}")
    assert reference.shape == (64, spec.vocab_size) and error <= 1e-4 * scale, (arch, error, scale)


def test_a_gguf_of_fewer_ids_than_bytes_loads_in_llama_cpp(tmp_path):
    """A random 100-id checkpoint without a tokenizer: moetier's stand-in vocabulary (one merge in place of the last
    byte token) is one llama.cpp loads, and it runs the file as moetier does (F32, within 1e-4 of the logit scale)."""
    from test_gguf import small_vocab_checkpoint

    path = write_gguf(small_vocab_checkpoint(tmp_path / "hf"), tmp_path / "small.gguf", "F32")[0]
    ids = np.random.default_rng(6).integers(0, 100, 48).tolist()
    reference = llama_logits(path, ids)  # [T, V]
    error, scale = float(np.abs(moetier_logits(path, ids) - reference).max()), float(np.abs(reference).max())
    assert reference.shape == (48, 100) and error <= 1e-4 * scale, (error, scale)


@pytest.fixture(scope="module", params=ARCHES)
def trained(request, tmp_path_factory):
    """A `small` synthetic checkpoint trained until its predictions are decisive (tests/trained_models.py), its F32
    GGUF, and 256 fresh positions of the chain it learned."""
    root = tmp_path_factory.mktemp(f"trained-{request.param}")
    init = write_synthetic(root / "init", arch=request.param, preset="small", seed=4)
    return request.param, root, *trained_files(init, root, POSITIONS)


TRAINED_TYPES = (("BF16", 32), ("Q8_0", 7), ("Q4_K_M", 15), ("Q6_K", 18), ("IQ3_S", 26))  # LLAMA_FTYPE_MOSTLY_*
HYBRID_TRAINED_TYPES = (("Q8_0", 7), ("Q4_K_M", 15), ("Q6_K", 18))  # qwen3next's and glm5next's wide checkpoints


def assert_trained_agrees(label: str, root: Path, folder: Path, f32: Path, ids: list[int], types=TRAINED_TYPES) -> None:
    """The GGUF issue's bars on a trained checkpoint `folder` and its F32 GGUF: the F32 GGUF and the checkpoint run
    by moetier within 1e-4 of the logit scale of llama.cpp's F32 run (and top-1 >= 99%, KL <= 1e-3 against it);
    each file llama.cpp's quantizer makes of `types` top-1 >= 99% and mean KL(llama.cpp || moetier) <= 1e-3."""
    reference = llama_logits(f32, ids)  # [T, V]
    assert decisive(reference) >= 0.8, (label, decisive(reference))  # trained: its top token leads
    scale = float(np.abs(reference).max())
    for name, mine in (("F32 GGUF", moetier_logits(f32, ids)), ("HF", moetier_logits(folder, ids))):
        error = float(np.abs(mine - reference).max())
        kl, top1 = kl_and_top1(reference, mine)
        print(f"trained {label} {name}: max |dlogit| {error:.3g} (logit scale {scale:.3g}), KL {kl:.3g}, top-1 {top1:.1%}")
        assert error <= 1e-4 * scale and top1 >= 0.99 and kl <= 1e-3, (label, name, error, top1, kl)
    for name, ftype in types:
        path = quantize(f32, root / f"model-{name}.gguf", ftype)
        kl, top1 = kl_and_top1(llama_logits(path, ids), moetier_logits(path, ids))
        print(f"trained {label} {name}: mean KL(llama.cpp || moetier) {kl:.3g} nats, top-1 agreement {top1:.1%}")
        assert top1 >= 0.99 and kl <= 1e-3, (label, name, top1, kl)


def test_quantized_gguf_of_a_trained_model_agrees_with_llama_cpp(trained):
    """The quantized bars on a model whose top token leads (a trained one, not a random one, whose near-tied logits
    part at the last bit: see test_quantized_gguf_top1_agrees_with_llama_cpp), on BF16, Q8_0, Q4_K_M (a file of mixed
    types: the 96-wide down rows take llama.cpp's fallback), Q6_K and IQ3_S."""
    arch, root, folder, f32, ids = trained
    assert_trained_agrees(arch, root, folder, f32, ids)
