"""Start expert workers: one local child process, or every remote tier a layout names.

`start_worker` runs `moetier worker` (locally, or through the ssh prefix of the
host it belongs to), waits for its "listening on ADDRESS" line and then for a
HELLO answered over the wire, and returns a handle that stops it. `launch`
does that for each `kind = "remote"` tier of a layout. Workers always read
their own copy of the weights (`model`: a path on that host); nothing is
shipped. A worker that dies or stays silent is reported in one line and the
ones already started are stopped: nothing is left running half-launched.
The line carries the worker's own last lines (its stderr), joined by " | ".
"""

from __future__ import annotations

import os
import re
import select
import shlex
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from moetier.config import Layout

READY = re.compile(r"listening on (\S+)")
TAIL_LINES, TAIL_BYTES = 5, 16_384  # what a failed worker's error shows of its output


class LaunchError(RuntimeError):
    """A worker that could not be started or did not answer."""


@dataclass
class WorkerHandle:
    name: str
    process: subprocess.Popen
    address: str  # where it listens (the real port when asked for port 0)
    command: list[str]

    def stop(self, timeout_s: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit code."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)
        return self.process.returncode


def worker_command(model: str | Path, listen: str, backend: str = "torch", keys: str | Path | None = None,
                   threads: int | None = None, python: str = sys.executable, ssh: str = "") -> list[str]:
    command = [python, "-m", "moetier.cli", "worker", "--listen", listen, "--model", str(model), "--backend", backend]
    if keys:
        command += ["--keys", str(keys)]
    if threads:
        command += ["--threads", str(threads)]
    return shlex.split(ssh) + command if ssh else command


def start_worker(name: str, command: Sequence[str], ready_timeout_s: float = 120.0, log: Path | None = None,
                 keys: str | Path | None = None) -> WorkerHandle:
    """Start one worker and wait until it listens and answers HELLO; one that does not is stopped, and the
    LaunchError says why in one line, with the last lines the worker wrote (its own reason, usually)."""
    # the worker's stderr goes to its log, or to an unnamed file that vanishes with the worker: read back if it fails
    output = open(log, "w+b") if log is not None else tempfile.TemporaryFile()
    with output:
        try:
            process = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=output, stdin=subprocess.DEVNULL,
                                       text=True, errors="replace")
        except OSError as err:
            raise LaunchError(f"worker {name!r}: cannot run {command[0]!r} ({err.strerror})") from None
        handle = WorkerHandle(name, process, "", list(command))
        printed: deque[str] = deque(maxlen=TAIL_LINES)  # its stdout before the ready line
        deadline = time.monotonic() + ready_timeout_s
        try:
            while not handle.address:
                left = deadline - time.monotonic()
                ready, _, _ = select.select([process.stdout], [], [], max(0.0, left))
                line = process.stdout.readline() if ready else ""
                match = READY.search(line)
                if match:
                    handle.address = match.group(1)
                elif process.poll() is not None or left <= 0 or (ready and not line):
                    silent = process.poll() is None and left <= 0
                    code = handle.stop()
                    what = f"did not start listening within {ready_timeout_s:g} s" if silent else f"exited (code {code}) before listening"
                    raise LaunchError(f"worker {name!r} {what}; {_tail(output, printed, log)}")
                elif line.strip():
                    printed.append(line.strip())
            _wait_for_hello(handle, keys, deadline, output, log)
        except BaseException:
            handle.stop()
            raise
    return handle


def _tail(output, printed: deque[str], log: Path | None) -> str:
    """The last lines a worker wrote to stderr (else to stdout), as one line: "its last lines: A | B"."""
    size = os.fstat(output.fileno()).st_size
    text = os.pread(output.fileno(), TAIL_BYTES, max(0, size - TAIL_BYTES)).decode(errors="replace")  # pread: the worker's offset stays
    lines = [line.strip()[:300] for line in text.splitlines() if line.strip()][-TAIL_LINES:] or list(printed)
    where = f" (log: {log})" if log is not None else ""
    return (f"its last lines: {' | '.join(lines)}" if lines else "it wrote nothing") + where


def _wait_for_hello(handle: WorkerHandle, keys: str | Path | None, deadline: float, output, log: Path | None) -> None:
    from moetier.transport.client import TransportError, WorkerClient

    try:
        # the constructor connects: HELLO (protocol version, capabilities) answered or TransportError
        WorkerClient(handle.address, None, keys=keys, connect_timeout_s=max(1.0, deadline - time.monotonic()), maintain=False).close()
    except TransportError as err:  # the caller stops the worker
        raise LaunchError(f"worker {handle.name!r} at {handle.address} did not answer HELLO: {err}; "
                          f"{_tail(output, deque(), log)}") from None


def launch(layout: Layout, model: str | Path, log_dir: Path | None = None, ready_timeout_s: float = 120.0) -> list[WorkerHandle]:
    """Start a worker for every remote tier of the layout; all or nothing."""
    handles: list[WorkerHandle] = []
    try:
        for tier in layout.tiers:
            if tier.kind != "remote":
                continue
            host = layout.host(tier.host) if tier.host else None
            keys = layout.relative(tier.keys) if tier.keys else None
            command = worker_command(model, tier.address, tier.backend_name, keys, tier.threads,
                                     python=host.python if host and host.ssh else sys.executable, ssh=host.ssh if host else "")
            log = log_dir / f"worker-{tier.name}.log" if log_dir is not None else None
            handles.append(start_worker(tier.name, command, ready_timeout_s, log, keys))
    except BaseException:  # a failed worker, Ctrl-C: none is left running
        for handle in handles:
            handle.stop()
        raise
    return handles
