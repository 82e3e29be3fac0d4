"""The native decode step: one token through every decoder layer in one call of the native kernels (cpu_step.h).

Decode on the CPU is a stream of weight bytes cut into ~10 small products per
layer; run from Python, each costs a framework op or a ctypes call and the
layer's glue (norms, rotary, the cache, the router, the residual) costs as
much again, which on a model of 0.2 MB experts is more than reading them.
`NativeStep.build(engine)` lays the engine's layers out once as the C reads
them (addresses of the tensors the engine keeps, each expert's record), and
`step(token, cache, start)` runs the token's embedding row, all of them, the
final norm and the lm head in one call on the backend's kernel pool,
releasing the GIL.

It serves an engine whose every layer is on the CPU and whose routed experts
are all resident on a CPU backend with the native kernels (ResidentExperts
over TorchBackend): `build` returns None otherwise, and `why_not` says why.
Qwen3-Next's layers run in it too: gated attention, the gated shared expert,
and the Gated DeltaNet layers, whose conv and delta-rule states (the cache's
`states`) the step updates in place where the Python path replaces them, so
the two take turns on one cache (a Python prefill, native decode).
Router bias tables are applied as the Python router applies them (a bias row
added to the selection scores); a damped bias, a step being timed
(engine.times) and MOETIER_NATIVE_STEP=0 take the Python path. The route
observer sees every MoE layer's Route after the step, in layer order.
Numerics: the same formats and products as the Python path; float32 sums in
other orders (attention, norms, router logits, conv taps) and a polynomial
e^x in the linear layers' silu, so logits agree to float32 rounding, and the
same bits for any thread count (tests/test_native_step.py).
Every shape, format and address is checked here, once, at build; a call
checks its own arguments.
"""

from __future__ import annotations

import ctypes
import operator
import os
from typing import TYPE_CHECKING

import torch

from moetier.backends import cpu_kernels
from moetier.backends.cpu_kernels import expert_record, matrix_error, status_error
from moetier.engine.layers import KVCache
from moetier.engine.router import Route

if TYPE_CHECKING:
    from moetier.engine.core import Engine

i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
DV_MAX = 512  # a linear-attention value head's dims, at most (cpu_deltanet.h keeps a head's sums on the stack)


class _Part(ctypes.Structure):  # linear_part
    _fields_ = [("address", i64), ("type", i64), ("rows", i64)]


class _Model(ctypes.Structure):  # step_model
    _fields_ = [(name, i64) for name in ("D", "H", "G", "d", "rotary_dim", "E", "k", "router", "norm_topk", "n_group",
                                         "topk_group", "I", "float_acts")] + [("eps", f64), ("scaling", f64),
                ("embed", ptr), ("embed_type", i64), ("final_norm", ptr), ("head", _Part)] + [
                (name, i64) for name in ("attention_gate", "Hk", "Hv", "dk", "dv", "K")]


class _DeltaNet(ctypes.Structure):  # step_deltanet
    _fields_ = [("in_", _Part * 3), ("in_parts", i64), ("conv", ptr), ("dt_bias", ptr), ("decay_rate", ptr), ("norm", ptr),
                ("out", _Part)]


class _Layer(ctypes.Structure):  # step_layer
    _fields_ = [("input_norm", ptr), ("post_norm", ptr), ("qk_norm", ptr), ("qkv", _Part * 3), ("qkv_parts", i64),
                ("qkv_bias", ptr), ("o", _Part), ("o_bias", ptr), ("router", ptr), ("correction", ptr),
                ("experts", ptr), ("mlp", ptr), ("mlp_I", i64), ("shared_gate", ptr), ("deltanet", _DeltaNet)]


class _Call(ctypes.Structure):  # step_call
    _fields_ = [("token", i64), ("h", ptr), ("position", i64), ("capacity", i64), ("window", i64), ("cos", ptr), ("sin", ptr),
                ("keys", ptr), ("values", ptr), ("nudge", ptr), ("logits", ptr), ("probs", ptr), ("weights", ptr),
                ("picks", ptr), ("scratch", ptr), ("out", ptr), ("conv_states", ptr), ("recurrent_states", ptr)]


def _declare(lib: ctypes.CDLL) -> None:
    if getattr(lib, "_step_declared", False):
        return
    lib.step_scratch.restype, lib.step_scratch.argtypes = i64, [ctypes.POINTER(_Model)]
    lib.moe_step.restype = i64
    lib.moe_step.argtypes = [ptr, ctypes.POINTER(_Model), ctypes.POINTER(_Layer), i64, ctypes.POINTER(_Call)]
    lib._step_declared = True


