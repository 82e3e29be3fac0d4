"""An importance matrix computed by moetier, handed to llama.cpp's quantizer (for IQ3_XXS and lower).

llama.cpp refuses IQ3_XXS, IQ2_* and IQ1_* without an importance matrix: per
weight matrix, per input column, the mean over calibration tokens of the
squared activation feeding that matrix. For an expert stack ffn_*_exps
[E, rows, cols] it is per expert, expert-major (length E * cols): llama-quant.cpp
reads row r's weights at `imatrix + (r / rows_per_expert) * cols` and checks
the size against ne[0] * ne[2].

How the matrix reaches llama.cpp: in the vendored llama.cpp of
llama-cpp-python 0.3.36 (include/llama.h, src/llama-quant.cpp)
`llama_model_quantize_params.imatrix` is no longer a `void *` to a C++
`std::unordered_map<std::string, std::vector<float>>`: it is a plain C
`const struct llama_model_imatrix_data *` ({const char *name; const float
*data; size_t size;}), an array ended by an entry whose name is NULL, which
llama.cpp copies into its own unordered_map. So no C++ shim is needed:
llama-cpp-python's own ctypes struct `llama_model_imatrix_data` builds it.

`activation_imatrix` computes a real one: moetier's engine over calibration
tokens, recording the inputs of every F.linear the trunk runs (attention
q/k/v and output, dense and shared-expert FFNs, the lm head) through a
torch function mode, and of every routed expert through the engine's
ExpertExecutor seam (gate/up: the normed hidden state rows routed to that
expert; down: its SwiGLU hidden, recomputed from the checkpoint's float32
weights). An expert no calibration token reached gets uniform importance
(all ones: every column weighted alike, what quantizing without an imatrix
minimizes, plain squared error).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from moetier.engine import Engine
from moetier.model import open_checkpoint


def uniform_imatrix(path: Path) -> dict[str, np.ndarray]:
    """Every weight matrix of the GGUF file at path weighted alike: ones per input column (per expert and column for
    an expert stack), what quantizing without a matrix minimizes."""
    import gguf

    return {t.name: np.ones(int(t.shape[0]) * (int(t.shape[2]) if len(t.shape) > 2 else 1), np.float32)
            for t in gguf.GGUFReader(path).tensors if len(t.shape) >= 2}


def quantize_with_imatrix(source: Path, out: Path, ftype: int, imatrix: dict[str, np.ndarray],
                          overrides: dict[str, int] | None = None) -> Path:
    """llama.cpp's quantizer with an importance matrix: GGUF tensor name -> float32 [cols] (or [E * cols]).
    overrides: regex (searched in tensor names) -> GGML type id, llama-quantize's --tensor-type."""
    import llama_cpp

    arrays = [np.ascontiguousarray(v, dtype=np.float32).reshape(-1) for v in imatrix.values()]
    names = [name.encode() for name in imatrix]  # kept alive here for the call
    entries = (llama_cpp.llama_model_imatrix_data * (len(arrays) + 1))()  # zeroed: the last one ends the list
    for entry, name, values in zip(entries, names, arrays):
        entry.name, entry.size = name, values.size
        entry.data = values.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 2
    params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    patterns = [pattern.encode() for pattern in overrides or {}]
    types = (llama_cpp.llama_model_tensor_override * (len(patterns) + 1))()  # NULL pattern ends the list
    for entry, pattern, ggml_type in zip(types, patterns, (overrides or {}).values()):
        entry.pattern, entry.type = pattern, ggml_type
    if patterns:
        params.tt_overrides = ctypes.cast(types, ctypes.POINTER(llama_cpp.llama_model_tensor_override))
    rc = llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params)
    assert rc == 0, f"llama_model_quantize returned {rc}"
    return out


class _Sums:
    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor) -> None:  # x [n, cols]
        s = x.detach().double().square().sum(0)
        self.sums[name] = self.sums[name] + s if name in self.sums else s
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]

    def mean(self, name: str, cols: int) -> np.ndarray:
        n = self.counts.get(name, 0)
        return (self.sums[name] / n).numpy().astype(np.float32) if n else np.ones(cols, np.float32)


