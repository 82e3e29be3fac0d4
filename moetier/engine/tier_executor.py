"""The tier executor: each MoE layer's picks, planned across tiers and dispatched.

Per layer: the VRAM tiers' policies see the picks (hits, admissions); the
scheduler plans every picked expert onto a tier under the layer budget; each
tier gets one submit with its jobs; the partials of GPU / helper / remote
tiers are summed now and the CPU lane's is returned as a future the engine may
defer (DEFER_CPU). Every expert is computed exactly once from the same
weights, so with tail_skip off the result equals the all-resident engine up
to float32 summation order. Counters and trace rows record who served what.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch

from moetier.engine.core import Partials, group_by_expert
from moetier.engine.router import Route
from moetier.tiers.base import DecodeJobs
from moetier.engine.timing import StepTimes
from moetier.sched.cost import TierCost
from moetier.sched.plan import PlanCache
from moetier.tiers.base import Tier

@dataclass
class TierCounters:
    served: int = 0  # expert computations
    hits: int = 0  # picks found resident (vram) at access time
    picks: int = 0  # picks on the layers this tier serves


@dataclass
class TraceRows:
    """Per forward, per MoE layer: picks, weights, probabilities and the tier index serving each pick.

    `add` only keeps references (the layer's picks, weights and probabilities, and its plan's
    assignment): a decode step pays nothing for being traced but a list append. Arrays are built when read (`picks`, `weights`,
    `probs`, `tiers`, each a list with one [T, L, ...] array per forward).
    """

    layers: list[int]
    tier_index: dict[str, int] = field(default_factory=dict)  # tier name -> its index in the trace
    _records: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, list[int]]]] = field(default_factory=list)

    def add(self, decision: Route, assign: dict[str, list[int]]) -> None:
        self._records.append((decision.picks, decision.weights, decision.probs, assign))

    @property
    def tokens(self) -> int:
        """Token rows traced so far (each forward's rows, counted at its first MoE layer)."""
        return sum(int(record[0].shape[0]) for record in self._records[:: len(self.layers)])

    def _forwards(self):
        """One [(picks, weights, probs, assign) per MoE layer] per forward, in order."""
        per = len(self.layers)
        return [self._records[i : i + per] for i in range(0, len(self._records) - per + 1, per)]

    def _stacked(self, read) -> list[np.ndarray]:
        return [np.stack([read(*record) for record in forward], axis=1) for forward in self._forwards()]

    @property
    def picks(self) -> list[np.ndarray]:  # each [T, L, k]
        return self._stacked(lambda picks, weights, probs, assign: picks.cpu().numpy())

    @property
    def weights(self) -> list[np.ndarray]:
        return self._stacked(lambda picks, weights, probs, assign: weights.float().cpu().numpy())

    @property
    def probs(self) -> list[np.ndarray]:  # each [T, L, E]
        return self._stacked(lambda picks, weights, probs, assign: probs.float().cpu().numpy())

    @property
    def tiers(self) -> list[np.ndarray]:  # each [T, L, k], -1 = skipped
        return self._stacked(self._tier_of_picks)

    def _tier_of_picks(self, picks: torch.Tensor, weights, probs, assign: dict[str, list[int]]) -> np.ndarray:
        picks = picks.cpu().numpy()
        lookup = np.full(int(picks.max()) + 1, -1, dtype=np.int8)
        for name, experts in assign.items():
            lookup[experts] = self.tier_index[name]
        return lookup[picks]  # [T, k]


class TierExecutor:
    def __init__(self, tiers: Sequence[Tier], serving: Mapping[int, Sequence[Tier]], costs: Mapping[str, TierCost],
                 budget_us: float, tail_skip: bool = False, num_experts: int = 0):
        self.tiers = list(tiers)
        self.serving = {layer: list(ts) for layer, ts in serving.items()}
        for layer, ts in self.serving.items():
            lanes = [t.name for t in ts if t.deferrable]
            if len(lanes) > 1:  # Partials carries one lane future: a second would be lost
                raise ValueError(f"MoE layer {layer} is served by {len(lanes)} deferrable tiers ({', '.join(lanes)}); expected at most one")
        self.live_cache = any(t.residency for t in self.tiers)
        self.costs = dict(costs)
        tables: dict[tuple[str, ...], dict[str, TierCost]] = {}  # one table per set of serving tiers: layers share plans
        self._layer_costs = {layer: tables.setdefault(tuple(t.name for t in ts), {t.name: self.costs[t.name] for t in ts})
                             for layer, ts in self.serving.items()}
        self._plan = PlanCache()  # decode steps with one pattern of hits and misses share a plan
        self.budget_us, self.tail_skip = budget_us, tail_skip
        self.num_experts = num_experts
        self.index = {tier.name: i for i, tier in enumerate(self.tiers)}
        self.counters = {tier.name: TierCounters() for tier in self.tiers}
        self.skipped = 0
        self.times: StepTimes | None = None
        self.trace: TraceRows | None = None

    def resident_mask(self, layer: int) -> torch.Tensor | None:
        """[E] bool: experts of `layer` resident in a tier with residency now (for live-cache affinity)."""
        caches = [t for t in self.serving.get(layer, []) if t.residency]
        if not caches:
            return None
        mask = torch.zeros(self.num_experts, dtype=torch.bool)
        for tier in caches:
            held = list(tier.holds(layer))
            if held:
                mask[held] = True
        return mask

    def reset_counters(self) -> None:
        self.counters = {tier.name: TierCounters() for tier in self.tiers}
        self.skipped = 0

    def dispatch(self, layer: int, x: torch.Tensor, decision: Route) -> Partials:
        begin = time.perf_counter()
        picks_rows = decision.picks.tolist()
        decode = len(picks_rows) == 1  # one token, each expert once: jobs as plain lists (DecodeJobs)
        if decode:
            scale_of = dict(zip(picks_rows[0], decision.weights.tolist()[0]))
            expert_tokens = dict.fromkeys(scale_of, 1)
        else:
            groups = {job.expert: job for job in group_by_expert(decision.picks, decision.weights)}
            expert_tokens = {e: int(job.rows.numel()) for e, job in groups.items()}
        serving = self.serving[layer]
        holders: dict[str, frozenset[int]] = {}
        fetchable: dict[str, frozenset[int]] = {}
        for tier in serving:
            counters = self.counters[tier.name]
            counters.picks += len(picks_rows) * len(picks_rows[0])
            if not tier.residency:
                holders[tier.name] = tier.holds(layer)
                continue
            before = tier.holds(layer)
            for row in picks_rows:  # the policy sees token steps in order
                counters.hits += tier.access(layer, row)[0]
            after = tier.holds(layer)  # a later row of a prefill may evict an earlier row's hit
            if after is before:  # nothing moved (the common case with a warm static cache)
                holders[tier.name], fetchable[tier.name] = before, frozenset()
            else:
                holders[tier.name] = before & after
                fetchable[tier.name] = after - before
        plan = self._plan(expert_tokens, holders, self._layer_costs[layer], self.budget_us, self.tail_skip, fetchable)
        self.skipped += len(plan.skipped)
        futures, lane, inline = [], None, []
        for tier in serving:
            assigned = plan.assign.get(tier.name)
            if not assigned:
                continue
            jobs = DecodeJobs(assigned, [scale_of[e] for e in assigned]) if decode else [groups[e] for e in assigned]
            self.counters[tier.name].served += len(jobs)
            if tier.inline:  # computed on this thread after every other tier has started
                inline.append((tier, jobs))
                continue
            future = tier.submit(layer, x, jobs)
            if tier.deferrable:
                lane = future
            else:
                futures.append((tier, future))
        if self.trace is not None:
            self.trace.add(decision, plan.assign)
        times = self.times
        if times is not None:
            times.add("dispatch", time.perf_counter() - begin)
        now = torch.zeros_like(x)
        for tier, jobs in inline:
            waited = time.perf_counter() if times is not None else 0.0
            now += tier.submit(layer, x, jobs).result()
            if times is not None:
                times.add(tier.wait_category, time.perf_counter() - waited)
        for tier, future in futures:
            waited = time.perf_counter() if times is not None else 0.0
            now += future.result()
            if times is not None:
                times.add(tier.wait_category, time.perf_counter() - waited)
        return Partials(now, lane)

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
