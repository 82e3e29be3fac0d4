"""The engine's one thread: generations run one at a time, in arrival order, over a kept prefix cache.

Handlers `submit` a Job and read its events (("prompt", logprob entries)
first when echo asks for the prompt's logprobs, ("text", choice, piece,
logprob entries), ("choice", choice, TextResult) as each of its `n` choices
ends, then ("done", [TextResult per choice]) or ("error", status, message))
from an asyncio queue the worker fills from its thread. The choices run one
after another over the same prefix cache, so the prompt is prefilled once
(best_of's candidates are choices too). max_tokens 0 (echo's scoring) generates nothing.
A job whose client left is `cancel`led: skipped while it waits, stopped
within one token while it runs, so the next job starts at once. With a
Recorder, each finished choice (a cancelled one included: its tokens ran) is
written as a session record and a routing trace (request id `ID-i` when n >
1). Invariant: the engine, its cache and its observer are touched by this
thread only.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field

from moetier.engine.prefix import PrefixCache
from moetier.engine.stream import StreamStats
from moetier.serve.record import Recorder
from moetier.serve.textgen import TextParams, TextResult, choice_params, generate_text, prompt_logprobs

log = logging.getLogger("moetier.serve")


@dataclass
class Job:
    request_id: str
    endpoint: str  # "chat" | "completions"
    prompt_ids: list[int]
    params: TextParams
    phase: str = "unlabelled"
    session: str = ""
    profile: bool = True
    n: int = 1  # choices generated (best_of's candidates)
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's entries with this many likeliest
    prompt_entries: list | None = None  # those entries, once computed
    loop: asyncio.AbstractEventLoop | None = None
    events: asyncio.Queue | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        self.cancelled.set()

    def put(self, event: tuple) -> None:
        if self.loop is None or self.events is None:
            return
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is gone (the server is stopping)
            self.cancel()


class Busy(Exception):
    """The queue is full."""


class Worker:
    def __init__(self, engine, tokenizer, recorder: Recorder | None = None, max_queue: int = 64, marks: int = 4):
        self.engine, self.tokenizer, self.recorder = engine, tokenizer, recorder
        self.prefix = PrefixCache(engine, keep=marks)
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.max_queue = max_queue
        self.running: Job | None = None
        self.served = 0
        self.thread = threading.Thread(target=self._run, name="moetier-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        if self.running is not None:
            self.running.cancel()
        self.jobs.put(None)
        self.thread.join(timeout=30)

    def submit(self, job: Job) -> None:
        if self.jobs.qsize() >= self.max_queue:
            raise Busy(f"{self.jobs.qsize()} requests are waiting already (the server's --max-queue)")
        self.jobs.put(job)

    @property
    def waiting(self) -> int:
        return self.jobs.qsize()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            if job.cancelled.is_set():
                continue
            self.running = job
            try:
                self._generate(job)
            except ValueError as err:  # bad input found late (an id past the vocabulary, non-finite logits)
                self.prefix.reset()  # a forward cut short leaves states the kept ids do not describe
                job.put(("error", 400, str(err)))
            except Exception as err:  # noqa: BLE001 - the server must keep serving; the client gets a 500
                log.exception("request %s failed", job.request_id)
                self.prefix.reset()
                job.put(("error", 500, f"{type(err).__name__}: {err}"))
            finally:
                self.running = None
                self.engine.observer = None
                self.served += 1

    def _generate(self, job: Job) -> None:
        if job.prompt_logprobs is not None:
            job.prompt_entries = prompt_logprobs(self.engine, self.tokenizer, job.prompt_ids, job.prompt_logprobs)
            job.put(("prompt", job.prompt_entries))
        if job.params.max_tokens == 0:
            empty = [] if job.params.top_logprobs is not None else None
            results = [TextResult(list(job.prompt_ids), [], "", "length", StreamStats(len(job.prompt_ids)), empty)
                       for _ in range(job.n)]
            for index, result in enumerate(results):
                job.put(("choice", index, result))
            job.put(("done", results))
            return
        results = []
        for index in range(job.n):
            rows = self.recorder.observer() if self.recorder is not None else None
            self.engine.observer = rows
            result = generate_text(self.engine, self.tokenizer, job.prompt_ids, choice_params(job.params, index), self.prefix,
                                   cancelled=job.cancelled.is_set,
                                   on_piece=lambda piece, entries, i=index: job.put(("text", i, piece, entries)))
            self.engine.observer = None
            if self.recorder is not None:
                rid = job.request_id if job.n == 1 else f"{job.request_id}-{index}"
                self.recorder.record(rid, job.endpoint, job.phase, job.session, job.profile, result, rows)
            results.append(result)
            job.put(("choice", index, result))
            if job.cancelled.is_set():
                break
        job.put(("done", results))
