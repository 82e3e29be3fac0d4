"""What moetier writes appears whole or not at all, and never lands on what the same command reads.

`check_output` refuses an output path before any work starts: a directory where
a file is expected, a non-empty folder where a new one is expected, a path that
is (by any spelling or symlink) one of the command's inputs or lies inside an
input folder. `new_folder` and `new_file` stage an output under a hidden name
beside it, `.NAME.partial-PID-N`, and move it into place only when the block
ends without error; an exception, Ctrl-C, SIGTERM or SIGHUP removes the staged
output and any parent folder made for it (the two signals become
SystemExit(128 + signal) while the block runs in the main thread). A staged
output whose process died without cleaning up (SIGKILL, power loss) is removed
by the next write to the same path. Standard library only.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import signal
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

KINDS = ("file", "new folder", "folder")
_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
_serial = itertools.count()  # tells apart two outputs one process stages at once


class OutputError(ValueError):
    """An output path that cannot be written whole, or would overwrite an input."""


def _relation(out: Path, source: Path) -> str | None:
    """"same" when out is source (by a symlink, another spelling, a hard link); "inside" when it lies in the folder
    source; else None."""
    if out.exists() and source.exists() and os.path.samefile(out, source):
        return "same"
    out_real, source_real = Path(os.path.realpath(out)), Path(os.path.realpath(source))
    if out_real == source_real:
        return "same"
    return "inside" if source_real.is_dir() and source_real in out_real.parents else None


def check_output(out, flag: str | None = None, inputs: Iterable[tuple[str, object]] = (), kind: str = "file",
                 suffixes: tuple[str, ...] = ()) -> Path:
    """Refuse (OutputError naming `flag`) an output that is not a writable `kind` ("file"; "new folder": absent
    or empty; "folder": absent or a folder) ending in one of `suffixes`, or that is, or lies inside, one of
    `inputs` ((flag, path) pairs; None paths are skipped). Reads only; touches nothing."""
    if kind not in KINDS:
        raise ValueError(f"kind {kind!r} (expected one of {KINDS})")
    out = Path(out)
    what = f"{flag} {out}" if flag else str(out)
    for source_flag, source in inputs:
        relation = _relation(out, Path(source)) if source is not None else None
        if relation == "same":
            noun = "folder" if Path(source).is_dir() else "file"
            raise OutputError(f"{what} is the {source_flag} {noun} {source} "
                              "(expected a path of its own: a command never writes over its other files)")
        if relation == "inside":
            raise OutputError(f"{what} is inside the {source_flag} folder {source} "
                              "(expected a path outside it: a command never writes into its input folders)")
    if suffixes and out.suffix not in suffixes:
        raise OutputError(f"{what} (expected a {' or '.join(suffixes)} file)")
    if kind == "file" and out.is_dir():
        raise OutputError(f"{what} is a directory (expected the path of a file to write)")
    if kind != "file" and out.exists() and not out.is_dir():
        raise OutputError(f"{what} is a file (expected a {kind})")
    if kind == "new folder" and out.is_dir() and any(out.iterdir()):
        raise OutputError(f"{what} exists and is not empty (expected a new folder)")
    ancestor = out.parent
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise OutputError(f"{what}: {ancestor} is not a folder (expected a path under a folder)")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputError(f"{what}: no permission to write in {ancestor}")
    return out


def _exit_on_signal(signum, frame) -> None:
    for sig in _SIGNALS:  # the cleanup this starts runs once, not cut short by a second signal
        signal.signal(sig, signal.SIG_IGN)
    raise SystemExit(128 + signum)


@contextmanager
def _signals_exit() -> Iterator[None]:
    """SIGTERM / SIGHUP raise SystemExit while the block runs, so `finally` and `except` clauses run; only
    in the main thread (where Python runs handlers) and only for signals nobody else handles."""
    previous = {}
    if threading.current_thread() is threading.main_thread():
        previous = {sig: signal.signal(sig, _exit_on_signal) for sig in _SIGNALS
                    if signal.getsignal(sig) == signal.SIG_DFL}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _alive(pid: int) -> bool:
    """Whether pid may still be writing: gone only when the kernel says no such process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process; no pid at all: not ours to judge
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sweep_stale(out: Path) -> None:
    """Remove outputs staged for `out` by processes that are gone (a SIGKILL gives no chance to clean up)."""
    if not out.parent.is_dir():
        return
    staged = re.compile(re.escape(f".{out.name}.partial-") + r"(\d+)-\d+")
    for entry in out.parent.iterdir():
        match = staged.match(entry.name)
        if match and not _alive(int(match.group(1))):
            _remove(entry)


@contextmanager
def _staged(out: Path, suffix: str, make: Callable[[Path], None],
            publish: Callable[[Path, Path], None]) -> Iterator[Path]:
    missing = [p for p in [out.parent, *out.parent.parents] if not p.exists()]
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}-{next(_serial)}{suffix}"
    with _signals_exit():
        _sweep_stale(out)
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            make(tmp)
            yield tmp
            publish(tmp, out)
        except BaseException:
            _remove(tmp)
            for folder in missing:  # deepest first: only the empty folders made for this output
                try:
                    folder.rmdir()
                except OSError:
                    break
            raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish_folder(tmp: Path, out: Path) -> None:
    _fsync_dir(tmp)
    if out.is_dir():
        out.rmdir()  # only an empty one: a folder that filled meanwhile is not ours to replace
    os.rename(tmp, out)
    _fsync_dir(out.parent)


def new_folder(out) -> AbstractContextManager[Path]:
    """`with new_folder(out) as tmp:` fill tmp; out (absent or empty) becomes it, fsynced, when the block ends."""
    out = check_output(out, kind="new folder")
    return _staged(out, "", lambda tmp: tmp.mkdir(), _publish_folder)


def new_file(out, suffix: str = "") -> AbstractContextManager[Path]:
    """`with new_file(out, ".npy") as tmp:` write tmp (its name ends with suffix, for writers that add one);
    it replaces out when the block ends."""
    out = check_output(out)
    return _staged(out, suffix, lambda tmp: None, lambda tmp, out: os.replace(tmp, out))
