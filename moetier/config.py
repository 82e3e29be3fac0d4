"""cluster.toml: a machine's tier layout as frozen dataclasses.

A layout names hosts, devices, parts (which layers run on which device), tiers
(where experts live: vram | helper | cpu | remote), links (rtt_us, gbps), and
the router and scheduler settings. `load_layout(path)` parses with tomllib and
validates everything it can without a model: unknown keys, types, ranges
(every float finite; each numeric field declares its bounds), references
between tables, part ranges. `Layout.check_model(spec)` adds the
checks that need the model (part coverage, slots that fit). Every error is a
`ConfigError` whose one line names the file, the key and what was expected.
"""

from __future__ import annotations

import math
import os
import tomllib
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

TIER_KINDS = ("vram", "helper", "cpu", "remote")
DEVICE_KINDS = ("cuda", "cpu")
POLICY_NAMES = ("static", "lru", "lfu", "xlayer")
BIAS_MODES = ("selection", "damped")
MAX_THREADS = 1024  # the most threads a layout may give a tier, on any machine
THREADS_PER_CPU = 8  # and at most this many per CPU of the machine that starts them: far past that a pool fails to start or crashes


def thread_limit() -> int:
    """The most threads one pool may start here (a layout's CPU lane, --threads): THREADS_PER_CPU per CPU, <= MAX_THREADS."""
    return min(MAX_THREADS, THREADS_PER_CPU * (os.cpu_count() or 1))


def _range(at_least: float | None = None, above: float | None = None, at_most: float | None = None) -> dict:
    """Field metadata: the values a numeric key may take; load_layout refuses others, naming the key."""
    return {"range": (at_least, above, at_most)}


class ConfigError(ValueError):
    """A layout that cannot be used; the message names the file and the key."""


@dataclass(frozen=True)
class HostConfig:
    name: str
    address: str = "127.0.0.1"
    cpu: str = ""
    ram_bytes: int = field(default=0, metadata=_range(at_least=0))
    ssh: str = ""  # command prefix that reaches the host, e.g. "ssh i5"; empty = this machine
    python: str = "python3"  # interpreter on that host (for `moetier launch`)


@dataclass(frozen=True)
class DeviceConfig:
    name: str
    host: str
    kind: str = "cpu"  # cuda | cpu
    index: int = field(default=0, metadata=_range(at_least=0))
    memory_bytes: int = field(default=0, metadata=_range(at_least=0))
    emulate: bool = False  # run on the CPU with links emulated even when CUDA exists

    def torch_device(self, cuda_available: bool) -> str:
        """Where this device's work runs here: cuda:N, or the CPU when it is emulated."""
        if self.kind == "cuda" and cuda_available and not self.emulate:
            return f"cuda:{self.index}"
        return "cpu"


@dataclass(frozen=True)
class LinkConfig:
    name: str
    rtt_us: float = field(metadata=_range(at_least=0, at_most=1e7))  # a round trip past 10 s is no link to plan over
    gbps: float = field(metadata=_range(at_least=1e-3))  # gigabits per second; at least 1 Mb/s

    def transfer_us(self, nbytes: int) -> float:
        """One-way time for nbytes: half the round trip plus serialisation at the link rate."""
        return self.rtt_us / 2 + nbytes * 8 / (self.gbps * 1e3)


@dataclass(frozen=True)
class PartConfig:
    name: str
    device: str
    start: int
    stop: int | None  # None: to the last layer

    def layers(self, num_layers: int) -> range:
        return range(self.start, num_layers if self.stop is None else self.stop)


