"""FP8 tensor math: quantize → dequantize error bounds and the scaled matmul, on the CPU."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from treadle.core.loading.quantization import FP8_DTYPE, FP8_MAX
from treadle.kernels.fp8_ops import dequantize, fp8_matmul, quantize_per_channel, quantize_static

# e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values, and within
# half the smallest subnormal step (2^-10 of the scale) below 2^-6.
REL_STEP = 2.0**-4
SUBNORMAL_HALF_STEP = 2.0**-10


def _within_fp8_rounding(x: torch.Tensor, restored: torch.Tensor, scale: torch.Tensor) -> bool:
    bound = torch.maximum(x.abs() * REL_STEP, scale * SUBNORMAL_HALF_STEP) * (1 + 1e-6)
    return bool(((x - restored).abs() <= bound).all())


def test_per_channel_round_trip_is_within_fp8_rounding():
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(48, 64, generator=gen) * torch.logspace(-3, 2, 48)[:, None]  # rows of very different size
    weight[5] = 0.0  # an all-zero row must not divide by zero
    q, scale = quantize_per_channel(weight)
    assert q.dtype == FP8_DTYPE and scale.shape == (48, 1) and scale.dtype == torch.float32
    # Each row's largest value lands on the top of the FP8 range, so no row wastes range.
    nonzero = torch.arange(48) != 5
    assert torch.allclose(q.float().abs().amax(1)[nonzero], torch.full((47,), FP8_MAX))
    restored = dequantize(q, scale, torch.float32)
    assert torch.equal(restored[5], torch.zeros(64))
    assert _within_fp8_rounding(weight, restored, scale)
    assert (weight - restored).abs().max() > 0  # it is really quantized


def test_bfloat16_weights_round_trip_too():
    weight = torch.randn(32, 32, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    q, scale = quantize_per_channel(weight)
    restored = dequantize(q, scale, torch.bfloat16)
    assert restored.dtype == torch.bfloat16
    assert _within_fp8_rounding(weight.float(), restored.float(), scale) or (
        (weight.float() - restored.float()).abs() <= weight.float().abs() * (REL_STEP + 2**-8) + scale * 2**-10).all()


def test_static_activation_scale_saturates_instead_of_overflowing():
    x = torch.tensor([[1.0, -2.0, 1000.0, -1000.0]])
    q, scale = quantize_static(x, torch.tensor([0.5]))
    assert scale.shape == (1, 1) and scale.item() == 0.5
    assert q.float().tolist() == [[2.0, -4.0, FP8_MAX, -FP8_MAX]]  # no NaN for out-of-range values


def test_scaled_matmul_equals_the_dequantized_product():
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 64, generator=gen), torch.randn(40, 64, generator=gen)
    xq, xs = quantize_per_channel(x)  # per token = per row of x
    wq, ws = quantize_per_channel(w)
    y = fp8_matmul(xq, xs, wq, ws, torch.float32)
    expected = dequantize(xq, xs, torch.float32) @ dequantize(wq, ws, torch.float32).t()
    assert y.shape == (7, 40)
    assert torch.allclose(y, expected, rtol=1e-5, atol=1e-5)
    # And close to the unquantized product: two FP8 roundings of random data.
    assert (y - x @ w.t()).abs().max() < 0.1 * (x @ w.t()).abs().max()


SCRIPT = r"""
import torch
from treadle.core.loading.quantization import FP8_DTYPE, FP8_MAX
from treadle.kernels.fp8 import per_token_quant
# Rows built from values FP8 represents exactly (times a per-row factor), so the kernel's result is
# exact: the interpreter's own FP8 rounding is not what is tested here (it mis-rounds values that
# carry into the next binade), the scale and layout are.
every = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
grid = every[torch.isfinite(every)]  # all 254 finite e4m3 values, subnormals included, +-448 among them
rows = []
for i, factor in enumerate((2.0**-10, 1.0, 32.0)):  # powers of two: every product is exact in float16
    row = grid[torch.randperm(grid.numel(), generator=torch.Generator().manual_seed(i))]
    rows.append(torch.cat([row, torch.zeros(3)]) * factor)  # 257 columns: not a power of two
x = torch.stack(rows).to(torch.float16)
q, scale = per_token_quant(x, FP8_DTYPE, FP8_MAX, 1e-12)
ok_scale = torch.equal(scale.flatten(), torch.tensor([2.0**-10, 1.0, 32.0]))
ok_values = q.dtype == FP8_DTYPE and torch.equal(q.float() * scale, x.float())
zero_q, zero_scale = per_token_quant(torch.zeros(1, 20, dtype=torch.float16), FP8_DTYPE, FP8_MAX, 1e-12)
print("RESULT", ok_scale, ok_values, bool((zero_q.float() == 0).all()), zero_scale.item() > 0)
"""


def test_per_token_quant_kernel_under_the_triton_interpreter():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "RESULT True True True True" in done.stdout, done.stdout + done.stderr
