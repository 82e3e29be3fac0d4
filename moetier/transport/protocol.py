"""The whole wire format between a RemoteTier (client) and an expert worker.

One request/response dataclass per command, `encode` to frames and
`decode_request` / `decode_reply` back, nothing else: no other module builds
or parses frames. Invariants: command values never change (a new command gets
a new value; PROTOCOL_VERSION changes when a field's meaning does); every
dtype, shape and size is checked against the received frames and the limits
before any tensor is made, and tensors are zero-copy views of the frames;
msgpack only, never pickle. Byte order on the wire is little-endian.

Frame layout of one message (a ROUTER socket sees the peer's identity frame
first; the identity is ZeroMQ's, not part of the format):

    +----------------------------------------------------------------------+
    | frame 0  u32 little-endian H: the header's length, H <= MAX_HEADER_BYTES
    |          header: H bytes of msgpack map                              |
    |          {"v": PROTOCOL_VERSION, "c": Command, "id": request id u64, |
    |           ...the command's own fields...,                            |
    |           "t": [[dtype, [d0, d1, ...]], ...]}  one entry per tensor |
    |          then each tensor under INLINE_MAX_BYTES, in "t" order, its  |
    |          raw bytes (C order) at the next multiple of 8 from the      |
    |          frame's start, zeros between; the frame ends with the last  |
    +----------------------------------------------------------------------+
    | frame 1  raw bytes of the first tensor of INLINE_MAX_BYTES or more,  |
    | ...      sent from the tensor's own memory (zero-copy), in "t" order |
    +----------------------------------------------------------------------+

A decode step's message is one frame: each ZeroMQ frame costs a few
microseconds at each end (a C ping-pong of 8 KiB on loopback: 1 frame ~101
us, 2 frames ~111-117, 4 frames ~112-138), and a tensor under 64 KiB costs
less to copy than to send zero-copy.

A reply carries the request's id and the request's command, or ERROR.
    HELLO  fingerprint, client              -> fingerprint, worker, backend, dtypes, sizes
    LOAD   pairs [m, 2] i32 (layer, expert) -> held, placed_bytes
    RUN    layer, experts [m], counts [m];  -> compute_us; y [n, D] in x's dtype =
           x [n, D] f32|bf16|f16,              sum over experts of weights * ffn(x[rows])
           rows [r] i32|i64 into x, weights [r] f32, r = sum(counts)
    PING   payload [N] u8                   -> the same payload
    STATS  -                                -> stats (flat map of numbers and short strings)
    BYE    -                                -> -
    ERROR  (reply only) code, message
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar

import msgpack
import torch
import zmq

PROTOCOL_VERSION = 2  # 2: small tensors ride in the header frame
MAX_HEADER_BYTES = 65_536
DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20  # tensor bytes of one message; the worker may announce another
MAX_DIM = 2**31 - 1
MAX_NAME_CHARS = 128
INLINE_MAX_BYTES = 65_536  # smaller tensors go in frame 0 (copied); larger ones in frames of their own (zero-copy)


class Command(IntEnum):
    HELLO = 1
    LOAD = 2
    RUN = 3
    PING = 4
    STATS = 5
    BYE = 6
    ERROR = 7


class ErrorCode(IntEnum):
    BAD_FRAME = 1  # undecodable header, wrong frame count, bad field
    BAD_VERSION = 2
    BAD_FINGERPRINT = 3  # the worker's weights are not the client's
    NO_SESSION = 4  # a command other than HELLO/PING before a good HELLO
    BAD_TENSOR = 5  # dtype, shape or byte count does not match
    TOO_LARGE = 6
    OUT_OF_RANGE = 7  # layer or expert id the model does not have
    NOT_LOADED = 8  # RUN of an expert the worker does not hold
    UNKNOWN_COMMAND = 9
    INTERNAL = 10


class ProtocolError(ValueError):
    """A message that breaks the format or the limits; `request_id` is 0 when the header was unreadable."""

    def __init__(self, code: ErrorCode, message: str, request_id: int = 0):
        super().__init__(message)
        self.code = ErrorCode(code)
        self.request_id = request_id


DTYPES: dict[str, torch.dtype] = {
    "f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16,
    "i32": torch.int32, "i64": torch.int64, "u8": torch.uint8,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
HIDDEN_DTYPES = ("f32", "bf16", "f16")


# -- messages -------------------------------------------------------------------
# Each class names its command, its tensor fields (name, allowed dtypes, ndim)
# and parses its header fields in `_parse`; `encode`/`_decode` do the rest.


@dataclass(frozen=True)
class Message:
    command: ClassVar[Command]
    tensors: ClassVar[tuple[tuple[str, tuple[str, ...], int], ...]] = ()

    def fields(self) -> dict:
        return {}

    @classmethod
    def _parse(cls, header: dict, tensors: list[torch.Tensor]) -> "Message":
        return cls()


@dataclass(frozen=True)
class Hello(Message):
    command = Command.HELLO
    fingerprint: str
    client: str = ""

    def fields(self) -> dict:
        return {"fingerprint": self.fingerprint, "client": self.client}

    @classmethod
    def _parse(cls, h, tensors):
        return cls(_str(h, "fingerprint"), _str(h, "client"))


@dataclass(frozen=True)
class HelloReply(Message):
    command = Command.HELLO
    fingerprint: str
    worker: str
    backend: str
    dtypes: tuple[str, ...]
    hidden_size: int
    num_experts: int
    moe_layers: tuple[int, ...]
    max_message_bytes: int

    def fields(self) -> dict:
        return {"fingerprint": self.fingerprint, "worker": self.worker, "backend": self.backend, "dtypes": list(self.dtypes),
                "hidden_size": self.hidden_size, "num_experts": self.num_experts, "moe_layers": list(self.moe_layers),
                "max_message_bytes": self.max_message_bytes}

    @classmethod
    def _parse(cls, h, tensors):
        dtypes = h.get("dtypes")
        if not isinstance(dtypes, list) or len(dtypes) > len(DTYPES) or not all(d in HIDDEN_DTYPES for d in dtypes):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"field 'dtypes': expected a list of {HIDDEN_DTYPES}")
        return cls(_str(h, "fingerprint"), _str(h, "worker"), _str(h, "backend"), tuple(dtypes), _int(h, "hidden_size", 1, MAX_DIM),
                   _int(h, "num_experts", 1, MAX_DIM), _ints(h, "moe_layers", 0, MAX_DIM), _int(h, "max_message_bytes", 1, 2**40))


@dataclass(frozen=True)
class Load(Message):
    command = Command.LOAD
    tensors = (("pairs", ("i32",), 2),)
    pairs: torch.Tensor  # [m, 2] int32 (layer, expert)

    @classmethod
    def _parse(cls, h, tensors):
        if tensors[0].shape[1] != 2:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"LOAD pairs: expected shape [m, 2], got {list(tensors[0].shape)}")
        return cls(tensors[0])


@dataclass(frozen=True)
class LoadReply(Message):
    command = Command.LOAD
    held: int  # experts the worker holds now, over all layers
    placed_bytes: int  # bytes placed by this request

    def fields(self) -> dict:
        return {"held": self.held, "placed_bytes": self.placed_bytes}

    @classmethod
    def _parse(cls, h, tensors):
        return cls(_int(h, "held", 0, 2**40), _int(h, "placed_bytes", 0, 2**62))


@dataclass(frozen=True)
class Run(Message):
    command = Command.RUN
    tensors = (("x", HIDDEN_DTYPES, 2), ("rows", ("i32", "i64"), 1), ("weights", ("f32",), 1))
    layer: int
    experts: tuple[int, ...]  # [m]
    counts: tuple[int, ...]  # [m] rows of each expert, in order
    x: torch.Tensor  # [n, D] hidden states of the rows any of these experts serves
    rows: torch.Tensor  # [r] indices into x, grouped by expert (r = sum(counts))
    weights: torch.Tensor  # [r] float32 gate weights

    def fields(self) -> dict:
        return {"layer": self.layer, "experts": list(self.experts), "counts": list(self.counts)}

    @classmethod
    def _parse(cls, h, tensors):
        x, rows, weights = tensors
        experts, counts = _ints(h, "experts", 0, MAX_DIM), _ints(h, "counts", 0, MAX_DIM)
        if len(experts) != len(counts):
            raise ProtocolError(ErrorCode.BAD_FRAME, f"RUN: {len(experts)} experts but {len(counts)} counts")
        if sum(counts) != rows.shape[0] or weights.shape[0] != rows.shape[0]:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"RUN: counts sum to {sum(counts)}, rows {rows.shape[0]}, weights {weights.shape[0]} (expected equal)")
        return cls(_int(h, "layer", 0, MAX_DIM), experts, counts, x, rows, weights)


@dataclass(frozen=True)
class RunReply(Message):
    command = Command.RUN
    tensors = (("y", HIDDEN_DTYPES, 2),)
    y: torch.Tensor  # [n, D]
    compute_us: float = 0.0

    def fields(self) -> dict:
        return {"compute_us": self.compute_us}

    @classmethod
    def _parse(cls, h, tensors):
        return cls(tensors[0], _float(h, "compute_us"))


@dataclass(frozen=True)
class Ping(Message):
    command = Command.PING
    tensors = (("payload", ("u8",), 1),)
    payload: torch.Tensor  # [N] uint8

    @classmethod
    def _parse(cls, h, tensors):
        return cls(tensors[0])


@dataclass(frozen=True)
class PingReply(Ping):
    """The worker's echo of a Ping: the same payload back."""


