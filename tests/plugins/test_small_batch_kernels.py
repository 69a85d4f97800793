"""The small-batch Triton matmul under the Triton interpreter: every launch config, on FP8 weights with
per-row scales and on 16-bit weights without, against a float32 reference.

The interpreter's ``tl.dot`` multiplies bfloat16 operands' bit patterns (triton-lang/triton#11584), so the
``tl.dot`` path is checked with float16 activations (and float16 weights); the GEMV path, which has no
``tl.dot``, with both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from treadle.kernels.small_batch import FP8_CONFIGS, SIXTEEN_BIT_CONFIGS  # noqa: E402

CONFIGS = {"fp8": FP8_CONFIGS, "16bit": SIXTEEN_BIT_CONFIGS}

# N not a multiple of any BLOCK_N; K=1000 not a multiple of any BLOCK_K * SPLIT_K; K=200 leaves splits empty;
# 32 x 2048 fits the GEMV tiles exactly (their unmasked loads; GEMV configs only, the tl.dot tiles have no such path).
SHAPES = [(100, 1000), (40, 200), (32, 2048)]
EVEN_SHAPE = (32, 2048)
DOT_ROWS = [1, 16, 20]  # 16: a whole 16-row tile; 20: the 32-row tiles, part masked
GEMV_ROWS = [1, 3]  # GEMV configs run one program per row: more rows check nothing new, slowly
ROWS = sorted(set(DOT_ROWS + GEMV_ROWS))
# Outputs are rounded to 16 bits (bfloat16: 2^-9 relative); a lost or doubled K block is off by far more.
MAX_RELATIVE_ERROR = 1e-2
# silu(gate) * up rounds three times (gate and up, silu, the product) where the interpreter truncates bfloat16.
SILU_MUL_MAX_RELATIVE_ERROR = 2e-2

CHECKS = r"""
import json, sys
import torch
from treadle.kernels.fp8_ops import dequantize, quantize_per_channel, quantize_per_token
from treadle.kernels.fused_ops import rmsnorm_reference
from treadle.kernels.small_batch import (FP8_CONFIGS, SIXTEEN_BIT_CONFIGS, fuses_silu_mul,
                                                      small_batch_matmul)

