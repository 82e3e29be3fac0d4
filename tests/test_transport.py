"""Remote expert workers as a user runs them: real worker processes on loopback, real sockets.

Protocol round trips and refusals in process; then a worker subprocess per
scenario (ephemeral ports): a quarter of the experts remote gives the
all-local logits and tokens, SIGKILL mid-generation loses nothing and the
client comes back when the worker does, CurveZMQ admits only listed keys, a
keyless non-loopback bind refuses to start. Every process started here is
killed in a fixture's teardown.
"""

from __future__ import annotations

import json
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from moetier.engine import Engine, generate, group_by_expert, score
from moetier.engine.core import Partials
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.tiers.base import ExpertJob
from moetier.tiers.cpu import CpuTier
from moetier.tiers.host_experts import HostExperts
from moetier.tiers.remote import RemoteTier
from moetier.transport import protocol as P
from moetier.transport.client import TransportError, WorkerClient
from moetier.sim.lan import lan_speedup
from moetier.transport.keys import KeysError, check_listen, is_loopback
from moetier.transport.worker import ExpertWorker

PROMPT = [5, 17, 3, 250, 99, 7]


# -- processes ---------------------------------------------------------------------------------


class WorkerProcess:
    def __init__(self, proc: subprocess.Popen, endpoint: str, log: Path):
        self.proc, self.endpoint, self.log = proc, endpoint, log

    def log_text(self) -> str:
        return self.log.read_text()


def moetier(*args, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moetier.cli", *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def workers(tmp_path):
    """start(model, *args, listen=...) -> WorkerProcess; all are killed at teardown."""
    started: list[subprocess.Popen] = []

    def start(model, *args, listen: str = "tcp://127.0.0.1:0") -> WorkerProcess:
        log = tmp_path / f"worker{len(started)}.log"
        with open(log, "w") as err:
            proc = subprocess.Popen([sys.executable, "-m", "moetier.cli", "worker", "--listen", listen, "--model", str(model),
                                     "--threads", "1", *map(str, args)], stdout=subprocess.PIPE, stderr=err, text=True)
        started.append(proc)
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else ""
        match = re.search(r"listening on (\S+)", line)
        assert match, f"worker did not start: {line!r} {log.read_text()}"
        return WorkerProcess(proc, match.group(1), log)

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("transport") / "tiny", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.fixture(scope="module")
def checkpoint(tiny):
    return open_checkpoint(tiny)


@pytest.fixture(scope="module")
def lane(checkpoint):
    tier = CpuTier("cpu", HostExperts(checkpoint, checkpoint.spec.moe_layers))
    yield tier
    tier.close()


def quarter(checkpoint) -> dict[int, list[int]]:
    """A quarter of each MoE layer's experts: every fourth id, from a different start per layer."""
    return {l: list(range(i % 4, checkpoint.spec.num_experts, 4)) for i, l in enumerate(checkpoint.spec.moe_layers)}


class SplitExecutor:
    """Each MoE layer's picks held by the remote tier go to it in one RUN; the rest to the CPU lane.

    `sent(calls)`, if given, runs after each layer's RUN went out, before its reply is awaited.
    """

    def __init__(self, remote: RemoteTier, lane: CpuTier, sent=None):
        self.remote, self.lane, self.sent, self.calls = remote, lane, sent, 0

    def dispatch(self, layer, x, decision):
        self.calls += 1
        held = self.remote.holds(layer)
        remote_jobs, local_jobs = [], []
        for expert, rows, weights in group_by_expert(decision.picks, decision.weights):
            (remote_jobs if expert in held else local_jobs).append(ExpertJob(expert, rows, weights))
        future = self.remote.submit(layer, x, remote_jobs)
        if self.sent is not None:
            self.sent(self.calls)
        local = self.lane.compute(layer, x, local_jobs) if local_jobs else torch.zeros_like(x)  # [T, D]
        return Partials(local + future.result())


# -- protocol, in process -----------------------------------------------------------------------


def _round_trip(message, decode=P.decode_request):
    frames = [bytes(f) if not isinstance(f, bytes) else f for f in P.encode(42, message)]
    request_id, back = decode(frames)
    assert request_id == 42 and type(back) is type(message)
    return back


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 5), d=st.integers(1, 9), m=st.integers(0, 4), dtype=st.sampled_from(["f32", "bf16", "f16"]), layer=st.integers(0, 2**20))
def test_run_round_trip_keeps_every_field(n, d, m, dtype, layer):
    x = torch.randn(n, d).to(P.DTYPES[dtype])
    counts = tuple(range(1, m + 1))
    rows = torch.randint(0, max(n, 1), (sum(counts),), dtype=torch.int32)
    run = P.Run(layer, tuple(range(m)), counts, x, rows, torch.rand(sum(counts)))
    back = _round_trip(run)
    assert (back.layer, back.experts, back.counts) == (layer, run.experts, counts)
    assert back.x.dtype == x.dtype and torch.equal(back.x, x) and torch.equal(back.rows, rows) and torch.equal(back.weights, run.weights)


