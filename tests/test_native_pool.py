"""The native kernels on their thread pool: the same bits for 1, 2 and 3 threads (decode, prefill `experts`,
`linear`, the lane); decode and `linear` against float64 on gguf's values with the activations converted as
each format's dot product takes them (moetier.backends.activations); prefill equal to one decode per token;
bad arguments refused in Python; and the cost of handing a tiny call to the pool, printed."""

from __future__ import annotations

import time
from array import array

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_native_formats import float64_decode, float64_dot, float64_ffn, stored

from moetier.backends import ExpertWork, cpu_kernels, cpu_lane
from moetier.model import ExpertWeights
from moetier.model.formats import BY_NAME

kernel = cpu_kernels.decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"native kernel {cpu_kernels.status()}")
THREADS = (1, 2, 3)
# (gate_up format, down format, float_acts)
CASES = [("F32", "F32", True), ("BF16", "BF16", True), ("BF16", "BF16", False), ("F16", "F16", False), ("Q8_0", "Q8_0", False),
         ("Q4_K", "Q6_K", False), ("Q4_1", "Q5_K", False), ("IQ4_XS", "IQ4_NL", False)]


def experts_of(gate_up: str, down: str, float_acts: bool, count: int, dim: int, inter: int, seed: int):
    """`count` random experts in those formats, and x [8, D] scaled so the gate's pre-activations are of order one."""
    rng = np.random.default_rng(seed)
    up_fmt, down_fmt = BY_NAME[gate_up], BY_NAME[down]
    experts = [ExpertWeights(stored(up_fmt, 2 * inter, dim, rng), stored(down_fmt, dim, inter, rng), False, up_fmt.id, down_fmt.id,
                             float_acts) for _ in range(count)]
    rms = float(np.sqrt(np.mean([kernel.dequantize(w.gate_up, w.gate_up_type, dim).double().pow(2).mean().item() for w in experts])))
    x = torch.from_numpy(rng.standard_normal((8, dim)).astype(np.float32)) / (rms * dim ** 0.5)  # [8, D]
    return experts, x


def groups_of(experts, tokens: int, seed: int) -> list[ExpertWork]:
    """Each expert serves a random subset of the tokens (token 0 served by none), with random weights."""
    g = torch.Generator().manual_seed(seed)
    work = []
    for w in experts:
        rows = torch.nonzero(torch.rand(tokens, generator=g) < 0.6).flatten()
        rows = rows[rows != 0]
        work.append(ExpertWork(w, rows, torch.rand(rows.numel(), generator=g)))
    return work


@pytest.mark.parametrize("gate_up, down, float_acts", CASES, ids=lambda v: str(v))
def test_decode_experts_and_linear_give_the_same_bits_on_any_thread_count(gate_up, down, float_acts):
    """The same bits from 1, 2 and 3 pool threads. A one-token job's granules depend on the thread count
    (cpu_kernels.c one_token_grain): here F32's decode call (7.5 MB) is cut in 1 MiB, 960 KiB and 640 KiB granules,
    BF16's in 960, 480 and 320 KiB, Q8_0's in 510 and 256 KiB."""
    experts, x = experts_of(gate_up, down, float_acts, count=5, dim=512, inter=256, seed=len(gate_up) + len(down))
    scales = [0.4, 0.3, 0.15, 0.1, 0.05]
    groups = groups_of(experts, 7, seed=1)
    results = []
    for threads in THREADS:
        k = kernel.with_threads(threads)
        assert k.pool.threads == threads
        results.append((k.run(x[:1], experts, scales), k.experts(x[:7], groups),
                        k.linear(x, experts[0].gate_up, experts[0].gate_up_type, float_acts)))
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(result, results[0]))


@pytest.mark.parametrize("gate_up, down, float_acts", CASES, ids=lambda v: str(v))
def test_decode_and_linear_are_float64_on_gguf_values_and_converted_activations(gate_up, down, float_acts):
    """8 experts, D = 512, I = 256 (many granules each): within 1e-5 of the output's scale."""
    experts, x = experts_of(gate_up, down, float_acts, count=8, dim=512, inter=256, seed=3)
    scales = list(np.linspace(0.3, 0.05, 8))
    got, exact = kernel.run(x[:1], experts, scales), float64_decode(x[:1], experts, scales)
    scale = exact.abs().max().item()
    assert scale > 0 and (got.double() - exact).abs().max().item() <= 1e-5 * scale
    w = experts[1]
    y, y_exact = kernel.linear(x, w.gate_up, w.gate_up_type, float_acts), float64_dot(x.numpy(), w.gate_up, w.gate_up_type, float_acts)
    assert y.shape == (8, 512) and np.abs(y.double().numpy() - y_exact).max() <= 1e-5 * np.abs(y_exact).max()


