"""Remote-worker commands: `moetier worker`, `moetier keys gen`, `moetier ping`, `moetier launch`.

Thin like the rest of the CLI: parse, call the transport, print a table or
one JSON object; expected failures exit 2 with one line. pyzmq and the
transport are imported only when a command runs. `ping` also says whether
expert parallelism over the measured link would pay (moetier.sim.lan).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Optional

import typer

from moetier.cli.common import UsageError, console, errors_to_exit, set_torch_threads


def _percentiles(samples_us: list[float]) -> dict:
    import numpy as np

    values = np.asarray(samples_us)
    return {"median_us": float(np.median(values)), "p90_us": float(np.percentile(values, 90)),
            "p99_us": float(np.percentile(values, 99)), "min_us": float(values.min())}


def _check_link_model(layers: int | None, bar: float, token_ms: float, cpu_lane_ms: float, cpu_wait_ms: float, remote_speed: float) -> None:
    """`ping`'s inputs to the LAN model (moetier.sim.lan), refused before connecting when it could not use them."""
    if layers is not None and layers < 1:
        raise UsageError(f"--layers is {layers} (expected >= 1)")
    for flag, value in (("--bar", bar), ("--token-ms", token_ms), ("--cpu-lane-ms", cpu_lane_ms), ("--remote-speed", remote_speed)):
        if not (0 < value < float("inf")):
            raise UsageError(f"{flag} is {value} (expected a finite number > 0)")
    if not 0 <= cpu_wait_ms < token_ms:
        raise UsageError(f"--cpu-wait-ms is {cpu_wait_ms} (expected a number in [0, --token-ms {token_ms}))")


@errors_to_exit
def worker(
    listen: str = typer.Option("tcp://127.0.0.1:5555", help="ZeroMQ endpoint to bind, tcp://HOST:PORT (port 0: any free port)"),
    model: Optional[Path] = typer.Option(None, help="HF model folder or GGUF file (its own copy); default: the built-in model"),
    backend: str = typer.Option("torch", help="expert backend: torch, numpy, or an entry point"),
    keys: Optional[Path] = typer.Option(None, help="key folder from `moetier keys gen`: CurveZMQ, listed clients only"),
    threads: Optional[int] = typer.Option(None, help="torch CPU threads"),
    max_message_mb: float = typer.Option(64.0, help="largest message accepted, MiB of tensors"),
    name: Optional[str] = typer.Option(None, help="name in logs and HELLO; default host:pid"),
):
    """Serve experts to remote tiers: hold what clients LOAD, compute what they RUN (stop with SIGTERM or Ctrl-C)."""
    import zmq

    from moetier.model import open_checkpoint
    from moetier.transport.keys import check_listen
    from moetier.transport.worker import ExpertWorker, serve

    check_listen(listen, keys, what="--listen")  # refuse before loading anything
    set_torch_threads(threads)
    if max_message_mb <= 0:
        raise UsageError(f"--max-message-mb is {max_message_mb} (expected > 0)")
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s moetier worker: %(message)s")
    from moetier.model.builtin import builtin_model

    expert_worker = ExpertWorker(open_checkpoint(model if model is not None else builtin_model()), backend, name,
                                 max_message_bytes=int(max_message_mb * 2**20))
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    try:
        serve(expert_worker, listen, keys, stop, on_ready=lambda endpoint: print(f"moetier worker: listening on {endpoint}", flush=True))
    except zmq.ZMQError as err:
        raise UsageError(f"cannot listen on {listen}: {err}") from None


keys_app = typer.Typer(no_args_is_help=True, help="CurveZMQ key pairs for workers and their clients.")


@keys_app.command("gen")
@errors_to_exit
def gen(
    folder: Path = typer.Argument(..., help="folder for the keys (created; a worker pair already there is kept)"),
    client: str = typer.Option("client", help="name of the client key pair to add"),
):
    """Make a worker key pair and a client key pair; the worker admits the client."""
    from moetier.transport.keys import generate

    paths = generate(folder, client)
    console.print(f"worker keys  {paths['worker_secret']} (stays on the worker host; run `moetier worker --keys {folder}`)", highlight=False)
    console.print(f"client keys  {paths['client_secret']} (copy it and {paths['worker_public']} to the client host)", highlight=False)
    console.print(f"admitted     {paths['authorized']}", highlight=False)