def test_every_command_round_trips():
    assert [int(c) for c in P.Command] == [1, 2, 3, 4, 5, 6, 7]  # values never change
    assert _round_trip(P.Hello("abc", "me")) == P.Hello("abc", "me")
    assert torch.equal(_round_trip(P.Load(torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))).pairs, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32))
    assert torch.equal(_round_trip(P.Ping(torch.arange(10, dtype=torch.uint8))).payload, torch.arange(10, dtype=torch.uint8))
    assert _round_trip(P.Stats()) == P.Stats() and _round_trip(P.Bye()) == P.Bye()
    hello = P.HelloReply("fp", "w", "torch", ("f32",), 64, 16, (0, 1, 2), 1 << 20)
    assert _round_trip(hello, P.decode_reply) == hello
    assert _round_trip(P.LoadReply(3, 999), P.decode_reply) == P.LoadReply(3, 999)
    assert _round_trip(P.StatsReply({"a": 1, "b": "x"}), P.decode_reply).stats == {"a": 1, "b": "x"}
    assert _round_trip(P.ErrorReply(P.ErrorCode.NOT_LOADED, "no"), P.decode_reply) == P.ErrorReply(P.ErrorCode.NOT_LOADED, "no")
    y = torch.randn(3, 8)
    assert torch.equal(_round_trip(P.RunReply(y, 12.5), P.decode_reply).y, y)


def _frames(header: dict, *tensors: bytes) -> list[bytes]:
    return P.pack(header, list(tensors))


V = P.PROTOCOL_VERSION


@pytest.mark.parametrize("frames, code", [
    ([b"\xc1garbage"], P.ErrorCode.BAD_FRAME),
    ([b""], P.ErrorCode.BAD_FRAME),
    ([], P.ErrorCode.BAD_FRAME),
    ([b"\x05\0\0\0\x80"], P.ErrorCode.BAD_FRAME),  # a header length past the frame's end
    (_frames([1, 2, 3]), P.ErrorCode.BAD_FRAME),
    (_frames({"v": 99, "c": 4, "id": 1, "t": [["u8", [1]]]}, b"x"), P.ErrorCode.BAD_VERSION),
    (_frames({"v": V, "c": 77, "id": 1}), P.ErrorCode.UNKNOWN_COMMAND),
    (_frames({"v": V, "c": 7, "id": 1}), P.ErrorCode.UNKNOWN_COMMAND),  # ERROR is never a request
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [4]]]}), P.ErrorCode.BAD_TENSOR),  # truncated: a small tensor's bytes missing
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [P.INLINE_MAX_BYTES]]]}), P.ErrorCode.BAD_FRAME),  # a large tensor's frame missing
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [1]]]}, b"x") + [b"y"], P.ErrorCode.BAD_FRAME),  # an extra frame
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [1]]]}, b"xy"), P.ErrorCode.BAD_TENSOR),  # an extra byte in frame 0
    (_frames({"v": V, "c": 4, "id": 1, "t": [["f32", [1]]]}, b"abcd"), P.ErrorCode.BAD_TENSOR),  # wrong dtype
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [5]]]}, b"abcd"), P.ErrorCode.BAD_TENSOR),  # shape vs bytes
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [2**40]]]}, b"abcd"), P.ErrorCode.BAD_TENSOR),
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [2**30, 2**30]]]}, b"abcd"), P.ErrorCode.BAD_TENSOR),
    (_frames({"v": V, "c": 4, "id": 1, "t": [["u8", [2**28]]]}, b"abcd"), P.ErrorCode.TOO_LARGE),
    ([(P.MAX_HEADER_BYTES + 1).to_bytes(4, "little") + b"\x80" + b"\0" * P.MAX_HEADER_BYTES], P.ErrorCode.TOO_LARGE),
    (_frames({"v": V, "c": 1, "id": -1, "fingerprint": "x", "client": ""}), P.ErrorCode.BAD_FRAME),
    (_frames({"v": V, "c": 1, "id": 1, "fingerprint": 5, "client": ""}), P.ErrorCode.BAD_FRAME),
    (_frames({"v": V, "c": 3, "id": 1, "layer": 0, "experts": [1], "counts": [2], "t": [["f32", [1, 1]], ["i32", [1]], ["f32", [1]]]},
             b"\0" * 4, b"\0" * 4, b"\0" * 4), P.ErrorCode.BAD_TENSOR),
])
def test_bad_messages_are_refused_with_a_code(frames, code):
    with pytest.raises(P.ProtocolError) as err:
        P.decode_request(frames, max_message_bytes=2**20)
    assert err.value.code == code


