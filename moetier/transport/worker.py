"""The expert worker: a ROUTER socket that computes experts for remote tiers.

A worker opens its own copy of the weights (`open_checkpoint`), places only
the (layer, expert)s that clients LOAD (weights never cross the wire), and
answers each RUN with the gate-weighted partial sum its backend computes. It
serves any number of clients, one message at a time; each must HELLO (same
protocol version, same model fingerprint) before LOAD, RUN, STATS or BYE.
When the backend decodes with the native kernel (the torch backend on the
CPU, one lane), `serve` receives in C (transport/wire.py): a PING, and a
decode RUN of an admitted session, are answered there, bit for bit as this
module would, and every other message comes here.
Invariants: no message can crash it — a bad one gets an ERROR reply, or is
dropped by ZeroMQ when a frame exceeds the size limit (or by the C loop when
it has more than 64 parts, counted in STATS); memory is bounded by
the experts loaded, the message limit times the per-peer queue, and the
session table; SIGTERM (via `stop`) ends the loop and closes every socket.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from moetier.backends import Backend, ExpertWork, get_backend
from moetier.transport.wire import PYTHON, FastWorker, wire
from moetier.transport.wire import status as fast_status
from moetier.transport.keys import check_listen, make_server, start_authenticator
from moetier.transport.protocol import (
    DEFAULT_MAX_MESSAGE_BYTES, HIDDEN_DTYPES, MAX_HEADER_BYTES, Bye, ByeReply, ErrorCode, ErrorReply, Hello,
    HelloReply, Load, LoadReply, Message, Ping, PingReply, ProtocolError, Run, RunReply, Stats, StatsReply, decode_request,
    encode, send,
)

log = logging.getLogger("moetier.worker")
IDLE_MS = 100  # an idle receive returns this often, so `stop` is seen
_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_AUTH | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL


@dataclass
class Session:
    client: str
    peer: str
    opened_s: float
    requests: int = 0


class ExpertWorker:
    """The worker's state and message handling, without sockets (see `serve`)."""

    def __init__(self, checkpoint, backend: str | Backend = "torch", name: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES, max_sessions: int = 256, errors_per_s: float = 20.0):
        self.checkpoint = checkpoint
        self.spec = checkpoint.spec
        self.backend = get_backend(backend, "cpu") if isinstance(backend, str) else backend
        self.name = name or f"{os.uname().nodename}:{os.getpid()}"
        self.max_message_bytes = max_message_bytes
        self.max_sessions = max_sessions
        self.placed: dict[int, dict[int, Any]] = {}  # layer -> expert -> what backend.place returned
        self.placed_bytes = 0
        self.sessions: OrderedDict[bytes, Session] = OrderedDict()  # least recently active first
        self.counts: Counter[str] = Counter()
        self.started_s = time.time()
        self._moe_layers = frozenset(self.spec.moe_layers)
        # torch dtypes it computes in; x in other wire dtypes goes through float32
        self._native = frozenset(getattr(torch, d) for d in self.backend.caps.dtypes if isinstance(getattr(torch, d, None), torch.dtype))
        self._error_budget, self._errors_per_s, self._suppressed, self._budget_at = errors_per_s, errors_per_s, 0, time.monotonic()
        self.fast: FastWorker | None = None  # the C receive loop while `serve` runs one

    def attach(self, fast: FastWorker) -> None:
        """Let `fast` serve decode RUNs: it learns every session and expert now, and each new one as it comes."""
        for layer, experts in self.placed.items():
            for expert, placed in experts.items():
                fast.expert(layer, expert, placed)
        for identity in self.sessions:
            fast.open_session(identity)
        self.fast = fast

    def detach(self) -> None:
        """Stop mirroring into the C loop; what it served stays in `counts`."""
        if self.fast is not None:
            fast, self.fast = self.fast, None
            _add_fast_counts(self.counts, fast.counts())
            fast.close()

    def requests(self, identity: bytes) -> int:
        """Requests a session made (those the C loop served included)."""
        session = self.sessions[identity]
        return session.requests + (max(self.fast.activity(identity)[0], 0) if self.fast is not None else 0)

    @property
    def held(self) -> int:
        return sum(len(experts) for experts in self.placed.values())

    # -- one message -------------------------------------------------------------------
    def handle(self, identity: bytes, frames: list, peer: str | None = None) -> list:
        """Frames of one request (identity stripped; `peer` its address if known) -> reply frames; never raises."""
        request_id = 0
        try:
            request_id, request = decode_request(frames, self.max_message_bytes)
            self.counts[type(request).__name__] += 1
            return encode(request_id, self._dispatch(identity, request, frames, peer))
        except ProtocolError as err:
            return self._error(identity, err.request_id or request_id, err.code, str(err))
        except Exception as err:  # a backend failure must not end the worker
            return self._error(identity, request_id, ErrorCode.INTERNAL, f"{type(err).__name__}: {err}")

    def _error(self, identity: bytes, request_id: int, code: ErrorCode, message: str) -> list:
        self.counts[f"error_{code.name.lower()}"] += 1
        self._log_error(f"error {code.name} for {identity.hex()} (request {request_id}): {message}")
        return encode(request_id, ErrorReply(code, message))

    def _log_error(self, line: str) -> None:
        """One line per error, at most errors_per_s a second (a flood is summarised, not written out)."""
        now = time.monotonic()
        self._error_budget = min(self._errors_per_s, self._error_budget + (now - self._budget_at) * self._errors_per_s)
        self._budget_at = now
        if self._error_budget < 1:
            self._suppressed += 1
            return
        self._error_budget -= 1
        if self._suppressed:
            log.warning("(%d more error lines suppressed)", self._suppressed)
            self._suppressed = 0
        log.warning(line)

    def _dispatch(self, identity: bytes, request: Message, frames: list, peer: str | None) -> Message:
        if isinstance(request, Ping):
            return PingReply(request.payload)  # echoes the received frame, zero-copy
        if isinstance(request, Hello):
            return self._hello(identity, request, peer or _peer_address(frames[0]))
        session = self.sessions.get(identity)
        if session is None:
            raise ProtocolError(ErrorCode.NO_SESSION, f"{type(request).__name__.upper()} before HELLO (send HELLO first)")
        session.requests += 1
        self.sessions.move_to_end(identity)
        if isinstance(request, Run):
            return self._run(request)
        if isinstance(request, Load):
            return self._load(request)
        if isinstance(request, Stats):
            return StatsReply(self.stats())
        if isinstance(request, Bye):
            requests = self.requests(identity)
            self._close_session(identity)
            log.info("session %r (%s) closed by BYE after %d requests", session.client, identity.hex(), requests)
            return ByeReply()
        raise ProtocolError(ErrorCode.UNKNOWN_COMMAND, f"{type(request).__name__} is not a request")

    def _close_session(self, identity: bytes) -> None:
        del self.sessions[identity]
        if self.fast is not None:
            self.fast.close_session(identity)

    def _least_recent(self) -> bytes:
        """The session whose last message is the oldest (the C loop's RUNs count as activity)."""
        if self.fast is None:
            return next(iter(self.sessions))
        return min(self.sessions, key=lambda identity: self.fast.activity(identity)[1])

    def _hello(self, identity: bytes, hello: Hello, peer: str) -> HelloReply:
        if hello.fingerprint != self.checkpoint.fingerprint:
            raise ProtocolError(ErrorCode.BAD_FINGERPRINT, f"model fingerprint {hello.fingerprint!r} does not match "
                                f"this worker's {self.checkpoint.fingerprint!r} ({self.checkpoint.folder})")
        if identity not in self.sessions and len(self.sessions) >= self.max_sessions:
            old_identity = self._least_recent()
            old = self.sessions[old_identity]
            self._close_session(old_identity)
            log.info("session %r (%s) evicted: %d sessions is the limit", old.client, old_identity.hex(), self.max_sessions)
        self.sessions[identity] = Session(hello.client, peer, time.time())
        self.sessions.move_to_end(identity)
        if self.fast is not None:
            self.fast.open_session(identity)
        log.info("session %r from %s (%s) opened; %d open", hello.client, peer, identity.hex(), len(self.sessions))
        s = self.spec
        return HelloReply(self.checkpoint.fingerprint, self.name, self.backend.name, HIDDEN_DTYPES, s.hidden_size,
                          s.num_experts, tuple(s.moe_layers), self.max_message_bytes)

    def _load(self, load: Load) -> LoadReply:
        pairs = load.pairs.tolist()
        bad = [(l, e) for l, e in pairs if l not in self._moe_layers or not 0 <= e < self.spec.num_experts]
        if bad:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"LOAD of (layer, expert) {tuple(bad[0])}: not a routed expert of this "
                                f"model (MoE layers {self.spec.moe_layers[0]}..{self.spec.moe_layers[-1]}, experts 0..{self.spec.num_experts - 1})")
        placed_bytes = 0
        for layer, expert in pairs:
            experts = self.placed.setdefault(layer, {})
            if expert not in experts:
                weights = self.checkpoint.expert(layer, expert)
                experts[expert] = self.backend.place(weights)
                placed_bytes += weights.nbytes
                if self.fast is not None:
                    self.fast.expert(layer, expert, experts[expert])
        self.placed_bytes += placed_bytes
        self.checkpoint.drop_pages()  # the placed copies are what serves: the file's pages leave the resident set
        return LoadReply(self.held, placed_bytes)

    def _run(self, run: Run) -> RunReply:
        experts = self.placed.get(run.layer)
        if experts is None:
            code = ErrorCode.NOT_LOADED if run.layer in self._moe_layers else ErrorCode.OUT_OF_RANGE
            raise ProtocolError(code, f"RUN of layer {run.layer}: no expert of it is loaded here")
        missing = [e for e in run.experts if e not in experts]
        if missing:
            raise ProtocolError(ErrorCode.NOT_LOADED, f"RUN of layer {run.layer} expert {missing[0]}: not loaded here (LOAD it first)")
        if len(set(run.experts)) != len(run.experts):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"RUN of layer {run.layer}: an expert appears twice in {list(run.experts)[:16]}")
        x = run.x  # [n, D]
        if x.shape[1] != self.spec.hidden_size:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"RUN x has {x.shape[1]} columns (expected hidden size {self.spec.hidden_size})")
        low, high = _min_max(run.rows) if run.rows.numel() else (0, -1)
        if low < 0 or high >= x.shape[0]:
            raise ProtocolError(ErrorCode.OUT_OF_RANGE, f"RUN rows outside [0, {x.shape[0]})")
        begin = time.perf_counter()
        rows, weights = run.rows.to(torch.int64), run.weights  # [r]
        if len(run.counts) > 1:
            rows, weights = torch.split(rows, run.counts), torch.split(weights, run.counts)  # m x [count]
        else:
            rows, weights = (rows,), (weights,)
        work = [ExpertWork(experts[e], r, w) for e, r, w in zip(run.experts, rows, weights)]
        wire_dtype = x.dtype
        if wire_dtype not in self._native:
            x = x.float()  # [n, D]
        y = self.backend.run_experts(x, work)  # [n, D]
        return RunReply(y if y.dtype == wire_dtype else y.to(wire_dtype), (time.perf_counter() - begin) * 1e6)

    def stats(self) -> dict:
        try:
            rss_bytes = int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, IndexError):
            rss_bytes = -1
        return {"worker": self.name, "fingerprint": self.checkpoint.fingerprint, "backend": self.backend.name,
                "uptime_s": round(time.time() - self.started_s, 3), "sessions": len(self.sessions), "held_experts": self.held,
                "placed_bytes": self.placed_bytes, "rss_bytes": rss_bytes, **self._counts()}

    def _counts(self) -> dict:
        counts = Counter(self.counts)
        if self.fast is not None:
            _add_fast_counts(counts, self.fast.counts())
        return dict(counts)


