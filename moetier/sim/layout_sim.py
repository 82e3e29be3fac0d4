"""What a layout would do with a routing trace: per-layer tier loads, then the per-pass critical path.

`simulate(layout, shape, calibration, trace)` replays the trace through each VRAM tier's
policy at its slots (`replay`; live-cache affinity re-picks through `replay_with_affinity`
when the layout asks for it and the trace has router probabilities), gives helper and remote
tiers the experts their `experts` rule holds (as `build_runtime` does), groups the trace into
verify passes of `rows_per_pass` rows, plans every pass's MoE layers with the runtime's own
`plan_layer` (hits to VRAM, misses to the CPU lane or a holder, tail skip past the budget),
and times each sampled pass with `predict_pass`, deferring where the engine would on the shape's
linear-attention layers (moetier.sched.defer). Invariant: the costs are `tier_cost` of the
same layout and calibration the runtime plans with, and the hit counts equal `replay`'s.
A profile (expert shares) instead of a trace is sampled into one (`sample_trace`), whose
consecutive tokens may share experts as real ones do (`reuse`, measured by `moetier.sim.reuse`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping, Sequence

import numpy as np

from moetier.config import Layout
from moetier.sched.cost import Calibration, TierCost, tier_cost
from moetier.sched.defer import deferred_layers
from moetier.sched.placement import ModelShape, place, served_layers
from moetier.sched.plan import plan_layer
from moetier.sim.critical_path import PartSpec, PassPrediction, TierLoad, predict_pass
from moetier.sim.replay import belady, replay, replay_with_affinity
from moetier.sim.traces import RoutingTrace
from moetier.residency import make_policy


# GLM-4.5-Air experts (hidden 4096, moe_intermediate 1408, gate+up+down) at Q4_K, 4.5 bits/weight;
# the seed counted 42 MoE layers (the checkpoint has 45 after one dense layer); bf16 hidden states.
GLM45_AIR_EXPERT_BYTES = 3 * 4096 * 1408 * 9 // 16  # 9,732,096
# Qwen3-Next-80B-A3B (the seed's Qwen: 48 layers, every one MoE, 512 experts top-10, hidden 2048, expert width 512)
# as the IQ3_S GGUF the seed ran: 256-value blocks of 110 bytes (3.44 bits/weight); bf16 hidden states.
QWEN3_NEXT_EXPERT_BYTES = 3 * 2048 * 512 // 256 * 110  # 1,351,680
# GLM-5.3-Flash (the seed's GLM: 45 layers, the first 3 dense, 42 MoE of 288 experts top-8, hidden 4096, expert width
# 2048) as unsloth's UD-IQ3_XXS mix, assumed gate/up IQ3_XXS (98 bytes per 256 weights) and down IQ4_XS (136): a file's
# own figure is `moetier info`'s bytes_per_expert; bf16 hidden states (the collapsed stream hyper-connections ship).
GLM53_FLASH_EXPERT_BYTES = 2 * 4096 * 2048 // 256 * 98 + 4096 * 2048 // 256 * 136  # 10,878,976


def every_fourth_full(num_layers: int) -> tuple[int, ...]:
    """The linear-attention layers of GLM-5.3 (KDA) and Qwen3-Next (Gated DeltaNet): all but every 4th, counted
    from 1 (layers 3, 7, ... attend over a KV cache), as their configs' defaults give (moetier.model.spec_hybrid)."""
    return tuple(layer for layer in range(num_layers) if layer % 4 != 3)


SHAPES = {"glm-4.5-air-q4k": ModelShape(42, tuple(range(42)), 128, 8, GLM45_AIR_EXPERT_BYTES, 4096 * 2, "glm-4.5-air-q4k"),
          "glm-5.3-flash-ud-iq3_xxs": ModelShape(45, tuple(range(3, 45)), 288, 8, GLM53_FLASH_EXPERT_BYTES, 4096 * 2,
                                                 "glm-5.3-flash-ud-iq3_xxs", linear_layers=every_fourth_full(45)),
          "qwen3-next-80b-a3b-iq3_s": ModelShape(48, tuple(range(48)), 512, 10, QWEN3_NEXT_EXPERT_BYTES, 2048 * 2,
                                                 "qwen3-next-80b-a3b-iq3_s", linear_layers=every_fourth_full(48))}


