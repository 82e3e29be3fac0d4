"""The VRAM tier: a fixed number of expert slots per MoE layer on one device, kept by a residency policy.

Each layer owns an arena of `slots` experts on the device in their stored
format (gate_up [S, 2I, D], down [S, D, I] for a float format; the rows' GGML
blocks for a quantized one, dequantized on the device as they are computed),
so a slot takes an expert's stored bytes. `access(layer, picks)` asks the policy which picks were
resident (the hits) and which experts it admits and evicts; admitted experts
are uploaded from host memory over the link on the tier's own link thread
(emulated time without CUDA), so a miss can be served elsewhere now and be a
hit later. Computing an expert whose upload is still on the wire waits for
it: the policy's residency is authoritative, so hit counts are deterministic
and equal to a replay of the same picks through the same policy. A policy that
prefetches (`xlayer`) admits into layer l+1 during layer l's access; those
uploads start right then, beside layer l's compute and l+1's attention, not at
layer l+1's access (`prefetch_uploads` counts them).
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import torch

from moetier.backends.torch_backend import TorchBackend
from moetier.model.checkpoint import ExpertWeights
from moetier.tiers.base import ExpertJob, Tier, job_experts, run_jobs
from moetier.tiers.host_experts import HostExperts
from moetier.tiers.link import Link


class _Landing:
    """Set once, when a batch of uploads has landed (or failed); wait() blocks until then and raises the
    failure. A held lock: a tenth of a threading.Event's cost, which counts once per layer-token."""

    __slots__ = ("_lock", "_error")

    def __init__(self):
        self._lock = threading.Lock()
        self._lock.acquire()
        self._error: BaseException | None = None

    def set(self, error: BaseException | None = None) -> None:
        self._error = error
        self._lock.release()

    def wait(self) -> None:
        self._lock.acquire()  # held until set(): blocks until then; released at once for the next waiter
        self._lock.release()
        if self._error is not None:
            raise RuntimeError(f"an expert upload failed: {self._error!r}") from self._error


class _LinkThread:
    """One thread running the tier's upload jobs in order; a job reports its own failure (through the
    landings it sets), so unlike a ThreadPoolExecutor there is no Future per job."""

    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def submit(self, job: Callable[[], None]) -> None:
        self._jobs.put(job)

    def shutdown(self) -> None:
        """Finish the queued jobs, then stop (idempotent)."""
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()


class _LayerSlots:
    """`slots` experts of one layer on the device, in the stored format of the layer's experts (`like`)."""

    def __init__(self, slots: int, like: ExpertWeights, device: torch.device):
        self.like = like
        # [S, 2I, D] and [S, D, I] for a float format; uint8 [S, 2I, row bytes] and [S, D, row bytes] for a block format
        self.gate_up = torch.empty(slots, *like.gate_up.shape, dtype=like.gate_up.dtype, device=device)
        self.down = torch.empty(slots, *like.down.shape, dtype=like.down.dtype, device=device)
        self.slot_of: dict[int, int] = {}
        self.free = list(range(slots - 1, -1, -1))
        self.ready: dict[int, _Landing] = {}  # expert -> set when its upload has landed
        self.held: frozenset[int] | None = None  # slot_of's keys, cached between changes

    def weights(self, expert: int) -> ExpertWeights:
        slot = self.slot_of[expert]
        return self.like.with_tensors(self.gate_up[slot], self.down[slot])