def _vector(what: str, t: torch.Tensor | None, n: int) -> int | None:
    """The address of a float32 vector of n values in host memory (None for None), or ValueError."""
    if t is None:
        return None
    if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or t.numel() != n:
        raise ValueError(f"{what}: expected float32 [{n}] contiguous in host memory, got {t.dtype} {list(t.shape)} on {t.device}")
    return t.data_ptr()


def _part(what: str, data: torch.Tensor, qtype: int, cols: int) -> _Part:
    why = matrix_error(what, data, qtype, data.shape[0] if data.dim() == 2 else -1, cols)
    if why is not None:
        raise ValueError(why)
    return _Part(data.data_ptr(), int(qtype), data.shape[0])


class NativeStep:
    """The engine's layers as cpu_step.h reads them; see the module docstring."""

    def __init__(self, engine: Engine, kernel: cpu_kernels.DecodeKernel):
        spec = engine.spec
        self.engine, self.kernel, self.spec = engine, kernel, spec
        _declare(kernel.library)
        D, H, G, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.model = _Model(D, H, G, d, spec.rotary_dim, spec.num_experts, spec.top_k, int(spec.router == "sigmoid"),
                            int(spec.norm_topk_prob), spec.n_group, spec.topk_group, spec.moe_intermediate_size,
                            int(engine.float_acts), spec.rms_norm_eps, spec.routed_scaling_factor)
        self.model.attention_gate = int(spec.attention_gate)
        g = spec.linear_attention
        if spec.linear_layers:
            self.model.Hk, self.model.Hv, self.model.dk, self.model.dv, self.model.K = (
                g.key_heads, g.value_heads, g.key_dim, g.value_dim, g.conv_kernel)
        embed, head = engine.embed, engine.lm_head
        V = spec.vocab_size
        self.model.embed, self.model.embed_type = _part("embedding", embed.data, embed.qtype, D).address, embed.qtype
        self.model.final_norm = _vector("final norm", engine.final_norm, D)
        if len(head.parts) != 1 or head.bias is not None or head.parts[0][0].shape[0] != V:
            raise ValueError(f"lm head: {len(head.parts)} parts{' and a bias' if head.bias is not None else ''} (expected one of {V} rows)")
        self.model.head = _part("lm head", *head.parts[0], D)
        self._keep: list = []  # the record buffers the layers point into
        self.layers = (_Layer * spec.num_layers)(*[self._layer(layer) for layer in range(spec.num_layers)])
        # one call's floats: logits [V], the residual stream [D], each MoE layer's route logits and probs [E] and
        # weights [k] (a call's own: two threads may decode on one engine), and the step's scratch (the pool's)
        moe, E, k = len(spec.moe_layers), spec.num_experts, spec.top_k
        self._sizes = [spec.vocab_size, D, moe * E, moe * E, moe * k]
        self.scratch = torch.empty(kernel.library.step_scratch(ctypes.byref(self.model)))
        self._nudge_of: tuple[torch.Tensor, torch.Tensor] | None = None  # (a bias table, its float32 host copy)
        self._first_attention = spec.attention_layers[0] if spec.attention_layers else None
        if spec.linear_layers:  # the shapes a linear layer's states must have in a cache
            self._state_shapes = ((g.conv_channels, g.conv_kernel - 1), (g.value_heads, g.key_dim, g.value_dim))

    def _records(self, experts, inter: int) -> int:
        """The address of the experts' records, one after another (kept alive with the step)."""
        records = b"".join(expert_record(e, self.spec.hidden_size, inter) for e in experts)
        buffer = ctypes.create_string_buffer(records, len(records))
        self._keep.append(buffer)
        return ctypes.addressof(buffer)

    def _layer(self, layer: int) -> _Layer:
        engine, spec, w = self.engine, self.spec, self.engine.layers[layer]
        D = spec.hidden_size
        where = f"layer {layer}"
        out = _Layer(input_norm=_vector(f"{where} input norm", w.input_norm, D),
                     post_norm=_vector(f"{where} post norm", w.post_norm, D))
        if w.deltanet is not None:
            out.deltanet = self._deltanet(where, w.deltanet)
        else:
            self._attention(where, w, out)
        mlp = w.mlp if w.mlp is not None else w.shared
        if mlp is not None:
            out.mlp, out.mlp_I = self._records([mlp], mlp.inter), mlp.inter
        if w.router is None:
            return out
        E, I = spec.num_experts, spec.moe_intermediate_size
        if tuple(w.router.shape) != (E, D):
            raise ValueError(f"{where}: router {list(w.router.shape)} (expected [{E}, {D}])")
        out.router = _vector(f"{where} router", w.router, E * D)
        out.correction = _vector(f"{where} correction bias", w.correction_bias, E)
        out.experts = self._records(engine.executor.placed[layer], I)
        if w.shared_gate is not None:
            if w.shared is None:
                raise ValueError(f"{where}: a shared expert gate without a shared expert")
            out.shared_gate = _vector(f"{where} shared expert gate", w.shared_gate, D)
        return out

    def _attention(self, where: str, w, out: _Layer) -> None:
        """An attention layer's parts into `out`: q (with its gate rows, per head), k, v; their norms; o."""
        spec = self.spec
        D, H, G, d = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
        rows = (H * (2 if spec.attention_gate else 1) + 2 * G) * d
        qkv = [_part(f"{where} qkv", data, qtype, D) for data, qtype in w.qkv.parts]
        if len(qkv) > 3 or sum(p.rows for p in qkv) != rows:
            raise ValueError(f"{where}: qkv parts {[p.rows for p in qkv]} are not {rows} rows in <= 3 parts")
        if len(w.o_proj.parts) != 1:
            raise ValueError(f"{where}: o_proj in {len(w.o_proj.parts)} parts (expected 1)")
        (o_data, o_type), = w.o_proj.parts
        out.qk_norm = _vector(f"{where} qk norm", w.qk_norm, (H + G) * d)
        out.qkv, out.qkv_parts = (_Part * 3)(*qkv), len(qkv)
        out.qkv_bias = _vector(f"{where} qkv bias", w.qkv.bias, rows)
        out.o, out.o_bias = _part(f"{where} o_proj", o_data, o_type, H * d), _vector(f"{where} o bias", w.o_proj.bias, D)

    def _deltanet(self, where: str, t) -> _DeltaNet:
        """A linear-attention layer's mixer (moetier.engine.deltanet.DeltaNetWeights) as cpu_step.h reads it."""
        g, D = self.spec.linear_attention, self.spec.hidden_size
        rows = g.conv_channels + g.value_width + 2 * g.value_heads
        parts = [_part(f"{where} in_proj", data, qtype, D) for data, qtype in t.in_proj.parts]
        if len(parts) > 3 or sum(p.rows for p in parts) != rows or t.in_proj.bias is not None:
            raise ValueError(f"{where}: in_proj parts {[p.rows for p in parts]} are not C + Hv dv + 2 Hv = {rows} rows in "
                             "<= 3 parts without a bias")
        if len(t.out_proj.parts) != 1 or t.out_proj.bias is not None:
            raise ValueError(f"{where}: out_proj in {len(t.out_proj.parts)} parts (expected 1, without a bias)")
        return _DeltaNet((_Part * 3)(*parts), len(parts), _vector(f"{where} conv", t.conv, g.conv_channels * g.conv_kernel),
                         _vector(f"{where} dt_bias", t.dt_bias, g.value_heads),
                         _vector(f"{where} decay rate", t.decay_rate, g.value_heads),
                         _vector(f"{where} gated norm", t.norm, g.value_dim),
                         _part(f"{where} out_proj", *t.out_proj.parts[0], g.value_width))

    @classmethod
    def build(cls, engine: Engine) -> NativeStep | None:
        """The step for `engine`, or None (see why_not)."""
        return None if cls.why_not(engine) else cls(engine, engine.backend.decode_kernel())

    @staticmethod
    def why_not(engine: Engine) -> str | None:
        """Why `engine` cannot decode through the native step, in a few words; None when it can."""
        from moetier.engine.core import ResidentExperts

        spec = engine.spec
        if os.environ.get("MOETIER_NATIVE_STEP", "1") == "0":
            return "MOETIER_NATIVE_STEP=0"
        if spec.hyper is not None or spec.latent_attention is not None:
            return f"{spec.arch}'s hyper-connections, KDA and latent attention are computed per layer"
        if any(part.device.type != "cpu" for part in engine.parts):
            return "a layer is not on the CPU"
        if not isinstance(engine.executor, ResidentExperts) or engine.backend.decode_kernel() is None:
            return "the routed experts are not all resident on a CPU backend with the native kernels"
        if spec.n_group > 64 or spec.num_experts % max(spec.n_group, 1):
            return f"{spec.n_group} router groups of {spec.num_experts} experts"
        if spec.linear_layers and spec.linear_attention.value_dim > DV_MAX:
            return f"linear-attention value heads of {spec.linear_attention.value_dim} dims (the native mixer takes {DV_MAX})"
        placed = [w for layer in spec.moe_layers for w in engine.executor.placed[layer]]
        placed += [w for layer in engine.layers for w in (layer.mlp, layer.shared) if w is not None]  # records too
        if not all(engine.backend.decode_kernel().fits(w) for w in placed):
            return "an expert the native kernels cannot read in place"
        return None

    def _cache_addresses(self, cache: KVCache, end: int) -> tuple:
        """Room for positions < end in `cache`, and the addresses of its layers' key and value buffers and linear
        layers' states, kept on the cache (its own: two threads decoding two sequences never share them) until its
        buffers change or the Python path replaces a state (it assigns new tensors; the step updates in place)."""
        if self._first_attention is not None:
            cache.reserve(end)
        states = tuple(t for layer in self.spec.linear_layers for t in (cache.states[layer].conv, cache.states[layer].recurrent))
        held = cache.native
        if held is None or held[0] != cache.grown or not all(map(operator.is_, held[1], states)):
            held = cache.native = (cache.grown, states, *self._addresses(cache, states))
        return held[2:]

    def _addresses(self, cache: KVCache, states: tuple) -> tuple[ctypes.Array, ...]:
        """`cache`'s key, value, conv and recurrent buffer addresses per layer (None where a layer has none), checked."""
        L = self.spec.num_layers
        conv, recurrent = [None] * L, [None] * L
        for i, layer in enumerate(self.spec.linear_layers):
            for what, t, shape, out in (("conv", states[2 * i], self._state_shapes[0], conv),
                                        ("recurrent", states[2 * i + 1], self._state_shapes[1], recurrent)):
                if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or tuple(t.shape) != shape:
                    raise ValueError(f"native step: layer {layer}'s {what} state must be float32 {list(shape)} contiguous in "
                                     f"host memory, got {t.dtype} {list(t.shape)} on {t.device}")
                out[layer] = t.data_ptr()
        address = lambda ts: (ptr * L)(*[None if t is None else t.data_ptr() for t in ts])  # noqa: E731
        return address(cache.keys), address(cache.values), (ptr * L)(*conv), (ptr * L)(*recurrent)

    def _nudge(self, table: torch.Tensor) -> torch.Tensor:
        """The bias table [MoE layers, E] as the C reads it: float32, contiguous, in host memory (converted once)."""
        if table.dtype is torch.float32 and table.is_cpu and table.is_contiguous():
            return table
        if self._nudge_of is None or self._nudge_of[0] is not table:
            self._nudge_of = (table, table.to("cpu", torch.float32).contiguous())
        return self._nudge_of[1]

    def step(self, token: int, cache: KVCache, start: int) -> torch.Tensor:
        """The logits [1, V] of token `token` at position start, through every layer; its keys and values land in
        `cache` (whose length is the caller's to advance)."""
        engine, spec = self.engine, self.spec
        if not 0 <= token < spec.vocab_size:
            raise ValueError(f"native step: token id {token} is outside the vocabulary [0, {spec.vocab_size})")
        keys, values, conv, recurrent = self._cache_addresses(cache, start + 1)
        capacity = 0 if self._first_attention is None else cache.keys[self._first_attention].shape[1]
        cos, sin = engine.ropes[torch.device("cpu")].at(start)  # [rotary_dim] each
        nudge = None if engine.router_bias is None else self._nudge(engine.router_bias.table)
        logits, h, route_logits, probs, weights = torch.empty(sum(self._sizes)).split(self._sizes)
        picks = torch.empty(len(spec.moe_layers), spec.top_k, dtype=torch.int64)
        call = _Call(token, h.data_ptr(), start, capacity, spec.sliding_window or 0, cos.data_ptr(), sin.data_ptr(),
                     ctypes.addressof(keys), ctypes.addressof(values), nudge.data_ptr() if nudge is not None else None,
                     route_logits.data_ptr(), probs.data_ptr(), weights.data_ptr(), picks.data_ptr(),
                     self.scratch.data_ptr(), logits.data_ptr(), ctypes.addressof(conv), ctypes.addressof(recurrent))
        status_error("native step", self.kernel.library.moe_step(self.kernel.pool.handle, ctypes.byref(self.model), self.layers,
                                                                 spec.num_layers, ctypes.byref(call)))
        if engine.observer is not None:
            E, k = spec.num_experts, spec.top_k
            route_logits, probs, weights = route_logits.view(-1, E), probs.view(-1, E), weights.view(-1, k)
            for i, layer in enumerate(spec.moe_layers):
                engine.observer(layer, Route(route_logits[i : i + 1], probs[i : i + 1], picks[i : i + 1], weights[i : i + 1]))
        return logits.view(1, -1)
