"""The wire format's C fast path (transport/wire.c): a decode RUN, or a PING, without Python at either end.

`FastClient` encodes and sends a RUN or a PING and takes its reply in C, on
the client's own pyzmq socket; `FastWorker` is the worker's receive loop in
C, which echoes a PING, serves a decode RUN (one row, all tensors in the
header frame, every expert in a stored format the kernel reads in place)
with the worker backend's native decode kernel, and hands every other
message to Python. A PING so measures the same path a decode RUN takes
(`moetier ping`, RemoteTier's cost model).
Python's protocol module stays the only judge: the C code accepts just
messages that `protocol.decode_*` accepts with the same fields, and defers
everything else, errors included, to it. The worker's reply is bit for bit
what the Python path sends for the same RUN: the same kernel on the same
arguments, and bf16 rounded as torch rounds it.

wire.c links the libzmq that pyzmq loaded (found in /proc/self/maps), so the
socket handles are shared. `wire()` is None — and both ends run in Python —
when MOETIER_NATIVE=0, there is no C compiler, or pyzmq's libzmq is not a
shared library here; `status()` says which.
"""

from __future__ import annotations

import ctypes
import functools
import os
from array import array
from pathlib import Path

import torch

from moetier import native
from moetier.backends import cpu_kernels
from moetier.model.checkpoint import ExpertWeights
from moetier.transport import protocol as P

SOURCE = Path(__file__).with_suffix(".c")

DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.int32: 3, torch.int64: 4, torch.uint8: 5}
MAX_PICKS = 1024  # experts in one fast RUN (wire.c)
IDLE, PYTHON, BATCH = 0, 1, 2  # wire_serve: nothing came, a message for Python, a batch served
NONE, REPLY, OTHER, DROPPED = 0, 1, 2, 3  # wire_recv_reply


def spin_us() -> float:
    """How long a client waiting for a reply polls before it sleeps: $MOETIER_REMOTE_SPIN_US, else 1000 — longer
    than a LAN round trip's tail, so a reply due soon costs no wake-up."""
    return float(os.environ.get("MOETIER_REMOTE_SPIN_US", "1000"))


def loaded_library(prefix: str = "libzmq") -> str | None:
    """The file of the library named prefix* that this process loaded for pyzmq (libzmq; libsodium, which its
    CURVE calls), or None (linked statically, or not Linux)."""
    import zmq.backend  # noqa: F401  (loads libzmq, and libsodium with it)

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    for line in maps.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and os.path.basename(fields[5]).startswith(prefix):
            return fields[5]
    return None


def _declare(lib: ctypes.CDLL) -> None:
    p, i64, u64, dbl = ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64, ctypes.c_double
    signatures = {
        "wire_constant": (i64, [i64]),
        "wire_inbox_count": (i64, [p]),
        "wire_inbox_part": (p, [p, i64, ctypes.POINTER(i64)]),
        "wire_inbox_peer": (ctypes.c_char_p, [p, i64]),
        "wire_parse_run": (i64, [p, i64, i64, p]),
        "wire_parse_ping": (i64, [p, i64, i64, p]),
        "wire_worker_open": (p, [i64, i64, i64, i64, i64, p, p]),
        "wire_worker_close": (None, [p]),
        "wire_worker_inbox": (p, [p]),
        "wire_worker_expert": (None, [p, i64, i64, ctypes.c_char_p, i64]),
        "wire_session_open": (i64, [p, ctypes.c_char_p, i64]),
        "wire_session_close": (None, [p, ctypes.c_char_p, i64]),
        "wire_session_activity": (None, [p, ctypes.c_char_p, i64, ctypes.POINTER(i64), ctypes.POINTER(i64)]),
        "wire_worker_counts": (None, [p, p]),
        "wire_serve": (i64, [p, p, i64, i64]),
        "wire_client_open": (p, [i64]),
        "wire_client_close": (None, [p]),
        "wire_client_inbox": (p, [p]),
        "wire_send_run": (i64, [p, p, u64, i64, i64, p, p, p, i64, i64, i64, p, i64, i64, p, i64]),
        "wire_send_ping": (i64, [p, p, u64, p, i64, i64]),
        "wire_recv_reply": (i64, [p, p, i64, dbl, u64, i64, p, i64, i64, i64, i64, ctypes.POINTER(dbl)]),
    }
    for name, (restype, argtypes) in signatures.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    libzmq = loaded_library()
    if libzmq is None:
        return None, "off: pyzmq's libzmq is not a shared library in this process (Python transport)"
    lib, path, why = native.library(SOURCE, native.STRICT_FLAGS, (libzmq, f"-Wl,-rpath,{os.path.dirname(libzmq)}"))
    if lib is None:
        return None, f"{why}: Python transport"
    _declare(lib)
    expected = (P.PROTOCOL_VERSION, P.MAX_HEADER_BYTES, P.INLINE_MAX_BYTES, P.MAX_DIM, int(P.Command.RUN), int(P.Command.PING), MAX_PICKS)
    got = tuple(lib.wire_constant(i) for i in range(len(expected)))
    if got != expected:  # wire.c and protocol.py drifted apart: never speak a different format
        return None, f"off: {path} has protocol constants {got}, protocol.py {expected}"
    return lib, f"on ({path})"


