"""The `moetier` command line for tests: as a real process, the same command in this process, and the refusal check.

`moetier(...)` runs `python -m moetier.cli` as a child process: the contract users see (exit status, stdout,
stderr, signals). `moetier_here(...)` runs the same command through typer's CliRunner in the test process, ~2.5 s
cheaper (no fresh interpreter, no `import torch`), and returns the same CompletedProcess, so the same assertions
apply: exit code, stdout and stderr apart, rich's consoles included (they look sys.stdout up when they print), and
warnings on stderr as a fresh interpreter's default filters would show them. An exception the CLI lets through
fails the test with its traceback; the cwd, os.environ and torch's thread count are put back; a command that leaves
a Python thread running fails. Use it for what is refused in Python before native code, a worker, a socket or a
signal is involved; the rest goes through `moetier(...)`. `refused(...)` is the one refusal contract.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

from typer.testing import CliRunner

# a fresh interpreter's filters (no -W, no PYTHONWARNINGS), whatever pytest's are
DEFAULT_WARNING_FILTERS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


def moetier(*args, cwd: Path | None = None, env: dict | None = None, stdin: str | None = None,
            timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m moetier.cli ARGS` in a child process; env, when given, is its whole environment."""
    return subprocess.run([sys.executable, "-m", "moetier.cli", *map(str, args)], input=stdin, capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=timeout)


def moetier_here(*args, cwd: Path | None = None, env: dict | None = None, stdin: str | None = None) -> subprocess.CompletedProcess:
    """The same command in this process (see the module docstring); pytest-timeout bounds it, not a timeout here."""
    from moetier.cli.app import app

    argv = [str(arg) for arg in args]
    overrides = None if env is None else {key: None for key in os.environ} | dict(env)  # env is the whole environment
    environ, threads_before = dict(os.environ), set(threading.enumerate())
    torch = sys.modules.get("torch")
    torch_threads = torch.get_num_threads() if torch is not None else None
    try:
        with contextlib.chdir(cwd or os.getcwd()), warnings.catch_warnings(record=True) as shown:
            warnings.resetwarnings()
            for category in DEFAULT_WARNING_FILTERS:
                warnings.simplefilter("ignore", category)
            result = CliRunner().invoke(app, argv, input=stdin, env=overrides, catch_exceptions=False,
                                        prog_name="python -m moetier.cli")
    finally:
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update(environ)
        if torch_threads is not None:
            torch.set_num_threads(torch_threads)
    left = [t.name for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    assert not left, f"moetier {' '.join(argv)} left threads running in the test process: {left} (run it with moetier())"
    stderr = result.stderr + "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in shown)
    return subprocess.CompletedProcess(["moetier", *argv], result.exit_code, result.stdout, stderr)


def refused(result: subprocess.CompletedProcess, *words: str) -> str:
    """The one error line of a refused command, after checking the contract: exit code 2, one line
    `moetier: error: ...` on stderr holding each of `words`, no traceback."""
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moetier: error: "), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])
    return lines[0]
