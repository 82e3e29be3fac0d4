"""A DEALER client of one expert worker: request ids, pipelined calls, heartbeats, reconnect with backoff.

`WorkerClient.submit(message, timeout_s)` sends at once and returns a
`ReplyFuture`; any number may be in flight. Replies are matched by request
id, and one whose id is no longer pending (cancelled, expired, from an old
socket) is dropped. Waiting on a future pumps the socket on the waiting
thread, so the hot path has no thread hop; a small maintenance thread, which
wakes only when something is due, drains replies between calls, expires
deadlines, PINGs an idle worker (heartbeat), and reconnects a suspect one with
exponential backoff: a new socket, HELLO, then the session's setup requests
(e.g. LOAD). A decode RUN is encoded and sent, and its reply read, in C when
this machine has the fast path (transport/wire.py): the waiting thread makes
one call for each, and only other messages reach the Python decoder.
Invariant: every future ends — with the reply, or with
TransportError at its deadline (a future no thread waits on: by the
maintenance thread's next tick, at most heartbeat_s later), on disconnect, or
on an ERROR reply — and a timeout, disconnect or lost session makes the
worker suspect (`ready` is False) until a reconnection succeeds.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Callable

import torch
import zmq
from zmq.backend import zmq_poll
from zmq.utils.monitor import recv_monitor_message

from moetier.transport.wire import DROPPED, OTHER, REPLY, FastClient, wire
from moetier.transport.wire import spin_us as fast_spin_us
from moetier.transport.keys import check_endpoint, make_client
from moetier.transport.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES, MAX_HEADER_BYTES, Bye, ErrorCode, ErrorReply, Hello, Message, Ping, ProtocolError, decode_reply, encode, send,
)

log = logging.getLogger("moetier.client")
READY, CONNECTING, SUSPECT, CLOSED = "ready", "connecting", "suspect", "closed"
_NOBLOCK = int(zmq.NOBLOCK)
_HANDSHAKE = {zmq.EVENT_HANDSHAKE_FAILED_AUTH: "the worker refused our CurveZMQ key (not in its authorized_clients)",
              zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "handshake failed (plaintext vs CurveZMQ, or the wrong worker public key)",
              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "handshake failed (plaintext vs CurveZMQ, or the wrong worker public key)"}


class TransportError(RuntimeError):
    """The worker did not answer in time, went away, refused us, or replied with ERROR."""


class DeadlineError(TransportError):
    """No reply by the call's deadline."""


class RemoteError(TransportError):
    """An ERROR reply: the worker understood the request and refused it."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(f"{code.name}: {message}")
        self.code = code


class ReplyFuture(Future):
    """A reply on its way; `result()` and `exception()` pump the client's socket until it arrives or the deadline passes."""

    def __init__(self, client: "WorkerClient", request_id: int, deadline_s: float, user: bool):
        super().__init__()
        self.client, self.request_id, self.deadline_s, self.user = client, request_id, deadline_s, user
        self.sent_s = time.perf_counter()
        self.command, self.y = 0, None  # a request the C path sent: its command, where its reply's tensor goes

    def result(self, timeout=None):
        self.client.wait(self)
        return super().result(timeout)

    def exception(self, timeout=None):
        self.client.wait(self)
        return super().exception(timeout)

    def cancel(self) -> bool:
        self.client.forget(self.request_id)
        return super().cancel()