@dataclass
class Simulation:
    """A layout's predicted decode: tok/s, ms per token by category, and what each tier served."""

    prediction: PassPrediction  # the sampled passes' mean
    hit_rate: float  # VRAM hits / picks over all MoE layers (what `run --layout` reports)
    tier_hit_rate: dict[str, float]  # vram tier -> hits / picks on its layers
    served_per_token: dict[str, float]  # tier -> experts computed per token
    skipped_per_token: float
    passes: int  # passes timed
    notes: list[str] = field(default_factory=list)
    slots_per_layer: dict[str, int] = field(default_factory=dict)  # tier -> experts it holds per layer (moetier.sched.placement)

    @property
    def tok_per_s(self) -> float:
        return self.prediction.tok_per_s

    def to_dict(self) -> dict:
        p = self.prediction
        return {"decode_tok_per_s": p.tok_per_s, "ms_per_token": p.ms_per_token, "pass_ms": p.pass_ms,
                "tokens_per_pass": p.tokens_per_pass, "part_ms_per_token": p.part_ms_per_token,
                "tier_busy_ms_per_token": p.busy_ms_per_token, "hit_rate": self.hit_rate,
                "tier_hit_rate": self.tier_hit_rate, "experts_served_per_token": self.served_per_token,
                "skipped_per_token": self.skipped_per_token, "passes": self.passes, "notes": self.notes,
                "slots_per_layer": self.slots_per_layer}


# -- profiles sampled into traces ---------------------------------------------------------
def inclusion_probabilities(shares: np.ndarray, top_k: int) -> np.ndarray:
    """[L, E] chance that a token picks each expert (each row sums to k, none above 1) from router shares."""
    shares = np.asarray(shares, np.float64)
    q = np.zeros_like(shares)
    for layer, row in enumerate(shares):
        fixed = np.zeros(row.shape, bool)
        for _ in range(len(row)):
            free = row * ~fixed
            q[layer] = np.where(fixed, 1.0, free * (top_k - fixed.sum()) / max(free.sum(), 1e-300))
            if (q[layer] <= 1.0 + 1e-12).all():
                break
            fixed |= q[layer] > 1.0
    return np.minimum(q, 1.0)


def sample_trace(shares: np.ndarray, top_k: int, tokens: int, seed: int = 0, layer_ids: Sequence[int] | None = None,
                 source: str = "profile", reuse: float = 0.0) -> RoutingTrace:
    """Tokens whose k distinct picks hit each expert with `inclusion_probabilities` exactly (systematic sampling
    over a random order of the experts). `reuse`: the chance that a token repeats the previous token's picks at a
    layer, as consecutive tokens do (`moetier.sim.reuse`); each token's marginal stays the same, since a repeat
    copies an earlier token drawn the same way. 0 (the default): independent tokens."""
    if not 0.0 <= reuse < 1.0:
        raise ValueError(f"reuse: expected a chance in [0, 1), got {reuse}")
    q = inclusion_probabilities(shares, top_k)  # [L, E]
    L, E = q.shape
    rng = np.random.default_rng(seed)
    order = np.argsort(rng.random((tokens, L, E)), axis=-1)  # [T, L, E] a random order per token and layer
    cum = np.cumsum(np.take_along_axis(np.broadcast_to(q, (tokens, L, E)), order, -1), -1)  # [T, L, E]
    points = rng.random((tokens, L, 1)) + np.arange(top_k)  # [T, L, k] one per unit of mass
    slot = np.minimum((cum[:, :, None, :] <= points[..., None]).sum(-1), E - 1)  # [T, L, k]
    picks = np.take_along_axis(order, slot, -1)
    if reuse:  # its own stream, so the fresh draws are the same as without reuse
        repeat = np.random.default_rng([seed, 1]).random((tokens, L)) < reuse  # [T, L]
        repeat[0] = False
        fresh = np.maximum.accumulate(np.where(repeat, 0, np.arange(tokens)[:, None]), axis=0)  # [T, L] the token it copies
        picks = picks[fresh, np.arange(L)[None, :]]  # [T, L, k]
    weights = np.full(picks.shape, 1.0 / top_k)
    return RoutingTrace(picks=picks, weights=weights, num_experts=E, layer_ids=tuple(layer_ids or range(L)), source=source)