@pytest.mark.parametrize("gate_up, down, float_acts", CASES[::2], ids=lambda v: str(v))
def test_prefill_experts_equal_one_decode_call_per_token(gate_up, down, float_acts):
    experts, x = experts_of(gate_up, down, float_acts, count=6, dim=256, inter=256, seed=5)
    groups = groups_of(experts, 7, seed=2)
    out = kernel.experts(x[:7], groups)  # [7, D]
    assert torch.equal(out[0], torch.zeros(256))  # a token no expert serves
    for t in range(1, 7):
        picks = [(g.expert, g.weights[(g.rows == t).nonzero()].item()) for g in groups if (g.rows == t).any()]
        one = kernel.run(x[t:t + 1], [w for w, _ in picks], [s for _, s in picks])
        assert (out[t] - one[0]).abs().max().item() <= 1e-6 * one.abs().max().item()
    reference = sum(s * float64_ffn(x[t:t + 1].numpy(), w) for w, s in picks)  # the last token's, against float64
    assert np.abs(out[6].double().numpy() - reference[0]).max() <= 1e-5 * np.abs(reference).max()


@pytest.mark.parametrize("threads, joins", [(2, None), (2, True), (1, True), (1, False)])
def test_the_lane_gives_run_s_bits_with_every_thread(threads, joins):
    """Whichever threads compute a call (the pool's, and a collecting caller that joins), its bits are run's."""
    experts, x = experts_of("Q4_K", "Q6_K", False, count=8, dim=512, inter=256, seed=9)
    scales = array("f", np.linspace(0.3, 0.05, 8))
    expected = kernel.with_threads(1).run(x[:1], experts, list(scales))
    lane = cpu_lane.NativeLane(kernel, threads, joins=joins)
    try:
        records = b"".join(map(cpu_kernels.expert_record, experts))
        assert len(records) == 8 * cpu_kernels.RECORD.size == 320 and lane.threads == threads
        tickets = [lane.submit(x[:1], records, scales, 256) for _ in range(lane.SLOTS)]
        assert all(torch.equal(ticket.result(), expected) for ticket in tickets)
    finally:
        lane.close()


def test_concurrent_callers_take_turns_and_a_forked_child_computes_alone():
    """Two Python threads and a lane on one pool get run's bits; in a forked child (its helpers stayed in the
    parent) the caller takes every granule itself, to the same bits."""
    import os
    import threading

    experts, x = experts_of("Q8_0", "Q6_K", False, count=8, dim=512, inter=256, seed=4)
    scales = list(np.linspace(0.3, 0.05, 8))
    k = kernel.with_threads(2)
    expected = k.run(x[:1], experts, scales)
    lane = cpu_lane.NativeLane(k, 2)
    records, floats = b"".join(map(cpu_kernels.expert_record, experts)), array("f", scales)
    got: list[torch.Tensor] = []

    def calls():
        got.extend(k.run(x[:1], experts, scales) for _ in range(20))

    try:
        threads = [threading.Thread(target=calls) for _ in range(2)]
        for thread in threads:
            thread.start()
        got.extend(lane.submit(x[:1], records, floats, 256).result() for _ in range(20))
        for thread in threads:
            thread.join()
    finally:
        lane.close()
    assert len(got) == 60 and all(torch.equal(out, expected) for out in got)
    child = os.fork()
    if child == 0:
        os._exit(0 if torch.equal(k.run(x[:1], experts, scales), expected) else 1)
    assert os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]) == 0