@dataclass(frozen=True)
class Stats(Message):
    command = Command.STATS


@dataclass(frozen=True)
class StatsReply(Message):
    command = Command.STATS
    stats: dict = field(default_factory=dict)  # name -> int | float | str

    def fields(self) -> dict:
        return {"stats": self.stats}

    @classmethod
    def _parse(cls, h, tensors):
        stats = h.get("stats")
        if not isinstance(stats, dict) or not all(isinstance(k, str) and isinstance(v, (int, float, str)) for k, v in stats.items()):
            raise ProtocolError(ErrorCode.BAD_FRAME, "field 'stats': expected a flat map of numbers and strings")
        return cls(stats)


@dataclass(frozen=True)
class Bye(Message):
    command = Command.BYE


@dataclass(frozen=True)
class ByeReply(Message):
    command = Command.BYE


@dataclass(frozen=True)
class ErrorReply(Message):
    command = Command.ERROR
    code: ErrorCode
    message: str

    def fields(self) -> dict:
        return {"code": int(self.code), "message": self.message[:512]}

    @classmethod
    def _parse(cls, h, tensors):
        try:
            code = ErrorCode(_int(h, "code", 0, 2**16))
        except ValueError:  # a code from a newer peer
            code = ErrorCode.INTERNAL
        return cls(code, _str(h, "message", 512))