# -- the simulation -----------------------------------------------------------------------
def _sub_trace(trace: RoutingTrace, index: Sequence[int]) -> RoutingTrace:
    probs = None if trace.probs is None else trace.probs[:, index]
    return RoutingTrace(picks=trace.picks[:, index], weights=trace.weights[:, index], probs=probs,
                        num_experts=trace.num_experts, layer_ids=tuple(trace.layer_ids[i] for i in index))


def _vram_digits(policy, picks: np.ndarray) -> np.ndarray:
    """picks [T, L, k] through the policy token by token -> [T, L, k]: 1 hit, 2 miss admitted now, 0 miss."""
    digits = np.zeros(picks.shape, np.int8)
    for t, token in enumerate(picks):
        hit = policy.access_all(token) if policy.mutable else policy.contains(token)
        digits[t] = np.where(hit, 1, np.where(policy.contains(token), 2, 0))
    return digits


def _classify(layout: Layout, shape: ModelShape, trace: RoutingTrace, lam: float, profiles: dict, warmup_tokens: int,
              notes: list[str]):
    """(picks [T, L, k] after affinity, tier -> [T, L, k] class digit of each pick, vram tier -> hit rate, hits):
    VRAM tiers replay their policy (1 hit, 2 a miss admitted now, 0 a miss); helper / remote tiers hold by rule."""
    E, moe = shape.num_experts, list(shape.moe_layers)
    position = {layer: j for j, layer in enumerate(moe)}
    counts = trace.tokens(warmup_tokens).counts().astype(np.float64)  # [L, E]
    profiles = dict(profiles)
    for tier in layout.tiers:  # a static cache without a profile file: the trace's own counts, an oracle profile
        if tier.kind == "vram" and tier.policy == "static" and not tier.profile and tier.name not in profiles:
            notes.append(f"{tier.name}: static cache from the trace's own counts (no profile file)")
            profiles[tier.name] = counts[[position[l] for l in served_layers(layout, tier, shape)]]
    placement = place(layout, shape, profiles)
    picks = trace.picks.astype(np.intp)  # [T, L, k]
    digits: dict[str, np.ndarray] = {}
    hit_rates, hits_total = {}, 0
    vram = [placement[t.name] for t in layout.tiers if t.kind == "vram" and placement[t.name].layers]
    if lam and vram and trace.probs is None:
        raise ValueError(f"[router].affinity = {lam} re-picks from router probabilities; trace {trace.source or ''} has none (use affinity 0)")
    for placed in vram:
        tier, rows, profile = placed.config, [position[l] for l in placed.layers], placed.profile
        if lam:
            picks[:, rows] = replay_with_affinity(_sub_trace(trace, rows), tier.policy, placed.slots, lam, profile).picks
            notes.append(f"{tier.name}: picks re-ranked with live-cache affinity {lam}")
        result = replay(replace(_sub_trace(trace, rows), picks=picks[:, rows], probs=None), tier.policy, placed.slots, profile,
                        warmup_tokens=warmup_tokens)
        digit = np.zeros(picks.shape, np.int8)
        digit[:, rows] = _vram_digits(make_policy(tier.policy, len(rows), E, placed.slots, profile), picks[:, rows])
        if int((digit[warmup_tokens:] == 1).sum()) != int(result.hits.sum()):
            raise AssertionError(f"tier {tier.name}: per-pick hits disagree with replay")  # the replay is the reference
        digits[tier.name], hit_rates[tier.name] = digit, result.hit_rate
        hits_total += int(result.hits.sum())
    for placed in placement.values():
        if placed.held is not None:  # helper / remote: a fixed set per layer
            table = np.zeros((len(moe), E), bool)  # [L, E] held
            for layer, experts in placed.held.items():
                table[position[layer], experts] = True
            digits[placed.name] = table[np.arange(len(moe))[None, :, None], picks].astype(np.int8)
    return picks, digits, hit_rates, hits_total, placement


