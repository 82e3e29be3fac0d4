"""Untrusted input at the transport and at start-up: one line on stderr, exit code 2, nothing left running.

A layout whose remote worker is down, or hung (a plain TCP server that never
speaks; a ZeroMQ peer that never answers HELLO), is refused within the
client's connect timeout; ports out of range are refused wherever an endpoint
is parsed (`worker --listen`, `ping`, a layout's address); `ping` checks its
sizes against the protocol's limit before allocating; `launch` shows a failed
worker's own last lines. Real processes, real sockets on 127.0.0.1; `ping`'s
refusals, all in Python before its client exists, run in this process
(cli_runs.moetier_here).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import zmq

from cli_runs import moetier, moetier_here, refused
from layouts import REMOTE_TIER
from moetier.model import open_checkpoint
from moetier.model.synth import write_synthetic
from moetier.tiers.cpu import CpuTier
from moetier.tiers.host_experts import HostExperts
from moetier.transport import protocol as P
from moetier.transport.client import TransportError
from moetier.transport.keys import EndpointError, check_endpoint, check_listen
from moetier.transport.launch import LaunchError, start_worker

LAYOUT = """[[devices]]
name = "gpu0"
host = "local"
kind = "cuda"
[[parts]]
name = "all"
device = "gpu0"
layers = "0:"
[[tiers]]
name = "cpu"
kind = "cpu"
""" + REMOTE_TIER


def timed(run, *args, **options) -> tuple[subprocess.CompletedProcess, float]:
    """(run(*args), seconds it took): run is moetier or moetier_here."""
    begin = time.monotonic()
    result = run(*args, **options)
    return result, time.monotonic() - begin


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_synthetic(tmp_path_factory.mktemp("untrusted_transport") / "tiny", arch="qwen3_moe", preset="tiny", seed=0)


@pytest.fixture
def silent_tcp():
    """A TCP server on 127.0.0.1 that accepts connections and never sends a byte: port."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.1)
    stop, accepted = threading.Event(), []

    def serve():
        while not stop.is_set():
            try:
                accepted.append(server.accept()[0])
            except (TimeoutError, OSError):
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1]
    stop.set()
    thread.join(timeout=5)
    for connection in accepted:
        connection.close()
    server.close()


def fake_worker(answer):
    """A ZeroMQ ROUTER on 127.0.0.1 in a thread; `answer(request)` -> a reply Message or None (no reply). -> (endpoint, stop)."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.linger = 0
    router.bind("tcp://127.0.0.1:0")
    endpoint = router.last_endpoint.decode()
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, *frames = router.recv_multipart()
            request_id, request = P.decode_request(frames)
            reply = answer(request)
            if reply is not None:
                P.send(router, [identity, *P.encode(request_id, reply)])
        router.close(linger=0)
        context.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()

    def close():
        stop.set()
        thread.join(timeout=5)

    return endpoint, close


# -- 1. a remote tier whose worker is not there at start --------------------------------------------


@pytest.mark.parametrize("worker", ["down", "silent_tcp", "no_hello"])
def test_run_refuses_a_layout_whose_worker_is_down_or_hung_in_one_line(worker, tiny, tmp_path, request):
    close = None
    if worker == "down":
        address = f"tcp://127.0.0.1:{free_port()}"
    elif worker == "silent_tcp":
        address = f"tcp://127.0.0.1:{request.getfixturevalue('silent_tcp')}"
    else:  # speaks ZeroMQ, never answers
        address, close = fake_worker(lambda request: None)
    layout = tmp_path / "layout.toml"
    layout.write_text(LAYOUT.format(address=address))
    try:
        result, elapsed_s = timed(moetier, "run", "--layout", layout, "--model", tiny, "--max-new-tokens", "2", timeout=60)
    finally:
        if close is not None:
            close()
    line = refused(result, str(layout), "[tiers.1]", "'i5'", address)
    assert "5 s" in line or "deadline" in line, line
    assert elapsed_s < 30, elapsed_s  # the connect timeout (5 s) plus start-up, not a hang


def test_a_remote_tier_that_fails_after_connecting_leaves_no_client_behind(tiny):
    """HELLO and LOAD answered, the start-up PINGs never: TransportError, and the client's thread and socket are gone."""
    from moetier.tiers.remote import RemoteTier

    checkpoint = open_checkpoint(tiny)
    spec = checkpoint.spec

    def answer(request):
        if isinstance(request, P.Hello):
            return P.HelloReply(checkpoint.fingerprint, "fake", "torch", ("f32",), spec.hidden_size, spec.num_experts,
                                tuple(spec.moe_layers), P.DEFAULT_MAX_MESSAGE_BYTES)
        if isinstance(request, P.Load):
            return P.LoadReply(int(request.pairs.shape[0]), 0)
        return None

    endpoint, close = fake_worker(answer)
    lane = CpuTier("cpu", HostExperts(checkpoint, spec.moe_layers))
    try:
        with pytest.raises(TransportError):
            RemoteTier("i5", endpoint, checkpoint, {spec.moe_layers[0]: [0, 1]}, lane, layer_budget_us=200_000)
        time.sleep(0.1)
        assert not [t.name for t in threading.enumerate() if t.name.startswith("moetier-client-")]
    finally:
        lane.close()
        close()


