"""The Triton kernels for integer weights (kernels/packed_int.py) under TRITON_INTERPRET=1 on small shapes: the
one-token GEMV (split-K included), the dequantize-then-``tl.dot`` tiles (act-order too) and the whole-weight
dequantization give ``x @ ((u - zero) * scale).T``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# (bits, group, N, K, asymmetric, act-order): 4-bit and 8-bit, groups smaller and larger than a K block, split-K
# (K = 512 with few output tiles), a ragged N.
SHAPES = [(4, 32, 48, 256, False, False), (4, 128, 40, 512, True, False), (8, 64, 32, 256, True, False),
          (4, 64, 32, 256, True, True), (4, 256, 32, 512, False, False)]
ROWS = (1, 3, 20, 300)

CHECKS = r"""
import json, sys, torch
from treadle.kernels.packed_int import plan_kernels
from treadle.layers.packed_int import pack_rows
torch.manual_seed(0)
errors, plans = {}, {}
for bits, group, n, k, asym, act_order in json.loads(sys.argv[1]):
    values = torch.randint(0, 1 << bits, (n, k))
    scales = torch.rand(n, k // group) * 0.01 + 0.001
    zeros = torch.randint(0, 1 << bits, (n, k // group)).float() if asym else None
    groups = torch.arange(k) // group
    if act_order:
        groups = groups[torch.randperm(k)].sort().values
    plan = plan_kernels(n, k, bits, group, act_order, sm_count=4)
    plans[f"{bits}-{group}-{n}x{k}"] = [plan.gemv and plan.gemv.split_k, plan.small.split_k]
    weight = (values.float() - (zeros[:, groups] if asym else 1 << (bits - 1))) * scales[:, groups]
    for rows in json.loads(sys.argv[2]):
        x = torch.randn(rows, k)
        y = plan.run(x, pack_rows(values, bits), scales, zeros, groups.to(torch.int32) if act_order else None)
        expected = x @ weight.t()
        errors[f"{bits}-{group}-{n}x{k}-{asym}-{act_order}-{rows}"] = ((y - expected).norm() / expected.norm()).item()
# Every launch config the loader may time, on one shape that admits them all.
from treadle.kernels.packed_int import gemv_candidates, int_dot, int_gemv, tile_candidates
n, k, group = 32, 1024, 128
values = torch.randint(0, 16, (n, k))
scales = torch.rand(n, k // group) * 0.01 + 0.001
zeros = torch.randint(0, 16, (n, k // group)).float()
weight = (values.float() - zeros[:, torch.arange(k) // group]) * scales[:, torch.arange(k) // group]
packed = pack_rows(values, 4)
candidates = {}
for tiles in gemv_candidates(n, k, group, 4) + tile_candidates(n, k, 16, 4) + tile_candidates(n, k, 64, 4):
    rows = 1 if tiles.block_m == 0 else 17
    x = torch.randn(rows, k)
    y = (int_gemv(x, packed, scales, zeros, 4, group, tiles) if tiles.block_m == 0
         else int_dot(x, packed, scales, zeros, None, 4, group, tiles))
    expected = x @ weight.t()
    candidates[str(tiles)] = ((y - expected).norm() / expected.norm()).item()
# The one-token GEMV of a [gate | up] weight with silu(gate) * up in its epilogue equals the matmul, then silu_mul.
from treadle.kernels.packed_int import IntTiles
x = torch.randn(1, k)
gate_up = int_gemv(x, packed, scales, zeros, 4, group, IntTiles(0, 16, 256))
gate, up = gate_up.chunk(2, dim=-1)
fused = int_gemv(x, packed, scales, zeros, 4, group, IntTiles(0, 16, 256), silu_mul=True)
silu_mul_error = ((fused - torch.nn.functional.silu(gate) * up).abs().max() / up.abs().max()).item()
print("RESULTS " + json.dumps({"errors": errors, "plans": plans, "candidates": candidates,
                               "silu_mul": [list(fused.shape), silu_mul_error]}))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHECKS, json.dumps(SHAPES), json.dumps(ROWS)], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULTS "))
    return json.loads(line.removeprefix("RESULTS "))


@pytest.mark.parametrize("bits, group, n, k, asym, act_order", SHAPES)
@pytest.mark.parametrize("rows", ROWS)
def test_int_kernels_match_the_dequantized_matmul(results, bits, group, n, k, asym, act_order, rows):
    assert results["errors"][f"{bits}-{group}-{n}x{k}-{asym}-{act_order}-{rows}"] < 1e-5


def test_every_launch_config_the_loader_may_time_is_exact(results):
    candidates = results["candidates"]
    assert len(candidates) >= 12 and any("split_k=4" in name for name in candidates)
    assert all(error < 1e-5 for error in candidates.values()), candidates


def test_the_gemv_computes_silu_mul_of_a_gate_up_weight_in_its_epilogue(results):
    shape, error = results["silu_mul"]
    assert shape == [1, 16] and error < 1e-6


def test_plans_split_k_where_a_shape_has_few_output_tiles(results):
    assert results["plans"]["4-128-40x512"][0] == 2  # two tiles of 32 rows, 4 SMs: K cut in two
    assert results["plans"]["4-64-32x256"][0] is None  # act-order: no GEMV, the tiles gather each column's group