def simulate(layout: Layout, shape: ModelShape, calibration: Calibration, trace: RoutingTrace, *,
             rows_per_pass: int = 1, tokens_per_pass: float | None = None, affinity: float | None = None,
             profiles: Mapping[str, np.ndarray] | None = None, warmup_tokens: int | None = None, max_passes: int = 400,
             planning: Calibration | None = None) -> Simulation:
    """Predict the layout's decode over the trace (see the module docstring). `profiles`: tier name ->
    [its layers, E] brightness for static caches and hot/cold rules (default: the tier's profile file,
    else the trace's own counts); `affinity` overrides [router].affinity; `planning`: the calibration
    the runtime plans with, when it differs from the rates that time the pass (default: the same);
    `warmup_tokens`: the trace's first tokens that only warm the caches (default: its prompt's, a run's
    "prefill" rows)."""
    warmup_tokens = trace.warmup_tokens(warmup_tokens)
    E, k, moe = shape.num_experts, shape.top_k, list(shape.moe_layers)
    if (trace.num_experts, trace.top_k, trace.num_layers) != (E, k, len(moe)):
        raise ValueError(f"trace {trace.source or ''} has {trace.num_layers} layers x {trace.num_experts} experts, top-{trace.top_k} "
                         f"(expected {len(moe)} x {E}, top-{k} for model {shape.name or 'shape'})")
    if rows_per_pass < 1 or not 0 <= warmup_tokens < trace.num_tokens - rows_per_pass + 1:
        raise ValueError(f"rows_per_pass {rows_per_pass} and warmup_tokens {warmup_tokens} leave no pass in {trace.num_tokens} tokens")
    notes: list[str] = []
    lam = layout.router.affinity if affinity is None else affinity
    picks, digits, hit_rates, hits_total, placement = _classify(layout, shape, trace, lam, dict(profiles or {}), warmup_tokens, notes)

    costs = {t.name: tier_cost(layout, t, calibration, shape.expert_bytes, shape.hidden_bytes) for t in layout.tiers}
    plan_costs = {t.name: tier_cost(layout, t, planning, shape.expert_bytes, shape.hidden_bytes) for t in layout.tiers} if planning else costs
    names = [t.name for t in layout.tiers if t.name in digits]
    code = sum(digits[name].astype(np.int64) * 3 ** i for i, name in enumerate(names)) if names else np.zeros(picks.shape, np.int64)
    starts = np.arange(warmup_tokens, trace.num_tokens - rows_per_pass + 1, rows_per_pass)
    if len(starts) > max_passes:
        starts = starts[np.linspace(0, len(starts) - 1, max_passes).round().astype(int)]
    parts = [PartSpec(p.name, list(p.layers(shape.num_layers))) for p in layout.parts]
    deferring = _defer_note(layout, shape, parts)
    if deferring:
        notes.append(deferring)
    serving = {l: [t.name for t in layout.tiers if l in placement[t.name].layers] for l in moe}
    memo: dict = {}
    predictions, served_count, skipped = [], {t.name: 0.0 for t in layout.tiers}, 0.0
    for start in starts:
        loads = {}
        for j, layer in enumerate(moe):
            experts, first, tokens = np.unique(picks[start:start + rows_per_pass, j].ravel(), return_index=True, return_counts=True)
            key = (tuple(serving[layer]), tuple(sorted(zip(tokens.tolist(), code[start:start + rows_per_pass, j].ravel()[first].tolist()))))
            if key not in memo:
                memo[key] = _plan(key[1], names, key[0], plan_costs, layout)
            loads[layer], skip = memo[key]
            skipped += skip
            for name, load in loads[layer].items():
                served_count[name] += load.experts
        predictions.append(predict_pass(parts, moe, loads, costs, calibration, layout.scheduler.defer_cpu,
                                        tokens_per_pass or rows_per_pass, rows_per_pass=rows_per_pass,
                                        linear_layers=shape.linear_layers,
                                        defer_into_linear=layout.scheduler.defer_into_linear))
    tokens_out = (tokens_per_pass or rows_per_pass) * len(starts)
    lookups = (trace.num_tokens - warmup_tokens) * len(moe) * k
    return Simulation(_mean(predictions), hits_total / lookups, hit_rates,
                      {n: v / tokens_out for n, v in served_count.items()}, skipped / tokens_out, len(starts), notes,
                      {name: placed.slots for name, placed in placement.items()})


