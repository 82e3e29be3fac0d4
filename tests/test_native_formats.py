"""The native kernel on every stored format: its dequantizers are gguf's bit for bit; decode on stored
experts is the math on gguf's values with each matrix's input converted as its dot product takes it
(llama.cpp's activation formats, moetier.backends.activations), up to float32 summation order; the
fallback family is bit for bit the float32 kernel on the dequantized values; the lane is `run`'s bits."""

from __future__ import annotations

from array import array

import gguf.quants
import numpy as np
import pytest
import torch
from quant_blocks import BLOCK_FORMATS, random_float_rows, random_rows

from moetier.backends import activations, cpu_kernels, cpu_lane
from moetier.model import ExpertWeights
from moetier.model.formats import BY_NAME, FORMATS, GGML_FORMATS, Format, format_of

kernel = cpu_kernels.decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason=f"native kernel {cpu_kernels.status()}")
FLOAT_FORMATS = tuple(BY_NAME[name] for name in ("F32", "F16", "BF16"))


def stored(fmt: Format, rows: int, cols: int, rng: np.random.Generator, scale: float = 0.01) -> torch.Tensor:
    """Random valid rows of `fmt`: uint8 [rows, row_bytes] of blocks, or [rows, cols] of its float dtype."""
    if fmt.dtype is not None:
        return random_float_rows(fmt, rows, cols, rng) * scale
    return torch.from_numpy(random_rows(fmt, rows, cols, rng, scale))


def reference(data: torch.Tensor, fmt: Format) -> np.ndarray:
    """gguf.quants.dequantize of data's stored bytes -> float32 [rows, cols]."""
    raw = data.contiguous().view(torch.uint8).numpy()  # [rows, row bytes], whatever the format
    return gguf.quants.dequantize(raw, fmt.id)


def test_formats_are_every_stored_format():
    """Every format a file holds is tested here; moetier's resident layouts (IQ3_XXS_T, IQ3_S_T) in their own tests."""
    assert set(GGML_FORMATS) == {f.id for f in BLOCK_FORMATS + FLOAT_FORMATS}
    assert set(FORMATS) - set(GGML_FORMATS) == {BY_NAME["IQ3_XXS_T"].id, BY_NAME["IQ3_S_T"].id}


@pytest.mark.parametrize("fmt", BLOCK_FORMATS + FLOAT_FORMATS, ids=lambda f: f.name)
def test_dequantize_is_gguf_bit_for_bit(fmt):
    """One block, a row of three, and a matrix of 7 rows of five blocks (256-value blocks: fewer)."""
    rng = np.random.default_rng(fmt.id)
    blocks = (1, 3) if fmt.block == 256 else (1, 3, 5)
    for rows, per_row in [(1, b) for b in blocks] + [(7, blocks[-1])]:
        cols = fmt.block * per_row if fmt.block > 1 else 33 * per_row
        data = stored(fmt, rows, cols, rng)
        got = kernel.dequantize(data, fmt.id, cols)  # [rows, cols]
        assert got.dtype == torch.float32 and got.shape == (rows, cols)
        assert np.array_equal(got.numpy().view(np.uint32), reference(data, fmt).view(np.uint32)), (fmt.name, rows, cols)


@pytest.mark.parametrize("name, view", [("F16", torch.float16), ("BF16", torch.bfloat16)])
def test_every_16_bit_pattern_converts_as_gguf_converts_it(name, view):
    """Subnormals, infinities and NaN payloads (signalling ones stay signalling, as numpy leaves them)."""
    patterns = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(view).reshape(256, 256)  # [256, 256]
    got = kernel.dequantize(patterns, BY_NAME[name].id, 256)
    assert np.array_equal(got.numpy().view(np.uint32), reference(patterns, BY_NAME[name]).view(np.uint32))


