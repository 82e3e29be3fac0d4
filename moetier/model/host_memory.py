"""Host memory for weights that stay resident: copies in anonymous mappings advised for transparent huge pages.

Decode streams every resident weight byte once a token, and on 4 KiB pages
the streams' page walks and the prefetchers' stops at page boundaries cost a
share of the memory bandwidth: on the 2-vCPU Xeon the Q4_K one-token gemv
read 22.8 GB/s from a 4 GiB buffer on 4 KiB pages and 25.0-26.5 on 2 MiB
pages (a C harness, 2 threads), the CPU lane 23.1 -> 26.1 GB/s. Where the
kernel's transparent huge pages are `madvise` (many distributions' default),
only memory advised MADV_HUGEPAGE gets them; `always` gives them anyway and
`never` not at all, and then these copies are plain memory.

`host_copy(t)` returns a contiguous copy of a host tensor in such memory:
tensors are carved one after another (64-byte aligned) out of 64 MiB chunks,
each a private anonymous mapping aligned to 2 MiB and advised once; a
tensor over a chunk gets one of its own. A chunk lives while any tensor
carved from it does. A kernel that refuses the advice (built without
transparent huge pages) leaves them plain memory: nothing fails. `host_buffer(n)` is an n-byte tensor of its own chunk
(the read probe's buffer, so the roofline reads the memory the weights are
in). MOETIER_HUGE_PAGES=0 turns it off (plain torch copies): the A/B.
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import threading

import torch

HUGE_PAGE_BYTES = 2 << 20
CHUNK_BYTES = 64 << 20
ALIGN_BYTES = 64  # every tensor's start: a cache line (the kernels' vector loads)
THP_ENABLED = "/sys/kernel/mm/transparent_hugepage/enabled"


def huge_pages_wanted() -> bool:
    """Whether resident copies go to advised mappings: on Linux (MADV_HUGEPAGE), unless MOETIER_HUGE_PAGES=0."""
    return hasattr(mmap, "MADV_HUGEPAGE") and os.environ.get("MOETIER_HUGE_PAGES", "1") != "0"


def thp_mode() -> str:
    """The kernel's transparent huge page mode: "always", "madvise", "never", or "unknown" (no such setting)."""
    try:
        with open(THP_ENABLED) as f:
            text = f.read()
    except OSError:
        return "unknown"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "unknown"


def describe() -> str:
    """A few words for reports: where resident copies go on this machine."""
    if not huge_pages_wanted():
        return "plain memory" + (", MOETIER_HUGE_PAGES=0" if hasattr(mmap, "MADV_HUGEPAGE") else "")
    return f"memory advised for huge pages, THP {thp_mode()}"


class _Chunk:
    """One anonymous mapping, its usable part aligned to HUGE_PAGE_BYTES and advised MADV_HUGEPAGE (`advised`:
    whether the kernel took the advice; one built without transparent huge pages refuses it, and the chunk is
    plain memory then)."""

    def __init__(self, nbytes: int):
        self.map = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            self.map.madvise(mmap.MADV_HUGEPAGE)
            self.advised = True
        except OSError:  # EINVAL: a kernel without transparent huge pages
            self.advised = False
        view = ctypes.c_char.from_buffer(self.map)
        address = ctypes.addressof(view)
        del view  # the export ends here: the tensors' own exports keep the mapping alive
        self.used = -address % HUGE_PAGE_BYTES  # the first 2 MiB boundary inside the mapping
        self.end = self.used + nbytes

    def carve(self, nbytes: int) -> torch.Tensor | None:
        """uint8 [nbytes] from this chunk, or None when it has no room."""
        start = -(-self.used // ALIGN_BYTES) * ALIGN_BYTES
        if start + nbytes > self.end:
            return None
        self.used = start + nbytes
        return torch.frombuffer(self.map, dtype=torch.uint8, count=nbytes, offset=start) if nbytes else torch.empty(0, dtype=torch.uint8)


def _own_chunk(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of a chunk of its own, rounded up to whole huge pages."""
    return _Chunk(-(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES).carve(nbytes)


class HostArena:
    """Resident copies carved out of advised chunks (thread-safe); the chunk being filled is the only one it holds."""

    def __init__(self, chunk_bytes: int = CHUNK_BYTES):
        self.chunk_bytes = chunk_bytes
        self._chunk: _Chunk | None = None
        self._lock = threading.Lock()

    def empty(self, nbytes: int) -> torch.Tensor:
        """uint8 [nbytes], uninitialised (zero pages until written)."""
        if nbytes > self.chunk_bytes // 4:  # a big tensor: a chunk of its own
            return _own_chunk(nbytes)
        with self._lock:
            out = self._chunk.carve(nbytes) if self._chunk is not None else None
            if out is None:
                self._chunk = _Chunk(self.chunk_bytes)
                out = self._chunk.carve(nbytes)
        return out

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of `shape` and `dtype` in advised memory."""
        return self.empty(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of host tensor t (any dtype, any shape) in advised memory."""
        if t.device.type != "cpu":
            raise ValueError(f"host_copy: a host tensor is needed, got one on {t.device}")
        return self.tensor(tuple(t.shape), t.dtype).copy_(t)


_ARENA = HostArena()


def host_copy(t: torch.Tensor) -> torch.Tensor:
    """t's contiguous copy in memory advised for huge pages (a plain clone when `huge_pages_wanted` is false)."""
    return _ARENA.copy(t) if huge_pages_wanted() else t.clone(memory_format=torch.contiguous_format)


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised contiguous tensor in memory advised for huge pages (torch.empty when they are not wanted)."""
    return _ARENA.tensor(tuple(shape), dtype) if huge_pages_wanted() else torch.empty(shape, dtype=dtype)


def host_cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.cat(parts) (along dim 0) written straight into memory advised for huge pages."""
    if not huge_pages_wanted():
        return torch.cat(parts)
    first = parts[0]
    return torch.cat(parts, out=_ARENA.tensor((sum(p.shape[0] for p in parts), *first.shape[1:]), first.dtype))


def host_buffer(nbytes: int) -> torch.Tensor:
    """uint8 [nbytes] of its own advised chunk, uninitialised (plain torch.empty when huge pages are not wanted)."""
    if not huge_pages_wanted():
        return torch.empty(nbytes, dtype=torch.uint8)
    return _own_chunk(nbytes)