@dataclass(frozen=True)
class TierConfig:
    name: str
    kind: str
    backend: str = ""  # cpu: the lane's expert backend; remote: the worker `launch` starts (default torch)
    device: str = ""  # vram / helper: a device name
    host: str = ""  # cpu / remote: a host name
    slots: int = field(default=0, metadata=_range(at_least=0))  # expert slots per MoE layer (vram / helper)
    capacity_bytes: int = field(default=0, metadata=_range(at_least=0))  # alternative to slots: bytes for all layers, split evenly
    policy: str = "lru"
    profile: str = ""  # counts/brightness file for the static policy or a warm start
    threads: int = field(default=1, metadata=_range(at_least=1, at_most=MAX_THREADS))
    link: str = ""
    address: str = ""  # remote: tcp://host:port of the worker
    keys: str = ""  # remote: folder with CurveZMQ keys
    experts: str = ""  # helper / remote: which experts it holds, "hot" | "cold" | "all" | "a:b"

    @property
    def backend_name(self) -> str:
        """The expert backend the CPU lane (or a launched worker) computes with: `backend`, else torch."""
        return self.backend or "torch"

    def held_experts(self, slots: int, num_experts: int, brightness=None) -> list[int]:
        """The experts a helper / remote tier holds in one layer: by `experts` ("hot" or "cold" by the
        brightness [E], ids ascending without one; "all"; an id range "a:b"); ValueError on a bad rule."""
        import numpy as np

        rule = self.experts or "hot"
        if rule == "all":
            return list(range(num_experts))
        if ":" in rule:
            start, _, stop = rule.partition(":")
            return list(range(int(start or 0), int(stop) if stop else num_experts))
        if rule in ("hot", "cold"):
            order = np.argsort(-(brightness if brightness is not None else -np.arange(num_experts)), kind="stable")
            return sorted(int(e) for e in (order[:slots] if rule == "hot" else order[::-1][:slots]))
        raise ValueError(f"experts = {rule!r} (expected hot, cold, all or a range a:b)")


@dataclass(frozen=True)
class RouterConfig:
    bias: str = ""  # bias table (.safetensors)
    bias_mode: str = "selection"
    affinity: float = field(default=0.0, metadata=_range(at_least=0))
    affinity_prefill: bool = False


@dataclass(frozen=True)
class SchedulerConfig:
    budget_us: float = field(default=2000.0, metadata=_range(above=0, at_most=1e9))  # per MoE layer
    tail_skip: bool = False
    defer_cpu: int = 0  # 0 | 1 | 2
    defer_into_linear: bool = False  # DEFER_CPU into linear-attention layers too: the seed's semantics, lossy in the recurrence
    calibration: str = ""  # file written by `moetier calibrate`


@dataclass(frozen=True)
class Layout:
    path: Path
    name: str
    hosts: tuple[HostConfig, ...]
    devices: tuple[DeviceConfig, ...]
    links: tuple[LinkConfig, ...]
    parts: tuple[PartConfig, ...]
    tiers: tuple[TierConfig, ...]
    router: RouterConfig = field(default_factory=RouterConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    model: str = ""

    def device(self, name: str) -> DeviceConfig:
        return next(d for d in self.devices if d.name == name)

    def link(self, name: str) -> LinkConfig | None:
        return next((l for l in self.links if l.name == name), None)

    def host(self, name: str) -> HostConfig:
        return next(h for h in self.hosts if h.name == name)

    def with_scheduler(self, **values: Any) -> "Layout":
        """This layout with [scheduler] keys set from the command line (a flag over the file's key); None leaves a key."""
        chosen = {key: value for key, value in values.items() if value is not None}
        return replace(self, scheduler=replace(self.scheduler, **chosen)) if chosen else self

    def relative(self, value: str) -> Path:
        """A path written in the layout, relative to the layout file."""
        return (self.path.parent / value) if value and not Path(value).is_absolute() else Path(value)

    def model_path(self) -> Path | None:
        """The model the layout names (`model = ...`, relative to the layout file), None where it names none."""
        return self.relative(self.model) if self.model else None

    def check_model(self, num_layers: int, num_experts: int) -> None:
        """Checks that need the model: parts cover every layer once, in order; slots fit."""
        last = self.parts[-1]
        end = num_layers if last.stop is None else last.stop
        if end != num_layers:
            raise ConfigError(f"{self.path}: parts end at layer {end} but the model has {num_layers} (expected the last part to reach {num_layers}, or an open range like \"{last.start}:\")")
        for index, part in enumerate(self.parts):
            if part.start >= (num_layers if part.stop is None else part.stop):
                raise ConfigError(f"{self.path}: [parts.{index}] layers is empty for a {num_layers}-layer model")
        for index, tier in enumerate(self.tiers):
            if tier.slots > num_experts:
                raise ConfigError(f"{self.path}: [tiers.{index}] slots = {tier.slots} exceeds the model's {num_experts} experts per layer")


# -- parsing -----------------------------------------------------------------------------
def load_layout(path: str | Path) -> Layout:
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such layout file (expected a cluster.toml)") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{path}: not valid TOML ({err})") from None
    return _Parser(path).layout(raw)