def test_msgpack_ext_and_bin_are_refused():
    import msgpack

    for header in ({"v": V, "c": 5, "id": 1, "x": msgpack.ExtType(1, b"obj")}, {"v": V, "c": 5, "id": 1, "x": b"raw"}):
        packed = msgpack.packb(header, use_bin_type=True)
        with pytest.raises(P.ProtocolError):
            P.decode_request([len(packed).to_bytes(4, "little") + packed])


def test_worker_handles_sessions_ranges_and_computes_like_the_lane(checkpoint, lane):
    worker = ExpertWorker(checkpoint)
    call = lambda me, message: P.decode_reply(worker.handle(me, [bytes(f) for f in P.encode(9, message)]))[1]  # noqa: E731
    x = torch.randn(3, checkpoint.spec.hidden_size)
    run = P.Run(1, (2, 5), (2, 1), x, torch.tensor([0, 2, 1], dtype=torch.int32), torch.tensor([0.5, 0.25, 1.0]))
    assert call(b"a", run).code == P.ErrorCode.NO_SESSION
    assert call(b"a", P.Hello("not-this-model")).code == P.ErrorCode.BAD_FINGERPRINT
    assert isinstance(call(b"a", P.Hello(checkpoint.fingerprint)), P.HelloReply)
    assert call(b"a", P.Load(torch.tensor([[1, 99]], dtype=torch.int32))).code == P.ErrorCode.OUT_OF_RANGE
    assert call(b"a", run).code == P.ErrorCode.NOT_LOADED
    assert call(b"a", P.Load(torch.tensor([[1, 2], [1, 5]], dtype=torch.int32))).held == 2
    assert call(b"b", run).code == P.ErrorCode.NO_SESSION  # sessions are per connection
    reply = call(b"a", run)
    expected = lane.compute(1, x, [ExpertJob(2, torch.tensor([0, 2]), torch.tensor([0.5, 0.25])), ExpertJob(5, torch.tensor([1]), torch.tensor([1.0]))])
    assert torch.allclose(reply.y, expected, atol=1e-6)
    bad_rows = P.Run(1, (2,), (1,), x, torch.tensor([7], dtype=torch.int32), torch.ones(1))
    assert call(b"a", bad_rows).code == P.ErrorCode.OUT_OF_RANGE
    assert call(b"a", P.Run(1, (2, 2), (1, 1), x, torch.zeros(2, dtype=torch.int32), torch.ones(2))).code == P.ErrorCode.BAD_FRAME
    assert call(b"a", P.Stats()).stats["held_experts"] == 2


def test_lan_speedup_model_on_the_seed_figures():
    out = lan_speedup(167.0, 42, 1000 / 18.6, 33.1, 11.6)
    assert out["round_trips_ms_per_token"] == pytest.approx(7.014)
    assert 1.0 < out["serial_speedup"] < out["best_speedup"] < 1.4  # below the seed's bar either way
    assert lan_speedup(167.0, 42, 50.0, 33.1, 0.0)["best_speedup"] == pytest.approx(1.0)  # nothing waits on the lane


def test_loopback_rule():
    assert all(is_loopback(e) for e in ["tcp://127.0.0.1:5", "tcp://localhost:5", "tcp://[::1]:5", "ipc:///tmp/x", "tcp://127.3.2.1:0"])
    assert not any(is_loopback(e) for e in ["tcp://0.0.0.0:5", "tcp://*:5", "tcp://192.168.1.5:5", "tcp://eth0:5", "tcp://[::]:5", "udp://127.0.0.1:5"])
    with pytest.raises(KeysError, match="refusing to listen on tcp://0.0.0.0:5 without --keys"):
        check_listen("tcp://0.0.0.0:5", None)


# -- real worker processes ------------------------------------------------------------------------


def test_non_loopback_bind_without_keys_refuses_to_start(tiny):
    for listen in ("tcp://0.0.0.0:0", "tcp://*:0"):
        result = moetier("worker", "--listen", listen, "--model", tiny)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "refusing to listen" in result.stderr and "--keys" in result.stderr


