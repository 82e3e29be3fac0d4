"""A GGUF file's copy with chosen tensors stored in other formats, as random valid blocks (tests/quant_blocks).

llama.cpp's quantizer makes the real quantized files (the peer suite); the
fast suite needs files of every block format without it. `restored` copies
every metadata key and tensor of a GGUF written by moetier.model.gguf_write,
storing each tensor whose name matches a pattern in the format named for it,
filled with random finite blocks whose values are about `scale` in size: a
model that runs (its logits mean nothing) with the byte sizes of the format.
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

import gguf
import numpy as np
from gguf import GGUFValueType

from moetier.model.formats import BY_NAME
from quant_blocks import NOT_STORED, random_rows


def restored(source: Path, out: Path, formats: dict[str, str], seed: int = 0, scale: float = 2e-4) -> Path:
    """formats: fnmatch pattern on GGUF tensor names -> format name (the first match wins): a stored format, or
    one of quant_blocks.NOT_STORED."""
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        kind = field.types[0]
        writer.add_key_value(name, field.contents(), kind, sub_type=field.types[1] if kind == GGUFValueType.ARRAY else None)
    rng = np.random.default_rng(seed)
    for tensor in reader.tensors:
        target = next((fmt for pattern, fmt in formats.items() if fnmatch.fnmatchcase(tensor.name, pattern)), None)
        shape = [int(d) for d in reversed(tensor.shape)]  # numpy order: [..., rows, cols]
        if target is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        fmt = BY_NAME.get(target) or NOT_STORED[target]
        rows = int(np.prod(shape[:-1]))
        blocks = random_rows(fmt, rows, shape[-1], rng, scale).reshape(*shape[:-1], fmt.row_bytes(shape[-1]))
        writer.add_tensor(tensor.name, blocks, raw_dtype=gguf.GGMLQuantizationType(fmt.id))  # byte shape
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
