"""The one-token GEMV's lean loop (``IntTiles.lean``, kernels/packed_int_lean.py) under TRITON_INTERPRET=1: against
``x @ ((u - zero) * scale).T`` on the panel layout for bf16 activations (their power of two added to the exponent,
zeros included), fp16 and float32 ones, groups smaller than, equal to and larger than a panel, zero points, split-K,
two warps, rows past N, and its SiLU·mul and add+RMSNorm epilogues; and the sweep (not the loader) lists it."""

from __future__ import annotations

import pytest

CHECKS = r"""
import json, torch
from treadle.kernels.packed_int import IntTiles, gemv_candidates, int_gemv
from treadle.bench.quant_sweep import trials
from treadle.layers.packed_int import pack_panels
torch.manual_seed(0)


def inputs(n, k, group, asym, dtype):
    values = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group)).to(dtype) if asym else None
    groups = torch.arange(k) // group
    weight = (values.float() - (zeros.float()[:, groups] if asym else 8)) * scales.float()[:, groups]
    x = torch.randn(1, k).to(dtype)
    x[0, ::7] = 0  # zero activations: the bf16 exponent add keeps their products zero
    return x, pack_panels(values, 4), scales, zeros, x.float() @ weight.t()


def error(y, expected):
    return ((y.float() - expected).norm() / expected.norm()).item()


errors = {}
for name, (n, k, group, asym, dtype, tiles) in {
        "bf16, groups of 128": (20, 2048, 128, False, torch.bfloat16, IntTiles(0, 8, 128, 1, 1, lean=True)),
        "bf16, zeros, groups of 32, split-K": (24, 2048, 32, True, torch.bfloat16, IntTiles(0, 16, 128, 2, 1,
                                                                                             lean=True)),
        "fp16, groups of 256, two warps": (16, 2048, 256, False, torch.float16, IntTiles(0, 8, 256, 1, 2, lean=True)),
        "float32, zeros, groups of 64, 16 words a step": (20, 256, 64, True, torch.float32, IntTiles(0, 8, 16, 2, 1,
                                                                                                     lean=True)),
}.items():
    x, words, scales, zeros, expected = inputs(n, k, group, asym, dtype)
    errors[name] = error(int_gemv(x, words, scales, zeros, 4, group, tiles), expected)
x, words, scales, zeros, expected = inputs(48, 2048, 128, True, torch.float32)
tiles = IntTiles(0, 8, 128, 1, 1, lean=True)
gate, up = expected.chunk(2, dim=-1)
fused = int_gemv(x, words, scales, zeros, 4, 128, tiles, silu_mul=True)
residual, norm_weight = torch.randn(1, 48), torch.rand(48) + 0.5
summed = expected + residual
norm = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
normed, residual_out = int_gemv(x, words, scales, zeros, 4, 128, IntTiles(0, 16, 128, 2, 1, lean=True),
                                add_rmsnorm=(residual, norm_weight, 1e-6))
epilogues = [((fused - torch.nn.functional.silu(gate) * up).abs().max() / up.abs().max()).item(),
             ((normed - norm).abs().max() / norm.abs().max()).item(),
             ((residual_out - summed).abs().max() / summed.abs().max()).item()]
loader = [str(t) for t in gemv_candidates(28672, 4096, 4, 132) if t.lean]
listed = [str(t) for t in trials(28672, 4096, 1, 132) if t.lean]
print("RESULTS " + json.dumps({"errors": errors, "epilogues": epilogues, "listed": listed, "loader": loader}))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreted import interpreted_code_results

    return interpreted_code_results(CHECKS)


def test_lean_gemv_gives_the_dequantized_matmul(results):
    for name, error in results["errors"].items():
        # Exact products and float32 sums; a 16-bit output rounds once.
        assert error < (4e-3 if name.startswith(("bf16", "fp16")) else 1e-6), (name, error)


def test_lean_gemv_runs_the_fused_epilogues(results):
    assert all(error < 1e-5 for error in results["epilogues"]), results["epilogues"]


def test_the_sweep_times_the_lean_gemv_and_the_loader_does_not(results):
    assert len(results["listed"]) >= 2 and any("block_n=16" in tiles for tiles in results["listed"])
    assert results["loader"] == []
