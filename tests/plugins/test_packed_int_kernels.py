"""The Triton kernels for integer weights (kernels/packed_int.py) under TRITON_INTERPRET=1 on small shapes: the
one-token GEMV (split-K, whose last program sums the partials, included), the ``tl.dot`` tiles that widen each
panel in registers (through float32, and with integer ops alone on fp16 activations) and the whole-weight
dequantization (act-order ``g_idx`` too) give ``x @ ((u - zero) * scale).T`` on the panel layout."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# (bits, group, N, K, asymmetric, act-order): 4-bit and 8-bit, groups smaller and larger than a panel, split-K
# (K = 1024 with few output tiles), a ragged N; act-order with uneven groups runs the dequantizing path.
SHAPES = [(4, 32, 48, 256, False, False), (4, 128, 40, 1024, True, False), (8, 64, 32, 256, True, False),
          (4, 64, 32, 256, True, True), (4, 256, 32, 512, False, False)]
ROWS = (1, 5, 20, 40, 300)  # the GEMV, each tl.dot bucket (int_mma's kernels where they tile), dequantize

CHECKS = r"""
import json, sys, torch
from treadle.kernels.int_kernel_plan import plan_kernels
from treadle.kernels.packed_int import PANEL_WORDS
from treadle.layers.packed_int import PANEL_WORDS as LAYER_PANEL_WORDS, pack_panels, unpack_panels
assert PANEL_WORDS == LAYER_PANEL_WORDS
torch.manual_seed(0)
errors, plans = {}, {}


