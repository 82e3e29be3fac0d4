"""Zero-copy, memory-mapped reading of safetensors files.

A safetensors file is `u64 header_len | JSON header | raw tensor bytes`. We map
the file once and hand out tensors that alias the mapping, so opening a
checkpoint far larger than RAM costs only its header, and a tensor's pages are
read from disk the first time they are touched. The header is validated
before any tensor is made: UTF-8 JSON nesting a few levels deep, string ->
string metadata, and per tensor a known dtype, a shape of sizes, offsets of
two non-negative ints inside the file with byte length = shape x itemsize, and
no two tensors' bytes overlapping. A tensor that starts at an offset its dtype
cannot be aligned to comes back as an aligned copy, never as a misaligned view.
"""

from __future__ import annotations

import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from moetier.model.untrusted import open_regular, parse_json

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
MAX_HEADER_BYTES = 100 * 1024 * 1024


class CheckpointError(ValueError):
    """A weight file that is missing, malformed or inconsistent; the message names the file."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int
    offset: int  # byte offset from the start of the data section (the header's data_offsets[0])


class SafetensorsFile:
    """One mapped safetensors file: `entries` by name, `tensor(name)` as a zero-copy view."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open_regular(path, CheckpointError) as handle:
                size = handle.seek(0, 2)
                handle.seek(0)
                if size < 8:
                    raise CheckpointError(f"{path}: too short to be a safetensors file ({size} bytes)")
                (header_len,) = struct.unpack("<Q", handle.read(8))
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise CheckpointError(f"{path}: header length {header_len} exceeds the file or the limit")
                header = parse_json(handle.read(header_len), f"{path}: header", CheckpointError)
                # A shared read-only mapping: unlike a private writable one it is not
                # charged against the commit limit, so a checkpoint larger than RAM maps.
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + header_len else None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        metadata = header.pop("__metadata__", None)
        metadata = {} if metadata is None else metadata
        if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
            raise CheckpointError(f"{path}: header __metadata__ is {_short(metadata)} (expected an object of strings)")
        self.metadata: dict[str, str] = metadata
        data_start = 8 + header_len
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            self.entries[name] = _entry(path, name, info, data_start, size)
        end, last = 0, None
        for name, entry in sorted(self.entries.items(), key=lambda item: (item[1].offset, item[1].nbytes)):
            if entry.nbytes and entry.offset < end:  # an empty tensor takes no bytes, wherever it says it starts
                raise CheckpointError(f"{path}: tensors {last!r} and {name!r} overlap (expected disjoint byte ranges)")
            if entry.nbytes:
                end, last = entry.offset + entry.nbytes, name

    def drop_pages(self) -> None:
        """Unmap the pages this process has read (they stay in the OS page cache; a later read maps them again), so
        weights copied out of the file are not counted twice in the resident set."""
        if self._map is not None:
            self._map.madvise(mmap.MADV_DONTNEED)

    def tensor(self, name: str) -> torch.Tensor:
        entry = self.entries[name]
        dtype = DTYPES[entry.dtype]
        count = entry.nbytes // dtype.itemsize
        if count == 0:
            return torch.empty(entry.shape, dtype=dtype)
        with warnings.catch_warnings():
            # Weights are read-only by contract; torch warns that the buffer is not writable.
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self._map, dtype=dtype, count=count, offset=entry.start)
        if entry.start % dtype.itemsize:  # native kernels read whole elements: give them an aligned copy
            flat = flat.clone()
        return flat.view(entry.shape)


def _entry(path: Path, name: str, info: object, data_start: int, file_size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: tensor {name!r} lacks dtype/shape/data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if not (isinstance(dtype, str) and dtype in DTYPES):
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {_short(dtype)} (expected one of {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(_is_size(d) for d in shape)):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {_short(shape)} (expected a list of sizes)")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_size(o) for o in offsets)):
        raise CheckpointError(f"{path}: tensor {name!r} has data_offsets {_short(offsets)} (expected [begin, end], two non-negative integers)")
    begin, end = offsets
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * DTYPES[dtype].itemsize
    if end - begin != nbytes or begin < 0 or data_start + end > file_size:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but shape {_short(shape)} x {dtype} needs {nbytes} inside the file"
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, nbytes, begin)


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object) -> str:
    """repr cut to one readable length: a hostile header's values may be megabytes long."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
