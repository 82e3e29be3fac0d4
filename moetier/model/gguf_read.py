"""Reading GGUF files moetier did not write: one file's header, metadata and tensor index, and which files a set holds.

`_read` opens a .gguf through gguf.GGUFReader (memory-mapped, read-only, no
tensor data read), with every read bounds-checked before it is made;
`_metadata` gives its keys as plain values (float32 scalars as their shortest
decimals, the vocabulary only by its length); `_first_file` finds the one GGUF
set in a folder and `_split_paths` every file of a split set
(NAME-00001-of-0000N.gguf). Invariant: a truncated, malformed or misnamed file
is one CheckpointError line naming it, never a traceback or a hang.
moetier.model.gguf_file builds the checkpoint from what these return.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QType
from gguf import GGUFValueType

from moetier.model.safetensors_mmap import CheckpointError
from moetier.model.untrusted import open_regular

SPLIT_NAME = re.compile(r"(.+)-(\d{5})-of-(\d{5})\.gguf")  # llama.cpp's llama_split_path: "%s-%05d-of-%05d.gguf"
_READER_ERRORS = (ValueError, KeyError, IndexError, TypeError, OverflowError)  # what GGUFReader raises on garbage


class _PastEnd(Exception):
    def __init__(self, where: str, end: int):
        super().__init__(where)
        self.where, self.end = where, end


class _Malformed(Exception):
    def __init__(self, where: str, error: Exception):
        super().__init__(where)
        self.where, self.error = where, error


class _CheckedReader(gguf.GGUFReader):
    """GGUFReader whose every read is bounds-checked first (the reader itself slices the mapping short, which
    turns a truncated file into a confusing error, or an array of 2**60 empty reads into a hang), and which
    remembers what it was reading when an error came."""

    where = "the header"

    def __init__(self, path: Path):
        try:
            super().__init__(path, "r")  # a shared read-only mapping: not charged against the commit limit
        except _READER_ERRORS as err:
            raise _Malformed(self.where, err) from None

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.nbytes:
            raise _PastEnd(self.where, end)
        return super()._get(offset, dtype, count, override_order)

    def _build_fields(self, offs, count):
        self.where = "the metadata"
        return super()._build_fields(offs, count)

    def _build_tensor_info(self, offs, count):
        self.where = "the tensor index"
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs, fields):
        tensors = []
        for field in fields:  # one at a time, so an error names the tensor
            self.where = f"tensor {field.name!r}"
            kind = int(field.parts[4][0])  # the parts of a tensor info: name length, name, n_dims, dims, type, offset
            try:
                QType(kind)
            except ValueError:
                raise ValueError(f"unknown GGML type {kind}") from None
            super()._build_tensors(start_offs, [field])
            tensors += self.tensors
        names = [t.name for t in tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"tensor {next(n for n in names if names.count(n) > 1)!r} appears twice")
        self.tensors = tensors


def _read(path: Path) -> gguf.GGUFReader:
    with open_regular(path, CheckpointError) as handle:
        size = os.fstat(handle.fileno()).st_size
    if size == 0:
        raise CheckpointError(f"{path}: empty file (expected a GGUF file)")
    try:
        reader = _CheckedReader(path)
    except _PastEnd as err:
        raise CheckpointError(f"{path}: {err.where} runs past the end of the file (to byte {err.end} of {size}: "
                              "truncated, or not a GGUF file)") from None
    except _Malformed as err:
        raise CheckpointError(f"{path}: not a readable GGUF file ({err.where}: {err.error})") from None
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read ({err.strerror})") from None
    if reader.byte_order != "I":
        raise CheckpointError(f"{path}: a GGUF file of the other byte order (big-endian): not supported")
    return reader


def _float32(value: float) -> float:
    """The shortest decimal that rounds to this float32 (a config's 1e-06 comes back as 1e-06, not 9.99e-07)."""
    return float(str(np.float32(value)))


def _metadata(reader: gguf.GGUFReader, path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """(key -> value, array key -> length): scalars, strings and the numeric arrays outside tokenizer.*
    (per-layer counts); string arrays (the vocabulary) only by their length."""
    meta: dict[str, Any] = {}
    lengths: dict[str, int] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or not field.types:
            continue
        kind = field.types[0]
        try:
            if kind == GGUFValueType.ARRAY:
                lengths[key] = len(field.data)
                element = field.types[1] if len(field.types) > 1 else None
                if not key.startswith("tokenizer.") and element not in (GGUFValueType.STRING, GGUFValueType.ARRAY):
                    values = field.contents() if element is not None else []
                    meta[key] = [_float32(v) for v in values] if element == GGUFValueType.FLOAT32 else values
            else:
                meta[key] = _float32(field.contents()) if kind == GGUFValueType.FLOAT32 else field.contents()
        except UnicodeDecodeError:
            raise CheckpointError(f"{path}: key {key!r} is not UTF-8 text") from None
    return meta, lengths


def _first_file(folder: Path) -> Path:
    """The one GGUF set in a folder: its file, or its split set's first file."""
    sets: dict[tuple[str, str | None], list[Path]] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix.lower() != ".gguf" or not path.is_file():
            continue
        match = SPLIT_NAME.fullmatch(path.name)
        sets.setdefault((match.group(1), match.group(3)) if match else (path.name, None), []).append(path)
    if not sets:
        raise CheckpointError(f"{folder}: no config.json and no .gguf file (expected a HF model folder or a GGUF file)")
    if len(sets) > 1:
        names = ", ".join(name if count is None else f"{name}-*-of-{count}.gguf" for name, count in sets)
        raise CheckpointError(f"{folder}: holds {len(sets)} GGUF sets ({names}; expected exactly one: name the file to open)")
    (name, count), = sets
    if count is None:
        return folder / name
    first = folder / f"{name}-00001-of-{count}.gguf"
    if not first.exists():
        raise CheckpointError(f"{first}: split file 1 of {int(count)} is missing (the set's first file holds its metadata)")
    return first


def _split_paths(first: Path, meta: dict[str, Any]) -> list[Path]:
    """Every file of the set `first` opens (itself alone unless its split.count says more)."""
    count, number = meta.get("split.count", 1), meta.get("split.no", 0)
    if not (isinstance(count, int) and isinstance(number, int)) or count < 1 or not 0 <= number < count:
        raise CheckpointError(f"{first}: keys 'split.count' = {count!r}, 'split.no' = {number!r} (expected 0 <= split.no < split.count)")
    if number != 0:
        raise CheckpointError(f"{first}: file {number + 1} of a {count}-file split set (expected the first file, "
                              f"NAME-00001-of-{count:05d}.gguf, which holds the metadata)")
    if count == 1:
        return [first]
    match = SPLIT_NAME.fullmatch(first.name)
    if not match or int(match.group(3)) != count:
        raise CheckpointError(f"{first}: the first of {count} split files (key 'split.count'), not named "
                              f"NAME-00001-of-{count:05d}.gguf (expected llama.cpp's split names, to find the others)")
    paths = [first.with_name(f"{match.group(1)}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    for i, path in enumerate(paths[1:], start=2):
        if not path.exists():
            raise CheckpointError(f"{first}: split file {i} of {count} is missing (expected {path.name} beside it)")
    return paths
