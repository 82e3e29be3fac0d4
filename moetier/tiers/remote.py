"""The remote tier: experts held and computed by an expert worker on another host.

`RemoteTier` LOADs its (layer, expert)s on one worker, which reads them from
its own copy of the weights, and sends ONE RUN per layer carrying every
expert of that layer it is asked to serve: the rows those experts need go out
([n, D], float32 by default, so the result is the same math as the CPU lane's),
their gate-weighted partial sum comes back. Each call has a deadline, the
layer budget. Invariant: no token is ever lost — on timeout, disconnect or an
ERROR reply the same work is recomputed on the fallback CpuTier,
synchronously, and the worker is suspect (`holds` is empty, `cost_us`
infinite) until its client reconnects, with backoff. A request over the
message limit (a long prefill) is computed on the fallback as well.
That holds once the tier has started: a worker that is down, or does not
connect and answer HELLO within the client's `connect_timeout_s` (5 s by
default), makes the constructor raise TransportError, and nothing is left
running.

cost_us = round trip (measured, EWMA) + experts x compute per expert (measured
from the worker's own timings on decode calls, EWMA) + the extra rows' bytes
over the link (`link_gbps`).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from concurrent.futures import Future
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from moetier.backends.base import rows_on_host
from moetier.model.checkpoint import Checkpoint
from moetier.tiers.base import DecodeJobs, ExpertJob, Tier, job_experts
from moetier.tiers.cpu import CpuTier
from moetier.transport.client import DeadlineError, RemoteError, ReplyFuture, TransportError, WorkerClient
from moetier.transport.protocol import MAX_HEADER_BYTES, Load, Ping, Run

_EMPTY: frozenset[int] = frozenset()
_EWMA = 0.1  # weight of a new measurement


class _RemoteRun(Future):
    """The tier's future: filled by a callback of the RUN's reply; `result()` pumps the reply first."""

    def __init__(self, reply: ReplyFuture):
        super().__init__()
        self._reply = reply

    def result(self, timeout=None):
        self._reply.exception()  # waits out the reply (bounded by its deadline); the callback fills this future
        return super().result(timeout)

    def exception(self, timeout=None):
        self._reply.exception()
        return super().exception(timeout)


class RemoteTier(Tier):
    kind = "remote"
    wait_category = "remote"

    def __init__(
        self,
        name: str,
        address: str,
        checkpoint: Checkpoint,
        experts: Mapping[int, Iterable[int]],
        fallback: CpuTier,
        layer_budget_us: float = 50_000.0,
        keys: str | Path | None = None,
        client: str = "client",
        wire_dtype: torch.dtype = torch.float32,
        link_gbps: float = 2.5,
        us_per_expert: float = 100.0,
        **client_options,
    ):
        super().__init__(name)
        spec = checkpoint.spec
        self.experts = {int(l): frozenset(int(e) for e in es) for l, es in experts.items()}
        self.experts = {l: es for l, es in self.experts.items() if es}
        for layer, held in self.experts.items():
            if not spec.is_moe(layer) or not all(0 <= e < spec.num_experts for e in held):
                raise ValueError(f"remote tier {name!r}: layer {layer} experts {sorted(held)[:8]} are not routed experts of the model")
            if not held <= fallback.holds(layer):
                raise ValueError(f"remote tier {name!r}: fallback tier {fallback.name!r} does not hold layer {layer}'s experts")
        self.fallback = fallback
        self.layer_budget_us = layer_budget_us
        self.wire_dtype = wire_dtype
        self.hidden_size = spec.hidden_size
        self.bytes_per_us = link_gbps * 125.0  # Gb/s -> bytes per microsecond
        self.us_per_expert = us_per_expert
        self.counts: Counter[str] = Counter()  # "remote", "fallback_<reason>"
        self.fallback_delay_us: deque[float] = deque(maxlen=1024)  # submit -> failure known, per fallback after a send
        self.round_trips_us: deque[float] = deque(maxlen=4096)  # decode RUNs: submit -> reply seen, less the worker's compute
        pairs = torch.tensor([[l, e] for l in sorted(self.experts) for e in sorted(self.experts[l])], dtype=torch.int32).reshape(-1, 2)
        self.client = WorkerClient(address, checkpoint.fingerprint, keys, client, name=name, setup=lambda: [Load(pairs)], **client_options)
        try:
            if self.client.hello.hidden_size != spec.hidden_size:
                raise ValueError(f"worker {address} has hidden size {self.client.hello.hidden_size} (expected {spec.hidden_size})")
            self.rtt_us = self.measure_rtt_us()
        except BaseException:  # a tier that does not start leaves no client thread or socket behind
            self.client.close()
            raise

    def measure_rtt_us(self, count: int = 5) -> float:
        """Median PING round trip carrying one hidden state's bytes."""
        payload = torch.zeros(self.hidden_size * self.wire_dtype.itemsize, dtype=torch.uint8)
        samples = []
        for _ in range(count):
            begin = time.perf_counter()
            self.client.call(Ping(payload), self.layer_budget_us / 1e6)
            samples.append((time.perf_counter() - begin) * 1e6)
        return sorted(samples)[len(samples) // 2]

    @property
    def ready(self) -> bool:
        return self.client.ready

    def holds(self, layer: int) -> frozenset[int]:
        return self.experts.get(layer, _EMPTY) if self.client.ready else _EMPTY

    def cost_us(self, layer: int, experts: int, tokens: int) -> float:
        if not self.client.ready:
            return math.inf
        extra_bytes = 2 * max(0, tokens - 1) * self.hidden_size * self.wire_dtype.itemsize  # the first row is in the RTT
        return self.rtt_us + experts * self.us_per_expert + extra_bytes / self.bytes_per_us

    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        begin = time.perf_counter()
        held = self.experts.get(layer, _EMPTY)
        decode = isinstance(jobs, DecodeJobs)  # one token, gate weights as floats: no per-expert tensors
        experts = tuple(job_experts(jobs))
        stray = [e for e in experts if e not in held]
        if stray:
            raise ValueError(f"remote tier {self.name!r}: layer {layer} expert {stray[0]} is not held here")
        if not self.client.ready:
            return self._done(self._fall_back(layer, x, jobs, "suspect", None))
        tokens = x.shape[0]
        host = jobs if decode else rows_on_host(jobs)  # rows and weights in host memory, one transfer each
        index = None  # rows of x that go out; None: all of them
        if tokens == 1:  # decode: every expert serves the one row, so every row index is 0
            sub = x  # [1, D]
            rows = torch.zeros(len(experts) if decode else sum(int(j.rows.numel()) for j in jobs), dtype=torch.int32)  # [k]
        else:
            wanted = torch.cat([j.rows for j in host])  # [r] grouped by expert
            index = torch.unique(wanted)  # [n] sorted
            if index.numel() == tokens:
                index, sub, rows = None, x, wanted.to(torch.int32)
            else:
                sub = x.index_select(0, index.to(x.device))  # [n, D]
                rows = torch.searchsorted(index, wanted).to(torch.int32)  # [r] into sub
        sub = sub.to("cpu", self.wire_dtype)  # [n, D]
        limit_bytes = min(self.client.hello.max_message_bytes, self.client.max_message_bytes)  # both ends enforce one
        if sub.numel() * sub.element_size() + rows.numel() * 8 + MAX_HEADER_BYTES > limit_bytes:
            return self._done(self._fall_back(layer, x, jobs, "too_large", None))
        if decode:
            weights, counts = torch.tensor(jobs.scales, dtype=torch.float32), (1,) * len(experts)  # [k]
        else:
            weights, counts = torch.cat([j.weights for j in host]), tuple(int(j.rows.numel()) for j in host)  # [r]
        request = Run(layer, experts, counts, sub, rows, weights)
        reply = self.client.submit(request, self.layer_budget_us / 1e6)
        future = _RemoteRun(reply)
        reply.add_done_callback(lambda r: self._finish(future, r, layer, x, jobs, index, begin))
        return future

    def _finish(self, future: Future, reply: ReplyFuture, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob],
                index: torch.Tensor | None, begin: float) -> None:
        """Reply in: scatter it into [T, D]; failed: recompute on the fallback. Runs on whichever thread saw the reply."""
        try:
            error = Future.exception(reply, 0)  # the base class's: the reply is in, nothing to pump
            answer = Future.result(reply, 0) if error is None else None
            rows = x.shape[0] if index is None else index.numel()
            if answer is not None and tuple(answer.y.shape) != (rows, self.hidden_size):
                error = TransportError(f"RUN reply of shape {list(answer.y.shape)} (expected {[rows, self.hidden_size]})")
            if error is not None:
                reason = "timeout" if isinstance(error, DeadlineError) else "error" if isinstance(error, RemoteError) else "disconnect"
                future.set_result(self._fall_back(layer, x, jobs, reason, begin))
                return
            y = answer.y.to(x.device, x.dtype)  # [n, D]
            if index is None:
                out = y  # [T, D]
            else:
                out = torch.zeros_like(x)  # [T, D]
                out.index_copy_(0, index.to(x.device), y)
            round_trip_us = max((time.perf_counter() - begin) * 1e6 - answer.compute_us, 0.0)
            self.rtt_us += _EWMA * (round_trip_us - self.rtt_us)
            if x.shape[0] == 1:
                self.us_per_expert += _EWMA * (answer.compute_us / len(jobs) - self.us_per_expert)
                self.round_trips_us.append(round_trip_us)
            self.counts["remote"] += 1
            future.set_result(out)
        except BaseException as err:  # a future must always end
            future.set_exception(err)

    def _fall_back(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob], reason: str, begin: float | None) -> torch.Tensor:
        if begin is not None:
            self.fallback_delay_us.append((time.perf_counter() - begin) * 1e6)
        self.counts[f"fallback_{reason}"] += 1
        return self.fallback.compute(layer, x, jobs)  # [T, D], the same math on this host

    @staticmethod
    def _done(value: torch.Tensor) -> "Future[torch.Tensor]":
        future: Future[torch.Tensor] = Future()
        future.set_result(value)
        return future

    def stats(self) -> dict:
        return {**self.counts, **{f"client_{k}": v for k, v in self.client.counts.items()}, "rtt_us": self.rtt_us,
                "us_per_expert": self.us_per_expert, "state": self.client.state}

    def close(self) -> None:
        self.client.close()