REQUESTS: dict[int, type[Message]] = {m.command: m for m in (Hello, Load, Run, Ping, Stats, Bye)}
REPLIES: dict[int, type[Message]] = {m.command: m for m in (HelloReply, LoadReply, RunReply, PingReply, StatsReply, ByeReply, ErrorReply)}


# -- encode / decode -------------------------------------------------------------------


def parts(request_id: int, message: Message) -> tuple[dict, list]:
    """A message's header and its tensors' bytes (numpy views of the tensors' memory), before framing."""
    header = message.fields()
    header.update(v=PROTOCOL_VERSION, c=int(message.command), id=request_id)
    buffers = []
    if message.tensors:
        descriptors = []
        for name, _, _ in message.tensors:
            tensor = getattr(message, name)
            tensor = tensor if tensor.is_contiguous() else tensor.contiguous()
            descriptors.append([DTYPE_NAMES[tensor.dtype], list(tensor.shape)])
            buffers.append(tensor.reshape(-1).view(torch.uint8).numpy())  # a view: the buffer is the tensor's memory
        header["t"] = descriptors
    return header, buffers


def pack(header: dict, buffers: list) -> list:
    """Frames of a message (the layout above): frame 0 with the header and the small buffers, then the large ones."""
    packed = msgpack.packb(header)
    head: list = [len(packed).to_bytes(4, "little"), packed]
    at, large = 4 + len(packed), []
    for buffer in buffers:
        nbytes = memoryview(buffer).nbytes
        if nbytes < INLINE_MAX_BYTES:
            head.append(bytes(-at % 8))
            head.append(buffer)
            at += -at % 8 + nbytes
        else:
            large.append(buffer)
    return [b"".join(head), *large]


