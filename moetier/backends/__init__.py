"""Backends by name: a registry of "module:Class" imported on first use.

`import moetier` never imports cupy or CUDA: a backend's module is imported only
when `get_backend(name)` asks for it. Third-party backends register through the
entry-point group `moetier.backends` (name = "package.module:Class").
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from moetier.backends.base import Backend, BackendCaps, ExpertWork

BUILTIN: dict[str, str] = {
    "torch": "moetier.backends.torch_backend:TorchBackend",
    "numpy": "moetier.backends.numpy_backend:NumpyBackend",
    "cupy": "moetier.backends.cupy_backend:CupyBackend",
}


class BackendError(ValueError):
    """An unknown backend name, or one whose module cannot be imported here."""


def available() -> dict[str, str]:
    """name -> "module:Class" for built-in and entry-point backends (nothing is imported)."""
    found = dict(BUILTIN)
    for point in entry_points(group="moetier.backends"):
        found.setdefault(point.name, point.value)
    return found


def get_backend(name: str, device: str = "cpu", **options) -> Backend:
    """Import and construct the backend `name` on `device` ("cpu", "cuda", "cuda:1"); options go to its constructor."""
    target = available().get(name)
    if target is None:
        raise BackendError(f"backend {name!r} is unknown (expected one of {', '.join(sorted(available()))})")
    module_name, _, class_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except ImportError as err:
        raise BackendError(f"backend {name!r} cannot be imported here: {err}") from None
    return cls(device, **options)


__all__ = ["Backend", "BackendCaps", "BackendError", "ExpertWork", "available", "get_backend"]