class _Parser:
    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.path}: {where}: {message}")

    def build(self, cls: type, table: Any, where: str, **extra: Any) -> Any:
        """A dataclass from a TOML table: unknown keys and wrong types are errors."""
        if not isinstance(table, dict):
            raise self.fail(where, f"expected a table, got {type(table).__name__}")
        known = {f.name: f for f in fields(cls)}
        values: dict[str, Any] = dict(extra)
        for key, value in table.items():
            if key not in known or key in extra:
                raise self.fail(f"{where}.{key}", f"unknown key (expected one of {', '.join(k for k in known if k not in extra)})")
            values[key] = self.typed(value, known[key].type, f"{where}.{key}")
            self.in_range(values[key], known[key].metadata.get("range"), f"{where}.{key}")
        missing = [f.name for f in fields(cls) if f.name not in values and f.default is MISSING and f.default_factory is MISSING]
        if missing:
            raise self.fail(where, f"missing key {missing[0]!r}")
        return cls(**values)

    def typed(self, value: Any, annotation: Any, where: str) -> Any:
        kind = str(annotation)
        if kind == "bool":
            ok = isinstance(value, bool)
        elif kind == "int":
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif kind == "float":
            ok = isinstance(value, (int, float)) and not isinstance(value, bool)
            value = float(value) if ok else value
            if ok and not math.isfinite(value):
                raise self.fail(where, f"is {value} (expected a finite number)")
        elif kind == "str":
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            raise self.fail(where, f"is {value!r} (expected {kind})")
        return value

    def in_range(self, value: float, bounds: tuple | None, where: str) -> None:
        """A numeric key inside the range its field declares (`_range`)."""
        if bounds is None:
            return
        at_least, above, at_most = bounds
        if ((at_least is not None and value < at_least) or (above is not None and value <= above)
                or (at_most is not None and value > at_most)):
            wanted = [f"{sign} {bound}" for sign, bound in ((">=", at_least), (">", above), ("<=", at_most)) if bound is not None]
            raise self.fail(where, f"is {value} (expected {' and '.join(wanted)})")

    def named(self, cls: type, raw: dict, key: str) -> tuple:
        tables = raw.get(key, [])
        if not isinstance(tables, list):
            raise self.fail(key, f"expected an array of tables ([[{key}]])")
        items = tuple(self.build(cls, t, f"[{key}.{i}]") for i, t in enumerate(tables))
        seen: set[str] = set()
        for i, item in enumerate(items):
            if not item.name:
                raise self.fail(f"[{key}.{i}].name", "is empty (expected a unique name)")
            if item.name in seen:
                raise self.fail(f"[{key}.{i}].name", f"{item.name!r} is used twice (expected unique names)")
            seen.add(item.name)
        return items

    def layout(self, raw: dict) -> Layout:
        allowed = {"name", "model", "hosts", "devices", "links", "parts", "tiers", "router", "scheduler"}
        for key in raw:
            if key not in allowed:
                raise self.fail(key, f"unknown table (expected one of {', '.join(sorted(allowed))})")
        hosts = self.named(HostConfig, raw, "hosts") or (HostConfig("local"),)
        devices = self.named(DeviceConfig, raw, "devices")
        links = self.named(LinkConfig, raw, "links")
        parts = tuple(self.part(t, i) for i, t in enumerate(raw.get("parts", [])))
        tiers = self.named(TierConfig, raw, "tiers")
        router = self.build(RouterConfig, raw.get("router", {}), "[router]")
        scheduler = self.build(SchedulerConfig, raw.get("scheduler", {}), "[scheduler]")
        layout = Layout(self.path, self.typed(raw.get("name", self.path.stem), "str", "name"), hosts, devices, links,
                        parts, tiers, router, scheduler, self.typed(raw.get("model", ""), "str", "model"))
        self.validate(layout)
        return layout

    def part(self, table: Any, index: int) -> PartConfig:
        where = f"[parts.{index}]"
        if not isinstance(table, dict):
            raise self.fail(where, "expected a table")
        layers = table.get("layers")
        rest = {k: v for k, v in table.items() if k != "layers"}
        if not isinstance(layers, str) or ":" not in layers:
            raise self.fail(f"{where}.layers", f"is {layers!r} (expected a range like \"0:24\" or \"24:\")")
        start_text, stop_text = layers.split(":", 1)
        try:
            start = int(start_text) if start_text.strip() else 0
            stop = int(stop_text) if stop_text.strip() else None
        except ValueError:
            raise self.fail(f"{where}.layers", f"is {layers!r} (expected integers, like \"0:24\")") from None
        return self.build(PartConfig, rest, where, start=start, stop=stop)

    def validate(self, layout: Layout) -> None:
        host_names = {h.name for h in layout.hosts}
        device_names = {d.name for d in layout.devices}
        link_names = {l.name for l in layout.links}
        for i, device in enumerate(layout.devices):
            if device.host not in host_names:
                raise self.fail(f"[devices.{i}].host", f"{device.host!r} is not a host (expected one of {', '.join(sorted(host_names))})")
            if device.kind not in DEVICE_KINDS:
                raise self.fail(f"[devices.{i}].kind", f"is {device.kind!r} (expected one of {', '.join(DEVICE_KINDS)})")
        if not layout.parts:
            raise self.fail("parts", "no [[parts]] (expected at least one part naming its device and layers)")
        expected_start = 0
        for i, part in enumerate(layout.parts):
            if part.device not in device_names:
                raise self.fail(f"[parts.{i}].device", f"{part.device!r} is not a device (expected one of {', '.join(sorted(device_names)) or 'a [[devices]] name'})")
            if part.start != expected_start:
                raise self.fail(f"[parts.{i}].layers", f"starts at {part.start} (expected {expected_start}: parts cover the layers in order)")
            if part.stop is None and i != len(layout.parts) - 1:
                raise self.fail(f"[parts.{i}].layers", "an open range is only allowed in the last part")
            if part.stop is not None and part.stop <= part.start:
                raise self.fail(f"[parts.{i}].layers", f"\"{part.start}:{part.stop}\" is empty")
            expected_start = part.stop if part.stop is not None else expected_start
        for i, tier in enumerate(layout.tiers):
            self.validate_tier(layout, tier, f"[tiers.{i}]", host_names, device_names, link_names)
        lanes = [i for i, t in enumerate(layout.tiers) if t.kind == "cpu"]
        if not lanes:
            raise self.fail("tiers", "no tier of kind \"cpu\" (expected one: the CPU lane serves what no other tier holds)")
        if len(lanes) > 1:
            raise self.fail(f"[tiers.{lanes[1]}].kind", f"is a second \"cpu\" tier (expected exactly one CPU lane per layout; "
                            f"give tier {layout.tiers[lanes[0]].name!r} more threads instead)")
        s, r = layout.scheduler, layout.router
        if s.defer_cpu not in (0, 1, 2):
            raise self.fail("[scheduler].defer_cpu", f"is {s.defer_cpu} (expected 0, 1 or 2)")
        if r.bias_mode not in BIAS_MODES:
            raise self.fail("[router].bias_mode", f"is {r.bias_mode!r} (expected one of {', '.join(BIAS_MODES)})")

    def validate_tier(self, layout, tier: TierConfig, where: str, hosts, devices, links) -> None:
        if tier.kind not in TIER_KINDS:
            raise self.fail(f"{where}.kind", f"is {tier.kind!r} (expected one of {', '.join(TIER_KINDS)})")
        if tier.kind in ("vram", "helper") and tier.backend not in ("", "torch"):
            raise self.fail(f"{where}.backend", f"is {tier.backend!r} (expected \"torch\" or none: a {tier.kind} tier computes "
                            f"with torch on its device; backend chooses the CPU lane's and a worker's)")
        if tier.kind in ("vram", "helper"):
            if tier.device not in devices:
                raise self.fail(f"{where}.device", f"{tier.device!r} is not a device (expected one of {', '.join(sorted(devices))})")
            if (tier.slots > 0) == (tier.capacity_bytes > 0):
                raise self.fail(where, "expected exactly one of slots or capacity_bytes, positive")
        if tier.kind in ("cpu", "remote") and tier.host and tier.host not in hosts:
            raise self.fail(f"{where}.host", f"{tier.host!r} is not a host (expected one of {', '.join(sorted(hosts))})")
        if tier.link and tier.link not in links:
            raise self.fail(f"{where}.link", f"{tier.link!r} is not a link (expected one of {', '.join(sorted(links)) or 'a [[links]] name'})")
        if tier.kind in ("vram", "helper", "remote") and not tier.link:
            raise self.fail(f"{where}.link", "missing (expected the link this tier's transfers cross)")
        if tier.kind == "vram" and tier.policy not in POLICY_NAMES:
            raise self.fail(f"{where}.policy", f"is {tier.policy!r} (expected one of {', '.join(POLICY_NAMES)})")
        if tier.kind == "remote" and not tier.address.startswith("tcp://"):
            raise self.fail(f"{where}.address", f"is {tier.address!r} (expected tcp://HOST:PORT)")

