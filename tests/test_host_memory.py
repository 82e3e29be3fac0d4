"""moetier.model.host_memory: resident copies in memory advised for huge pages, exact, aligned, and released."""

from __future__ import annotations

import gc

import pytest
import torch

from moetier.model import host_memory
from moetier.model.host_memory import HUGE_PAGE_BYTES, HostArena, host_buffer, host_cat, host_copy


def _advised_ranges() -> list[tuple[int, int]] | None:
    """The address ranges of this process's mappings advised MADV_HUGEPAGE ("hg" in /proc/self/smaps), or None."""
    try:
        text = open("/proc/self/smaps").read()
    except OSError:
        return None
    ranges, current = [], None
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:  # a mapping's first line: start-end perms ...
            start, end = (int(v, 16) for v in head.split("-"))
            current = (start, end)
        elif line.startswith("VmFlags:") and " hg" in f" {line.split(':', 1)[1]}":
            ranges.append(current)
    return ranges


def _advised_bytes() -> int | None:
    """kB of this process's mappings advised MADV_HUGEPAGE, or None."""
    ranges = _advised_ranges()
    return None if ranges is None else sum(end - start for start, end in ranges) // 1024


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float32, torch.bfloat16, torch.float16, torch.int64])
def test_copy_is_exact_contiguous_and_aligned(dtype):
    source = (torch.randn(37, 129) * 100).to(dtype).t()  # not contiguous
    out = host_copy(source)
    assert out.dtype == dtype and out.shape == source.shape and out.is_contiguous()
    assert torch.equal(out, source)
    assert out.data_ptr() % 64 == 0
    assert out.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()  # its own memory


def test_cat_stacks_rows_as_torch_does():
    parts = [torch.randint(0, 256, (n, 40), dtype=torch.uint8) for n in (3, 0, 5)]
    assert torch.equal(host_cat(parts), torch.cat(parts))
    floats = [torch.randn(2, 3, 4), torch.randn(1, 3, 4)]
    assert torch.equal(host_cat(floats), torch.cat(floats))


def test_arena_carves_consecutive_tensors_and_starts_new_chunks():
    arena = HostArena(chunk_bytes=4 * HUGE_PAGE_BYTES)
    tensors = [arena.copy(torch.full((300_000,), i, dtype=torch.uint8)) for i in range(40)]  # ~12 MB: several chunks
    for i, t in enumerate(tensors):
        assert t.data_ptr() % 64 == 0 and int(t.min()) == int(t.max()) == i  # no tensor overwrote another
    assert tensors[1].data_ptr() - tensors[0].data_ptr() == -(-300_000 // 64) * 64
    big = arena.copy(torch.ones(HUGE_PAGE_BYTES * 3, dtype=torch.uint8))  # over a quarter chunk: a chunk of its own
    assert big.data_ptr() % HUGE_PAGE_BYTES == 0 and int(big.sum()) == HUGE_PAGE_BYTES * 3


@pytest.mark.skipif(not host_memory.huge_pages_wanted(), reason="no MADV_HUGEPAGE here, or MOETIER_HUGE_PAGES=0")
def test_chunks_are_advised_and_released():
    before = _advised_bytes()
    if before is None:
        pytest.skip("no /proc/self/smaps")
    if not host_memory._Chunk(HUGE_PAGE_BYTES).advised:
        pytest.skip("this kernel refuses MADV_HUGEPAGE (no transparent huge pages)")
    buffer = host_buffer(64 << 20)
    assert buffer.data_ptr() % HUGE_PAGE_BYTES == 0
    assert _advised_bytes() - before >= 64 << 10  # kB: the whole buffer advised
    del buffer
    gc.collect()
    assert _advised_bytes() - before < 64 << 10  # the mapping went with its last tensor


@pytest.mark.skipif(not host_memory.huge_pages_wanted(), reason="no MADV_HUGEPAGE here, or MOETIER_HUGE_PAGES=0")
@pytest.mark.parametrize("source", ["hf", "gguf"])
def test_an_engine_on_the_cpu_holds_its_weights_in_advised_memory(synth_models, tmp_path, source):
    """Experts, the trunk's matrices and the embedding of a CPU engine, from safetensors or GGUF, all lie in
    mappings advised for huge pages."""
    from moetier.engine import Engine
    from moetier.model import open_checkpoint
    from moetier.model.gguf_write import write_gguf

    if not host_memory._Chunk(HUGE_PAGE_BYTES).advised:
        pytest.skip("this kernel refuses MADV_HUGEPAGE (no transparent huge pages)")
    folder = synth_models("qwen3_moe")
    path = folder if source == "hf" else write_gguf(folder, tmp_path / "f32.gguf")[0]
    engine = Engine(open_checkpoint(path))
    ranges = _advised_ranges()
    if ranges is None:
        pytest.skip("no /proc/self/smaps")
    layer = engine.spec.moe_layers[0]
    expert = engine.executor.placed[layer][1]
    held = {"gate_up": expert.gate_up, "down": expert.down, "qkv": engine.layers[layer].qkv.parts[0][0],
            "o_proj": engine.layers[layer].o_proj.parts[0][0], "lm_head": engine.lm_head.parts[0][0], "embed": engine.embed.data}
    for name, t in held.items():
        start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        assert any(lo <= start and end <= hi for lo, hi in ranges), f"{name} is not in advised memory"


def test_switched_off_gives_plain_copies(monkeypatch):
    monkeypatch.setenv("MOETIER_HUGE_PAGES", "0")
    assert not host_memory.huge_pages_wanted()
    source = torch.randn(5, 6)
    assert torch.equal(host_copy(source), source) and torch.equal(host_cat([source, source]), torch.cat([source, source]))
    assert host_buffer(100).shape == (100,)
    assert host_memory.describe().startswith("plain memory")


def test_a_kernel_that_refuses_the_advice_still_gets_copies(monkeypatch):
    """Where madvise(MADV_HUGEPAGE) fails (a kernel without transparent huge pages), chunks are plain memory."""
    import mmap

    def refuse(self, *args):
        raise OSError(22, "Invalid argument")

    class Refusing(mmap.mmap):
        madvise = refuse

    monkeypatch.setattr(host_memory.mmap, "mmap", Refusing)
    arena = HostArena(chunk_bytes=4 * HUGE_PAGE_BYTES)
    source = torch.randn(100, 100)
    assert torch.equal(arena.copy(source), source) and not arena._chunk.advised


def test_device_tensors_are_refused():
    with pytest.raises(ValueError, match="host tensor"):
        HostArena().copy(torch.empty(3, device="meta"))


def test_thp_mode_reads_the_setting():
    assert host_memory.thp_mode() in ("always", "madvise", "never", "unknown")
    if host_memory.huge_pages_wanted():
        assert host_memory.describe() == f"memory advised for huge pages, THP {host_memory.thp_mode()}"