def test_quarter_of_experts_remote_matches_all_local(checkpoint, lane, workers, tiny):
    worker = workers(tiny)
    remote = RemoteTier("remote", worker.endpoint, checkpoint, quarter(checkpoint), lane, layer_budget_us=2_000_000)
    try:
        ids = np.array(PROMPT * 4)
        expected = score(Engine(checkpoint), ids)
        logits = score(Engine(checkpoint, executor=SplitExecutor(remote, lane)), ids)
        assert np.abs(logits - expected).max() <= 1e-5
        local = generate(Engine(checkpoint), PROMPT, 16)
        split = generate(Engine(checkpoint, executor=SplitExecutor(remote, lane)), PROMPT, 16)
        assert split.ids == local.ids
        assert remote.counts["remote"] >= 16 and not any(k.startswith("fallback") for k in remote.counts)
        assert remote.cost_us(1, 2, 1) > remote.rtt_us > 0
        result = moetier("ping", worker.endpoint, "--count", 20, "--layers", 42, "--json")
        report = json.loads(result.stdout)
        assert [r["bytes"] for r in report["sizes"]] == [64, 4096, 8192]
        assert all(r["min_us"] <= r["median_us"] <= r["p90_us"] <= r["p99_us"] for r in report["sizes"])
        assert report["model"]["round_trips_ms_per_token"] == pytest.approx(42 * report["model"]["rtt_us"] / 1000)
    finally:
        remote.close()
    assert "closed by BYE" in worker.log_text()


def test_pipelined_calls_and_stale_replies_dropped_by_id(checkpoint, lane, workers, tiny):
    worker = workers(tiny)
    pairs = torch.tensor([[0, 1], [0, 2]], dtype=torch.int32)
    with WorkerClient(worker.endpoint, checkpoint.fingerprint, setup=lambda: [P.Load(pairs)], maintain=False) as client:
        xs = [torch.randn(1, checkpoint.spec.hidden_size) for _ in range(6)]
        runs = [P.Run(0, (1 + i % 2,), (1,), x, torch.zeros(1, dtype=torch.int32), torch.ones(1)) for i, x in enumerate(xs)]
        futures = [client.submit(run, 5.0) for run in runs]  # all in flight at once
        futures[2].cancel()
        for i in (5, 4, 3, 1, 0):  # waited on out of order
            expected = lane.compute(0, xs[i], [ExpertJob(1 + i % 2, torch.zeros(1, dtype=torch.int64), torch.ones(1))])
            assert torch.allclose(futures[i].result().y, expected, atol=1e-6)
        client.call(P.Stats(), 5.0)  # by now the cancelled request's reply has come and gone
        assert client.counts["stale_replies"] == 1


def test_sigkill_mid_generation_loses_nothing_and_the_client_comes_back(checkpoint, lane, workers, tiny):
    first = workers(tiny)
    deadline_us = 300_000
    remote = RemoteTier("remote", first.endpoint, checkpoint, quarter(checkpoint), lane, layer_budget_us=deadline_us,
                        backoff_s=(0.05, 0.4), connect_timeout_s=1.0, heartbeat_s=0.2, heartbeat_timeout_s=1.0)
    try:
        expected = generate(Engine(checkpoint), PROMPT, 24)

        def kill_midway(calls):
            if calls == 20:  # decode, a few tokens in, with a RUN in flight
                first.proc.send_signal(signal.SIGKILL)
                first.proc.wait(timeout=10)

        executor = SplitExecutor(remote, lane, sent=kill_midway)
        got = generate(Engine(checkpoint, executor=executor), PROMPT, 24)
        assert first.proc.returncode == -signal.SIGKILL
        assert got.ids == expected.ids
        assert remote.counts["remote"] > 0 and remote.client.counts["suspect"] >= 1
        assert max(remote.fallback_delay_us, default=0.0) <= deadline_us + 100_000  # the deadline bounds the added delay
        served = remote.counts["remote"]
        second = workers(tiny, listen=first.endpoint)  # same address
        for _ in range(200):
            if remote.ready:
                break
            time.sleep(0.05)
        assert remote.ready, remote.client.last_error
        logits = score(Engine(checkpoint, executor=SplitExecutor(remote, lane)), np.array(PROMPT))
        assert np.abs(logits - score(Engine(checkpoint), np.array(PROMPT))).max() <= 1e-5
        assert remote.counts["remote"] > served and remote.client.counts["reconnects"] >= 1
    finally:
        remote.close()
    second.proc.send_signal(signal.SIGTERM)
    assert second.proc.wait(timeout=15) == 0 and "stopped after" in second.log_text()