def test_bad_arguments_are_one_value_error_before_c():
    experts, x = experts_of("Q8_0", "Q8_0", False, count=2, dim=64, inter=32, seed=1)
    w = experts[0]
    rows = lambda *r: torch.tensor(r, dtype=torch.int64)  # noqa: E731
    cases = [
        (lambda: kernel.linear(x.double(), w.gate_up, w.gate_up_type, False), "linear: x must be float32 \\[T, n\\]"),
        (lambda: kernel.linear(x, w.gate_up, 99, False), "GGML type 99 is not a stored format"),
        (lambda: kernel.linear(x[:, :32], w.gate_up, w.gate_up_type, False), "Q8_0 \\[64, 32\\] is torch.uint8 \\[64, 34\\]"),
        (lambda: kernel.linear(x, w.gate_up.reshape(-1), w.gate_up_type, False), "weights must be a matrix"),
        (lambda: kernel.experts(x, [ExpertWork(w, rows(0, 8), torch.ones(2))]), "rows must lie in \\[0, 8\\), got 0..8"),
        (lambda: kernel.experts(x, [ExpertWork(w, rows(0, 1), torch.ones(3))]), "rows must be int64 \\[n\\]"),
        (lambda: kernel.experts(x[:, :32], [ExpertWork(w, rows(0), torch.ones(1))]), "expert gate_up: Q8_0 \\[64, 32\\]"),
        (lambda: kernel.linear(x[:, :0], w.gate_up, w.gate_up_type, False), "at least one column"),
        (lambda: kernel.run(x[:1], [ExpertWeights(torch.zeros(0, 64), torch.zeros(64, 0))], [1.0]), "width 0 \\(expected at least 1"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    assert torch.equal(kernel.experts(x, []), torch.zeros(8, 64))
    assert kernel.linear(x[:0], w.gate_up, w.gate_up_type, False).shape == (0, 64)


def test_the_read_probe_sums_what_it_reads_the_same_for_any_thread_count():
    """The roofline's native reader (moetier.calibrate.read_probes): the sum of every value, tails and a partial
    last granule included, the same float for 1, 2 and 3 threads; and the bandwidth dict names its readers."""
    from moetier.calibrate import read_bandwidth_bytes_per_s

    x = torch.from_numpy(np.random.default_rng(5).standard_normal(3 * 2**18 + 77, dtype=np.float32))  # 3 granules and a tail
    for plain in (False, True):
        sums = {t: kernel.with_threads(t).read_sum(x, plain=plain) for t in THREADS}
        assert len(set(sums.values())) == 1, (plain, sums)
        assert sums[1] == pytest.approx(x.double().sum().item(), abs=1e-3)
    for plain in (False, True):
        assert kernel.read_sum(x[:0], plain) == 0.0 and kernel.read_sum(x[:5], plain) == pytest.approx(x[:5].double().sum().item(), abs=1e-5)
    with pytest.raises(ValueError, match="read_sum: x must be float32"):
        kernel.read_sum(x.double())
    rates = read_bandwidth_bytes_per_s(2, nbytes=64 << 20, repeats=2)
    assert set(rates) == {"torch.sum", "native", "native plain", "best"}
    assert rates["best"] == max(v for name, v in rates.items() if name != "best") > 0
    held = torch.ones(16 << 20)  # a caller's own buffer (bench_decode keeps one for the run): read, not replaced
    assert read_bandwidth_bytes_per_s(1, nbytes=64 << 20, repeats=1, buffer=held)["best"] > 0
    for wrong in (held[:-1], held.double(), held.view(-1, 2)[:, 0]):
        with pytest.raises(ValueError, match="read_probes: buffer must be"):
            read_bandwidth_bytes_per_s(1, nbytes=64 << 20, repeats=1, buffer=wrong)


@pytest.mark.parametrize("tokens, n", [(1, 5), (8, 64), (37, 2048), (256, 100)])
def test_rms_norm_on_the_pool_is_torchs(tokens, n):
    """Prefill's RMSNorm on the pool: F.rms_norm's values to float32 rounding (the sums' order differs), with and
    without a weight, rows whose width is not a multiple of 32 included; the same bits for 1, 2 and 3 threads (a row
    is one granule's); bad arguments refused in Python."""
    gen = torch.Generator().manual_seed(tokens * 1000 + n)
    x = torch.randn(tokens, n, generator=gen) * 3
    w = torch.randn(n, generator=gen)
    for weight in (w, None):
        ref = F.rms_norm(x.double(), (n,), None if weight is None else weight.double(), 1e-6)
        outs = [kernel.with_threads(t).rms_norm(x, weight, 1e-6) for t in THREADS]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        assert (outs[0].double() - ref).abs().max().item() <= 4e-7 * ref.abs().max().item()
    assert torch.equal(kernel.rms_norm(x.t().contiguous().t(), w, 1e-6), kernel.rms_norm(x, w, 1e-6))  # a strided view
    with pytest.raises(ValueError, match="rms_norm: weight must be float32"):
        kernel.rms_norm(x, w[:-1] if n > 1 else w.double(), 1e-6)
    with pytest.raises(ValueError, match="rms_norm: x must be float32"):
        kernel.rms_norm(x.double(), w, 1e-6)


def test_hand_off_cost_of_a_tiny_call(capsys):
    """8 float32 experts of [64, 64] / [64, 32]: the work is ~0.2 MB, so a call's time is mostly its hand-off
    (Python and ctypes, then waking the pool). Printed, not judged: a loaded CI machine is slower."""
    experts = [ExpertWeights(torch.randn(64, 64) * 0.1, torch.randn(64, 32) * 0.1) for _ in range(8)]
    x, scales = torch.randn(1, 64), [0.125] * 8
    records, floats = b"".join(map(cpu_kernels.expert_record, experts)), array("f", scales)
    lines = []
    for threads in (1, 2):
        k = kernel.with_threads(threads)
        lane = cpu_lane.NativeLane(k, threads)
        try:
            for label, call in (("run", lambda: k.run(x, experts, scales)),
                                ("lane", lambda: lane.submit(x, records, floats, 32).result())):
                for _ in range(200):
                    call()
                times = []
                for _ in range(2000):
                    start = time.perf_counter()
                    call()
                    times.append(time.perf_counter() - start)
                lines.append(f"{label} {threads} thread(s): median {np.median(times) * 1e6:.1f} us, p90 {np.quantile(times, 0.9) * 1e6:.1f} us")
        finally:
            lane.close()
    with capsys.disabled():
        print("\nhand-off of a tiny call: " + "; ".join(lines))


@pytest.mark.parametrize("tokens, heads, d, rd", [(1, 1, 4, 4), (37, 6, 64, 64), (70, 3, 128, 32), (5, 2, 16, 0)])
def test_rotary_on_the_pool_is_the_tables(tokens, heads, d, rd):
    """Prefill's rotary on the pool: RotaryTable.apply's values (HF's rotate_half) to float32 rounding, with the heads'
    transpose fused, from a strided slice of the projections (the engine's q and k beside v); the same bits for 1, 2
    and 3 threads; bad arguments refused in Python."""
    from moetier.engine.layers import RotaryTable

    gen = torch.Generator().manual_seed(tokens + heads + d + rd)
    table = RotaryTable(rd, 10000.0, torch.device("cpu"))
    projections = torch.randn(tokens, heads + 2, d, generator=gen)
    x = projections[:, :heads]  # [T, heads, d], token stride (heads + 2) d
    start = 9
    ref = table.apply(x.transpose(0, 1), start)  # [heads, T, d]
    cos, sin = table.rows(start, start + tokens)
    outs = [kernel.with_threads(t).rotary(x, cos, sin) for t in THREADS]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert outs[0].shape == ref.shape and (outs[0] - ref).abs().max().item() <= 1e-6 * max(1.0, ref.abs().max().item())
    with pytest.raises(ValueError, match="rotary: x must be float32"):
        kernel.rotary(x.transpose(1, 2), cos, sin)
    with pytest.raises(ValueError, match="rotary: cos must be float32"):
        kernel.rotary(x, cos[:-1] if tokens > 1 else cos.double(), sin)


STREAMS_PROBE = """
import json
from moetier.backends import cpu_kernels, cpu_streams, dot_kernels
kernel = cpu_kernels.decode_kernel(2)
kernel.read_sum(__import__("torch").ones(4))
chosen = cpu_streams._CHOICE["plain"]
eight = dot_kernels.dot_kernels().set_plain_streams(True)  # whether this build has the eight-stream path
print(json.dumps({"why": cpu_streams.streams(), "plain": chosen, "eight": eight}))
"""


def test_the_float_formats_streams_are_chosen_once_per_host(tmp_path):
    """moetier.backends.cpu_streams: $MOETIER_STREAMS decides, a wrong value is one clear error; else the two read
    probes are measured when the first pool opens, kept in moetier's home, and the next process reads them."""
    import json
    import os
    import subprocess
    import sys

    from moetier.native import moetier_home

    (tmp_path / "native").mkdir()
    for built in (moetier_home() / "native").glob("*.so"):  # the builds, not 25 s of cc again; no streams file
        (tmp_path / "native" / built.name).symlink_to(built)

    def probe(**env):
        done = subprocess.run([sys.executable, "-c", STREAMS_PROBE], capture_output=True, text=True, timeout=300,
                              env={**os.environ, "MOETIER_HOME": str(tmp_path), "MOETIER_STREAMS": "", **env})
        return done.returncode, done.stdout.strip().splitlines()[-1:] or [""], done.stderr

    for asked in ("prefetched", "plain"):
        code, (line,), err = probe(MOETIER_STREAMS=asked)
        assert code == 0, err
        got = json.loads(line)
        assert got["why"] == f"{asked} ($MOETIER_STREAMS)" and isinstance(got["plain"], bool)
        assert got["plain"] is (asked == "plain" and got["eight"])
    assert not list((tmp_path / "native").glob("streams-*.json"))
    code, _, err = probe(MOETIER_STREAMS="fast")
    assert code != 0 and "MOETIER_STREAMS must be plain or prefetched, got 'fast'" in err
    code, (line,), err = probe()
    assert code == 0, err
    first = json.loads(line)
    kept = list((tmp_path / "native").glob("streams-*.json"))
    assert len(kept) == 1 and first["why"].startswith(("plain (read ", "prefetched (read ")), first
    rates = json.loads(kept[0].read_text())
    assert set(rates) == {"plain", "prefetched"} and min(rates.values()) > 0
    assert first["plain"] is (rates["plain"] > 1.03 * rates["prefetched"] and first["eight"])
    written = kept[0].stat().st_mtime_ns
    code, (line,), err = probe()
    assert code == 0 and json.loads(line) == first and kept[0].stat().st_mtime_ns == written  # read, not measured again
