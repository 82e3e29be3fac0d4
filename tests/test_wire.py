"""The transport's C fast path (transport/wire.c through transport/wire.py) against protocol.py, its judge.

Parsing: for generated RUN and PING messages, well-formed and broken, the C
parser accepts only what `protocol.decode_request` accepts, with the same
fields, and it accepts every RUN and PING that `protocol.encode` frames as one
frame. Serving, over real sockets to worker threads: a C or Python client
against a C or Python worker gives the same reply bits; errors get the same
codes; BYE and eviction reach the C loop's sessions, and RUNs served in C
count as activity when the least recent session is evicted; experts held
in a stored format (Q8_0) are served in C with the local kernel's bits.
"""

from __future__ import annotations

import ctypes
import threading

import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.backends import cpu_kernels
from moetier.model import open_checkpoint
from moetier.model.gguf_write import write_gguf
from moetier.model.synth import write_synthetic
from moetier.transport import wire
from moetier.transport import protocol as P
from moetier.transport.client import WorkerClient
from moetier.transport.worker import ExpertWorker, serve

pytestmark = pytest.mark.skipif(wire.wire() is None, reason=f"transport fast path {wire.status()}")


class TensorDesc(ctypes.Structure):  # wire.c's tensor_desc
    _fields_ = [("dtype", ctypes.c_int), ("ndim", ctypes.c_int), ("dims", ctypes.c_int64 * 2), ("nbytes", ctypes.c_int64)]


class Header(ctypes.Structure):  # wire.c's header
    _fields_ = [("seen", ctypes.c_uint32), ("version", ctypes.c_int64), ("command", ctypes.c_int64), ("layer", ctypes.c_int64),
                ("m", ctypes.c_int64), ("ncounts", ctypes.c_int64), ("id", ctypes.c_uint64), ("compute_us", ctypes.c_double),
                ("experts", ctypes.c_int64 * wire.MAX_PICKS), ("counts", ctypes.c_int64 * wire.MAX_PICKS), ("nt", ctypes.c_int64),
                ("t", TensorDesc * 3), ("offset", ctypes.c_int64 * 3)]


def c_parse(frame: bytes, kind: type[P.Message], limit: int = 2**20) -> Header | None:
    out = Header()
    parse = wire.wire().wire_parse_run if kind is P.Run else wire.wire().wire_parse_ping
    return out if parse(frame, len(frame), limit, ctypes.byref(out)) else None


def py_decode(frames: list, limit: int = 2**20) -> tuple[int, P.Run] | None:
    try:
        return P.decode_request(frames, limit)
    except P.ProtocolError:
        return None


# -- parsing -------------------------------------------------------------------------------------


@st.composite
def runs(draw) -> P.Run:
    n, d, m = draw(st.integers(0, 3)), draw(st.integers(1, 40)), draw(st.integers(0, 6))
    counts = tuple(draw(st.lists(st.integers(0, 3), min_size=m, max_size=m)))
    x = torch.randn(n, d).to(draw(st.sampled_from([torch.float32, torch.bfloat16, torch.float16])))
    rows = torch.randint(0, max(n, 1), (sum(counts),), dtype=draw(st.sampled_from([torch.int32, torch.int64])))
    experts = tuple(draw(st.lists(st.integers(0, 2**31 - 1), min_size=m, max_size=m)))
    return P.Run(draw(st.integers(0, 2**31 - 1)), experts, counts, x, rows, torch.rand(sum(counts)))


@st.composite
def pings(draw) -> P.Ping:
    return P.Ping(torch.tensor(list(draw(st.binary(max_size=300))), dtype=torch.uint8))


FIELD_VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True), st.text(max_size=6),
                         st.lists(st.integers(-3, 2**33), max_size=4), st.lists(st.lists(st.integers(-1, 9), max_size=3), max_size=3))