def weight_of(bits, group, n, k, asym, dtype=torch.float32):
    values = torch.randint(0, 1 << bits, (n, k))
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (n, k // group)).to(dtype) if asym else None
    assert torch.equal(unpack_panels(pack_panels(values, bits), bits), values)
    return values, pack_panels(values, bits), scales, zeros


def reference(values, scales, zeros, groups, bits):
    zero = zeros.float()[:, groups] if zeros is not None else 1 << (bits - 1)
    return (values.float() - zero) * scales.float()[:, groups]


def error(y, expected):
    return ((y.float() - expected).norm() / expected.norm()).item()


for bits, group, n, k, asym, act_order in json.loads(sys.argv[1]):
    values, packed, scales, zeros = weight_of(bits, group, n, k, asym)
    groups = torch.arange(k) // group
    if act_order:  # uneven groups, as a row-parallel rank's sorted columns may have
        groups = torch.randint(0, k // group, (k,)).sort().values
    plan = plan_kernels(n, k, bits, group, sm_count=4)
    plans[f"{bits}-{group}-{n}x{k}"] = [plan.gemv.split_k, plan.small.split_k] + [
        type(tiles).__name__ for tiles in (plan.small, plan.medium, plan.large)]
    weight = reference(values, scales, zeros, groups, bits)
    for rows in json.loads(sys.argv[2]):
        x = torch.randn(rows, k)
        y = plan.run(x, packed, scales, zeros, groups.to(torch.int32) if act_order else None)
        errors[f"{bits}-{group}-{n}x{k}-{asym}-{act_order}-{rows}"] = error(y, x @ weight.t())
# Every launch config the loader may time, on one shape that admits them all; the integer-only widening on fp16.
from treadle.kernels.packed_int import IntTiles, gemv_candidates, int_dot, int_gemv, tile_candidates
n, k, group = 32, 256, 128
values, packed, scales, zeros = weight_of(4, group, n, k, True)
weight = reference(values, scales, zeros, torch.arange(k) // group, 4)
candidates = {}
for tiles in gemv_candidates(n, k, 4, 4) + tile_candidates(n, k, 4, 16, 4) + tile_candidates(n, k, 4, 32, 4)[:1] + \
        tile_candidates(n, k, 4, 64, 4):
    x = torch.randn(1 if tiles.block_m == 0 else 17, k)
    y = (int_gemv(x, packed, scales, zeros, 4, group, tiles) if tiles.block_m == 0
         else int_dot(x, packed, scales, zeros, 4, group, tiles))
    candidates[str(tiles)] = error(y, x @ weight.t())
half = {}
for asym in (False, True):
    values, packed, scales, zeros = weight_of(4, group, n, k, asym, torch.float16)
    weight = reference(values, scales, zeros, torch.arange(k) // group, 4)
    x = torch.randn(5, k).half()
    for i16 in (True, False):
        y = int_dot(x, packed, scales, zeros, 4, group, IntTiles(16, 32, 16, 2, 4, i16))
        half[f"{asym}-{i16}"] = [str(y.dtype), error(y, x.float() @ weight.t())]
# The one-token GEMV of a [gate | up] weight with silu(gate) * up in its epilogue equals the matmul, then silu_mul.
x = torch.randn(1, k)
gate_up = int_gemv(x, packed, scales.float(), zeros.float(), 4, group, IntTiles(0, 16))
gate, up = gate_up.chunk(2, dim=-1)
fused = int_gemv(x, packed, scales.float(), zeros.float(), 4, group, IntTiles(0, 16), silu_mul=True)
silu_mul_error = ((fused - torch.nn.functional.silu(gate) * up).abs().max() / up.abs().max()).item()
# One token's GEMV with the residual add and the next RMSNorm in its epilogue (no split-K, and split-K's last
# program) equals the matmul, then the add and the norm.
residual, norm_weight = torch.randn(1, n), torch.rand(n) + 0.5
y = int_gemv(x, packed, scales.float(), zeros.float(), 4, group, IntTiles(0, 16))
summed = y + residual
expected_norm = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight
add_rmsnorm = {}
for split in (1, 2):
    normed, residual_out = int_gemv(x, packed, scales.float(), zeros.float(), 4, group, IntTiles(0, 16, 16, split),
                                    add_rmsnorm=(residual, norm_weight, 1e-6))
    add_rmsnorm[split] = [(residual_out - summed).abs().max().item(), (normed - expected_norm).abs().max().item()]
# The dequantization alone, bit for bit: 5 panels among programs of 4 (one walks a single panel), a ragged N.
from treadle.kernels.packed_int_dequant import DequantTiles, dequantize
values, packed, scales, zeros = weight_of(4, 128, 40, 640, True)
dequantized = dequantize(packed, scales, zeros, None, 4, 128, torch.float32, tiles=DequantTiles(32, 4))
exact = torch.equal(dequantized, reference(values, scales, zeros, torch.arange(640) // 128, 4))
print("RESULTS " + json.dumps({"errors": errors, "plans": plans, "candidates": candidates, "half": half,
                               "silu_mul": [list(fused.shape), silu_mul_error], "add_rmsnorm": add_rmsnorm,
                               "dequantize_exact": exact}))
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
    assert len(candidates) >= 8 and any("split_k=2" in name for name in candidates)
    assert all(error < 1e-5 for error in candidates.values()), candidates


def test_16_bit_activations_widen_4_bit_values_with_integer_ops(results):
    # fp16: 0x6400 | u read as fp16 is 1024 + u; the offset leaves through the rows' activation sums.
    for name, (dtype, error) in results["half"].items():
        assert dtype == "torch.float16" and error < 2e-3, (name, error)


def test_the_gemv_computes_silu_mul_of_a_gate_up_weight_in_its_epilogue(results):
    shape, error = results["silu_mul"]
    assert shape == [1, 16] and error < 1e-6


def test_plans_split_k_where_a_shape_has_few_output_tiles(results):
    gemv_split, small_split, *_ = results["plans"]["4-128-40x1024"]
    assert gemv_split > 1 and small_split > 1  # few row tiles, 4 SMs: K cut into ranges


def test_untimed_plans_run_int_mma_for_batches_of_2_to_256_rows(results):
    # int_mma won every shape at 16 and 32 rows on an H100; without timing its first launch runs.
    assert all(plan[2:] == ["MmaTiles"] * 3 for plan in results["plans"].values()), results["plans"]


def test_the_gemv_adds_the_residual_and_norms_in_its_epilogue(results):
    for split, (residual_error, norm_error) in results["add_rmsnorm"].items():
        assert residual_error < 1e-5 and norm_error < 1e-5, (split, residual_error, norm_error)


def test_the_dequantization_walks_uneven_panel_shares_exactly(results):
    assert results["dequantize_exact"]


def test_large_batches_dequantize_into_one_buffer_per_device():
    # Allocated once at the size the layers reserved, shared by every shape and dtype; a weight past it gets a larger
    # tensor and the old one is kept (a captured CUDA graph may still write it); gone once no layer holds it.
    import gc

    import torch

    from treadle.kernels.packed_int_dequant import shared_dequant_buffer

    cpu = torch.device("cpu")
    buffer = shared_dequant_buffer(cpu)
    assert shared_dequant_buffer(cpu) is buffer
    buffer.reserve(8, 64, torch.bfloat16)
    buffer.reserve(4, 64, torch.bfloat16)
    qkv, down = buffer.view(4, 64, torch.bfloat16), buffer.view(8, 32, torch.float32)
    assert qkv.shape == (4, 64) and down.shape == (8, 32) and down.dtype == torch.float32
    assert qkv.data_ptr() == down.data_ptr() and qkv.untyped_storage().nbytes() == 8 * 64 * 2
    larger = buffer.view(16, 64, torch.bfloat16)
    assert larger.data_ptr() != qkv.data_ptr() and buffer.outgrown[0].data_ptr() == qkv.data_ptr()
    del buffer
    gc.collect()
    assert shared_dequant_buffer(cpu).tensor is None  # a new one: the model that held the old one is gone


def test_the_loader_times_how_many_rows_the_tl_dot_kernels_run(monkeypatch):
    import torch

    from treadle.kernels import int_kernel_plan
    from treadle.kernels.int_kernel_plan import DOT_MAX_ROWS, plan_kernels
    from treadle.kernels.packed_int_dequant import DequantTiles, load_dequantize_candidates

    def dequantize_wins_from(threshold):  # a stand-in for the loader's timing: the first launch, or the last
        return lambda candidates, rows: candidates[-1] if rows >= threshold else candidates[0]

    assert plan_kernels(4096, 4096, 4, 128, 132).dot_max_rows == DOT_MAX_ROWS == 256  # untimed
    assert plan_kernels(4096, 4096, 4, 128, 132, dequantize_wins_from(512)).dot_max_rows == 256
    assert plan_kernels(4096, 4096, 4, 128, 132, dequantize_wins_from(256)).dot_max_rows == 128
    assert plan_kernels(4096, 4096, 4, 128, 132).dequant == DequantTiles()
    plan = plan_kernels(4096, 4096, 4, 128, 132, dequantize_wins_from(128))
    # The dequantization's launch is timed too (at 512 rows, the last candidate here), then raced at 128.
    assert plan.dot_max_rows == 64 and plan.dequant == load_dequantize_candidates()[-1] != DequantTiles()
    ran = []
    monkeypatch.setattr(int_kernel_plan, "run_tiles", lambda *args: ran.append(args[-2]))
    monkeypatch.setattr(int_kernel_plan, "dequantize_linear", lambda *args: ran.append(args[7]))
    for rows in (64, 65):
        plan.run(torch.zeros(rows, 4096), None, None, None, None)
    assert ran == [plan.large, plan.dequant]