class _LinearInputs(TorchFunctionMode):
    """Records x of every F.linear(x, weight) whose weight is one of `names` (data_ptr -> GGUF names)."""

    def __init__(self, names: dict[int, list[str]], sums: _Sums):
        super().__init__()
        self.names, self.sums = names, sums

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            weight = args[1] if len(args) > 1 else kwargs["weight"]
            for name in self.names.get(weight.data_ptr(), ()):
                self.sums.add(name, args[0].reshape(-1, args[0].shape[-1]))
        return func(*args, **kwargs)


class _RecordingExperts:
    """Wraps the engine's executor: records each routed expert's gate/up and down inputs, then delegates."""

    def __init__(self, inner, checkpoint, sums: _Sums):
        self.inner, self.checkpoint, self.sums, self.live_cache = inner, checkpoint, sums, inner.live_cache

    def dispatch(self, layer, x, decision):
        for e in decision.picks.unique().tolist():
            xe = x[(decision.picks == e).any(dim=1)]  # [n, D]: the tokens routed to expert e
            w = self.checkpoint.expert(layer, e)
            gate_up = F.linear(xe, w.gate_up.float())  # [n, 2I]
            self.sums.add(f"{layer}.{e}.in", xe)
            self.sums.add(f"{layer}.{e}.hidden", F.silu(gate_up[:, : w.inter]) * gate_up[:, w.inter :])
        return self.inner.dispatch(layer, x, decision)

    def resident_mask(self, layer):
        return self.inner.resident_mask(layer)


def activation_imatrix(path: Path, tokens: int = 128, seed: int = 11) -> dict[str, np.ndarray]:
    """GGUF tensor name -> mean squared input per column, from moetier running `path` (float weights:
    an HF checkpoint or an F32 GGUF) over `tokens` random token ids."""
    checkpoint = open_checkpoint(path)
    spec, engine, sums = checkpoint.spec, Engine(checkpoint), _Sums()
    engine.executor = _RecordingExperts(engine.executor, checkpoint, sums)
    # a float file: each trunk StoredLinear is one float32 matrix (`dense`), one F.linear once the native kernels
    # are out of its way (on the CPU they run float32 rows too, where no F.linear is seen)
    names: dict[int, list[str]] = {engine.lm_head.dense.data_ptr(): ["output.weight"]}
    for linear in [engine.lm_head] + [part for w in engine.layers for part in (w.qkv, w.o_proj)]:
        linear._kernel = None
    for layer, w in enumerate(engine.layers):
        b = f"blk.{layer}."
        names[w.qkv.dense.data_ptr()] = [f"{b}attn_{n}.weight" for n in "qkv"]
        names[w.o_proj.dense.data_ptr()] = [f"{b}attn_output.weight"]
        for mlp, suffix in ((w.mlp, ""), (w.shared, "_shexp")):
            if mlp is not None:
                names[mlp.gate_up.data_ptr()] = [f"{b}ffn_gate{suffix}.weight", f"{b}ffn_up{suffix}.weight"]
                names[mlp.down.data_ptr()] = [f"{b}ffn_down{suffix}.weight"]
    ids = torch.tensor(np.random.default_rng(seed).integers(0, spec.vocab_size, tokens), dtype=torch.int64)
    with _LinearInputs(names, sums):
        engine.forward(ids, engine.new_cache())
    out = {name: sums.mean(name, 0) for names_ in names.values() for name in names_ if name in sums.sums}
    for layer in spec.moe_layers:
        d, i = spec.hidden_size, spec.moe_intermediate_size
        inputs = np.concatenate([sums.mean(f"{layer}.{e}.in", d) for e in range(spec.num_experts)])  # [E * D]
        out[f"blk.{layer}.ffn_gate_exps.weight"] = out[f"blk.{layer}.ffn_up_exps.weight"] = inputs
        out[f"blk.{layer}.ffn_down_exps.weight"] = np.concatenate([sums.mean(f"{layer}.{e}.hidden", i) for e in range(spec.num_experts)])
    return out