def _defer_note(layout: Layout, shape: ModelShape, parts: Sequence[PartSpec]) -> str:
    """On a model with linear-attention layers, how many MoE layers DEFER_CPU defers and by which rule ("" else)."""
    s = layout.scheduler
    if not s.defer_cpu or not shape.linear_layers:
        return ""
    moe = set(shape.moe_layers)
    deferred = deferred_layers(s.defer_cpu, [p.layers for p in parts], shape.linear_layers, s.defer_into_linear)
    rule = ("into linear-attention layers too ([scheduler].defer_into_linear, the seed's)" if s.defer_into_linear
            else "not into linear-attention layers, as the engine does (defer_into_linear = true opts in)")
    return f"DEFER_CPU={s.defer_cpu} defers {len(deferred & moe)} of {len(moe)} MoE layers: {rule}"


def _plan(signature, names: list[str], serving: list[str], costs: Mapping[str, TierCost], layout: Layout):
    """Loads of one layer-pass from its (tokens, class code) per distinct expert, by the runtime's planner."""
    expert_tokens = {i: tokens for i, (tokens, _) in enumerate(signature)}
    digit = {name: [(c // 3 ** n) % 3 for _, c in signature] for n, name in enumerate(names)}
    holders, fetchable = {}, {}
    for name in serving:
        if costs[name].kind == "cpu":
            holders[name] = frozenset(expert_tokens)
        else:
            holders[name] = frozenset(i for i, d in enumerate(digit[name]) if d == 1)
            if costs[name].kind == "vram":
                fetchable[name] = frozenset(i for i, d in enumerate(digit[name]) if d == 2)
    plan = plan_layer(expert_tokens, holders, {n: costs[n] for n in serving}, layout.scheduler.budget_us,
                      layout.scheduler.tail_skip, fetchable)
    loads = {name: TierLoad(len(experts), sum(expert_tokens[e] for e in experts), len(plan.fetch.get(name, ())))
             for name, experts in plan.assign.items()}
    return loads, len(plan.skipped)


def _mean(predictions: Sequence[PassPrediction]) -> PassPrediction:
    n = len(predictions)

    def average(attribute: str) -> dict[str, float]:
        keys = sorted({key for p in predictions for key in getattr(p, attribute)})
        return {key: sum(getattr(p, attribute).get(key, 0.0) for p in predictions) / n for key in keys}

    return PassPrediction(average("ms_per_token"), sum(p.pass_ms for p in predictions) / n, predictions[0].tokens_per_pass,
                          average("part_ms_per_token"), average("busy_ms_per_token"))


# -- traces from files, sweeps, hit-rate curves ------------------------------------------
def load_trace(path) -> RoutingTrace:
    """A routing trace: the DESIGN.md format (`RoutingTrace.save`), the npz `moetier run --layout --trace`
    writes, or a published trace of shared/traces (FLAME-MoE, Qwen1.5-MoE) through its adapter."""
    import json

    from moetier.sim.traces import from_flame, from_qwen15moe

    try:
        return RoutingTrace.load(path)
    except ValueError as err:
        try:
            with np.load(path, allow_pickle=False) as z:
                files = set(z.files)
            if {"topk_ids", "batch_id"} <= files:
                return from_qwen15moe(path)
            if {"topk_ids", "dense_scores"} <= files:
                return from_flame(path)
            with np.load(path, allow_pickle=False) as z:
                if "metadata" not in z.files:
                    raise err from None
                meta = json.loads(str(z["metadata"]))
                return RoutingTrace(picks=z["picks"], weights=z["weights"], probs=z["probs"] if "probs" in z.files else None,
                                    num_experts=meta["num_experts"], layer_ids=meta["layers"], model=meta.get("fingerprint", ""),
                                    source=str(path), extra={"tier_names": meta.get("tier_names", [])},
                                    phase=z["phase"] if "phase" in z.files else None, phase_names=tuple(meta.get("phase_names", ())))
        except (OSError, KeyError, json.JSONDecodeError) as inner:
            raise ValueError(f"{path}: not a routing trace ({inner})") from None


SWEEPS = ("slots", "rtt_us", "lambda")


def with_value(layout: Layout, parameter: str, value: float) -> Layout:
    """The layout with one knob turned: every VRAM tier's slots, the remote tiers' link rtt_us, or the affinity."""
    if parameter == "slots":
        if not any(t.kind == "vram" for t in layout.tiers):
            raise ValueError(f"{layout.path}: no vram tier to give slots to")
        tiers = tuple(replace(t, slots=int(value), capacity_bytes=0) if t.kind == "vram" else t for t in layout.tiers)
        return replace(layout, tiers=tiers)
    if parameter == "rtt_us":
        remote = {t.link for t in layout.tiers if t.kind == "remote"}
        if not remote:
            raise ValueError(f"{layout.path}: no remote tier whose link round trip could change (rtt_us sweeps need one)")
        return replace(layout, links=tuple(replace(l, rtt_us=float(value)) if l.name in remote else l for l in layout.links))
    if parameter == "lambda":
        return replace(layout, router=replace(layout.router, affinity=float(value)))
    raise ValueError(f"cannot sweep {parameter!r} (expected one of {', '.join(SWEEPS)})")


def sweep(layout: Layout, shape: ModelShape, calibration: Calibration, trace: RoutingTrace, parameter: str,
          values: Sequence[float], **options) -> list[tuple[float, Simulation]]:
    """`simulate` at each value of one knob (see `with_value`)."""
    return [(value, simulate(with_value(layout, parameter, value), shape, calibration, trace, **options)) for value in values]


CURVE_POLICIES = ("static", "lru", "lfu", "xlayer")


def hit_rate_curves(trace: RoutingTrace, slots: Sequence[int], policies: Sequence[str] = CURVE_POLICIES,
                    warmup_tokens: int | None = None) -> dict[str, list[float]]:
    """Hit rate per policy at each slot count (static: the trace's own counts, an oracle profile), and
    Belady's optimum with bypass, which bounds every policy that admits only requested experts. warmup_tokens as
    `simulate`'s."""
    warmup_tokens = trace.warmup_tokens(warmup_tokens)
    counts = trace.tokens(warmup_tokens).counts()
    curves: dict[str, list[float]] = {}
    for policy in policies:
        profile = counts if policy == "static" else None
        curves[policy] = [replay(trace, policy, int(s), profile, warmup_tokens=warmup_tokens).hit_rate for s in slots]
    curves["belady"] = [belady(trace, int(s), bypass=True, warmup_tokens=warmup_tokens).hit_rate for s in slots]
    return curves