@st.composite
def messages(draw) -> tuple[list, bool]:
    """(frames, mutated, kind) of a RUN or a PING, possibly broken in its header or its bytes."""
    message = draw(st.one_of(runs(), pings()))
    header, buffers = P.parts(draw(st.integers(0, 2**64 - 1)), message)
    kind = draw(st.sampled_from(["none", "none", "field", "drop", "extra", "descriptor", "bytes", "truncate", "append"]))
    if kind == "field":
        header[draw(st.sampled_from(sorted(header)))] = draw(FIELD_VALUES)
    elif kind == "drop":
        del header[draw(st.sampled_from(sorted(header)))]
    elif kind == "extra":
        header[draw(st.text(min_size=1, max_size=8))] = draw(FIELD_VALUES)
    elif kind == "descriptor":
        i = draw(st.integers(0, len(header["t"]) - 1))
        header["t"][i] = [draw(st.sampled_from(["f32", "bf16", "f16", "i32", "i64", "u8", "f64"])),
                          draw(st.lists(st.integers(0, 70), min_size=0, max_size=3))]
    frames = P.pack(header, buffers)
    if kind == "bytes":
        raw = bytearray(frames[0])
        for _ in range(draw(st.integers(1, 3))):
            raw[draw(st.integers(0, len(raw) - 1))] = draw(st.integers(0, 255))
        frames[0] = bytes(raw)
    elif kind == "truncate":
        frames[0] = frames[0][: draw(st.integers(0, len(frames[0]) - 1))]
    elif kind == "append":
        frames[0] = frames[0] + b"\0" * draw(st.integers(1, 9))
    return frames, kind != "none", type(message)


@settings(max_examples=800, deadline=None)
@given(message=messages())
def test_c_parser_accepts_only_what_python_accepts_with_the_same_fields(message):
    frames, mutated, kind = message
    c, py = c_parse(frames[0], kind) if len(frames) == 1 else None, py_decode(frames)
    if not mutated and len(frames) == 1:
        assert c is not None, f"a {kind.__name__} protocol.encode made, deferred"
    if c is None:
        return
    assert py is not None and type(py[1]) is kind, f"C accepted a {kind.__name__} the protocol refuses"
    request_id, request = py
    assert (c.id, c.command) == (request_id, int(request.command))
    if kind is P.Ping:
        tensors = (request.payload,)
    else:
        assert (c.layer, c.m) == (request.layer, len(request.experts))
        assert tuple(c.experts[: c.m]) == request.experts and tuple(c.counts[: c.m]) == request.counts
        tensors = (request.x, request.rows, request.weights)
    for i, tensor in enumerate(tensors):
        assert wire.DTYPE_CODES[tensor.dtype] == c.t[i].dtype and list(tensor.shape) == list(c.t[i].dims[: c.t[i].ndim])
        start = c.offset[i]
        assert frames[0][start : start + c.t[i].nbytes] == tensor.contiguous().view(torch.uint8).numpy().tobytes()


