"""The two-GPU layouts the tier and DEFER_CPU tests run (tests/test_tiers.py, tests/test_defer.py).

With CUDA they run on the real devices; a machine with one GPU emulates the second, a machine without CUDA both.
`runtime_for` writes HEAD + a body (parts, tiers, scheduler) and builds it over a checkpoint.
"""

from __future__ import annotations

import numpy as np
import torch

from moetier.config import load_layout
from moetier.engine.runtime import build_runtime

# With CUDA these layouts run on the real devices; a machine with one GPU emulates the second.
SECOND_GPU_EMULATED = "emulate = true\n" if torch.cuda.device_count() < 2 else ""
HEAD = f"""
[[devices]]
name = "gpu0"
host = "local"
kind = "cuda"
[[devices]]
name = "gpu1"
host = "local"
kind = "cuda"
index = 1
{SECOND_GPU_EMULATED}[[links]]
name = "pcie"
rtt_us = 20.0
gbps = 64.0
"""
ONE_PART = '[[parts]]\nname = "all"\ndevice = "gpu0"\nlayers = "0:"\n'
TWO_PARTS = '[[parts]]\nname = "a"\ndevice = "gpu0"\nlayers = "0:2"\n[[parts]]\nname = "b"\ndevice = "gpu1"\nlayers = "2:"\n'
CPU = '[[tiers]]\nname = "cpu"\nkind = "cpu"\nthreads = 2\n'


def vram(name: str, device: str, slots: int, policy: str) -> str:
    return f'[[tiers]]\nname = "{name}"\nkind = "vram"\ndevice = "{device}"\nslots = {slots}\npolicy = "{policy}"\nlink = "pcie"\n'


def scheduler(defer: int, tail_skip: bool = False, budget_us: float = 5000.0) -> str:
    return f"[scheduler]\nbudget_us = {budget_us}\ntail_skip = {str(tail_skip).lower()}\ndefer_cpu = {defer}\n"


def runtime_for(tmp_path, checkpoint, body: str):
    path = tmp_path / "layout.toml"
    path.write_text(HEAD + body)
    return build_runtime(load_layout(path), checkpoint)


IDS = np.array([7, 19, 3, 250, 41, 8, 8, 90, 310, 12, 5, 77, 200, 31, 64, 2, 99, 150, 11, 4])