# -- 2. ports out of range -----------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:65536", "tcp://127.0.0.1:-1", "tcp://127.0.0.1:",
                                      "tcp://127.0.0.1:x", "tcp://127.0.0.1:0", "tcp://:5555", "127.0.0.1:5555", "udp://127.0.0.1:5",
                                      "tcp://127.0.0.1:" + "9" * 5000])
def test_check_endpoint_refuses_what_zeromq_would_wrap_or_choke_on(endpoint):
    with pytest.raises(EndpointError) as caught:
        check_endpoint(endpoint)
    assert "\n" not in str(caught.value) and len(str(caught.value)) < 400 and "expected" in str(caught.value)


def test_check_endpoint_keeps_good_addresses_and_port_0_to_listen():
    for endpoint in ("tcp://127.0.0.1:1", "tcp://127.0.0.1:65535", "tcp://[::1]:5555", "tcp://worker.lan:5555", "ipc:///tmp/w", "inproc://w"):
        assert check_endpoint(endpoint) == endpoint
    for endpoint in ("tcp://127.0.0.1:0", "tcp://127.0.0.1:*", "tcp://127.0.0.1:5555"):
        check_listen(endpoint, None)
    with pytest.raises(EndpointError, match="0-65535"):
        check_listen("tcp://127.0.0.1:99999", None)


def test_worker_listen_port_out_of_range_is_refused():
    result = moetier("worker", "--listen", "tcp://127.0.0.1:99999", timeout=30)  # it listened on port 34463 before
    line = refused(result, "--listen", "tcp://127.0.0.1:99999", "0-65535")
    assert "listening" not in result.stdout, line


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:99999", "tcp://127.0.0.1:0", "not-an-endpoint"])
def test_ping_refuses_a_bad_address(address):
    result, elapsed_s = timed(moetier_here, "ping", address, "--count", "1")
    refused(result, repr(address), "expected")
    assert elapsed_s < 20  # refused before any connection attempt


def test_run_refuses_a_layout_address_out_of_range(tiny, tmp_path):
    layout = tmp_path / "layout.toml"
    layout.write_text(LAYOUT.format(address="tcp://127.0.0.1:99999"))
    result = moetier("run", "--layout", layout, "--model", tiny, "--max-new-tokens", "2", timeout=60)  # after the lane starts
    refused(result, str(layout), "[tiers.1]", "'i5'", "tcp://127.0.0.1:99999", "1-65535")
    assert "within 5 s" not in result.stderr  # refused as written, not after a connect attempt to port 34463


# -- 3. ping's sizes and counts -----------------------------------------------------------------------


