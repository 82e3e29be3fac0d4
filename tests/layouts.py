"""The cluster.toml most tests need: one emulated GPU running every layer, a VRAM cache, a CPU lane.

`cache_layout()` spells it out once; tests add tables to it or edit its lines. With no
`scheduler` it writes no [scheduler] table (tests that append their own rely on that).
"""

from __future__ import annotations


def cache_layout(slots: int = 4, policy: str | None = None, rtt_us: float = 10.0, cpu_threads: int | None = None,
                 scheduler: str | None = None) -> str:
    policy_line = f'policy = "{policy}"\n' if policy else ""
    threads_line = f"threads = {cpu_threads}\n" if cpu_threads else ""
    return f"""
[[devices]]
name = "gpu0"
host = "local"
kind = "cuda"
[[links]]
name = "pcie"
rtt_us = {rtt_us}
gbps = 64.0
[[parts]]
name = "all"
device = "gpu0"
layers = "0:"
[[tiers]]
name = "vram"
kind = "vram"
device = "gpu0"
slots = {slots}
{policy_line}link = "pcie"
[[tiers]]
name = "cpu"
kind = "cpu"
{threads_line}""" + (f"[scheduler]\n{scheduler}" if scheduler else "")


# A remote tier on a 2.5 GbE link holding experts 0-5; `address` is filled in with str.format.
REMOTE_TIER = """[[links]]
name = "lan"
rtt_us = 150.0
gbps = 2.5
[[tiers]]
name = "i5"
kind = "remote"
address = "{address}"
link = "lan"
experts = "0:6"
"""