errors = {}
gen = torch.Generator().manual_seed(0)
for n, k in json.loads(sys.argv[1]):
    dense = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None]
    fp8_weight, scale = quantize_per_channel(dense)
    for rows in json.loads(sys.argv[2]):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            weights = {"fp8": (FP8_CONFIGS, fp8_weight, scale, dequantize(fp8_weight, scale, torch.float32)),
                       "16bit": (SIXTEEN_BIT_CONFIGS, dense.to(dtype), None, dense.to(dtype).float())}
            for kind, (configs, weight, weight_scale, reference_weight) in weights.items():
                exact_x = x.float() @ reference_weight.t()
                # W8A8 configs multiply x quantized per token: against that x, to the same tolerance.
                quantized_x = dequantize(*quantize_per_token(x), torch.float32) @ reference_weight.t()
                for index, config in enumerate(configs):
                    if (dtype == torch.bfloat16 and not config.gemv) or rows not in (GEMV_ROWS if config.gemv
                                                                                     else DOT_ROWS):
                        continue
                    if [n, k] == EVEN_SHAPE and not config.gemv:
                        continue
                    if dtype == torch.bfloat16 and [n, k] != BFLOAT16_SHAPE:  # masking is the float16 runs' check
                        continue
                    reference = quantized_x if config.w8a8 else exact_x
                    y = small_batch_matmul(x, weight, weight_scale, config)
                    ok = y.dtype == dtype and y.shape == (rows, n)
                    error = ((y.float() - reference).norm() / reference.norm()).item() if ok else float("inf")
                    errors[f"{kind}-{index}-{n}x{k}-{rows}-{str(dtype)[6:]}"] = error
                    if config.gemv and rows == 1:  # the residual add and RMSNorm after the layer, in its last program
                        residual = torch.randn(1, n, generator=gen).to(dtype)
                        norm_weight = (torch.rand(n, generator=gen) + 0.5).to(dtype)
                        normed, summed = small_batch_matmul(x, weight, weight_scale, config,
                                                            add_rmsnorm=(residual, norm_weight, 1e-5))
                        expected_sum = (y.float() + residual.float()).to(dtype)  # the same y, then a torch add
                        expected = rmsnorm_reference(expected_sum, norm_weight, 1e-5).float()
                        # Exact where the interpreter rounds as the GPU does (float16; it truncates bfloat16).
                        exact = dtype != torch.float16 or torch.equal(summed, expected_sum)
                        ok = exact and normed.dtype == summed.dtype == dtype and normed.shape == (1, n)
                        error = max(((normed.float() - expected).norm() / expected.norm()).item(),
                                    ((summed.float() - expected_sum.float()).norm() / expected_sum.float().norm()).item()
                                    ) if ok else float("inf")
                        errors[f"{kind}-{index}-{n}x{k}-{rows}-{str(dtype)[6:]}-add_rmsnorm"] = error
                    if fuses_silu_mul(config):  # the weight as [gate | up]: silu(gate) * up
                        y = small_batch_matmul(x, weight, weight_scale, config, silu_mul=True)
                        gate, up = reference.chunk(2, dim=-1)
                        expected = torch.nn.functional.silu(gate) * up
                        ok = y.dtype == dtype and y.shape == (rows, n // 2)
                        error = ((y.float() - expected).norm() / expected.norm()).item() if ok else float("inf")
                        errors[f"{kind}-{index}-{n}x{k}-{rows}-{str(dtype)[6:]}-silu_mul"] = error
from treadle.kernels.small_batch import _arrival_counts
errors["arrival counts left nonzero"] = sum(int(counts.count_nonzero()) for counts in _arrival_counts.values())
print("RESULTS " + json.dumps(errors))
"""


@pytest.fixture(scope="module")
def relative_errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", f"GEMV_ROWS = {GEMV_ROWS}\nDOT_ROWS = {DOT_ROWS}\nEVEN_SHAPE = {list(EVEN_SHAPE)}\n"
                           f"BFLOAT16_SHAPE = {list(SHAPES[0])}\n" + CHECKS,
                           json.dumps(SHAPES),
                           json.dumps(ROWS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def test_split_k_calls_leave_their_arrival_counts_at_zero(relative_errors):
    # Every split-K call's last program resets its tiles' counts; a leftover count would make the next call on
    # those tiles sum before all its splits have arrived.
    assert relative_errors["arrival counts left nonzero"] == 0


@pytest.mark.parametrize("kind", CONFIGS)
def test_configs_cover_split_k_and_the_one_row_gemv(kind):
    configs = CONFIGS[kind]
    assert {config.split_k for config in configs} >= {1, 2, 4, 8}
    assert any(config.gemv for config in configs) and len(configs) <= 14  # each is timed per shape at load


CASES = [(kind, index, rows, n, k) for kind, configs in CONFIGS.items() for index, config in enumerate(configs)
         for rows in (GEMV_ROWS if config.gemv else DOT_ROWS) for n, k in SHAPES if config.gemv or (n, k) != EVEN_SHAPE]


@pytest.mark.parametrize("kind, index, rows, n, k", CASES,
                         ids=[f"{kind}-{CONFIGS[kind][index]}-{rows}rows-{n}x{k}" for kind, index, rows, n, k in CASES])
def test_small_batch_matmul_matches_the_reference(relative_errors, kind, index, n, k, rows):
    checked = {key: error for key, error in relative_errors.items() if key.startswith(f"{kind}-{index}-{n}x{k}-{rows}-")}
    assert checked and all(error < (SILU_MUL_MAX_RELATIVE_ERROR if key.endswith("silu_mul") else MAX_RELATIVE_ERROR)
                           for key, error in checked.items()), checked