@pytest.mark.parametrize("args, names", [
    (["--sizes", "4000000000"], ["--sizes", str(P.DEFAULT_MAX_MESSAGE_BYTES)]),
    (["--sizes", f"64,{P.DEFAULT_MAX_MESSAGE_BYTES + 1}"], ["--sizes", "message limit"]),
    (["--sizes", "-5"], ["--sizes"]),
    (["--count", "0"], ["--count"]),
    (["--layers", "0"], ["--layers"]),
    (["--remote-speed", "0"], ["--remote-speed"]),
    (["--token-ms", "nan"], ["--token-ms"]),
    (["--cpu-wait-ms", "100"], ["--cpu-wait-ms"]),
])
def test_ping_checks_its_options_before_connecting_or_allocating(args, names):
    address = f"tcp://127.0.0.1:{free_port()}"  # nobody there: a refusal after connecting would say "cannot connect"
    line = refused(moetier_here("ping", address, *args), *names)
    assert "cannot connect" not in line


# -- 4. launch shows a failed worker's own reason ---------------------------------------------------------


@pytest.mark.parametrize("logs", [False, True])
def test_launch_shows_the_failed_workers_last_lines(tmp_path, logs):
    layout = tmp_path / "layout.toml"
    layout.write_text(LAYOUT.format(address="tcp://127.0.0.1:0"))
    extra = ["--logs", tmp_path / "logs"] if logs else []
    result = moetier("launch", layout, "--model", tmp_path / "no-such-model", *extra, "--ready-timeout-s", "60", timeout=60)
    line = refused(result, "'i5'", "exited (code 2)", "its last lines:", str(tmp_path / "no-such-model"))
    assert "within" not in line  # it did not time out: it said why and left
    if logs:
        assert str(tmp_path / "logs" / "worker-i5.log") in line


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_launch_refuses_a_ready_timeout_it_cannot_wait(tmp_path, value):
    layout = tmp_path / "layout.toml"
    layout.write_text(LAYOUT.format(address="tcp://127.0.0.1:0"))
    refused(moetier("launch", layout, "--ready-timeout-s", value, timeout=30), "--ready-timeout-s")


def test_start_worker_joins_the_last_lines_into_one_and_stops_a_silent_worker(tmp_path):
    noisy = [sys.executable, "-c", "import sys\nfor i in range(9): print(f'line {i}', file=sys.stderr)\nsys.exit(3)"]
    with pytest.raises(LaunchError) as caught:
        start_worker("noisy", noisy, ready_timeout_s=30)
    message = str(caught.value)
    assert "\n" not in message and "exited (code 3)" in message
    assert "line 4 | line 5 | line 6 | line 7 | line 8" in message and "line 3" not in message

    pid_file = tmp_path / "pid"
    silent = [sys.executable, "-c", f"import os, sys, time\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
              "print('loading the weights', file=sys.stderr, flush=True)\ntime.sleep(60)"]
    begin = time.monotonic()
    with pytest.raises(LaunchError, match=r"did not start listening within 2 s; its last lines: loading the weights"):
        start_worker("silent", silent, ready_timeout_s=2)
    assert time.monotonic() - begin < 20
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):  # stopped and reaped: nothing left running
        os.kill(pid, 0)


def test_a_layout_refused_while_building_leaves_no_lane_threads(tmp_path):
    """build_runtime as a library call: a tier refused after the CPU lane started closes the lane again."""
    import threading

    from layouts import cache_layout
    from moetier.config import ConfigError, load_layout
    from moetier.engine.runtime import build_runtime
    from moetier.model import open_checkpoint
    from moetier.model.synth import write_synthetic

    checkpoint = open_checkpoint(write_synthetic(tmp_path / "m", arch="qwen3_moe", preset="tiny", seed=0))
    path = tmp_path / "layout.toml"
    path.write_text(cache_layout(policy="static"))  # a static cache without a profile: refused after the lane is up
    before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match="static policy needs a profile"):
        build_runtime(load_layout(path), checkpoint)
    left = [t.name for t in threading.enumerate() if t.name not in before and t.name.startswith("cpu-lane")]
    assert left == []
