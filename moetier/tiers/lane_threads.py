"""Lane threads with the lightest hand-off CPython has, for one submit per MoE layer.

`LaneThreads.submit(fn, *args)` queues a call for the lane's threads and
returns a `Handoff`, whose `result()` waits for it and returns its value (or
raises its exception). A `Handoff` is a lock taken at birth and released once,
by the thread that ran the call, right after storing the value: the waiter
wakes with one futex, and the lane thread holds the GIL for a few bytecodes
after that before it blocks again. A `ThreadPoolExecutor` future instead
notifies a Condition and runs its bookkeeping while the waiter wants the GIL,
which a layer's router then pays for (measured by benchmarks/bench_sched.py).
Calls run in submit order on each thread; with several threads, concurrently.
"""

from __future__ import annotations

import _thread
import threading
from queue import SimpleQueue
from typing import Any, Callable


class Handoff:
    __slots__ = ("_lock", "_value", "_error")

    def __init__(self):
        self._lock = _thread.allocate_lock()
        self._lock.acquire()
        self._value: Any = None
        self._error: BaseException | None = None

    def result(self, timeout: float | None = None) -> Any:
        if not self._lock.acquire(timeout=-1 if timeout is None else timeout):
            raise TimeoutError(f"lane call not done after {timeout} s")
        self._lock.release()
        if self._error is not None:
            raise self._error
        return self._value

    def done(self) -> bool:
        return not self._lock.locked()


class LaneThreads:
    def __init__(self, threads: int, name: str):
        self._queue: SimpleQueue = SimpleQueue()
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Handoff:
        handoff = Handoff()
        self._queue.put((fn, args, handoff))
        return handoff

    def _serve(self) -> None:
        get = self._queue.get
        while (item := get()) is not None:
            fn, args, handoff = item
            try:
                handoff._value = fn(*args)
            except BaseException as err:  # handed to the waiter, raised there
                handoff._error = err
            handoff._lock.release()
            del item, fn, args, handoff

    def shutdown(self) -> None:
        """Let queued calls finish, then stop the threads (idempotent)."""
        for _ in self._threads:
            self._queue.put(None)
        for thread in self._threads:
            if thread.is_alive() and thread is not threading.current_thread():
                thread.join()
        self._threads = []
