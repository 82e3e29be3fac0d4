"""Zero-copy, memory-mapped reading of safetensors files.

A safetensors file is `u64 header_len | JSON header | raw tensor bytes`. We map
the file once and hand out tensors that alias the mapping, so opening a
checkpoint far larger than RAM costs only its header, and a tensor's pages are
read from disk the first time they are touched. The header is validated
(known dtype, offsets inside the file, byte length = shape x itemsize) before
any tensor is made.
"""

from __future__ import annotations

import json
import mmap
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

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


class SafetensorsFile:
    """One mapped safetensors file: `entries` by name, `tensor(name)` as a zero-copy view."""

    def __init__(self, path: Path):
        self.path = path
        try:
            with open(path, "rb") as handle:
                size = handle.seek(0, 2)
                handle.seek(0)
                if size < 8:
                    raise CheckpointError(f"{path}: too short to be a safetensors file ({size} bytes)")
                (header_len,) = struct.unpack("<Q", handle.read(8))
                if header_len > min(MAX_HEADER_BYTES, size - 8):
                    raise CheckpointError(f"{path}: header length {header_len} exceeds the file or the limit")
                header = json.loads(handle.read(header_len))
                # A shared read-only mapping: unlike a private writable one it is not
                # charged against the commit limit, so a checkpoint larger than RAM maps.
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) if size > 8 + header_len else None
        except OSError as err:
            raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: header is not valid JSON") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: header is not a JSON object")
        self.metadata = header.pop("__metadata__", None) or {}
        data_start = 8 + header_len
        self.entries: dict[str, TensorEntry] = {}
        for name, info in header.items():
            self.entries[name] = _entry(path, name, info, data_start, size)

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
        return flat.view(entry.shape)


def _entry(path: Path, name: str, info: object, data_start: int, file_size: int) -> TensorEntry:
    if not isinstance(info, dict) or not {"dtype", "shape", "data_offsets"} <= info.keys():
        raise CheckpointError(f"{path}: tensor {name!r} lacks dtype/shape/data_offsets")
    dtype, shape, offsets = info["dtype"], info["shape"], info["data_offsets"]
    if dtype not in DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} has dtype {dtype!r} (expected one of {', '.join(DTYPES)})")
    if not (isinstance(shape, list) and all(isinstance(d, int) and d >= 0 for d in shape)):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {shape!r} (expected a list of sizes)")
    begin, end = offsets
    numel = 1
    for dim in shape:
        numel *= dim
    nbytes = numel * DTYPES[dtype].itemsize
    if end - begin != nbytes or begin < 0 or data_start + end > file_size:
        raise CheckpointError(
            f"{path}: tensor {name!r} spans bytes [{begin}, {end}) but shape {shape} x {dtype} needs {nbytes} inside the file"
        )
    return TensorEntry(path, dtype, tuple(shape), data_start + begin, nbytes)