def test_constants_and_a_large_run_defers():
    lib = wire.wire()
    assert [lib.wire_constant(i) for i in range(7)] == [P.PROTOCOL_VERSION, P.MAX_HEADER_BYTES, P.INLINE_MAX_BYTES, P.MAX_DIM,
                                                        int(P.Command.RUN), int(P.Command.PING), wire.MAX_PICKS]
    big = P.Run(0, (1,), (1,), torch.zeros(1, P.INLINE_MAX_BYTES // 4), torch.zeros(1, dtype=torch.int32), torch.ones(1))
    frames = P.encode(3, big)
    assert len(frames) == 2 and c_parse(frames[0], P.Run, 2**24) is None and py_decode(frames, 2**24) is not None


# -- serving, over sockets ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return open_checkpoint(write_synthetic(tmp_path_factory.mktemp("wire") / "tiny", arch="qwen3_moe", preset="tiny", seed=2))


@pytest.fixture(scope="module")
def quantized(tmp_path_factory, checkpoint):
    """The same tiny model as llama.cpp's converter writes it with --outtype Q8_0 (experts held as Q8_0 blocks)."""
    folder = tmp_path_factory.mktemp("wire-q8")
    return open_checkpoint(write_gguf(write_synthetic(folder / "tiny", arch="qwen3_moe", preset="tiny", seed=2), folder / "tiny-q8_0.gguf", "Q8_0")[0])


@pytest.fixture
def workers(checkpoint):
    """start(native, **worker options) -> (endpoint, ExpertWorker); each serves in a thread until teardown.
    options may name another checkpoint (`of=`)."""
    running = []

    def start(native: bool, of=None, **options):
        worker, stop, ready = ExpertWorker(of or checkpoint, **options), threading.Event(), []
        thread = threading.Thread(target=serve, args=(worker, "tcp://127.0.0.1:0"), kwargs=dict(stop=stop, on_ready=ready.append, native=native))
        thread.start()
        running.append((thread, stop))
        while not ready and thread.is_alive():
            thread.join(0.01)
        return ready[0], worker

    yield start
    for thread, stop in running:
        stop.set()
        thread.join(10)


def test_every_pairing_of_c_and_python_ends_gives_the_same_bits(checkpoint, workers):
    spec, layer = checkpoint.spec, checkpoint.spec.moe_layers[1]
    load = P.Load(torch.tensor([[layer, e] for e in range(8)], dtype=torch.int32))
    torch.manual_seed(0)
    one_row = [torch.randn(1, spec.hidden_size).to(dtype) for dtype in (torch.float32, torch.bfloat16, torch.float16)]
    requests = [P.Run(layer, (3, 1, 6), (1, 1, 1), x, torch.zeros(3, dtype=torch.int32), torch.tensor([0.5, 0.3, 0.2])) for x in one_row]
    requests.append(P.Run(layer, (3, 1), (2, 1), torch.randn(2, spec.hidden_size), torch.tensor([0, 1, 1], dtype=torch.int32), torch.rand(3)))
    replies, served_in_c = {}, {}
    for worker_native in (True, False):
        endpoint, worker = workers(worker_native)
        for client_native in (True, False):
            with WorkerClient(endpoint, checkpoint.fingerprint, setup=lambda: [load], native=client_native) as client:
                replies[worker_native, client_native] = [client.call(r, 10.0).y for r in requests]
                for size in (0, 3, 5000):
                    payload = torch.randint(0, 256, (size,), dtype=torch.uint8)
                    assert torch.equal(client.call(P.Ping(payload), 10.0).payload, payload)
                stats = client.call(P.Stats(), 10.0).stats
                served_in_c[worker_native, client_native] = stats.get("fast_runs", 0), stats.get("fast_pings", 0)
    reference = replies[False, False]
    for pairing, ys in replies.items():
        for y, expected in zip(ys, reference):
            assert y.dtype == expected.dtype and torch.equal(y, expected), pairing
    # f32 and bf16 one-row RUNs and every PING (a heartbeat may add one), from either client; the counts are the worker's, cumulative
    assert served_in_c[True, True][0] == 2 and served_in_c[True, False][0] == 4
    assert served_in_c[True, False][1] >= served_in_c[True, True][1] + 3 >= 6
    assert served_in_c[False, True] == served_in_c[False, False] == (0, 0)


def test_a_c_worker_serves_stored_format_experts_with_the_local_kernels_bits(quantized, workers):
    """Q8_0 experts: the C loop serves one-row RUNs with moe_decode on the stored blocks, the same bits as the
    Python worker and as the local CPU path (DecodeKernel.run on the same placed experts)."""
    spec, layer = quantized.spec, quantized.spec.moe_layers[1]
    picks, scales = (3, 1, 6), torch.tensor([0.5, 0.3, 0.2])
    torch.manual_seed(1)
    x = torch.randn(1, spec.hidden_size)
    requests = [P.Run(layer, picks, (1, 1, 1), x.to(dtype), torch.zeros(3, dtype=torch.int32), scales) for dtype in (torch.float32, torch.bfloat16)]
    load = P.Load(torch.tensor([[layer, e] for e in picks], dtype=torch.int32))
    replies = {}
    for native in (True, False):
        endpoint, worker = workers(native, of=quantized)
        with WorkerClient(endpoint, quantized.fingerprint, setup=lambda: [load]) as client:
            replies[native] = [client.call(r, 10.0).y for r in requests]
            served = client.call(P.Stats(), 10.0).stats.get("fast_runs", 0)
        assert served == (2 if native else 0)
        placed = [worker.placed[layer][e] for e in picks]
    assert placed[0].formats == "Q8_0"
    local = cpu_kernels.decode_kernel().run(requests[0].x, placed, scales.tolist())  # the CPU tier's arithmetic
    assert torch.equal(replies[True][0], local) and torch.equal(replies[False][0], local)
    assert torch.equal(replies[True][1], replies[False][1])  # bf16: the same x rounded, the same kernel, y rounded alike


def _dealer(endpoint: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.linger = 0
    socket.connect(endpoint)
    return socket


def _ask(socket: zmq.Socket, message: P.Message) -> P.Message:
    P.send(socket, P.encode(5, message))
    assert socket.poll(10_000)
    return P.decode_reply(socket.recv_multipart())[1]


@pytest.mark.parametrize("native", [True, False])
def test_errors_and_bye_are_the_same_with_the_c_loop(checkpoint, workers, native):
    spec, layer = checkpoint.spec, checkpoint.spec.moe_layers[0]
    endpoint, _ = workers(native)
    x = torch.randn(1, spec.hidden_size)
    run = lambda experts, x=x: P.Run(layer, experts, (1,) * len(experts), x, torch.zeros(len(experts), dtype=torch.int32), torch.ones(len(experts)))  # noqa: E731
    socket = _dealer(endpoint)
    assert _ask(socket, run((0,))).code == P.ErrorCode.NO_SESSION
    assert isinstance(_ask(socket, P.Hello(checkpoint.fingerprint)), P.HelloReply)
    assert _ask(socket, P.Load(torch.tensor([[layer, 0], [layer, 1]], dtype=torch.int32))).held == 2
    assert isinstance(_ask(socket, run((0, 1))), P.RunReply)
    assert _ask(socket, run((0, 2))).code == P.ErrorCode.NOT_LOADED
    assert _ask(socket, run((1, 1))).code == P.ErrorCode.BAD_FRAME  # an expert twice
    assert _ask(socket, run((0,), torch.randn(1, spec.hidden_size + 1))).code == P.ErrorCode.BAD_TENSOR
    assert isinstance(_ask(socket, P.Bye()), P.ByeReply)
    assert _ask(socket, run((0,))).code == P.ErrorCode.NO_SESSION
    socket.close()


def test_runs_served_in_c_count_as_activity_when_a_session_is_evicted(checkpoint, workers):
    layer = checkpoint.spec.moe_layers[0]
    endpoint, worker = workers(True, max_sessions=2)
    a, b, c = (_dealer(endpoint) for _ in range(3))
    for socket in (a, b):
        assert isinstance(_ask(socket, P.Hello(checkpoint.fingerprint)), P.HelloReply)
    _ask(a, P.Load(torch.tensor([[layer, 0]], dtype=torch.int32)))
    run = P.Run(layer, (0,), (1,), torch.randn(1, checkpoint.spec.hidden_size), torch.zeros(1, dtype=torch.int32), torch.ones(1))
    assert isinstance(_ask(a, run), P.RunReply)  # served in C: a is now more recent than b
    assert isinstance(_ask(c, P.Hello(checkpoint.fingerprint)), P.HelloReply)  # evicts the least recent
    assert isinstance(_ask(a, run), P.RunReply)
    assert _ask(b, run).code == P.ErrorCode.NO_SESSION
    assert worker.counts["Run"] + worker.fast.counts()["fast_runs"] >= 2 and worker.fast.counts()["fast_runs"] >= 2
    for socket in (a, b, c):
        socket.close()


def test_a_message_of_too_many_parts_is_dropped_and_the_worker_serves_on(checkpoint, workers):
    endpoint, worker = workers(True)
    socket = _dealer(endpoint)
    socket.send_multipart([b"x"] * 70)  # more parts than the C loop keeps
    payload = torch.arange(7, dtype=torch.uint8)
    assert torch.equal(_ask(socket, P.Ping(payload)).payload, payload)
    assert worker.fast.counts()["dropped_many_parts"] == 1
    socket.close()