def encode(request_id: int, message: Message) -> list:
    """-> frames: bytes, then views of large tensors' memory (send them with `send`)."""
    return pack(*parts(request_id, message))


_SNDMORE = int(zmq.SNDMORE)  # plain ints: flag enums cost a microsecond per operation on this path


def send(socket, frames: list, flags: int = 0) -> None:
    """Send frames on a ZeroMQ socket: bytes copied, large tensor buffers zero-copy."""
    flags, last = int(flags), len(frames) - 1
    for i, frame in enumerate(frames):
        socket.send(frame, flags | _SNDMORE if i < last else flags, copy=isinstance(frame, bytes))


def decode_request(frames: list, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[int, Message]:
    """Worker side: frames (bytes or zmq.Frame) -> (request id, request); raises ProtocolError."""
    return _decode(frames, REQUESTS, max_message_bytes)


def decode_reply(frames: list, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[int, Message]:
    """Client side: frames -> (request id, reply or ErrorReply); raises ProtocolError."""
    return _decode(frames, REPLIES, max_message_bytes)


def _buffer(frame) -> memoryview:
    return frame.buffer if hasattr(frame, "buffer") else memoryview(frame)


def _decode(frames: list, table: dict[int, type[Message]], max_message_bytes: int) -> tuple[int, Message]:
    if not frames:
        raise ProtocolError(ErrorCode.BAD_FRAME, "empty message (expected a header frame)")
    raw = _buffer(frames[0])
    if raw.nbytes < 4:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"frame 0 of {raw.nbytes} bytes (expected the header's 4-byte length first)")
    length = int.from_bytes(raw[:4], "little")
    if 4 + length > raw.nbytes:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"a header of {length} bytes announced in a frame of {raw.nbytes}")
    if length > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"header of {length} bytes (limit {MAX_HEADER_BYTES})")
    try:
        header = msgpack.unpackb(raw[4 : 4 + length], raw=False, strict_map_key=True, max_str_len=4096, max_bin_len=0,
                                 max_array_len=65_536, max_map_len=256, max_ext_len=0)
    except Exception as err:  # msgpack raises several types for malformed input
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is not valid msgpack ({type(err).__name__})") from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"header is a msgpack {type(header).__name__} (expected a map)")
    request_id = header.get("id")
    if type(request_id) is not int or not 0 <= request_id < 2**64:
        raise ProtocolError(ErrorCode.BAD_FRAME, "header field 'id': expected an unsigned 64-bit integer")
    if type(header.get("v")) is not int or header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(ErrorCode.BAD_VERSION, f"protocol version {_show(header.get('v'))} (this side speaks {PROTOCOL_VERSION})", request_id)
    command = header.get("c")
    cls = table.get(command) if type(command) is int else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_COMMAND, f"unknown command {_show(command)}", request_id)
    try:
        tensors = _tensors(header, raw, 4 + length, frames[1:], cls, max_message_bytes)
        return request_id, cls._parse(header, tensors)
    except ProtocolError as err:
        err.request_id = request_id
        raise