class WorkerClient:
    """One worker at `address`; see the module docstring. `fingerprint=None` skips HELLO (PING only)."""

    def __init__(self, address: str, fingerprint: str | None, keys: str | Path | None = None, client: str = "client",
                 name: str = "moetier", setup: Callable[[], list[Message]] | None = None, connect_timeout_s: float = 5.0,
                 setup_timeout_s: float = 120.0, heartbeat_s: float = 1.0, heartbeat_timeout_s: float = 1.0,
                 backoff_s: tuple[float, float] = (0.1, 5.0), tick_s: float = 0.02, maintain: bool = True,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, native: bool = True, spin_us: float | None = None):
        """native=False keeps every message in Python (otherwise decode RUNs go through the C fast path when it is
        here); spin_us: how long a thread waiting for a reply polls before it sleeps, in the C path (default
        fast.spin_us(); 0 sleeps at once). A bad `address` is an EndpointError before any socket or thread exists."""
        self.address, self.fingerprint, self.keys, self.client, self.name = check_endpoint(address), fingerprint, keys, client, name
        self.setup = setup or (lambda: [])
        self.connect_timeout_s, self.setup_timeout_s = connect_timeout_s, setup_timeout_s
        self.heartbeat_s, self.heartbeat_timeout_s, self.tick_s = heartbeat_s, heartbeat_timeout_s, tick_s
        self.backoff_min_s, self.backoff_max_s = backoff_s
        self.max_message_bytes = max_message_bytes
        self.context = zmq.Context.instance()
        self.state = CLOSED
        self.hello = None  # the worker's HelloReply once connected
        self.last_error = ""
        self.counts = {"sent": 0, "replies": 0, "stale_replies": 0, "bad_replies": 0, "timeouts": 0, "suspect": 0, "reconnects": 0}
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._pending: dict[int, ReplyFuture] = {}
        self._socket: zmq.Socket | None = None
        self._handle = 0  # the socket's libzmq handle, for the fast path
        self._monitor: zmq.Socket | None = None
        lib = wire() if native else None
        self._fast = FastClient(lib, max_message_bytes, fast_spin_us() if spin_us is None else spin_us) if lib is not None else None
        self._backoff_s = self.backoff_min_s
        self._next_attempt_s = 0.0
        self._attempt: tuple[float, list[ReplyFuture]] | None = None  # (started, [hello, setup...]) while connecting
        self._active_s = time.monotonic()
        self._heartbeat: ReplyFuture | None = None
        self._closing = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            self.connect()
        except BaseException:  # a client that never connected leaves no socket or C buffer behind
            self.close()
            raise
        if maintain:
            self._thread = threading.Thread(target=self._maintain, name=f"moetier-client-{address}", daemon=True)
            self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == READY

    # -- calls ------------------------------------------------------------------------
    def submit(self, message: Message, timeout_s: float, user: bool = True) -> ReplyFuture:
        """Send now (never blocks on the network); the future ends with the reply or TransportError."""
        with self._lock:
            future = ReplyFuture(self, next(self._ids), time.monotonic() + timeout_s, user)
            if user and self.state != READY:
                future.set_exception(TransportError(f"worker {self.address} is {self.state}: {self.last_error}"))
                return future
            try:
                if self._fast is not None and self._socket is not None and self._fast.fits(message):
                    errno = self._fast.send(self._handle, future.request_id, message, _NOBLOCK)
                    if errno:
                        raise zmq.ZMQError(errno)
                    future.command, future.y = int(message.command), self._fast.reply_buffer(message)
                else:
                    send(self._socket, encode(future.request_id, message), zmq.NOBLOCK)
            except (zmq.Again, zmq.ZMQError, AttributeError) as err:
                future.set_exception(TransportError(f"worker {self.address}: cannot send ({type(err).__name__}: not connected)"))
                self._suspect(f"cannot send: {err or 'not connected'}")
                return future
            self._pending[future.request_id] = future
            self.counts["sent"] += 1
            self._active_s = time.monotonic()
            return future

    def call(self, message: Message, timeout_s: float) -> Message:
        """submit + result: the reply, or TransportError."""
        return self.submit(message, timeout_s).result()

    def forget(self, request_id: int) -> None:
        with self._lock:
            self._pending.pop(request_id, None)

    def wait(self, future: ReplyFuture) -> None:
        """Pump replies on this thread until `future` is done (its deadline bounds the wait)."""
        if future.done():
            return
        with self._lock:
            while not future.done():
                now = time.monotonic()
                if now >= future.deadline_s or self._socket is None:
                    self._expire(now, force=future)
                    continue
                timeout_ms = max(1, min(math.ceil((future.deadline_s - now) * 1000), 5))
                if self._fast is not None:
                    status, reply = self._fast.receive(self._handle, timeout_ms, future.request_id, future.command, future.y)
                    if status == REPLY:
                        self._pending.pop(future.request_id, None)
                        self._settle(future, reply)
                    elif status == OTHER:
                        self._take(self._fast.message())
                    elif status == DROPPED:
                        self.counts["bad_replies"] += 1
                    else:
                        self._watch()
                elif zmq_poll([(self._socket, zmq.POLLIN)], timeout_ms):  # the bare poll: this is the hot path
                    self._receive()  # one reply per wake: no extra readiness check on the way back
                else:
                    self._watch()

    # -- connection ---------------------------------------------------------------------
    def connect(self) -> None:
        """Connect and run HELLO + setup now, blocking; raises TransportError with the reason on failure."""
        with self._lock:
            self._start_attempt()
            while self.state == CONNECTING:
                self._advance_attempt(time.monotonic())
                if self.state == CONNECTING and self._socket is not None and self._socket.poll(5, zmq.POLLIN):
                    self._drain()
                self._watch()
                self._expire(time.monotonic())
            if self.state != READY:
                raise TransportError(f"cannot connect to worker {self.address}: {self.last_error}")
        self._backoff_s = self.backoff_min_s

    def _open_socket(self) -> None:
        self._close_socket(f"reconnecting to {self.address}")
        socket = self.context.socket(zmq.DEALER)
        socket.linger = 0
        socket.immediate = True  # sends fail at once without a live connection, instead of queueing
        socket.maxmsgsize = max(self.max_message_bytes, MAX_HEADER_BYTES)
        socket.reconnect_ivl = 100
        if self.keys is not None:
            make_client(socket, self.keys, self.client)
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | sum(_HANDSHAKE))
        socket.connect(self.address)
        self._socket, self._handle = socket, socket.underlying

    def _close_socket(self, reason: str) -> None:
        for future in list(self._pending.values()):
            future.set_exception(TransportError(f"worker {self.address}: {reason}"))
        self._pending.clear()
        if self._socket is not None:
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close(linger=0)
        self._socket = self._monitor = None
        self._handle = 0

    def _start_attempt(self) -> None:
        self._open_socket()
        self.state = CONNECTING
        self._attempt = (time.monotonic(), [])

    def _advance_attempt(self, now: float) -> None:
        started, futures = self._attempt
        if not futures:
            if self._socket.poll(0, zmq.POLLOUT):  # with `immediate`, writable means connected
                messages = ([Hello(self.fingerprint, self.name)] if self.fingerprint is not None else []) + list(self.setup())
                futures.extend(self.submit(m, self.connect_timeout_s if i == 0 else self.setup_timeout_s, user=False) for i, m in enumerate(messages))
                if not futures:
                    self._connected(None)
            elif now - started > self.connect_timeout_s:
                self._suspect(self.last_error or f"no connection within {self.connect_timeout_s:g} s (is the worker running and reachable?)")
            return
        failed = next((f for f in futures if f.done() and f.exception(0) is not None), None)
        if failed is not None:
            self._suspect(str(failed.exception(0)))
        elif all(f.done() for f in futures):
            self._connected(futures[0].result(0) if self.fingerprint is not None else None)

    def _connected(self, hello) -> None:
        self.hello, self.state, self._attempt, self.last_error = hello, READY, None, ""
        self._active_s = time.monotonic()
        if self.counts["suspect"]:
            self.counts["reconnects"] += 1
            log.warning("worker %s: connected again", self.address)

    def _suspect(self, reason: str) -> None:
        """Drop the socket, fail what is pending, and schedule the next attempt after the backoff."""
        if self.state == CLOSED:
            return
        if self.state == READY:
            log.warning("worker %s is suspect: %s", self.address, reason)
        self.state, self.last_error, self._attempt, self._heartbeat = SUSPECT, reason, None, None
        self.counts["suspect"] += 1
        self._close_socket(reason)
        self._next_attempt_s = time.monotonic() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.backoff_max_s)

    # -- pumping ---------------------------------------------------------------------------
    def _drain(self) -> None:
        while self._socket is not None and self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self._receive()

    def _receive(self) -> None:
        """Take one reply (the socket is readable) and end its future."""
        self._take(self._socket.recv_multipart(copy=False))  # tensors stay in ZeroMQ's buffers

    def _take(self, frames: list) -> None:
        """Decode one reply and end its future; unknown ids are stale and dropped."""
        try:
            request_id, reply = decode_reply(frames, self.max_message_bytes)
        except ProtocolError:
            self.counts["bad_replies"] += 1  # its request will expire
            return
        future = self._pending.pop(request_id, None)
        if future is None:
            self.counts["stale_replies"] += 1
            return
        self._settle(future, reply)

    def _settle(self, future: ReplyFuture, reply: Message) -> None:
        """End a future (no longer pending) with its reply."""
        self.counts["replies"] += 1
        self._active_s = time.monotonic()
        if isinstance(reply, ErrorReply):
            future.set_exception(RemoteError(reply.code, reply.message))
            if reply.code == ErrorCode.NO_SESSION:
                self._suspect("the worker lost our session (restarted?)")
            return
        if future.user and self._backoff_s != self.backoff_min_s:
            self._backoff_s = self.backoff_min_s  # a served call: the link is healthy again
        future.set_result(reply)

    def _watch(self) -> None:
        """Socket events: a disconnect or a failed handshake makes the worker suspect."""
        while self._monitor is not None and self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event in _HANDSHAKE:
                self.last_error = _HANDSHAKE[event]
                self._suspect(_HANDSHAKE[event])
            elif event == zmq.EVENT_DISCONNECTED:
                self._suspect("disconnected")

    def _expire(self, now: float, force: ReplyFuture | None = None) -> None:
        overdue = [f for f in self._pending.values() if f.deadline_s <= now]
        for future in overdue:
            del self._pending[future.request_id]
            self.counts["timeouts"] += 1
            future.set_exception(DeadlineError(f"worker {self.address}: no reply within the call's deadline"))
        if force is not None and not force.done():
            force.set_exception(TransportError(f"worker {self.address}: {self.last_error or 'not connected'}"))
        if overdue:
            self._suspect(f"no reply within the deadline (request {overdue[0].request_id})")

    # -- maintenance -----------------------------------------------------------------------------
    def _maintain(self) -> None:
        """Wake when something is due (a deadline, the heartbeat, a reconnection), not on a fixed beat: an idle
        client's thread then takes the GIL about once a heartbeat, not 50 times a second."""
        delay_s = self.tick_s
        while not self._closing.wait(delay_s):
            if self._lock.acquire(blocking=False):  # never delays a caller: skip the tick instead
                try:
                    self._tick(time.monotonic())
                    delay_s = self._next_tick_s(time.monotonic())
                finally:
                    self._lock.release()
            else:
                delay_s = self.tick_s

    def _next_tick_s(self, now: float) -> float:
        """Seconds until the next tick has work, within [tick_s, heartbeat_s]."""
        if self.state == CONNECTING:
            return self.tick_s
        due = [f.deadline_s for f in self._pending.values()]
        if self.state == READY and self._heartbeat is None:
            due.append(self._active_s + self.heartbeat_s)
        elif self.state == READY:
            due.append(now)  # an answered heartbeat is cleared on the next tick
        elif self.state == SUSPECT:
            due.append(self._next_attempt_s)
        return min(max(min(due, default=now + self.heartbeat_s) - now, self.tick_s), self.heartbeat_s)

    def _tick(self, now: float) -> None:
        if self._socket is not None:
            self._drain()
            self._watch()
        self._expire(now)
        if self.state == READY and self._heartbeat is None and now - self._active_s >= self.heartbeat_s:
            self._heartbeat = self.submit(Ping(torch.empty(0, dtype=torch.uint8)), self.heartbeat_timeout_s, user=False)
        elif self.state == READY and self._heartbeat is not None and self._heartbeat.done():
            self._heartbeat = None  # answered (a lost one expired above and made the worker suspect)
        elif self.state == SUSPECT and now >= self._next_attempt_s:
            self._start_attempt()
        elif self.state == CONNECTING:
            self._advance_attempt(now)

    def close(self) -> None:
        """Say BYE (best effort), stop the maintenance thread, close the socket; idempotent."""
        self._closing.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        with self._lock:
            if self.state == READY and self.fingerprint is not None:
                with contextlib.suppress(Exception):  # the worker may be gone already
                    self.submit(Bye(), 0.2, user=False).exception()
            self.state = CLOSED
            self._close_socket("client closed")
            if self._fast is not None:
                self._fast.close()

    def __enter__(self) -> "WorkerClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
