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
the two take turns on one cache (a Python prefill, native decode). So do
GLM-5.3's: the hyper-connected streams, KDA layers (states as Gated
DeltaNet's), and latent attention with its DSA indexer, whose latent and
index rows the step writes into the layer's LatentState in place (reserved
first) and whose tied pool scores it hands back to torch.topk (`_choose_pools`:
the Python path's choice among equal scores, which no fixed rule reproduces).
Router bias tables are applied as the Python router applies them (a bias row
added to the selection scores); a damped bias, a step being timed
(engine.times) and MOETIER_NATIVE_STEP=0 take the Python path. The route
observer sees every MoE layer's Route after the step, in layer order.
Numerics: the same formats and products as the Python path; float32 sums in
other orders (attention, norms, router logits, conv taps) and a polynomial
e^x in the linear layers' silu, so logits agree to float32 rounding, and the
same bits for any thread count (tests/test_native_step.py).
Every shape, format and address is checked here, once, at build; a call
checks its own arguments. A cache keeps its call record and outputs between
tokens (`_Held`), so `next_token` (Engine.decode_greedy: greedy generate,
stream_tokens and the server) decodes without making a tensor; `step` returns
a copy of the logits, and the observer sees copies of the routes.
"""

from __future__ import annotations

import ctypes
import operator
import os
from typing import TYPE_CHECKING

import torch

from moetier.backends import cpu_kernels
from moetier.backends.cpu_kernels import expert_record, matrix_error
from moetier.backends.cpu_status import status_error
from moetier.engine.layers import KVCache
from moetier.engine.router import Route
from moetier.model.formats import F32

if TYPE_CHECKING:
    from moetier.engine.core import Engine

i64, ptr, f64 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_double
CPU = torch.device("cpu")
DV_MAX = 512  # a linear-attention value head's dims, at most (cpu_deltanet.h keeps a head's sums on the stack)


class _Part(ctypes.Structure):  # linear_part
    _fields_ = [("address", i64), ("type", i64), ("rows", i64)]


class _LatentShape(ctypes.Structure):  # latent_shape
    _fields_ = [(name, i64) for name in ("q_rank", "r", "dn", "dv", "H", "Hi", "di", "pool", "topk", "select_tail")]


class _Model(ctypes.Structure):  # step_model
    _fields_ = [(name, i64) for name in ("D", "H", "G", "d", "rotary_dim", "E", "k", "router", "norm_topk", "n_group",
                                         "topk_group", "I", "float_acts")] + [("eps", f64), ("scaling", f64),
                ("embed", ptr), ("embed_type", i64), ("final_norm", ptr), ("head", _Part)] + [
                (name, i64) for name in ("attention_gate", "Hk", "Hv", "dk", "dv", "K")] + [
                ("lower_bound", f64), ("streams", i64), ("hc_iters", i64), ("hc_eps", f64), ("latent", _LatentShape)]


class _DeltaNet(ctypes.Structure):  # step_deltanet
    _fields_ = [("in_", _Part * 3), ("in_parts", i64), ("conv", ptr), ("dt_bias", ptr), ("decay_rate", ptr), ("norm", ptr),
                ("out", _Part)]


class _Kda(ctypes.Structure):  # step_kda
    _fields_ = [("in_", _Part * 6), ("in_parts", i64), ("forget_up", _Part), ("gate_up", _Part), ("conv", ptr),
                ("dt_bias", ptr), ("decay_rate", ptr), ("norm", ptr), ("out", _Part)]


class _Latent(ctypes.Structure):  # step_latent
    _fields_ = [("in_", _Part * 5), ("in_parts", i64), ("in_bias", ptr), ("q_norm", ptr), ("kv_norm", ptr), ("up", _Part * 2),
                ("kv_weight", ptr), ("out", _Part), ("out_bias", ptr), ("k_norm", ptr), ("k_bias", ptr), ("pool_bias", ptr)]


class _Hyper(ctypes.Structure):  # step_hyper
    _fields_ = [("fn", _Part), ("base", ptr), ("scale", ptr)]


class _Layer(ctypes.Structure):  # step_layer
    _fields_ = [("input_norm", ptr), ("post_norm", ptr), ("qk_norm", ptr), ("qkv", _Part * 3), ("qkv_parts", i64),
                ("qkv_bias", ptr), ("o", _Part), ("o_bias", ptr), ("router", ptr), ("correction", ptr),
                ("experts", ptr), ("mlp", ptr), ("mlp_I", i64), ("shared_gate", ptr), ("deltanet", _DeltaNet),
                ("kda", _Kda), ("latent", _Latent), ("hyper_attn", _Hyper), ("hyper_ffn", _Hyper)]


# the indexer's tied choices (cpu_latent.h's choose_fn): scores [n] float32, k -> picks [k] int64; 0, or -1
CHOOSE = ctypes.CFUNCTYPE(i64, ptr, i64, i64, ptr)


class _Call(ctypes.Structure):  # step_call
    _fields_ = [("token", i64), ("h", ptr), ("position", i64), ("capacity", i64), ("window", i64), ("cos", ptr), ("sin", ptr),
                ("keys", ptr), ("values", ptr), ("nudge", ptr), ("logits", ptr), ("probs", ptr), ("weights", ptr),
                ("picks", ptr), ("scratch", ptr), ("out", ptr), ("conv_states", ptr), ("recurrent_states", ptr),
                ("latents", ptr), ("index", ptr), ("picked", ptr), ("choose", CHOOSE)]


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


class _Held:
    """What a cache keeps of a native step between tokens (KVCache.native): its buffers' and states' addresses as
    they were taken, and one call record over outputs of its own (the logits, the residual stream, each MoE layer's
    route), reused token after token. A decoded token then makes no tensor: after a step the Python around the call
    runs with caches the call has just flushed, where each torch op costs tens of microseconds (the `wide` Q4_K_M
    model, 2 threads: ~0.4 ms a token outside the native call before, of ~4.5)."""

    def __init__(self, step: NativeStep, grown: int, states: tuple, addresses: tuple, capacity: int, room: int):
        spec = step.spec
        self.step, self.grown, self.states, self.addresses = step, grown, states, addresses
        self.logits, self.h, self.route_logits, self.probs, self.weights = torch.empty(sum(step._sizes)).split(step._sizes)
        self.logits_array = self.logits.numpy()  # the same memory
        self.picks = torch.empty(len(spec.moe_layers), spec.top_k, dtype=torch.int64)
        self.picked = torch.empty(room, dtype=torch.int64)  # the positions a latent layer attends: < room
        keys, values, conv, recurrent, latents, index = (ctypes.addressof(a) for a in addresses)
        self.call = _Call(0, self.h.data_ptr(), 0, capacity, spec.sliding_window or 0, None, None, keys, values, None,
                          self.route_logits.data_ptr(), self.probs.data_ptr(), self.weights.data_ptr(),
                          self.picks.data_ptr(), step.scratch.data_ptr(), self.logits.data_ptr(), conv, recurrent,
                          latents, index, self.picked.data_ptr(), step._choose)
        self.call_ref = ctypes.byref(self.call)


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
        self.model.lower_bound = float("nan") if g is None or g.lower_bound is None else g.lower_bound
        if spec.hyper is not None:
            self.model.streams, self.model.hc_iters, self.model.hc_eps = (spec.hyper.streams, spec.hyper.sinkhorn_iters,
                                                                          spec.hyper.eps)
        mla, index = spec.latent_attention, spec.indexer
        if mla is not None:
            self.model.latent = _LatentShape(mla.q_rank, mla.kv_rank, mla.key_dim, mla.value_dim, spec.num_heads,
                                             index.heads, index.head_dim, index.pool, index.topk, int(index.select_tail))
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
        self._sizes = [spec.vocab_size, D * (spec.hyper.streams if spec.hyper else 1), moe * E, moe * E, moe * k]
        self.scratch = torch.empty(kernel.library.step_scratch(ctypes.byref(self.model)))
        self._nudge_of: tuple[torch.Tensor, torch.Tensor] | None = None  # (a bias table, its float32 host copy)
        attention = [l for l in spec.attention_layers if mla is None]  # the layers with key and value buffers
        self._first_attention = attention[0] if attention else None
        self._latent_layers = spec.attention_layers if mla is not None else ()
        self._keys_only = not spec.linear_layers and not self._latent_layers  # a cache of keys and values, no states
        self._choose = CHOOSE(self._choose_pools)  # kept alive as long as the step
        self._failure: BaseException | None = None  # what the last call's _choose_pools raised
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
        elif w.kda is not None:
            out.kda = self._kda(where, w.kda)
        elif w.latent is not None:
            out.latent = self._latent(where, w.latent)
        else:
            self._attention(where, w, out)
        if spec.hyper is not None:
            out.hyper_attn, out.hyper_ffn = (self._hyper(f"{where} hyper-connection {block}", hw)
                                             for block, hw in (("attn", w.hyper_attn), ("ffn", w.hyper_ffn)))
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
        out.qk_norm = _vector(f"{where} qk norm", w.qk_norm, (H + G) * d)
        out.qkv, out.qkv_parts = self._parts(f"{where} qkv", w.qkv, D, 3, rows)
        out.qkv_bias = _vector(f"{where} qkv bias", w.qkv.bias, rows)
        out.o, out.o_bias = self._one(f"{where} o_proj", w.o_proj, H * d, D, bias=True), _vector(f"{where} o bias", w.o_proj.bias, D)

    def _deltanet(self, where: str, t) -> _DeltaNet:
        """A linear-attention layer's mixer (moetier.engine.deltanet.DeltaNetWeights) as cpu_step.h reads it."""
        g, D = self.spec.linear_attention, self.spec.hidden_size
        if t.in_proj.bias is not None:
            raise ValueError(f"{where}: a Gated DeltaNet in-projection with a bias")
        parts, count = self._parts(f"{where} in_proj (C + Hv dv + 2 Hv)", t.in_proj, D, 3,
                                   g.conv_channels + g.value_width + 2 * g.value_heads)
        return _DeltaNet(parts, count, _vector(f"{where} conv", t.conv, g.conv_channels * g.conv_kernel),
                         _vector(f"{where} dt_bias", t.dt_bias, g.value_heads),
                         _vector(f"{where} decay rate", t.decay_rate, g.value_heads),
                         _vector(f"{where} gated norm", t.norm, g.value_dim),
                         self._one(f"{where} out_proj", t.out_proj, g.value_width, D))

    def _parts(self, what: str, linear, cols: int, most: int, rows: int) -> tuple[ctypes.Array, int]:
        """A StoredLinear's parts, at most `most`, of `rows` rows in all, as the C reads them."""
        parts = [_part(what, data, qtype, cols) for data, qtype in linear.parts]
        if len(parts) > most or sum(p.rows for p in parts) != rows:
            raise ValueError(f"{what}: parts of {[p.rows for p in parts]} rows (expected {rows} rows in <= {most} parts)")
        return (_Part * most)(*parts), len(parts)

    def _one(self, what: str, linear, cols: int, rows: int, bias: bool = False) -> _Part:
        """A StoredLinear of one part of `rows` rows, without a bias unless `bias`, as the C reads it."""
        if len(linear.parts) != 1 or (linear.bias is not None and not bias) or linear.parts[0][0].shape[0] != rows:
            raise ValueError(f"{what}: {len(linear.parts)} parts{' and a bias' if linear.bias is not None else ''} "
                             f"(expected one of {rows} rows)")
        return _part(what, *linear.parts[0], cols)

    def _kda(self, where: str, t) -> _Kda:
        """A KDA layer's mixer (moetier.engine.kda.KdaWeights) as cpu_step.h reads it."""
        g, D = self.spec.linear_attention, self.spec.hidden_size
        H, d, K = g.key_heads, g.key_dim, g.conv_kernel
        if t.in_proj.bias is not None:
            raise ValueError(f"{where}: a KDA in-projection with a bias")
        parts, count = self._parts(f"{where} KDA in_proj", t.in_proj, D, 6, 3 * H * d + H + 2 * d)
        return _Kda(parts, count, self._one(f"{where} f_b_proj", t.forget_up, d, H * d),
                    self._one(f"{where} g_b_proj", t.gate_up, d, H * d), _vector(f"{where} conv", t.conv, 3 * H * d * K),
                    _vector(f"{where} dt_bias", t.dt_bias, H * d), _vector(f"{where} decay rate", t.decay_rate, H),
                    _vector(f"{where} o_norm", t.norm, d), self._one(f"{where} o_proj", t.out_proj, H * d, D))

    def _latent(self, where: str, t) -> _Latent:
        """A latent-attention layer (moetier.engine.mla.LatentWeights) as cpu_step.h reads it."""
        spec, D = self.spec, self.spec.hidden_size
        mla, index, H = spec.latent_attention, spec.indexer, spec.num_heads
        indexed = t.indexer is not None
        rows = mla.q_rank + mla.kv_rank + (2 * index.head_dim + index.heads if indexed else 0)
        parts, count = self._parts(f"{where} latent in_proj", t.in_proj, D, 5, rows)
        up = [self._one(f"{where} q_b_proj", t.q_up, mla.q_rank, H * mla.key_dim)]
        out = _Latent(parts, count, _vector(f"{where} latent in_proj bias", t.in_proj.bias, rows),
                      _vector(f"{where} q_a_layernorm", t.q_norm, mla.q_rank),
                      _vector(f"{where} kv_a_layernorm", t.kv_norm, mla.kv_rank))
        if indexed:
            di = index.head_dim
            up.append(self._one(f"{where} indexer wq_b", t.indexer.q_up, mla.q_rank, index.heads * di))
            out.k_norm = _vector(f"{where} indexer k_norm", t.indexer.k_norm[0], di)
            out.k_bias = _vector(f"{where} indexer k_norm bias", t.indexer.k_norm[1], di)
            out.pool_bias = _vector(f"{where} indexer pool bias", t.indexer.pool_bias, index.pool * di)
        out.up = (_Part * 2)(*up)
        out.kv_weight = _vector(f"{where} kv_b_proj", t.kv_weight, H * (mla.key_dim + mla.value_dim) * mla.kv_rank)
        out.out = self._one(f"{where} o_proj", t.out_proj, H * mla.value_dim, D, bias=True)
        out.out_bias = _vector(f"{where} o_proj bias", t.out_proj.bias, D)
        return out

    def _hyper(self, what: str, w) -> _Hyper:
        """One block's hyper-connection weights (moetier.engine.hyper.HyperWeights) as cpu_step.h reads them."""
        n, D = self.spec.hyper.streams, self.spec.hidden_size
        width = (2 + n) * n
        if w.fn.dtype != torch.float32 or tuple(w.fn.shape) != (width, n * D):
            raise ValueError(f"{what}: fn {w.fn.dtype} {list(w.fn.shape)} (expected float32 [{width}, {n * D}])")
        return _Hyper(_part(what, w.fn, F32, n * D), _vector(f"{what} base", w.base, width), _vector(f"{what} scale", w.scale, 3))

    def _choose_pools(self, scores: int, n: int, k: int, picks: int) -> int:
        """The indexer's choice among tied pool scores, as the Python path makes it (torch.topk over [1, n])."""
        try:
            values = torch.frombuffer((ctypes.c_float * n).from_address(scores), dtype=torch.float32).view(1, n)
            out = torch.frombuffer((ctypes.c_int64 * k).from_address(picks), dtype=torch.int64)
            out.copy_(values.topk(k, dim=-1).indices[0])
            return 0
        except BaseException as failure:  # noqa: BLE001 (raised again by step, after the native call)
            self._failure = failure
            return -1

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
        if any(part.device.type != "cpu" for part in engine.parts):
            return "a layer is not on the CPU"
        if not isinstance(engine.executor, ResidentExperts) or engine.backend.decode_kernel() is None:
            return "the routed experts are not all resident on a CPU backend with the native kernels"
        if spec.n_group > 64 or spec.num_experts % max(spec.n_group, 1):
            return f"{spec.n_group} router groups of {spec.num_experts} experts"
        if spec.linear_layers and spec.linear_attention.value_dim > DV_MAX:
            return f"linear-attention value heads of {spec.linear_attention.value_dim} dims (the native mixer takes {DV_MAX})"
        if spec.linear_layers and spec.linear_attention.kind == "kda" and spec.linear_attention.key_dim > DV_MAX:
            return f"KDA heads of {spec.linear_attention.key_dim} dims (the native mixer takes {DV_MAX})"
        placed = [w for layer in spec.moe_layers for w in engine.executor.placed[layer]]
        placed += [w for layer in engine.layers for w in (layer.mlp, layer.shared) if w is not None]  # records too
        if not all(engine.backend.decode_kernel().fits(w) for w in placed):
            return "an expert the native kernels cannot read in place"
        return None

    def _held(self, cache: KVCache, end: int) -> _Held:
        """Room for positions < end in `cache`, and what the cache keeps of this step (its own: two threads decoding
        two sequences never share one) until its buffers change or the Python path replaces a state (it assigns new
        tensors; the step updates in place). With keys and values alone, a held record whose buffers have room is
        taken at once: the Python around the call runs on caches the call has flushed, where the full check (every
        layer's buffers) took ~60 us a token (`deep` IQ3_S, 12 ms a token), the fast one a few."""
        held = cache.native
        if (self._keys_only and held is not None and held.step is self and held.grown == cache.grown
                and end <= held.call.capacity):
            return held
        if self._first_attention is not None:
            cache.reserve(end)
        for layer in self._latent_layers:
            cache.states[layer].reserve(end)
        states = tuple(t for layer in self.spec.linear_layers for t in (cache.states[layer].conv, cache.states[layer].recurrent))
        states += tuple(t for layer in self._latent_layers for t in (cache.states[layer].latents, cache.states[layer].index))
        held = cache.native
        if held is None or held.step is not self or held.grown != cache.grown or not all(map(operator.is_, held.states, states)):
            capacity = 0 if self._first_attention is None else cache.keys[self._first_attention].shape[1]
            room = max((cache.states[layer].latents.shape[0] for layer in self._latent_layers), default=0)
            held = cache.native = _Held(self, cache.grown, states, self._addresses(cache, states), capacity, room)
        return held

    def _addresses(self, cache: KVCache, states: tuple) -> tuple[ctypes.Array, ...]:
        """`cache`'s key, value, conv and recurrent buffer addresses per layer (None where a layer has none), checked."""
        L, spec = self.spec.num_layers, self.spec
        conv, recurrent, latents, index = [None] * L, [None] * L, [None] * L, [None] * L
        linear = len(spec.linear_layers)
        checks = [(layer, what, states[2 * i + j], self._state_shapes[j], out) for i, layer in enumerate(spec.linear_layers)
                  for j, (what, out) in enumerate((("conv", conv), ("recurrent", recurrent)))]
        if self._latent_layers:
            cap = [states[2 * (linear + i)].shape[0] for i in range(len(self._latent_layers))]
            mla, di = spec.latent_attention, spec.indexer.head_dim
            checks += [(layer, what, states[2 * (linear + i) + j], shape, out) for i, layer in enumerate(self._latent_layers)
                       for j, (what, shape, out) in enumerate((("latent", (cap[i], mla.kv_rank), latents),
                                                               ("index", (cap[i], 2 * di), index)))]
        for layer, what, t, shape, out in checks:
            if t.dtype != torch.float32 or not t.is_cpu or not t.is_contiguous() or tuple(t.shape) != shape:
                raise ValueError(f"native step: layer {layer}'s {what} state must be float32 {list(shape)} contiguous in "
                                 f"host memory, got {t.dtype} {list(t.shape)} on {t.device}")
            out[layer] = t.data_ptr()
        address = lambda ts: (ptr * L)(*[None if t is None else t.data_ptr() for t in ts])  # noqa: E731
        return (address(cache.keys), address(cache.values), (ptr * L)(*conv), (ptr * L)(*recurrent), (ptr * L)(*latents),
                (ptr * L)(*index))

    def _nudge(self, table: torch.Tensor) -> torch.Tensor:
        """The bias table [MoE layers, E] as the C reads it: float32, contiguous, in host memory (converted once)."""
        if table.dtype is torch.float32 and table.is_cpu and table.is_contiguous():
            return table
        if self._nudge_of is None or self._nudge_of[0] is not table:
            self._nudge_of = (table, table.to("cpu", torch.float32).contiguous())
        return self._nudge_of[1]

    def _run(self, token: int, cache: KVCache, start: int) -> _Held:
        """Token `token` at position start through every layer into the cache's held outputs; its keys and values
        land in `cache` (whose length is the caller's to advance). The route observer sees copies of the routes."""
        engine, spec = self.engine, self.spec
        if not 0 <= token < spec.vocab_size:
            raise ValueError(f"native step: token id {token} is outside the vocabulary [0, {spec.vocab_size})")
        held = self._held(cache, start + 1)
        call = held.call
        call.token, call.position = token, start
        call.cos, call.sin = engine.ropes[CPU].row_addresses(start)
        call.nudge = None if engine.router_bias is None else self._nudge(engine.router_bias.table).data_ptr()
        status = self.kernel.library.moe_step(self.kernel.pool.handle, ctypes.byref(self.model), self.layers, spec.num_layers,
                                              held.call_ref)
        if status == -3:  # the indexer's torch.topk raised: that, not a status
            failure, self._failure = self._failure, None
            raise RuntimeError("native step: the indexer's choice among tied pools failed") from failure
        status_error("native step", status)
        if engine.observer is not None:  # copies: the held outputs are the next token's
            E, k = spec.num_experts, spec.top_k
            route_logits, probs = held.route_logits.view(-1, E).clone(), held.probs.view(-1, E).clone()
            picks, weights = held.picks.clone(), held.weights.view(-1, k).clone()
            for i, layer in enumerate(spec.moe_layers):
                engine.observer(layer, Route(route_logits[i : i + 1], probs[i : i + 1], picks[i : i + 1], weights[i : i + 1]))
        return held

    def step(self, token: int, cache: KVCache, start: int) -> torch.Tensor:
        """The logits [1, V] (the caller's own) of token `token` at position start, through every layer; its keys and
        values land in `cache` (whose length is the caller's to advance)."""
        return self._run(token, cache, start).logits.clone().view(1, -1)

    def next_token(self, token: int, cache: KVCache, start: int) -> tuple[int, float]:
        """As step, then (the argmax of the logits, that logit) with no tensor made: the first of equal logits, and
        a NaN before any number, as torch.argmax takes them."""
        logits = self._run(token, cache, start).logits_array
        top = int(logits.argmax())
        return top, float(logits[top])