def _add_fast_counts(counts: Counter, fast: dict[str, int]) -> None:
    """The C loop's RUNs and PINGs counted with the rest, and its own counters beside them."""
    counts["Run"] += fast["fast_runs"]
    counts["Ping"] += fast["fast_pings"]
    for name in ("fast_runs", "fast_pings", "dropped_many_parts"):
        counts[name] += fast[name]


def _min_max(rows: torch.Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty index tensor; plain Python for the few rows of a decode step (cheaper than two kernels)."""
    if rows.numel() <= 64:
        values = rows.tolist()
        return min(values), max(values)
    return int(rows.min()), int(rows.max())


def _peer_address(frame) -> str:
    try:
        return frame.get("Peer-Address") or "?"
    except (AttributeError, zmq.ZMQError):
        return "local"


def fast_worker(worker: ExpertWorker) -> FastWorker | None:
    """The C receive loop for `worker`, or None: no fast path here, or a backend that does not decode with the native kernel."""
    lib, kernel = wire(), worker.backend.decode_kernel()
    if lib is None or kernel is None:
        return None
    return FastWorker(lib, kernel, worker.spec, worker.max_message_bytes, worker.max_sessions)


def serve(worker: ExpertWorker, listen: str, keys: str | Path | None = None, stop: threading.Event | None = None,
          on_ready: Callable[[str], None] | None = None, queue_messages: int = 16, native: bool = True) -> None:
    """Bind a ROUTER on `listen` and answer requests until `stop` is set; every socket is closed on return.

    `queue_messages` bounds the messages ZeroMQ queues per peer (its receive
    high-water mark), so queued input is at most that many times the message limit per connection.
    `native=False` keeps every message in Python (otherwise the C loop serves PINGs and decode RUNs when it can).
    """
    check_listen(listen, keys)
    stop = stop or threading.Event()
    context = zmq.Context()
    auth = start_authenticator(context, keys) if keys is not None else None
    router = context.socket(zmq.ROUTER)
    monitor = None
    try:
        router.linger = 0
        router.rcvhwm = router.sndhwm = queue_messages
        router.maxmsgsize = max(worker.max_message_bytes, MAX_HEADER_BYTES)  # per frame: larger ones drop the peer
        if keys is not None:
            make_server(router, keys)
        router.bind(listen)
        endpoint = router.last_endpoint.decode()
        monitor = router.get_monitor_socket(_HANDSHAKE_FAILED | zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        fast = fast_worker(worker) if native else None
        if fast is not None:
            worker.attach(fast)
        log.info("listening on %s (model %s, fingerprint %s, backend %s, %s; PINGs and decode RUNs in %s)", endpoint, worker.checkpoint.folder,
                 worker.checkpoint.fingerprint, worker.backend.name, "CurveZMQ, listed clients only" if keys else "plaintext, loopback only",
                 "C" if fast is not None else f"Python, fast path {fast_status() if native else 'not asked for'}")
        if on_ready is not None:
            on_ready(endpoint)
        router.rcvtimeo = IDLE_MS  # a blocking receive (the cheapest wake-up) that still lets `stop` be seen
        handled = 0
        while not stop.is_set():
            if fast is not None:
                status = fast.serve(router.underlying, IDLE_MS)  # PINGs and decode RUNs are answered in there
                if status != PYTHON:
                    _log_events(monitor)
                    continue
                identity, frames, peer = fast.message()
            else:
                try:
                    frames = router.recv_multipart(copy=False)  # tensors stay in ZeroMQ's buffers
                except zmq.Again:  # idle
                    _log_events(monitor)
                    continue
                identity, peer = frames.pop(0).bytes, None
            send(router, [identity, *worker.handle(identity, frames, peer)])  # dropped by ZeroMQ if the peer is gone
            handled += 1
            if handled % 256 == 0:  # never idle: look at connection events now and then
                _log_events(monitor)
    finally:
        worker.detach()
        if monitor is not None:
            router.disable_monitor()
            monitor.close(linger=0)
        router.close(linger=0)
        if auth is not None:
            auth.stop()
        context.term()
        log.info("stopped after %d requests (%d errors)", sum(v for k, v in worker.counts.items() if not k.startswith("error_")),
                 sum(v for k, v in worker.counts.items() if k.startswith("error_")))


def _log_events(monitor: zmq.Socket) -> None:
    while monitor.poll(0):
        event = recv_monitor_message(monitor)
        kind = event["event"]
        if kind & _HANDSHAKE_FAILED:
            log.warning("connection refused at the handshake (%s): not an admitted CurveZMQ client", zmq.Event(kind).name)
        else:
            log.debug("connection %s (fd %s)", zmq.Event(kind).name.lower(), event["value"])