class VramTier(Tier):
    kind = "vram"
    inline = True
    residency = True
    wait_category = "gpu experts"

    def __init__(self, name: str, host: HostExperts, layers: Sequence[int], slots: int, policy, link: Link,
                 device: str = "cpu"):
        super().__init__(name)
        self.host, self.policy, self.link = host, policy, link
        self.slots = slots
        self.device = torch.device(device)
        self.backend = TorchBackend(device)
        self.index = {layer: i for i, layer in enumerate(layers)}  # model layer -> the policy's layer index
        self._layer_at = {i: layer for layer, i in self.index.items()}
        self.arenas = {layer: _LayerSlots(slots, host.get(layer, 0), self.device) for layer in layers}
        self._uploads = _LinkThread(f"link-{name}")
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.upload_wait_us = 0.0
        self.prefetch_uploads = 0
        for layer in layers:  # initial residency (a static profile, a warm start) lands before timing
            self._upload([self._apply(layer, policy.resident(self.index[layer]).tolist(), [])], timed=False)

    # -- residency ----------------------------------------------------------------------
    def holds(self, layer: int) -> frozenset[int]:
        arena = self.arenas.get(layer)
        if arena is None:
            return frozenset()
        if arena.held is None:  # rebuilt only after residency moved
            arena.held = frozenset(arena.slot_of)
        return arena.held

    def access(self, layer: int, picks: Sequence[int]) -> tuple[int, list[int]]:
        """One token-step's picks through the policy -> (how many were hits, experts admitted now and being uploaded)."""
        if not self.policy.mutable and not self.policy.prefetches:  # a fixed set (static): membership is the answer
            return len(self.holds(layer).intersection(picks)), []
        index = self.index[layer]
        hits, admitted, evicted, admitted_next, evicted_next = self.policy.touch_next(index, list(picks))
        batches = [self._apply(layer, admitted, evicted)]
        if admitted_next or evicted_next:  # what this access prefetched into the next layer: on the link now, beside this layer's compute
            batches.append(self._apply(self._layer_at[index + 1], admitted_next, evicted_next))
            self.prefetch_uploads += len(batches[-1][1])
        self._upload(batches, timed=True)
        return hits, batches[0][1]

    def _apply(self, layer: int, admitted: list[int], evicted: list[int]) -> tuple[int, list[int], list[int]]:
        """Make the arena's bookkeeping hold what the policy holds: free the evicted, give each admitted
        expert it lacks a slot (a prefetch applied early is reported again by the next access)
        -> (layer, the experts to upload now, their slots)."""
        arena = self.arenas[layer]
        for expert in evicted:
            if expert in arena.slot_of:
                arena.free.append(arena.slot_of.pop(expert))
                arena.ready.pop(expert, None)
                arena.held = None
        new = [expert for expert in admitted if expert not in arena.slot_of]
        slots = [arena.free.pop() for _ in new]
        for expert, slot in zip(new, slots):
            arena.slot_of[expert] = slot
        if new:
            arena.held = None
        return layer, new, slots

    def _upload(self, batches: list[tuple[int, list[int], list[int]]], timed: bool) -> None:
        """Copy batches of (layer, experts, slots) in, in one job on the link thread (or here when untimed);
        each batch lands together, in order, and its experts wait until then."""
        batches = [batch for batch in batches if batch[1]]
        if not batches:
            return
        landings = [_Landing() for _ in batches]
        for (layer, experts, _), landing in zip(batches, landings):
            ready = self.arenas[layer].ready
            for expert in experts:
                ready[expert] = landing

        def copy() -> None:
            error = None
            for (layer, experts, slots), landing in zip(batches, landings):
                if error is None:
                    try:
                        self._copy(layer, experts, slots, timed)
                    except Exception as err:  # the computing thread raises it when it waits for these experts
                        if not timed:
                            raise  # the initial residency, copied here: a failure raises now
                        error = err
                landing.set(error)

        if timed:
            self._uploads.submit(copy)
        else:
            copy()

    def _copy(self, layer: int, experts: list[int], slots: list[int], timed: bool) -> None:
        arena = self.arenas[layer]
        for expert, slot in zip(experts, slots):
            source = self.host.get(layer, expert)
            if timed:
                self.link.transfer(source.nbytes)
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    arena.gate_up[slot].copy_(source.gate_up, non_blocking=True)
                    arena.down[slot].copy_(source.down, non_blocking=True)
            else:
                arena.gate_up[slot].copy_(source.gate_up)
                arena.down[slot].copy_(source.down)
        if self._stream is not None:
            self._stream.synchronize()

    # -- compute --------------------------------------------------------------------------
    def _submit(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> "Future[torch.Tensor]":
        # The engine's own device: kernels are queued from the calling thread (on CUDA they run
        # asynchronously; emulated, the main thread plays the GPU while the CPU lane runs beside it).
        done: Future[torch.Tensor] = Future()
        done.set_result(self._run(layer, x, jobs))
        return done

    def _run(self, layer: int, x: torch.Tensor, jobs: Sequence[ExpertJob]) -> torch.Tensor:
        arena = self.arenas[layer]
        begin = time.perf_counter()
        ready = arena.ready
        for expert in job_experts(jobs):
            ready[expert].wait()
        self.upload_wait_us += (time.perf_counter() - begin) * 1e6
        out = run_jobs(self.backend, x.to(self.device), jobs, arena.weights)
        self.backend.synchronize()
        return out.to(x.device)

    def close(self) -> None:
        self._uploads.shutdown()