def _wait_until(condition, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_hung_worker_costs_one_deadline_then_heartbeats_find_it(checkpoint, lane, workers, tiny):
    worker = workers(tiny)
    deadline_us = 200_000
    remote = RemoteTier("remote", worker.endpoint, checkpoint, quarter(checkpoint), lane, layer_budget_us=deadline_us,
                        backoff_s=(0.05, 0.2), connect_timeout_s=0.5, heartbeat_s=0.1, heartbeat_timeout_s=0.3)
    layer = checkpoint.spec.moe_layers[1]
    x = torch.randn(1, checkpoint.spec.hidden_size)
    job = [ExpertJob(quarter(checkpoint)[layer][0], torch.zeros(1, dtype=torch.int64), torch.ones(1))]
    try:
        assert torch.allclose(remote.submit(layer, x, job).result(), lane.compute(layer, x, job), atol=1e-6)
        worker.proc.send_signal(signal.SIGSTOP)  # hung: the connection stays up, nothing answers
        begin = time.perf_counter()
        out = remote.submit(layer, x, job).result()
        waited_us = (time.perf_counter() - begin) * 1e6
        assert torch.allclose(out, lane.compute(layer, x, job), atol=1e-6)  # recomputed on the lane
        assert waited_us <= deadline_us + 100_000 and sum(v for k, v in remote.counts.items() if k.startswith("fallback")) == 1
        assert not remote.ready and remote.holds(layer) == frozenset() and remote.cost_us(layer, 1, 1) == float("inf")
        worker.proc.send_signal(signal.SIGCONT)
        assert _wait_until(lambda: remote.ready, 10), remote.client.last_error
        worker.proc.send_signal(signal.SIGSTOP)  # idle this time: only the heartbeat can notice
        assert _wait_until(lambda: not remote.ready, 2), "heartbeats did not notice a hung worker"
        assert "deadline" in remote.client.last_error
        worker.proc.send_signal(signal.SIGCONT)
        assert _wait_until(lambda: remote.ready, 10), remote.client.last_error
    finally:
        worker.proc.send_signal(signal.SIGCONT)
        remote.close()


def test_curve_admits_only_listed_client_keys(checkpoint, workers, tiny, tmp_path):
    keys = tmp_path / "keys"
    result = moetier("keys", "gen", keys)
    assert result.returncode == 0, result.stderr
    assert (keys / "worker.key_secret").stat().st_mode & 0o077 == 0
    worker = workers(tiny, "--keys", keys)
    with WorkerClient(worker.endpoint, checkpoint.fingerprint, keys=keys, maintain=False) as client:
        assert client.call(P.Stats(), 5.0).stats["sessions"] == 1  # a listed key gets service

    def served(socket: zmq.Socket) -> bool:
        socket.linger = 0
        # a refused handshake tears the connection down; a send that falls between teardown and the
        # next reconnect has no pipe and would block a DEALER forever: refused either way
        socket.sndtimeo = 1500
        socket.connect(worker.endpoint)
        try:
            socket.send_multipart(P.encode(1, P.Ping(torch.zeros(8, dtype=torch.uint8))), copy=False)
            answered = socket.poll(1500)
        except zmq.Again:
            answered = 0
        socket.close()
        return bool(answered)

    context = zmq.Context.instance()
    assert not served(context.socket(zmq.DEALER))  # plaintext
    stranger = context.socket(zmq.DEALER)
    stranger.curve_publickey, stranger.curve_secretkey = zmq.curve_keypair()
    stranger.curve_serverkey = (keys / "worker.key").read_text().split('public-key = "')[1].split('"')[0].encode()
    assert not served(stranger)  # a key the worker does not list

    other = tmp_path / "other"
    moetier("keys", "gen", other)
    (other / "worker.key").write_bytes((keys / "worker.key").read_bytes())  # right worker, unlisted client key
    with pytest.raises(TransportError, match="refused our CurveZMQ key"):
        WorkerClient(worker.endpoint, checkpoint.fingerprint, keys=other, maintain=False, connect_timeout_s=3.0)
    assert "refused at the handshake" in worker.log_text()
    (keys / "client.key_secret").chmod(0o644)
    with pytest.raises(KeysError, match="readable by other users"):
        WorkerClient(worker.endpoint, checkpoint.fingerprint, keys=keys, maintain=False)
