"""Slow transport tests: a worker under generated bad input, and under load from several processes.

Fuzz: well over 1,000 hypothesis-generated bad messages (random bytes,
truncated and extra frames, wrong version, wrong fingerprint, wrong dtype or
shape, oversize headers and tensors, out-of-range ids, flipped header bytes)
against one real worker process: it never dies, its RSS stays bounded, and
every message whose frames are within the size limit gets a reply (an ERROR,
or a valid reply when the mutation left a valid request); larger ones are
dropped by ZeroMQ. Load: 4 client processes x 500 pipelined RUNs against one
worker; every reply matches its own request's expected result.
"""

from __future__ import annotations

import json
import math
import re
import select
import subprocess
import sys
import textwrap
from pathlib import Path

import msgpack
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.transport import wire
from moetier.transport import protocol as P

pytestmark = pytest.mark.slow
LIMIT_BYTES = 2**20  # the worker runs with --max-message-mb 1


def start_worker(model: Path, log: Path, *args) -> tuple[subprocess.Popen, str]:
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "moetier.cli", "worker", "--listen", "tcp://127.0.0.1:0", "--model", str(model),
                                 "--threads", "1", *map(str, args)], stdout=subprocess.PIPE, stderr=err, text=True)
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    match = re.search(r"listening on (\S+)", proc.stdout.readline() if ready else "")
    if not match:
        proc.kill()
        raise AssertionError(f"worker did not start: {log.read_text()}")
    return proc, match.group(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("fuzz") / "tiny", arch="qwen3_moe", preset="tiny", seed=1)


@pytest.fixture(scope="module")
def worker(tiny, tmp_path_factory):
    proc, endpoint = start_worker(tiny, tmp_path_factory.mktemp("fuzzlog") / "worker.log", "--max-message-mb", 1)
    yield proc, endpoint
    proc.kill()
    proc.wait(timeout=10)


def rss_bytes(pid: int) -> int:
    text = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", text).group(1)) * 1024


# -- generated bad input ------------------------------------------------------------------------------

def _valid(spec, fingerprint: str) -> dict[str, list[bytes]]:
    d, layer = spec.hidden_size, spec.moe_layers[0]
    run = P.Run(layer, (0, 1), (1, 1), torch.randn(1, d), torch.zeros(2, dtype=torch.int32), torch.ones(2))
    messages = {"hello": P.Hello(fingerprint, "fuzz"), "load": P.Load(torch.tensor([[layer, 0], [layer, 1]], dtype=torch.int32)),
                "run": run, "ping": P.Ping(torch.arange(16, dtype=torch.uint8)), "stats": P.Stats()}
    return {name: [bytes(f) for f in P.encode(7, m)] for name, m in messages.items()}


def _split(frames: list[bytes]) -> tuple[dict, list[bytes]]:
    """The header and the tensors' bytes of a well-formed message (the inverse of P.pack)."""
    raw = frames[0]
    length = int.from_bytes(raw[:4], "little")
    header, tensors, at, large = msgpack.unpackb(raw[4 : 4 + length]), [], 4 + length, iter(frames[1:])
    for dtype, shape in header.get("t", []):
        nbytes = math.prod(shape) * P.DTYPES[dtype].itemsize
        if nbytes < P.INLINE_MAX_BYTES:
            at += -at % 8
            tensors.append(raw[at : at + nbytes])
            at += nbytes
        else:
            tensors.append(next(large))
    return header, tensors


