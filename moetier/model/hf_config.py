"""Reading a HF config.json moetier did not write: the file as a dict, its keys typed.

`read_config` reads the file through moetier.model.untrusted (a regular file,
UTF-8 JSON nesting a few levels deep, an object at the top); `_ConfigReader`
gives each key as the type asked for (an int where a float is asked becomes a
float; a bool is never a number; an integer beyond 64 bits is refused).
Invariant: every failure is one `SpecError` line naming the file and the key,
never a traceback. What the values mean is moetier.model.spec's to check.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetier.model.untrusted import read_json


class SpecError(ValueError):
    """A config.json moetier cannot run: names the file, the key and what was expected."""


class _ConfigReader:
    """Typed access to config keys; every failure names the file and the key."""

    def __init__(self, config: dict[str, Any], source: str):
        self.config, self.source = config, source

    def get(self, key: str, kind: type, default: Any = ...) -> Any:
        if key not in self.config or self.config[key] is None:
            if default is ...:
                raise SpecError(f"{self.source}: missing key {key!r} (expected {kind.__name__})")
            return default
        return self._typed(key, self.config[key], kind)

    def _typed(self, key: str, value: Any, kind: type) -> Any:
        """value as `kind` (an int becomes a float where a float is asked for; a bool is never a number)."""
        if kind in (int, float) and isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63:
            raise SpecError(f"{self.source}: key {key!r} is out of range (expected {kind.__name__} within 64 bits)")
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is int and isinstance(value, bool) or not isinstance(value, kind):
            raise SpecError(f"{self.source}: key {key!r} is {value!r} (expected {kind.__name__})")
        return value

    def first(self, keys: tuple[str, ...], kind: type) -> tuple[str, Any]:
        """(key, value) of the first of several synonymous keys present (transformers renamed some across versions)."""
        for key in keys:
            if self.config.get(key) is not None:
                return key, self.get(key, kind)
        raise SpecError(f"{self.source}: missing key {keys[0]!r} (expected {kind.__name__}; also looked for {', '.join(keys[1:])})")

    def rope(self, default_partial: float) -> tuple[float, float]:
        """(theta, partial_rotary_factor) from v5 `rope_parameters` or v4 `rope_theta`/`rope_scaling`."""
        params = self.get("rope_parameters", dict, default={})
        scaling = self.get("rope_scaling", dict, default={})
        rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
        if rope_type != "default":
            raise SpecError(f"{self.source}: rope type {rope_type!r} is not supported (expected 'default')")
        theta = self._typed("rope_theta", params.get("rope_theta", self.config.get("rope_theta", 10000.0)), float)
        partial = params.get("partial_rotary_factor", self.config.get("partial_rotary_factor", default_partial))
        partial = self._typed("partial_rotary_factor", partial, float)
        if not 0 < partial <= 1:  # NaN included
            raise SpecError(f"{self.source}: key 'partial_rotary_factor' is {partial!r} (expected 0 < f <= 1)")
        return theta, partial  # theta's domain is ModelSpec.validate's to check



def _is_int(value: Any, low: int, high: int) -> bool:
    """Whether value is an int (not a bool) from low to high."""
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def read_config(path: Path) -> dict[str, Any]:
    """A config.json as a dict; one SpecError naming the file when it is missing, unreadable, not UTF-8 JSON
    nesting a few levels deep (moetier.model.untrusted), or not an object."""
    if not path.exists():
        raise SpecError(f"{path}: no config.json (expected a HF model folder)")
    config = read_json(path, SpecError)
    if not isinstance(config, dict):
        raise SpecError(f"{path}: expected a JSON object at the top level")
    return config