def test_bad_input_is_refused_before_c_with_one_line():
    q4k, rng = BY_NAME["Q4_K"], np.random.default_rng(0)
    good = stored(q4k, 4, 512, rng)
    cases = [
        (lambda: kernel.dequantize(good, 99, 512), "GGML type 99 is not a stored format"),
        (lambda: kernel.dequantize(good, q4k.id, 256), r"Q4_K \[4, 256\] is torch.uint8 \[4, 144\], got torch.uint8 \[4, 288\]"),
        (lambda: kernel.dequantize(good, q4k.id, 500), "not a whole number of 256-value blocks"),
        (lambda: kernel.dequantize(good.float(), q4k.id, 512), "got torch.float32"),
        (lambda: kernel.dequantize(good[:, ::2], q4k.id, 256), "contiguous in host memory"),
        (lambda: kernel.dequantize(good.reshape(-1), q4k.id, 512), "expected a matrix"),
        (lambda: kernel.dequantize(torch.zeros(2, 8), BY_NAME["F16"].id, 8), "F16 \\[2, 8\\] is torch.float16"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message) as caught:
            call()
        assert "\n" not in str(caught.value)
    down = stored(BY_NAME["Q6_K"], 512, 256, rng)
    with pytest.raises(ValueError, match="expert down: Q4_K"):  # down's bytes labelled with the wrong format
        cpu_kernels.expert_record(ExpertWeights(stored(q4k, 512, 512, rng), down, False, q4k.id, q4k.id))
    with pytest.raises(ValueError, match="expert gate_up: Q4_K \\[512, 256\\]"):  # a call of another hidden size
        cpu_kernels.expert_record(ExpertWeights(stored(q4k, 512, 512, rng), down, False, q4k.id, BY_NAME["Q6_K"].id), 256)


DIM, INTER, K = 512, 256, 3
DECODE_CASES = [(f.name, f.name) for f in BLOCK_FORMATS + FLOAT_FORMATS] + [("Q4_K", "Q6_K"), ("Q8_0", "F32"), ("F16", "IQ4_XS")]


def decode_case(gate_up_name: str, down_name: str, seed: int):
    """K random experts (gate_up in one format, down in another), their gguf-dequantized float32 twins, and an
    x [1, D] scaled so the gate's pre-activations are of order one."""
    rng = np.random.default_rng(seed)
    gate_up_fmt, down_fmt = BY_NAME[gate_up_name], BY_NAME[down_name]
    experts = [ExpertWeights(stored(gate_up_fmt, 2 * INTER, DIM, rng), stored(down_fmt, DIM, INTER, rng), False,
                             gate_up_fmt.id, down_fmt.id) for _ in range(K)]
    twins = [ExpertWeights(torch.from_numpy(reference(w.gate_up, gate_up_fmt)), torch.from_numpy(reference(w.down, down_fmt)))
             for w in experts]  # [2I, D], [D, I] float32
    rms = float(np.sqrt(np.mean([t.gate_up.double().pow(2).mean().item() for t in twins])))
    x = torch.from_numpy(rng.standard_normal((1, DIM)).astype(np.float32)) / (rms * DIM ** 0.5)  # [1, D]
    return experts, twins, x, [0.5, 0.3, 0.2]


def float64_dot(x: np.ndarray, data: torch.Tensor, qtype: int, float_acts: bool) -> np.ndarray:
    """x [T, n] float32 times a stored matrix [rows, ...] of GGML type qtype -> [T, rows] float64: gguf's values of the
    weights times x converted to the kernel's activation format for qtype and back (moetier.backends.activations:
    llama.cpp's bytes), in float64. Q8_1 activations (Q4_1, Q5_1 weights) also carry each block's sum s as float16,
    which the dot product multiplies by the weight block's minimum m: that rounding is added here too."""
    act, n = kernel.act_type(qtype, float_acts), x.shape[-1]
    xq = activations.quantize(act, x.astype(np.float32))  # [T, act row bytes]
    weights = reference(data, format_of(qtype)).astype(np.float64)  # [rows, n]
    y = activations.dequantize(act, xq, n).astype(np.float64) @ weights.T
    if act == activations.ACT_Q8_1:
        blocks = xq.reshape(-1).view(activations.Q8_1_BLOCK).reshape(len(x), n // 32)  # [T, n / 32]
        rounding = blocks["s"].astype(np.float64) - blocks["d"].astype(np.float64) * blocks["qs"].astype(np.float64).sum(-1)
        fmt = format_of(qtype)
        raw = data.contiguous().view(torch.uint8).numpy().reshape(-1, fmt.block_bytes)  # [rows * n / 32, block bytes]
        minimum = raw[:, 2:4].copy().view(np.float16).astype(np.float64).reshape(len(weights), n // 32)  # m, after d
        y += rounding @ minimum.T
    return y


def float64_ffn(x: np.ndarray, w: ExpertWeights) -> np.ndarray:
    """x [T, D] float32 -> [T, D] float64: one expert, each matrix by `float64_dot`, the SwiGLU in float64 (its
    output rounded to float32 before down's conversion, as the kernel holds it)."""
    h = float64_dot(x, w.gate_up, w.gate_up_type, w.float_acts)  # [T, 2I]
    inter = h.shape[1] // 2
    hidden = h[:, :inter] / (1 + np.exp(-h[:, :inter])) * h[:, inter:]  # [T, I]
    return float64_dot(hidden.astype(np.float32), w.down, w.down_type, w.float_acts)


def float64_decode(x: torch.Tensor, experts: list[ExpertWeights], scales: list[float]) -> torch.Tensor:
    """x [1, D] -> [1, D] float64: sum_j scales[j] * float64_ffn_j(x)."""
    return torch.from_numpy(sum(s * float64_ffn(x.numpy(), w) for w, s in zip(experts, scales)))


@pytest.mark.parametrize("gate_up_name, down_name", DECODE_CASES, ids=lambda name: name)
def test_decode_on_stored_experts_is_the_math_on_their_values_and_converted_activations(gate_up_name, down_name):
    """Within 2e-6 of the output's scale of float64 on gguf's values, each matrix's input converted to the activation
    format its dot product takes (llama.cpp's for a native family's format, float32 on the fallback); the lane gives
    run's bits."""
    experts, _, x, scales = decode_case(gate_up_name, down_name, seed=len(gate_up_name) * 31 + len(down_name))
    got = kernel.run(x, experts, scales)  # [1, D]
    exact = float64_decode(x, experts, scales)
    scale = exact.abs().max().item()
    assert scale > 0 and (got.double() - exact).abs().max().item() <= 2e-6 * scale  # seen: 0.7e-7 .. 3.4e-7
    lane = cpu_lane.NativeLane(kernel, 1)
    try:
        records = b"".join(map(cpu_kernels.expert_record, experts))
        assert torch.equal(lane.submit(x, records, array("f", scales), INTER).result(), got)
    finally:
        lane.close()


FALLBACK_PROBE = """
import sys, torch
sys.path.insert(0, {tests!r})
import test_native_formats as t
from moetier.backends import cpu_kernels
for gate_up, down in (("Q4_K", "Q6_K"), ("F16", "IQ4_XS"), ("Q8_0", "F32"), ("BF16", "BF16")):
    experts, twins, x, scales = t.decode_case(gate_up, down, seed=3)
    assert all(t.kernel.act_type(w.gate_up_type, True) == 0 for w in experts), "fallback activations are float32"
    assert torch.equal(t.kernel.run(x, experts, scales), t.kernel.run(x, twins, scales)), (gate_up, down)
print(cpu_kernels.status())
"""


def test_the_fallback_family_is_the_float32_kernel_on_dequantized_values():
    """MOETIER_DOT_FAMILIES=0: every format dequantized a row at a time and dotted as float32 rows are, so stored
    experts give the bits of their float32 twins."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-c", FALLBACK_PROBE.format(tests=str(Path(__file__).parent))], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "MOETIER_DOT_FAMILIES": "0"})
    assert done.returncode == 0, done.stderr
    assert "fallback dots for every format (MOETIER_DOT_FAMILIES=0)" in done.stdout


def test_a_lane_split_over_threads_gives_run_s_bits_every_time():
    experts, _, x, scales = decode_case("Q4_K", "Q6_K", seed=7)
    expected = kernel.with_threads(1).run(x, experts, scales)
    lane = cpu_lane.NativeLane(kernel, 2)
    try:
        records = b"".join(map(cpu_kernels.expert_record, experts))
        outs = [ticket.result() for ticket in [lane.submit(x, records, array("f", scales), INTER) for _ in range(4)]]
    finally:
        lane.close()
    assert all(torch.equal(out, expected) for out in outs)