def _mutate(frames: list[bytes], kind: str, data, spec) -> list[bytes]:
    header, tensors = _split(frames)
    if kind == "truncate":
        return frames[: data.draw(st.integers(1, max(1, len(frames) - 1)))] if len(frames) > 1 else [frames[0][: data.draw(st.integers(0, len(frames[0]) - 1))]]
    if kind == "extra":
        return frames + data.draw(st.lists(st.binary(max_size=64), min_size=1, max_size=3))
    if kind == "version":
        header["v"] = data.draw(st.one_of(st.integers(-5, 1000).filter(lambda v: v != P.PROTOCOL_VERSION), st.text(max_size=4), st.none()))
    elif kind == "fingerprint":
        header.update(c=int(P.Command.HELLO), fingerprint=data.draw(st.text(max_size=40)), client="x")
        header.pop("t", None)
        tensors = []
    elif kind == "dtype" and header.get("t"):
        i = data.draw(st.integers(0, len(header["t"]) - 1))
        header["t"][i][0] = data.draw(st.sampled_from(["f64", "i8", "u8", "f32", "bf16", "i64", "", "f32 "]))
    elif kind == "shape" and header.get("t"):
        i = data.draw(st.integers(0, len(header["t"]) - 1))
        header["t"][i][1] = data.draw(st.lists(st.integers(-3, 2**62), max_size=5))
    elif kind == "ids" and header["c"] == P.Command.RUN:
        header.update(layer=data.draw(st.integers(-2, 2**33)), experts=data.draw(st.lists(st.integers(-2, 2**33), min_size=2, max_size=2)))
    elif kind == "ids" and header["c"] == P.Command.LOAD:
        tensors = [torch.tensor(data.draw(st.lists(st.integers(-2**31, 2**31 - 1), min_size=2, max_size=2)) * 2, dtype=torch.int32).numpy().tobytes()]
    elif kind == "field":
        key = data.draw(st.sampled_from(sorted(header)))
        header[key] = data.draw(st.one_of(st.none(), st.booleans(), st.floats(allow_nan=True), st.text(max_size=8), st.lists(st.integers(-2**63, 2**64 - 1), max_size=3)))
    elif kind == "flip":
        raw = bytearray(frames[0])
        for _ in range(data.draw(st.integers(1, 4))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        return [bytes(raw), *frames[1:]]
    elif kind == "big_header":
        header["pad"] = "x" * data.draw(st.integers(P.MAX_HEADER_BYTES, 4 * P.MAX_HEADER_BYTES))
    elif kind == "big_tensors":  # within the frame limit each, over the message limit together
        header = {"v": P.PROTOCOL_VERSION, "c": int(P.Command.RUN), "id": 7, "layer": spec.moe_layers[0], "experts": [0], "counts": [LIMIT_BYTES // 8],
                  "t": [["f32", [LIMIT_BYTES // 4 // spec.hidden_size, spec.hidden_size]], ["i32", [LIMIT_BYTES // 8]], ["f32", [LIMIT_BYTES // 8]]]}
        tensors = [b"\0" * (LIMIT_BYTES // 4 // spec.hidden_size * spec.hidden_size * 4), b"\0" * (LIMIT_BYTES // 2), b"\0" * (LIMIT_BYTES // 2)]
    elif kind == "oversize_frame":  # one frame over the limit: ZeroMQ drops the connection
        tensors = [b"\0" * (LIMIT_BYTES + data.draw(st.integers(1, 4096)))]
    return P.pack(header, tensors)


KINDS = ["random", "truncate", "extra", "version", "fingerprint", "dtype", "shape", "ids", "field", "flip", "big_header", "big_tensors", "oversize_frame"]
WEIGHTS = [12, 10, 10, 8, 8, 10, 10, 10, 10, 12, 3, 3, 1]


class Prober:
    """A DEALER with a fresh HELLO before each case (a case may be BYE, or get the connection dropped)."""

    def __init__(self, endpoint: str, fingerprint: str):
        self.endpoint, self.fingerprint = endpoint, fingerprint
        self.socket = None
        self.stats = {"replies": 0, "errors": 0, "dropped": 0}

    def _fresh(self) -> None:
        if self.socket is not None:
            self.socket.close(linger=0)
        self.socket = zmq.Context.instance().socket(zmq.DEALER)
        self.socket.linger = 0
        self.socket.connect(self.endpoint)

    def send(self, frames: list[bytes], timeout_ms: int) -> list | None:
        self.socket.send_multipart(frames, copy=False)
        return self.socket.recv_multipart() if self.socket.poll(timeout_ms) else None

    def case(self, frames: list[bytes]) -> None:
        if self.socket is None:
            self._fresh()
        hello = self.send(P.encode(1, P.Hello(self.fingerprint, "fuzz")), 5000)
        assert hello is not None and isinstance(P.decode_reply(hello)[1], P.HelloReply)
        oversize = any(len(f) > LIMIT_BYTES for f in frames)
        reply = self.send(frames, 300 if oversize else 5000)
        if reply is None:
            assert oversize, f"no reply to a message within the limits: {[f[:40] for f in frames]}"
            self.stats["dropped"] += 1
            self._fresh()
            return
        _, message = P.decode_reply(reply)  # always a well-formed reply
        self.stats["replies"] += 1
        self.stats["errors"] += isinstance(message, P.ErrorReply)


def test_worker_survives_generated_bad_input(tiny, worker):
    proc, endpoint = worker
    checkpoint = open_checkpoint(tiny)
    valid = _valid(checkpoint.spec, checkpoint.fingerprint)
    prober = Prober(endpoint, checkpoint.fingerprint)
    for name in valid:  # warm up: every path once, so the RSS baseline includes loaded code and experts
        prober.case(valid[name])
    baseline = rss_bytes(proc.pid)
    cases = []

    @settings(max_examples=1300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(data=st.data())
    def case(data):
        kind = data.draw(st.sampled_from([k for k, w in zip(KINDS, WEIGHTS) for _ in range(w)]))
        if kind == "random":
            frames = data.draw(st.lists(st.binary(max_size=512), min_size=1, max_size=5))
        else:
            frames = _mutate(valid[data.draw(st.sampled_from(sorted(valid)))], kind, data, checkpoint.spec)
        prober.case(frames)
        assert proc.poll() is None, "the worker died"
        cases.append(kind)

    case()
    grown_mb = (rss_bytes(proc.pid) - baseline) / 2**20
    assert len(cases) >= 1000 and prober.stats["errors"] + prober.stats["dropped"] >= 1000
    assert proc.poll() is None and grown_mb < 64, f"RSS grew by {grown_mb:.1f} MiB"
    prober._fresh()
    prober.send(P.encode(1, P.Hello(checkpoint.fingerprint, "fuzz")), 5000)
    stats = P.decode_reply(prober.send(valid["stats"], 5000))[1].stats  # still serving
    if wire.wire() is not None:  # the C loop stood in front of the Python decoder for these cases
        assert stats.get("fast_runs", 0) >= 1, stats
    print(f"fuzz: {len(cases)} cases, {prober.stats}, RSS {baseline / 2**20:.0f} MiB -> +{grown_mb:.1f} MiB, "
          f"{stats.get('fast_runs', 0)} RUNs served in C")


# -- load --------------------------------------------------------------------------------------------------

CLIENT = textwrap.dedent("""
    import json, random, sys, torch
    from moetier.model import open_checkpoint
    from moetier.tiers.base import ExpertJob
    from moetier.tiers.cpu import CpuTier
    from moetier.tiers.host_experts import HostExperts
    from moetier.transport import protocol as P
    from moetier.transport.client import WorkerClient

    endpoint, model, seed, calls = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    checkpoint = open_checkpoint(model)
    spec = checkpoint.spec
    lane = CpuTier("cpu", HostExperts(checkpoint, spec.moe_layers))
    pairs = torch.tensor([[l, e] for l in spec.moe_layers for e in range(spec.num_experts)], dtype=torch.int32)
    client = WorkerClient(endpoint, checkpoint.fingerprint, name=f"load{seed}", setup=lambda: [P.Load(pairs)])
    rng = random.Random(seed)
    torch.manual_seed(seed)
    window, wrong, done = [], 0, 0

    def check(item):
        global wrong, done
        future, expected = item
        wrong += not torch.allclose(future.result(30.0).y, expected, atol=1e-5)
        done += 1

    for i in range(calls):
        layer, n = rng.choice(spec.moe_layers), rng.randint(1, 4)
        experts = rng.sample(range(spec.num_experts), rng.randint(1, 4))
        x = torch.randn(n, spec.hidden_size)
        jobs = [ExpertJob(e, torch.tensor(sorted(rng.sample(range(n), rng.randint(1, n)))), torch.rand(1)) for e in experts]
        jobs = [ExpertJob(j.expert, j.rows, torch.rand(j.rows.numel())) for j in jobs]
        rows = torch.cat([j.rows for j in jobs]).to(torch.int32)
        run = P.Run(layer, tuple(experts), tuple(j.rows.numel() for j in jobs), x, rows, torch.cat([j.weights for j in jobs]))
        window.append((client.submit(run, 30.0), lane.compute(layer, x, jobs)))
        if len(window) == 4:  # four in flight per client
            check(window.pop(0))
    for item in window:
        check(item)
    print(json.dumps({"done": done, "wrong": wrong, **client.counts}))
    client.close()
    lane.close()
""")


def test_four_clients_pipelining_500_runs_each_get_their_own_replies(tiny, worker):
    _, endpoint = worker
    procs = [subprocess.Popen([sys.executable, "-c", CLIENT, endpoint, str(tiny), str(seed), "500"], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in range(4)]
    try:
        results = []
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
    for result in results:
        assert result["done"] == 500 and result["wrong"] == 0
        assert result["stale_replies"] == 0 and result["bad_replies"] == 0 and result["timeouts"] == 0