@errors_to_exit
def ping(
    address: str = typer.Argument(..., help="worker endpoint, tcp://HOST:PORT"),
    sizes: str = typer.Option("64,4096,8192", help="payload sizes in bytes"),
    count: int = typer.Option(200, help="round trips per size (after 20 warm-up ones)"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object"),
    model: Optional[Path] = typer.Option(None, help="model folder or GGUF file: its MoE layers and a float32 hidden state's bytes"),
    layers: Optional[int] = typer.Option(None, help="MoE layers per token (without --model); the largest size is the hidden state"),
    bar: float = typer.Option(1.4, help="speedup that would justify building expert parallelism"),
    token_ms: float = typer.Option(53.76, help="ms per token now (seed: 18.6 tok/s)"),
    cpu_lane_ms: float = typer.Option(33.1, help="CPU-lane work per token, ms (seed: 33.1)"),
    cpu_wait_ms: float = typer.Option(11.6, help="ms per token the critical path waits for the CPU lane (seed: 11.6)"),
    remote_speed: float = typer.Option(1.0, help="remote host's expert speed relative to the local CPU lane"),
    keys: Optional[Path] = typer.Option(None, help="key folder for a CurveZMQ worker"),
    client: str = typer.Option("client", help="client key pair name in --keys"),
):
    """Round-trip times to a worker per payload size, and whether remote experts would pay over that link."""
    import torch

    from moetier.sim.lan import lan_speedup
    from moetier.transport.client import TransportError, WorkerClient
    from moetier.transport.protocol import DEFAULT_MAX_MESSAGE_BYTES, Ping

    try:
        size_list = [int(part) for part in sizes.split(",") if part.strip()]
    except ValueError:
        raise UsageError(f"--sizes {sizes!r} is not a comma-separated list of byte counts") from None
    # before anything is allocated: a payload over the message limit would be refused by the worker anyway
    if not size_list or not all(0 <= size <= DEFAULT_MAX_MESSAGE_BYTES for size in size_list):
        raise UsageError(f"--sizes {sizes!r}: expected byte counts in 0-{DEFAULT_MAX_MESSAGE_BYTES} (the protocol's message limit)")
    if count < 1:
        raise UsageError(f"--count is {count} (expected >= 1)")
    _check_link_model(layers, bar, token_ms, cpu_lane_ms, cpu_wait_ms, remote_speed)
    layer_count, hidden_bytes = layers, max(size_list)
    if model is not None:
        from moetier.model import open_checkpoint

        spec = open_checkpoint(model).spec
        layer_count, hidden_bytes = len(spec.moe_layers), spec.hidden_size * 4
        size_list = sorted(set(size_list) | {hidden_bytes})
    try:
        link = WorkerClient(address, None, keys, client, name="moetier-ping", maintain=False, connect_timeout_s=5.0)
    except TransportError as err:
        raise UsageError(str(err)) from None
    rows = []
    try:
        for size in size_list:
            payload = torch.zeros(size, dtype=torch.uint8)
            samples = []
            for i in range(count + 20):
                begin = time.perf_counter()
                link.call(Ping(payload), 5.0)
                if i >= 20:
                    samples.append((time.perf_counter() - begin) * 1e6)
            rows.append({"bytes": size, "count": count, **_percentiles(samples)})
    except TransportError as err:
        raise UsageError(str(err)) from None
    finally:
        link.close()
    report: dict = {"address": address, "sizes": rows}
    if layer_count is not None:
        rtt_us = next(r["median_us"] for r in rows if r["bytes"] == hidden_bytes)
        inputs = {"layers": layer_count, "hidden_bytes": hidden_bytes, "rtt_us": rtt_us, "token_ms": token_ms,
                  "cpu_lane_ms": cpu_lane_ms, "cpu_wait_ms": cpu_wait_ms, "remote_speed": remote_speed, "bar": bar}
        model_out = lan_speedup(rtt_us, layer_count, token_ms, cpu_lane_ms, cpu_wait_ms, remote_speed)
        report["model"] = {**inputs, **model_out, "clears_bar": model_out["best_speedup"] >= bar}
    if as_json:
        print(json.dumps(report))
        return
    from rich.table import Table

    table = Table("bytes", "count", "median us", "p90 us", "p99 us", "min us", title=f"round trips to {address}")
    for r in rows:
        table.add_row(str(r["bytes"]), str(r["count"]), f"{r['median_us']:.1f}", f"{r['p90_us']:.1f}", f"{r['p99_us']:.1f}", f"{r['min_us']:.1f}")
    console.print(table)
    if "model" in report:
        m = report["model"]
        console.print(f"{m['layers']} MoE layers x {m['rtt_us']:.0f} us ({m['hidden_bytes']} B hidden state) = "
                      f"{m['round_trips_ms_per_token']:.2f} ms/token of round trips", highlight=False)
        verdict = "clears" if m["clears_bar"] else "is below"
        console.print(f"modelled speedup of moving CPU-lane work there: best case {m['best_speedup']:.2f}x, round trips "
                      f"serial {m['serial_speedup']:.2f}x; the best case {verdict} the {bar:.2f}x bar", highlight=False)


@errors_to_exit
def launch(
    file: Path = typer.Argument(..., help="cluster.toml with kind = \"remote\" tiers"),
    model: Optional[Path] = typer.Option(None, help="model folder or GGUF file on the worker hosts (default: the layout's model)"),
    logs: Optional[Path] = typer.Option(None, help="folder for each worker's log"),
    ready_timeout_s: float = typer.Option(120.0, help="seconds to wait for each worker's HELLO"),
):
    """Start every remote worker of a layout (local ones as child processes, others through their host's ssh)."""
    from moetier.config import load_layout
    from moetier.transport.launch import LaunchError, launch as start_all

    if not 0 < ready_timeout_s < float("inf"):
        raise UsageError(f"--ready-timeout-s is {ready_timeout_s} (expected a finite number of seconds > 0)")
    layout = load_layout(file)
    from moetier.model.builtin import builtin_model

    folder = model or layout.model_path() or builtin_model()
    if not any(t.kind == "remote" for t in layout.tiers):
        raise UsageError(f"{file}: no tier of kind \"remote\" (nothing to launch)")
    if logs is not None:
        logs.mkdir(parents=True, exist_ok=True)
    try:
        handles = start_all(layout, folder, logs, ready_timeout_s)
    except LaunchError as err:
        raise UsageError(str(err)) from None
    stop = []  # Ctrl-C and SIGTERM only raise this flag, so no signal lands mid-cleanup
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    for handle in handles:
        console.print(f"worker {handle.name} listening on {handle.address} (pid {handle.process.pid})", highlight=False)
    console.print("all workers answered HELLO; Ctrl-C stops them", highlight=False)
    try:
        while not stop and all(h.process.poll() is None for h in handles):
            time.sleep(0.2)
    finally:
        for handle in handles:
            code = handle.stop()
            console.print(f"worker {handle.name} stopped (exit {code})", highlight=False)