def wire() -> ctypes.CDLL | None:
    """The loaded fast path, built on first use; None when this machine has none (see status())."""
    return _load()[0]


def status() -> str:
    """One line: whether the transport's C fast path is in use, and why not when it is not."""
    return _load()[1]


def _inbox_message(lib: ctypes.CDLL, inbox: int) -> list[bytearray]:
    """Copies of the parts of the message an inbox holds (the C side reuses its buffers on the next receive)."""
    size = ctypes.c_int64()
    parts = []
    for i in range(lib.wire_inbox_count(inbox)):
        address = lib.wire_inbox_part(inbox, i, ctypes.byref(size))
        part = bytearray(size.value)  # writable: tensors are viewed in place
        if size.value:
            ctypes.memmove((ctypes.c_char * size.value).from_buffer(part), address, size.value)
        parts.append(part)
    return parts


class FastClient:
    """A client's C encoder and reply reader; use it only under the client's socket lock."""

    def __init__(self, lib: ctypes.CDLL, max_message_bytes: int, spin_us: float):
        """spin_us: how long `receive` polls before it sleeps."""
        self._lib, self._spin_s = lib, spin_us * 1e-6
        self._handle = lib.wire_client_open(max_message_bytes)
        if not self._handle:
            raise MemoryError("wire_client_open")
        self._inbox = lib.wire_client_inbox(self._handle)
        self._compute_us = ctypes.c_double()

    @staticmethod
    def fits(message: P.Message) -> bool:
        """Whether `message` is a RUN or PING that goes out as one frame from host memory, as the C encoder sends it."""
        kind = type(message)
        if kind is P.Ping:
            payload = message.payload
            return payload.device.type == "cpu" and payload.is_contiguous() and payload.numel() < P.INLINE_MAX_BYTES
        if kind is not P.Run:
            return False
        x, rows, weights = message.x, message.rows, message.weights
        return (len(message.experts) <= MAX_PICKS and x.device.type == "cpu" and x.is_contiguous() and rows.is_contiguous()
                and weights.is_contiguous() and x.numel() * x.element_size() < P.INLINE_MAX_BYTES
                and rows.numel() * rows.element_size() < P.INLINE_MAX_BYTES and weights.numel() * 4 < P.INLINE_MAX_BYTES)

    def send(self, socket: int, request_id: int, message: P.Message, flags: int) -> int:
        """Encode and send `message` (it `fits`) on the libzmq socket `socket`; -> 0, or ZeroMQ's errno."""
        if type(message) is P.Ping:
            payload = message.payload
            return self._lib.wire_send_ping(self._handle, socket, request_id, payload.data_ptr(), payload.numel(), flags)
        experts, counts = array("q", message.experts), array("q", message.counts)
        x = message.x
        return self._lib.wire_send_run(self._handle, socket, request_id, message.layer, len(experts), experts.buffer_info()[0],
                                       counts.buffer_info()[0], x.data_ptr(), DTYPE_CODES[x.dtype], x.shape[0], x.shape[1],
                                       message.rows.data_ptr(), DTYPE_CODES[message.rows.dtype], message.rows.shape[0],
                                       message.weights.data_ptr(), flags)

    @staticmethod
    def reply_buffer(message: P.Message) -> torch.Tensor:
        """Where `receive` puts the reply's tensor: a RUN's y [n, D] in x's dtype, a PING's payload [N] u8."""
        like = message.payload if type(message) is P.Ping else message.x
        return torch.empty(like.shape, dtype=like.dtype)

    def receive(self, socket: int, timeout_ms: int, want_id: int, command: int, y: torch.Tensor | None) -> tuple[int, P.Message | None]:
        """Wait up to timeout_ms -> (NONE | REPLY | OTHER | DROPPED, the reply if REPLY). REPLY: the reply to request
        `want_id` of `command`, its tensor copied into y; OTHER: another message, for `message()`."""
        expected = (0, 0, None, -1, 0, 0, 0)  # nothing awaited: every message is OTHER
        if y is not None:
            expected = (want_id, command, y.data_ptr(), DTYPE_CODES[y.dtype], y.dim(), y.shape[0], y.shape[-1])
        status = self._lib.wire_recv_reply(self._handle, socket, timeout_ms, self._spin_s, *expected, ctypes.byref(self._compute_us))
        if status != REPLY:
            return status, None
        return status, P.RunReply(y, self._compute_us.value) if command == P.Command.RUN else P.PingReply(y)

    def message(self) -> list[bytearray]:
        return _inbox_message(self._lib, self._inbox)

    def close(self) -> None:
        if self._handle:
            self._lib.wire_client_close(self._handle)
            self._handle = None


