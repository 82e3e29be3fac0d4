"""The engine core: one decoder forward pass over a MoE checkpoint, batch 1.

`Engine.forward(ids, cache)` runs embed -> layers -> norm -> lm head for T new
tokens after `cache.length` cached ones. A layer mixes tokens by attention
over its KV cache or, in Qwen3-Next's linear-attention layers, by the Gated
DeltaNet recurrence over a state the cache also holds (moetier.engine.deltanet).
Attention and the trunk (norms, dense
MLPs, shared experts, router) run in torch on the engine's device (on the CPU
the matrices and the attention heads through the native kernels); routed
experts go through an `ExpertExecutor` — here `ResidentExperts`, every expert
placed on one backend — which is the seam where tiers plug in. A decoded
token on an all-CPU engine whose experts are all resident on the native
kernels runs instead through the native step (moetier.engine.native_step:
every layer in one C call); while a forward runs on such an engine torch
keeps one intra-op thread (the pool's threads do the matrix work on every
core). The engine knows nothing about tokenization. Invariant: with the torch backend and no
bias, logits match the transformers reference within float32 rounding.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, NamedTuple, Protocol, Sequence

import torch
import torch.nn.functional as F

from moetier.backends import Backend, ExpertWork, cpu_kernels, get_backend
from moetier.backends.base import ROW0
from moetier.engine.deltanet import DeltaNetState, DeltaNetWeights, deltanet_layer
from moetier.engine.hyper import HyperWeights, Residual, Streams
from moetier.engine.kda import KdaWeights, kda_layer
from moetier.engine.mla import IndexerWeights, LatentState, LatentWeights, latent_layer
from moetier.engine.layers import KVCache, RotaryTable, attend, attention_mask, rms_norm, torch_threads
from moetier.engine.linear import StoredEmbedding, StoredLinear, stored_ffn
from moetier.engine.native_step import NativeStep
from moetier.engine.router import Route, route_gate
from moetier.engine.router_bias import RouterBias
from moetier.engine.timing import StepTimes
from moetier.model.checkpoint import Checkpoint, ExpertWeights
from moetier.sched.defer import deferred_layers
from moetier.tiers.base import ExpertJob

RouteObserver = Callable[[int, Route], None]  # (layer, route) for every MoE layer of every forward
NATIVE_NORM_ROWS = 8  # from this many rows an RMSNorm runs on the native pool (a hand-off costs ~5-10 us)


class Partials(NamedTuple):
    """A MoE layer's routed-expert output: what to add now, and the CPU lane's share (deferrable)."""

    now: torch.Tensor  # [T, D]
    lane: "Future[torch.Tensor] | None" = None  # [T, D] when done


class ExpertExecutor(Protocol):
    live_cache: bool  # some expert cache's residency moves as it serves: live-cache affinity has something to follow

    def dispatch(self, layer: int, x: torch.Tensor, decision: Route) -> Partials:
        """x [T, D] and the layer's routing -> the gate-weighted sum of each token's experts."""

    def resident_mask(self, layer: int) -> torch.Tensor | None:
        """[E] bool: the experts of `layer` in a live cache now; None without one."""


@dataclass(frozen=True)
class Part:
    """Consecutive layers that run on one device; DEFER_CPU never carries a partial across parts."""

    layers: range
    device: torch.device


def group_by_expert(picks: torch.Tensor, weights: torch.Tensor) -> list[ExpertJob]:
    """picks/weights [T, k] -> one ExpertJob(expert, rows [n], weights [n]) per expert picked at least once."""
    tokens, k = picks.shape
    if tokens == 1:  # decode: k distinct experts, one row each; one unbind, not k slices
        return list(map(ExpertJob, picks.view(-1).tolist(), (ROW0,) * k, weights.reshape(k, 1).unbind(0)))
    flat = picks.reshape(-1)
    order = torch.argsort(flat, stable=True)  # [T*k] grouped by expert
    experts, counts = torch.unique_consecutive(flat[order], return_counts=True)
    rows, gate = order // k, weights.reshape(-1)[order]
    groups, start = [], 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        groups.append(ExpertJob(expert, rows[start : start + count], gate[start : start + count]))
        start += count
    return groups


def _device(name: str) -> torch.device:
    """A torch device with its index spelled out ("cuda" -> cuda:N, the current one): tensors report
    their device that way, and the engine keys per-device state (rotary tables, caches) by it."""
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class ResidentExperts:
    """Every routed expert of every MoE layer placed on one backend: the all-resident executor."""

    live_cache = False

    def __init__(self, checkpoint: Checkpoint, backend: Backend):
        self.backend = backend
        spec = checkpoint.spec
        self.placed: dict[int, list] = {
            layer: [backend.place(checkpoint.expert(layer, e)) for e in range(spec.num_experts)] for layer in spec.moe_layers
        }

    def dispatch(self, layer: int, x: torch.Tensor, decision: Route) -> Partials:
        placed = self.placed[layer]
        work = [ExpertWork(placed[e], rows, w) for e, rows, w in group_by_expert(decision.picks, decision.weights)]
        return Partials(self.backend.run_experts(x, work))

    def resident_mask(self, layer: int) -> None:
        return None


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor  # [D]
    post_norm: torch.Tensor  # [D]
    # attention layers: q, k, v stacked (with their biases): D -> (H + 2G) * d, or (2H + 2G) * d with an output gate
    # (q_proj's rows per head: d query rows, then d gate rows); None in a linear-attention layer
    qkv: StoredLinear | None
    o_proj: StoredLinear | None  # H * d -> D
    qk_norm: torch.Tensor | None  # [H + G, d]: q_norm for each query head, then k_norm for each kv head
    mlp: ExpertWeights | None  # dense layers, stored
    router: torch.Tensor | None  # [E, D]
    correction_bias: torch.Tensor | None  # [E]
    shared: ExpertWeights | None  # shared experts (GLM) / the shared expert (Qwen3-Next), stored
    shared_gate: torch.Tensor | None = None  # [1, D]: the shared expert's output scaled by sigmoid(x . w) (Qwen3-Next)
    deltanet: DeltaNetWeights | None = None  # a linear-attention layer's token mixer (Qwen3-Next)
    kda: KdaWeights | None = None  # a linear-attention layer's token mixer (GLM-5.3)
    latent: LatentWeights | None = None  # a latent-attention layer's token mixer (GLM-5.3)
    hyper_attn: HyperWeights | None = None  # the hyper-connections around the mixer and the MLP (GLM-5.3)
    hyper_ffn: HyperWeights | None = None




class Engine:
    """A loaded model ready to run: see the module docstring."""

    def __init__(
        self,
        checkpoint: Checkpoint,
        backend: str | Backend = "torch",
        device: str = "cpu",
        executor: ExpertExecutor | None = None,
        parts: Sequence[tuple[range, str]] | None = None,
        defer_cpu: int = 0,
        defer_into_linear: bool = False,
    ):
        """parts: (layers, device) in order, covering every layer once (default: one part on `device`).
        defer_cpu: 0 waits for the CPU lane every layer; 1 defers in the first part; 2 in every part
        (moetier.sched.defer: never across a part boundary, nor into a linear-attention layer).
        defer_into_linear: a deferred partial may also land after a linear-attention layer's mixer, the seed's
        semantics: that layer's recurrent state then updates from the hidden state without the partial and keeps
        the difference in every later token. Lossy like DEFER_CPU itself; nothing changes with defer_cpu 0."""
        self.checkpoint = checkpoint
        self.spec = spec = checkpoint.spec
        self.parts = [Part(r, _device(d)) for r, d in (parts or [(range(spec.num_layers), device)])]
        covered = [layer for part in self.parts for layer in part.layers]
        if covered != list(range(spec.num_layers)):
            raise ValueError(f"parts cover layers {covered[:3]}...{covered[-3:]} (expected 0..{spec.num_layers - 1} once, in order)")
        self.device = self.parts[0].device
        self.defer_cpu, self.defer_into_linear = defer_cpu, defer_into_linear
        # the layers whose CPU-lane partial lands after the next layer's mixer (the rule the simulator reads too)
        self.deferred = deferred_layers(defer_cpu, [p.layers for p in self.parts], spec.linear_layers, defer_into_linear)
        self.backend = get_backend(backend, device) if isinstance(backend, str) else backend
        self.observer: RouteObserver | None = None
        self.times: StepTimes | None = None  # set to a StepTimes to account where each step's time goes
        c, first, last = checkpoint, self.parts[0].device, self.parts[-1].device
        # Everything the engine keeps is copied out of the file mapping (load, resident, the stored layers), the
        # trunk's matrices in their stored format (moetier.engine.linear)
        self.float_acts = c.float_acts
        self._cpu_kernel = cpu_kernels.decode_kernel()  # the native kernels of the trunk's MLPs on the CPU, or None
        self.embed = StoredEmbedding(*c.stored("model.embed_tokens.weight"), first)  # [V, D]
        self.final_norm = c.norm("model.norm.weight").to(last)  # [D]
        head = "model.embed_tokens.weight" if spec.tie_word_embeddings else "lm_head.weight"
        self.lm_head = StoredLinear([c.stored(head)], None, self.float_acts, last)  # D -> V
        self.layer_device = {layer: part.device for part in self.parts for layer in part.layers}
        self.layers = [self._layer_weights(layer) for layer in range(spec.num_layers)]
        self.ropes = {part.device: RotaryTable(spec.rotary_dim, spec.rope_theta, part.device) for part in self.parts}
        self.executor = executor if executor is not None else ResidentExperts(checkpoint, self.backend)
        self.moe_index = {layer: i for i, layer in enumerate(spec.moe_layers)}
        self.router_bias: RouterBias | None = None  # None: the reference router (route_gate)
        self.native_step = NativeStep.build(self)  # one token through every layer in one native call, or None
        # torch's intra-op threads while a forward runs: one when every layer is on the CPU and the native kernels do its
        # matrix work on every core (torch's idle workers spin for the cores the pool's threads compute on, and the
        # pool's for theirs: at 2 torch threads prefill on 2 CPUs ran 25% slower); None leaves torch's setting
        self.torch_threads = 1 if self._cpu_kernel is not None and all(p.device.type == "cpu" for p in self.parts) else None
        checkpoint.drop_pages()  # what runs holds its own copies now: the file's pages leave the resident set

    def set_router_bias(self, bias: "RouterBias | None") -> None:
        if bias is not None and tuple(bias.table.shape) != (len(self.spec.moe_layers), self.spec.num_experts):
            raise ValueError(f"router bias has shape {list(bias.table.shape)} (expected [{len(self.spec.moe_layers)}, {self.spec.num_experts}]: MoE layers x experts)")
        self.router_bias = bias

    def executor_affinity(self, layer: int) -> torch.Tensor | None:
        """lambda on the experts resident in a cache right now [E], from executors that have one."""
        mask = self.executor.resident_mask(layer)
        return None if mask is None else mask.to(torch.float32) * self.router_bias.affinity

    def _layer_weights(self, layer: int) -> LayerWeights:
        c, spec, dev = self.checkpoint, self.spec, self.layer_device[layer]
        p = f"model.layers.{layer}."
        attn = p + "self_attn."
        moe, linear = spec.is_moe(layer), spec.is_linear(layer)
        qkv = o_proj = qk_norm = None
        if not linear and spec.latent_attention is None:
            bias = None
            if spec.attention_bias:
                bias = torch.cat([c.tensor(f"{attn}{n}_proj.bias") for n in "qkv"])
            qkv = StoredLinear([c.stored(f"{attn}{n}_proj.weight") for n in "qkv"], bias, self.float_acts, dev)
            o_bias = c.load(attn + "o_proj.bias") if spec.output_bias else None
            o_proj = StoredLinear([c.stored(attn + "o_proj.weight")], o_bias, self.float_acts, dev)
            if spec.qk_norm:
                qk_norm = torch.cat([c.norm(attn + "q_norm.weight").expand(spec.num_heads, -1),
                                     c.norm(attn + "k_norm.weight").expand(spec.num_kv_heads, -1)]).to(dev)
        to_dev = lambda w: None if w is None else w.resident().to(dev)  # noqa: E731
        gate = c.shared_expert_gate(layer) if moe else None
        return LayerWeights(
            input_norm=c.norm(p + "input_layernorm.weight").to(dev),
            post_norm=c.norm(p + "post_attention_layernorm.weight").to(dev),
            qkv=qkv,
            o_proj=o_proj,
            qk_norm=qk_norm,
            mlp=None if moe else to_dev(c.dense_mlp(layer, stored=True)),
            router=c.router_weight(layer).clone().to(dev) if moe else None,
            correction_bias=(lambda b: None if b is None else b.clone().to(dev))(c.router_bias(layer)) if moe else None,
            shared=to_dev(c.shared_experts(layer, stored=True)) if moe else None,
            shared_gate=None if gate is None else gate.to(dev),
            deltanet=self._deltanet_weights(layer, dev) if linear and spec.linear_attention.kind == "gated_deltanet" else None,
            kda=self._kda_weights(layer, dev) if linear and spec.linear_attention.kind == "kda" else None,
            latent=self._latent_weights(layer, dev) if not linear and spec.latent_attention is not None else None,
            hyper_attn=self._hyper_weights(layer, "attn", dev), hyper_ffn=self._hyper_weights(layer, "ffn", dev),
        )

    def _hyper_weights(self, layer: int, block: str, dev: torch.device) -> HyperWeights | None:
        if self.spec.hyper is None:
            return None
        p = f"model.layers.{layer}.hc_{block}_"
        return HyperWeights(*(self.checkpoint.load(p + name).to(dev, torch.float32).contiguous() for name in ("fn", "base", "scale")))

    def _kda_weights(self, layer: int, dev: torch.device) -> KdaWeights:
        c, g, p = self.checkpoint, self.spec.linear_attention, f"model.layers.{layer}.self_attn."
        parts = [c.stored(f"{p}{n}.weight") for n in ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj")]
        linear = lambda name: StoredLinear([c.stored(p + name)], None, self.float_acts, dev)  # noqa: E731
        conv = torch.cat([c.tensor(f"{p}{n}_conv1d.weight") for n in "qkv"]).reshape(3 * g.value_width, g.conv_kernel)
        f32 = lambda t: t.to(dev, torch.float32).contiguous()  # noqa: E731 (the native mixer reads them in place)
        return KdaWeights(in_proj=StoredLinear(parts, None, self.float_acts, dev), forget_up=linear("f_b_proj.weight"),
                          gate_up=linear("g_b_proj.weight"), conv=f32(conv), dt_bias=f32(c.load(p + "dt_bias")),
                          decay_rate=f32(c.tensor(p + "A_log").exp()), norm=f32(c.load(p + "o_norm.weight")),
                          out_proj=linear("o_proj.weight"))

    def _latent_weights(self, layer: int, dev: torch.device) -> LatentWeights:
        c, spec, p = self.checkpoint, self.spec, f"model.layers.{layer}.self_attn."
        shared = layer in spec.indexer.shared_layers
        names = ["q_a_proj", "kv_a_proj_with_mqa"] + ([] if shared else
                                                       ["indexer.wk", "indexer.weights_proj", "indexer.index_kpool_compress_gate"])
        parts = [c.stored(f"{p}{n}" + ("" if n.endswith("compress_gate") else ".weight")) for n in names]
        bias = None
        if spec.attention_bias:  # q_a and kv_a carry biases; the indexer's projections none
            mla, index = spec.latent_attention, spec.indexer
            zeros = torch.zeros(0 if shared else 2 * index.head_dim + index.heads)
            bias = torch.cat([c.tensor(p + "q_a_proj.bias"), c.tensor(p + "kv_a_proj_with_mqa.bias"), zeros])
            assert bias.shape[0] == mla.q_rank + mla.kv_rank + zeros.shape[0]
        linear = lambda name, b=None: StoredLinear([c.stored(p + name)], b, self.float_acts, dev)  # noqa: E731
        indexer = None if shared else IndexerWeights(
            q_up=linear("indexer.wq_b.weight"),
            k_norm=(c.load(p + "indexer.k_norm.weight").to(dev), c.load(p + "indexer.k_norm.bias").to(dev)),
            pool_bias=c.load(p + "indexer.index_kpool_compress_ape").to(dev))
        return LatentWeights(in_proj=StoredLinear(parts, bias, self.float_acts, dev), q_norm=c.load(p + "q_a_layernorm.weight").to(dev),
                             q_up=linear("q_b_proj.weight"), kv_norm=c.load(p + "kv_a_layernorm.weight").to(dev),
                             kv_up=linear("kv_b_proj.weight"),
                             kv_weight=c.tensor(p + "kv_b_proj.weight").reshape(
                                 spec.num_heads, spec.latent_attention.key_dim + spec.latent_attention.value_dim, -1).to(dev, copy=True),
                             out_proj=linear("o_proj.weight", c.load(p + "o_proj.bias") if spec.attention_bias else None),
                             indexer=indexer)

    def _deltanet_weights(self, layer: int, dev: torch.device) -> DeltaNetWeights:
        t = self.checkpoint.deltanet(layer)
        return DeltaNetWeights(
            in_proj=StoredLinear([t.qkv, t.z, t.ba], None, self.float_acts, dev),  # one call: q|k|v, z, b|a
            conv=t.conv.to(dev), dt_bias=t.dt_bias.to(dev), decay_rate=t.decay_rate.to(dev), norm=t.norm.to(dev),
            out_proj=StoredLinear([t.out], None, self.float_acts, dev))

    def new_cache(self) -> KVCache:
        s = self.spec
        devices = [self.layer_device[l] for l in range(s.num_layers)]
        states: dict = {l: DeltaNetState(s.linear_attention, devices[l]) for l in s.linear_layers}
        if s.latent_attention is not None:
            states |= {l: LatentState(s, devices[l]) for l in s.attention_layers}
        return KVCache(s.num_layers, s.num_kv_heads, s.head_dim, devices, states=states)

    def warm_up(self) -> None:
        """One untimed two-token forward, so one-time kernel set-up is not billed to a timed prefill."""
        self.forward(torch.zeros(2, dtype=torch.int64), self.new_cache())

    # -- forward ------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, ids: torch.Tensor, cache: KVCache, all_logits: bool = True) -> torch.Tensor:
        """ids [T] int64 -> logits [T, V] (or [1, V] for the last position when all_logits is False)."""
        if ids.shape[0] == 1 and self._native_decode():
            logits = self.native_step.step(int(ids[0]), cache, cache.length)  # [1, V]
            cache.length += 1
            return logits
        with torch_threads(self.torch_threads):
            return self._forward(ids, cache, all_logits)

    def decode_greedy(self, token: int, cache: KVCache) -> tuple[int, float]:
        """Feed one token at cache.length (advanced by one) -> (the argmax of its logits, the first of equal ones and
        a NaN before any number, as torch.argmax takes them; that logit). Through the native step without making a
        tensor where it serves, else forward."""
        if self._native_decode():
            top, value = self.native_step.next_token(int(token), cache, cache.length)
            cache.length += 1
            return top, value
        logits = self.forward(torch.tensor([int(token)], dtype=torch.int64), cache)[0]  # [V]
        top = int(torch.argmax(logits))
        return top, float(logits[top])

    def _forward(self, ids: torch.Tensor, cache: KVCache, all_logits: bool) -> torch.Tensor:
        start, eps, times, spec = cache.length, self.spec.rms_norm_eps, self.times, self.spec
        h = self.embed.rows(ids)  # [T, D]
        new = h.shape[0]
        stream = Streams.of(h, spec.hyper, eps, self._cpu_kernel) if spec.hyper is not None else Residual(h)  # [T, (N,) D]
        for index, part in enumerate(self.parts):
            stream.to(part.device)
            mask = None if self._native_attention(part.device) else attention_mask(start, new, spec.sliding_window, part.device)
            pending = None  # the previous layer's CPU-lane partial, deferred: (its future, the post weights it expands by)
            selection = None  # the positions the previous latent-attention layer attended to (a shared indexer's)
            for layer in part.layers:
                w = self.layers[layer]
                begin = time.perf_counter() if times is not None else 0.0
                x = self._norm(stream.enter(w.hyper_attn), w.input_norm)
                y, selection = self._mix(layer, w, x, cache, start, mask, selection, part.device)
                stream.leave(y)
                if times is not None:
                    times.add("attention" if w.qkv is not None or w.latent is not None else "linear attention",
                              time.perf_counter() - begin)
                if pending is not None:  # DEFER_CPU: layer-1's lane partial lands after this attention
                    stream.late(self._wait_lane(pending[0], index), pending[1])
                    pending = None
                x = self._norm(stream.enter(w.hyper_ffn), w.post_norm)
                if w.mlp is not None:  # a dense layer: trunk work, accounted with attention
                    begin = time.perf_counter() if times is not None else 0.0
                    stream.leave(stored_ffn(x, w.mlp, self._cpu_kernel))
                    if times is not None:
                        times.add("attention", time.perf_counter() - begin)
                    continue
                partials = self._moe(layer, w, x)
                if partials.lane is None:
                    stream.leave(partials.now)
                elif layer in self.deferred:
                    # never across a part boundary; into a linear-attention layer only by defer_into_linear (its
                    # state would keep the missing partial in every later token): a deferred partial lands after
                    # attention's KV writes, the semantics DEFER_CPU was measured with
                    stream.leave(partials.now)
                    pending = (partials.lane, stream.post)
                else:
                    stream.leave(partials.now + self._wait_lane(partials.lane, index))
        cache.length = start + new
        h = stream.hidden()  # [T, D]
        if not all_logits:
            h = h[-1:]
        begin = time.perf_counter() if times is not None else 0.0
        logits = self.lm_head(self._norm(h, self.final_norm))  # [T, V]
        if times is not None:
            times.add("head", time.perf_counter() - begin)
            times.steps += 1
        return logits

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """rms_norm over x's last dim [T, n] (times weight [n] where given): on the native pool for a prefill's rows on
        the CPU (torch's F.rms_norm runs on one thread in a forward, ~10x slower), else F.rms_norm; the two agree to
        float32 rounding."""
        eps = self.spec.rms_norm_eps
        if (self._cpu_kernel is not None and x.dim() == 2 and x.shape[0] >= NATIVE_NORM_ROWS and x.device.type == "cpu"
                and x.dtype == torch.float32 and (weight is None or weight.dtype == torch.float32)):
            return self._cpu_kernel.rms_norm(x, weight, eps)
        return rms_norm(x, weight, eps) if weight is not None else F.rms_norm(x, (x.shape[-1],), None, eps)

    def _native_attention(self, device: torch.device) -> bool:
        """Whether attention on `device` runs on the native kernels (which need no mask)."""
        return self._cpu_kernel is not None and device.type == "cpu"

    def _native_decode(self) -> bool:
        """Whether this token goes through the native step: there is one, no one times the steps' parts, and the
        router bias (if any) is not damped (the native router selects with it as route() does undamped)."""
        bias = self.router_bias
        return self.native_step is not None and self.times is None and (bias is None or not bias.damped)

    def decode_path(self) -> str:
        """How a decoded token runs, in words (`moetier run` prints it)."""
        if self.native_step is not None:
            return f"native step: every layer in one call on {self.native_step.kernel.threads} thread(s)"
        return f"per layer from Python ({NativeStep.why_not(self)})"

    def _wait_lane(self, lane: Future, part: int) -> torch.Tensor:
        if self.times is None:
            return lane.result()
        begin = time.perf_counter()
        result = lane.result()
        self.times.add(f"cpu lane wait (part {part})", time.perf_counter() - begin)
        return result

    def _mix(self, layer: int, w: LayerWeights, x: torch.Tensor, cache: KVCache, start: int, mask, selection,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A layer's token mixer on x [T, D] -> (its output [T, D], the selection a latent-attention layer made)."""
        g = self.spec.linear_attention
        kernel = self._cpu_kernel if device.type == "cpu" else None
        if w.deltanet is not None:
            return deltanet_layer(w.deltanet, g, x, cache.states[layer], self.spec.rms_norm_eps, kernel), None
        if w.kda is not None:
            return kda_layer(w.kda, g, x, cache.states[layer], self.spec.rms_norm_eps, kernel), None
        if w.latent is not None:
            return latent_layer(w.latent, self.spec, x, cache.states[layer], start,
                                None if selection is None else selection.to(device))
        return self._attention(layer, w, x, cache, start, mask), None

    def _attention(self, layer: int, w: LayerWeights, x: torch.Tensor, cache: KVCache, start: int, mask) -> torch.Tensor:
        s = self.spec
        new, d = x.shape[0], s.head_dim
        heads, groups = s.num_heads, s.num_kv_heads
        qkv = w.qkv(x)  # [T, (H or 2H) * d + 2G * d]
        gate = None
        if s.attention_gate:  # per head: d query dims, then d gate dims
            q_gate, kv = qkv.split([2 * heads * d, 2 * groups * d], dim=-1)
            q_gate = q_gate.view(new, heads, 2 * d)
            gate = q_gate[..., d:].reshape(new, heads * d)  # [T, H * d]
            qkv = torch.cat([q_gate[..., :d].reshape(new, heads * d), kv], dim=-1)
        qkv = qkv.view(new, heads + 2 * groups, d)  # [T, H + 2G, d]
        qk, v = qkv[:, : heads + groups], qkv[:, heads + groups :]  # [T, H + G, d], [T, G, d]
        if w.qk_norm is not None:  # per-head RMSNorm; q and k heads carry their own weights
            qk = self._norm(qk.reshape(new * (heads + groups), d), None).view(new, heads + groups, d) * w.qk_norm
        if self._native_attention(x.device):  # the rotation and the heads' transpose in one pass on the pool
            qk = self._cpu_kernel.rotary(qk, *self.ropes[x.device].rows(start, start + new))  # [H + G, T, d]
        else:
            qk = self.ropes[x.device].apply(qk.transpose(0, 1), start)  # [H + G, T, d]: one rotation for q and k
        q, k = qk[:heads], qk[heads:]  # [H, T, d], [G, T, d]
        v = v.transpose(0, 1)  # [G, T, d]
        keys, values = cache.append(layer, k, v, start)  # [G, P, d]
        if self._native_attention(x.device):  # every head on every pool thread, over the cache in place
            out = self._cpu_kernel.attention(q.contiguous(), cache.keys[layer], cache.values[layer], start, s.sliding_window)
        else:
            out = attend(q, keys, values, mask)  # [T, H * d]
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return w.o_proj(out)  # [T, D]

    def _moe(self, layer: int, w: LayerWeights, x: torch.Tensor) -> Partials:
        begin = time.perf_counter() if self.times is not None else 0.0
        bias = affinity = None
        if self.router_bias is not None:
            bias = self.router_bias.table[self.moe_index[layer]].to(x.device)  # [E]
            if self.router_bias.affinity and (x.shape[0] == 1 or self.router_bias.affinity_prefill):
                affinity = self.executor_affinity(layer)
                affinity = None if affinity is None else affinity.to(x.device)
        decision = route_gate(self.spec, x, w.router, w.correction_bias, bias, affinity,
                              self.router_bias is not None and self.router_bias.damped)
        if self.observer is not None:
            self.observer(layer, decision)
        if self.times is not None:
            self.times.add("router", time.perf_counter() - begin)
        partials = self.executor.dispatch(layer, x, decision)
        if w.shared is None:
            return partials
        shared = stored_ffn(x, w.shared, self._cpu_kernel)  # [T, D]
        if w.shared_gate is not None:
            shared = torch.sigmoid(F.linear(x, w.shared_gate)) * shared
        return Partials(partials.now + shared, partials.lane)