def _tensors(header: dict, raw: memoryview, at: int, frames: list, cls: type[Message], max_message_bytes: int) -> list[torch.Tensor]:
    """Check the descriptors against the class, frame 0's length and the large frames, then view each tensor's bytes."""
    specs = cls.tensors
    descriptors = header.get("t", [])
    name = cls.__name__
    if not isinstance(descriptors, list) or len(descriptors) != len(specs):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{name}: descriptors {_show(descriptors)} (expected {len(specs)})")
    places, total, large = [], 0, 0  # (dtype, shape, bytes, frame index, offset)
    for (field_name, allowed, ndim), descriptor in zip(specs, descriptors):
        if not (isinstance(descriptor, list) and len(descriptor) == 2 and descriptor[0] in allowed and isinstance(descriptor[1], list)):
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{name}.{field_name}: descriptor {_show(descriptor)} (expected [dtype in {allowed}, shape])")
        shape = descriptor[1]
        if len(shape) != ndim or not all(type(d) is int and 0 <= d <= MAX_DIM for d in shape):
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{name}.{field_name}: shape {_show(shape)} (expected {ndim} sizes in [0, {MAX_DIM}])")
        dtype = DTYPES[descriptor[0]]
        nbytes = math.prod(shape) * dtype.itemsize
        total += nbytes
        if total > max_message_bytes:
            raise ProtocolError(ErrorCode.TOO_LARGE, f"{name}: tensors of more than {max_message_bytes} bytes (the limit)")
        if nbytes < INLINE_MAX_BYTES:
            at += -at % 8
            places.append((dtype, shape, nbytes, 0, at))
            at += nbytes
        else:
            large += 1
            places.append((dtype, shape, nbytes, large, 0))
    if len(frames) != large:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"{name}: {len(frames)} tensor frames after the header frame (expected {large})")
    if raw.nbytes != at:
        raise ProtocolError(ErrorCode.BAD_TENSOR, f"{name}: header frame of {raw.nbytes} bytes (its header and small tensors make {at})")
    buffers = [raw, *(_buffer(frame) for frame in frames)]
    for (field_name, _, _), (dtype, shape, nbytes, index, _) in zip(specs, places):
        if index and buffers[index].nbytes != nbytes:
            raise ProtocolError(ErrorCode.BAD_TENSOR, f"{name}.{field_name}: frame of {buffers[index].nbytes} bytes for "
                                f"{DTYPE_NAMES[dtype]} {shape} ({nbytes} bytes)")
    return [_view(buffers[index][offset : offset + nbytes], dtype, shape) for dtype, shape, nbytes, index, offset in places]


def _view(buffer: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    """A tensor over a frame's bytes; copied only if empty, read-only or misaligned for the dtype."""
    if buffer.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if buffer.readonly:  # bytes objects (tests, copying receives): torch wants writable memory
        buffer = bytearray(buffer)
    flat = torch.frombuffer(buffer, dtype=dtype)  # [numel], no copy
    if flat.data_ptr() % dtype.itemsize:  # ZeroMQ may hand out a frame at any byte offset
        flat = flat.clone()
    return flat if len(shape) == 1 else flat.view(shape)


# -- field checks ---------------------------------------------------------------------------


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(h: dict, key: str, lo: int, hi: int) -> int:
    value = h.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"field {key!r}: {_show(value)} (expected an integer in [{lo}, {hi}])")
    return value


def _ints(h: dict, key: str, lo: int, hi: int) -> tuple[int, ...]:
    value = h.get(key)
    if not isinstance(value, list) or not all(type(v) is int and lo <= v <= hi for v in value):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"field {key!r}: {_show(value)} (expected a list of integers in [{lo}, {hi}])")
    return tuple(value)


def _float(h: dict, key: str) -> float:
    value = h.get(key)
    if type(value) not in (int, float) or not math.isfinite(value):
        raise ProtocolError(ErrorCode.BAD_FRAME, f"field {key!r}: {_show(value)} (expected a finite number)")
    return float(value)


def _str(h: dict, key: str, max_chars: int = MAX_NAME_CHARS) -> str:
    value = h.get(key)
    if not isinstance(value, str) or len(value) > max_chars:
        raise ProtocolError(ErrorCode.BAD_FRAME, f"field {key!r}: {_show(value)} (expected a string of at most {max_chars} characters)")
    return value
