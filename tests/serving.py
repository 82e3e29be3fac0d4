"""A real `moetier serve` process for tests: started on a free loopback port, its URL read from its first line."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager

URL = re.compile(r"on (http://\S+)/v1")


@contextmanager
def server(*args, timeout_s: float = 120.0):
    """Yields (base URL without /v1, the stderr lines so far); SIGTERM and a wait at the end."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "moetier.cli", "serve", "--port", "0", *map(str, args)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    found = threading.Event()

    def read() -> None:
        for line in proc.stderr:
            lines.append(line)
            if URL.search(line):
                found.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while not found.wait(0.1):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"moetier serve did not start (exit {proc.poll()}):\n{''.join(lines)}")
        yield next(URL.search(line).group(1) for line in lines if URL.search(line)), lines
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def http(url: str, body=None, headers: dict | None = None, timeout: float = 60.0) -> tuple[int, dict]:
    """(status, JSON body) of a GET (body None) or a POST of `body` (bytes as they are, else JSON)."""
    data = None if body is None else body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"content-type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())
