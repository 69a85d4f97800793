"""The W8A16 Triton kernel under the Triton interpreter: every launch config against a float32 reference.

The interpreter's ``tl.dot`` multiplies bfloat16 operands' bit patterns (triton-lang/triton#11584), so the
``tl.dot`` path is checked with float16 activations; the one-row GEMV path, which has no ``tl.dot``, with both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from treadle.plugins.models.fp8_kernels import W8A16_CONFIGS  # noqa: E402

# N not a multiple of any BLOCK_N; K=1000 not a multiple of any BLOCK_K * SPLIT_K; K=200 leaves splits empty.
SHAPES = [(100, 1000), (40, 200)]
ROWS = [1, 3, 16]
# Outputs are rounded to 16 bits (bfloat16: 2^-9 relative); a lost or doubled K block is off by far more.
MAX_RELATIVE_ERROR = 1e-2

CHECKS = r"""
import json, sys
import torch
from treadle.plugins.models.fp8_kernels import W8A16_CONFIGS, w8a16_matmul
from treadle.plugins.models.fp8_ops import dequantize, quantize_per_channel

errors = {}
gen = torch.Generator().manual_seed(0)
for n, k in json.loads(sys.argv[1]):
    weight, scale = quantize_per_channel(torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, n)[:, None])
    dense = dequantize(weight, scale, torch.float32)
    for rows in json.loads(sys.argv[2]):
        for dtype in (torch.float16, torch.bfloat16):
            x = torch.randn(rows, k, generator=gen).to(dtype)
            reference = x.float() @ dense.t()
            for index, config in enumerate(W8A16_CONFIGS):
                if dtype == torch.bfloat16 and not (config.gemv and rows == 1):
                    continue
                y = w8a16_matmul(x, weight, scale, config)
                ok = y.dtype == dtype and y.shape == (rows, n)
                error = ((y.float() - reference).norm() / reference.norm()).item() if ok else float("inf")
                errors[f"{index}-{n}x{k}-{rows}-{str(dtype)[6:]}"] = error
print("RESULTS " + json.dumps(errors))
"""


@pytest.fixture(scope="module")
def relative_errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECKS, json.dumps(SHAPES), json.dumps(ROWS)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


def test_configs_cover_split_k_and_the_one_row_gemv():
    assert {config.split_k for config in W8A16_CONFIGS} >= {1, 2, 4, 8}
    assert any(config.gemv for config in W8A16_CONFIGS) and len(W8A16_CONFIGS) <= 12


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("n, k", SHAPES)
@pytest.mark.parametrize("index", range(len(W8A16_CONFIGS)), ids=[str(c) for c in W8A16_CONFIGS])
def test_w8a16_matches_the_dequantized_product(relative_errors, index, n, k, rows):
    checked = {key: error for key, error in relative_errors.items() if key.startswith(f"{index}-{n}x{k}-{rows}-")}
    assert checked and all(error < MAX_RELATIVE_ERROR for error in checked.values()), checked