class FastWorker:
    """A worker's receive loop in C; it mirrors the worker's sessions and native-form experts (see transport.worker)."""

    BATCH = 256  # RUNs served before the loop returns to look at the stop flag and socket events

    def __init__(self, lib: ctypes.CDLL, kernel: cpu_kernels.DecodeKernel, spec, max_message_bytes: int, max_sessions: int):
        self._lib, self._kernel, self._hidden = lib, kernel, spec.hidden_size
        decode = ctypes.cast(kernel.library.moe_decode, ctypes.c_void_p).value  # on the kernel's pool, as DecodeKernel.run
        self._handle = lib.wire_worker_open(spec.hidden_size, max(spec.moe_layers) + 1, spec.num_experts, max_message_bytes,
                                            max_sessions, decode, kernel.pool.handle)
        if not self._handle:
            raise MemoryError("wire_worker_open")
        self._inbox = lib.wire_worker_inbox(self._handle)

    def expert(self, layer: int, expert: int, placed) -> None:
        """An expert the backend placed: served here if the kernel reads it in place (any stored format;
        its record is checked by `cpu_kernels.expert_record`, which raises ValueError for a malformed one)."""
        if isinstance(placed, ExpertWeights) and self._kernel.fits(placed):
            self._lib.wire_worker_expert(self._handle, layer, expert, cpu_kernels.expert_record(placed, self._hidden),
                                         placed.inter)

    def open_session(self, identity: bytes) -> None:
        if not self._lib.wire_session_open(self._handle, identity, len(identity)):
            raise RuntimeError(f"wire: no room for session {identity.hex()}")

    def close_session(self, identity: bytes) -> None:
        self._lib.wire_session_close(self._handle, identity, len(identity))

    def activity(self, identity: bytes) -> tuple[int, int]:
        """(RUNs served here, the message count at its last message) of a session, (-1, -1) if unknown."""
        runs, active = ctypes.c_int64(), ctypes.c_int64()
        self._lib.wire_session_activity(self._handle, identity, len(identity), ctypes.byref(runs), ctypes.byref(active))
        return runs.value, active.value

    def counts(self) -> dict[str, int]:
        out = (ctypes.c_int64 * 4)()
        self._lib.wire_worker_counts(self._handle, out)
        return {"messages": out[0], "fast_runs": out[1], "fast_pings": out[2], "dropped_many_parts": out[3]}

    def serve(self, socket: int, timeout_ms: int) -> int:
        """Receive and serve (PINGs, decode RUNs) on the libzmq ROUTER `socket` -> IDLE (nothing within
        timeout_ms), PYTHON (`message()` waits), or BATCH."""
        return self._lib.wire_serve(self._handle, socket, self.BATCH, timeout_ms)

    def message(self) -> tuple[bytes, list[bytearray], str]:
        """The message waiting for Python: (identity, frames, the peer's address or "?")."""
        identity, *frames = _inbox_message(self._lib, self._inbox)
        peer = self._lib.wire_inbox_peer(self._inbox, 1)
        return bytes(identity), frames, peer.decode(errors="replace") if peer else "?"

    def close(self) -> None:
        if self._handle:
            self._lib.wire_worker_close(self._handle)
            self._handle = None
