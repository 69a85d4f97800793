"""kernels/packed_int_magic.py's and kernels/packed_int_natural.py's tensor-core kernels under TRITON_INTERPRET=1 on
small shapes: the plain-op twins of their inline-PTX widening (magic_mma's scaled after the dot or before it;
natural_mma's through the plan's ``run_tiles``; the PTX itself runs on GPUs only:
tests/gpu/test_packed_int_magic_gpu.py), and today's GEMV with the subnormal widening, against
``x @ ((u - zero) * scale).T`` on the panel layout; the plans the loader makes with them, where it races
natural_mma. fp16 activations: the interpreter's bf16 ``tl.dot`` of converted values is wrong (a Triton
interpreter limit)."""

from __future__ import annotations

import pytest

CHECKS = r"""
import json, torch
from treadle.kernels.packed_int import IntTiles, int_gemv
from treadle.kernels.packed_int_magic import MagicMmaTiles, magic_mma, mma_trials
from treadle.layers.packed_int import pack_panels
torch.manual_seed(0)


def errors(kernels, n, k, rows, group, asym, dtype):
    values = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // group)).to(dtype) if asym else None
    groups = torch.arange(k) // group
    weight = (values.float() - (zeros.float()[:, groups] if asym else 8)) * scales.float()[:, groups]
    x = torch.randn(rows, k).to(dtype)
    expected = x.float() @ weight.t()
    words = pack_panels(values, 4)
    found = []
    for run, tiles in kernels:
        y = run(x, words, scales, zeros, 4, group, tiles)
        assert y.dtype == dtype and y.shape == (rows, n)
        found.append(((y.float() - expected).norm() / expected.norm()).item())
    return found


# Today's GEMV with the subnormal widening (IntTiles.subnormal): plain, split-K with zero points, SiLU·mul.
subnormal = {}
for name, (tiles, k, group, asym) in {
        "plain": (IntTiles(0, 8, 32, 1, 1, subnormal=True), 512, 128, False),
        "split-K, zeros, groups of 32": (IntTiles(0, 16, 16, 2, 1, subnormal=True), 512, 32, True),
        # the sweep's wide programs (bench/quant_sweep.py's wide_gemv_trials): a K range in one step over 2 warps
        "4 rows by 256 words, 2 warps, split-K": (IntTiles(0, 4, 256, 2, 2, subnormal=True), 4096, 128, False)}.items():
    subnormal[name] = errors([(int_gemv, tiles)], 24, k, 1, group, asym, torch.float32)[0]
values = torch.randint(0, 16, (32, 256))
scales = torch.rand(32, 2) * 0.01 + 0.001
x = torch.randn(1, 256)
words = pack_panels(values, 4)
fused = int_gemv(x, words, scales, None, 4, 128, IntTiles(0, 8, 32, 1, 1, subnormal=True), silu_mul=True)
plain = int_gemv(x, words, scales, None, 4, 128, IntTiles(0, 8, 32, 1, 1), silu_mul=True)
subnormal["silu_mul"] = ((fused - plain).norm() / plain.norm()).item()
mma = {}
for name, (tiles, rows, group, asym) in {
        "16-token tile, one token, split-K, zeros": (MagicMmaTiles(16, 32, 2, asm=False), 1, 128, True),
        "32-token tile, 20 tokens, groups of 256": (MagicMmaTiles(32, 64, asm=False), 20, 256, False),
        "16-token tiles, 20 tokens (two tiles)": (MagicMmaTiles(16, 32, asm=False), 20, 128, True),
        "scaled before the dot, split-K, zeros": (MagicMmaTiles(16, 32, 2, asm=False, scaled=True), 5, 128, True),
        "scaled before the dot, groups of 256": (MagicMmaTiles(32, 32, asm=False, scaled=True), 20, 256, False),
}.items():
    mma[name] = errors([(magic_mma, tiles)], 40, 512, rows, group, asym, torch.float16)[0]
refused = []
try:  # groups smaller than the panel step
    errors([(magic_mma, MagicMmaTiles(16, 32))], 16, 512, 1, 64, False, torch.float16)
except ValueError:
    refused.append(True)
trials = [len(mma_trials(4096, 14336, 32, 132))]
from treadle.kernels.int_kernel_plan import batch_candidates, run_tiles
from treadle.kernels.packed_int_natural import NaturalMmaTiles, natural_mma
natural = {}
for name, (tiles, n, rows, group, asym) in {
        "16-token tile, 5 tokens, split-K, zeros, registers capped": (NaturalMmaTiles(16, 32, 2, asm=False,
                                                                                      max_registers=128),
                                                                      40, 5, 128, True),
        "32-token tile, 20 tokens, groups of 256": (NaturalMmaTiles(32, 64, asm=False), 40, 20, 256, False),
        "16-token tiles, 20 tokens (two tiles), four K ranges": (NaturalMmaTiles(16, 32, 4, asm=False), 40, 20, 128,
                                                                 True),
        # one warp: each partial 64 registers a thread, summed one by one
        "64-token tile, 40 tokens, whole row tiles, four K ranges": (NaturalMmaTiles(64, 64, 4, 1, asm=False), 64, 40,
                                                                     128, False),
}.items():
    natural[name] = errors([(run_tiles, tiles)], n, 512, rows, group, asym, torch.float16)[0]
# silu(gate) * up in natural_mma's epilogue (gate and up 40 rows each: partial row tiles), by the plan's
# run_silu_mul where its bucket fuses and by the loader's race candidate, against the matmul, then silu_mul.
import dataclasses
from treadle.kernels.fused_ops import silu_mul
from treadle.kernels.int_kernel_plan import IntKernelPlan, SiluMulTiles
from treadle.kernels.packed_int import IntTiles
words = pack_panels(torch.randint(0, 16, (80, 512)), 4)
gate_scales, gate_zeros = (torch.rand(80, 4) * 0.01 + 0.001).half(), torch.randint(0, 16, (80, 4)).half()
twin = NaturalMmaTiles(16, 32, asm=False)
fusing = IntKernelPlan(4, 128, IntTiles(0, 8, 64, 1, 1), twin, dataclasses.replace(twin, block_m=32),
                       dataclasses.replace(twin, block_m=64), fused_silu_mul=(True, False, True))
gated = {}
for rows in (5, 20, 40):
    x = torch.randn(rows, 512).half()
    unfused = silu_mul(natural_mma(x, words, gate_scales, gate_zeros, 4, 128, twin))
    fused = fusing.run_silu_mul(x, words, gate_scales, gate_zeros)
    raced = run_tiles(x, words, gate_scales, gate_zeros, 4, 128, SiluMulTiles(twin, True))
    gated[rows] = None if fused is None else [((y.float() - unfused.float()).abs().max() / unfused.abs().max()).item()
                                              for y in (fused, raced)]
for dtype, group in ((torch.float32, 128), (torch.float16, 64)):
    try:
        natural_mma(torch.zeros(2, 512, dtype=dtype), torch.zeros(8, 64, dtype=torch.int32),
                    torch.ones(8, 512 // group, dtype=dtype), None, 4, group, NaturalMmaTiles(16, 32))
    except ValueError:
        refused.append(True)
raced = {str(dtype): [type(t).__name__ for t in batch_candidates(4096, 4096, 4, 128, 32, 132, dtype)]
         for dtype in (torch.float16, torch.float32)}
# The plan the loader makes for 16-bit activations: the GEMV widens as subnormals, 2 to 64 rows run magic_mma (its
# plain-op twin here), epilogues included; float32 activations or groups of 64 keep today's tl.dot kernels.
import dataclasses
from treadle.kernels.int_kernel_plan import plan_kernels
plan = plan_kernels(40, 512, 4, 128, sm_count=4, dtype=torch.float16)
kinds = [plan.gemv.subnormal] + [type(t).__name__ for t in (plan.small, plan.medium, plan.large)]
kinds += [type(plan_kernels(40, 512, 4, 128, 4, dtype=torch.float32).small).__name__,
          type(plan_kernels(40, 512, 4, 64, 4, dtype=torch.float16).small).__name__]
plan = dataclasses.replace(plan, **{bucket: dataclasses.replace(getattr(plan, bucket), asm=False)
                                    for bucket in ("small", "medium", "large")})
planned = {}
for asym in (False, True):
    for rows in (1, 5, 20, 40):
        planned[f"{asym}-{rows}"] = errors([(lambda x, w, s, z, b, g, t: plan.run(x, w, s, z, None), None)], 40, 512,
                                          rows, 128, asym, torch.float16)[0]
x, residual, norm_weight = torch.randn(1, 512).half(), torch.randn(1, 40).half(), torch.rand(40).half() + 0.5
words, half_scales = pack_panels(torch.randint(0, 16, (40, 512)), 4), (torch.rand(40, 4) * 0.01 + 0.001).half()
y = plan.run(x, words, half_scales, None, None)
summed = (y.float() + residual.float())
norm = summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-6) * norm_weight.float()
normed, residual_out = plan.run_add_rmsnorm(x, words, half_scales, None, residual, norm_weight, 1e-6)
gate, up = y.float().chunk(2, dim=-1)
fused = plan.run_silu_mul(x, words, half_scales, None)
epilogues = [((normed.float() - norm).abs().max() / norm.abs().max()).item(),
             ((fused.float() - torch.nn.functional.silu(gate) * up).abs().max() / up.abs().max()).item()]
print("RESULTS " + json.dumps({"subnormal": subnormal, "mma": mma, "refused": refused, "trials": trials,
                               "kinds": kinds, "planned": planned, "epilogues": epilogues, "natural": natural,
                               "gated": gated, "raced": raced}))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreted import interpreted_code_results

    return interpreted_code_results(CHECKS)


def test_todays_gemv_with_subnormal_values_gives_the_dequantized_matmul(results):
    assert len(results["subnormal"]) == 4
    for name, error in results["subnormal"].items():
        assert error < 1e-6, (name, error)


def test_tensor_core_twin_gives_the_dequantized_matmul(results):
    for name, error in results["mma"].items():
        assert error < 2e-3, (name, error)


def test_launches_that_do_not_tile_are_refused_and_trials_are_listed(results):
    # magic_mma: groups of 64; natural_mma: float32 activations, groups of 64
    assert results["refused"] == [True, True, True]
    assert all(count >= 4 for count in results["trials"])


def test_loader_plans_run_subnormal_gemv_and_magic_mma_for_16_bit_activations(results):
    assert results["kinds"] == [True, "MagicMmaTiles", "MagicMmaTiles", "MagicMmaTiles", "MmaTiles", "MmaTiles"]
    for name, error in results["planned"].items():
        assert error < 2e-3, (name, error)
    norm_error, silu_mul_error = results["epilogues"]  # fp16 outputs: a rounding or two of each
    assert norm_error < 4e-3 and silu_mul_error < 4e-3, results["epilogues"]


def test_natural_order_twin_gives_the_dequantized_matmul(results):
    assert len(results["natural"]) == 4
    for name, error in results["natural"].items():
        assert error < 2e-3, (name, error)


def test_natural_order_silu_mul_epilogue_gives_the_matmul_then_silu_mul(results):
    # rows 20: the plan's medium bucket does not fuse (the caller runs the matmul, then silu_mul)
    assert results["gated"]["20"] is None
    for rows in ("5", "40"):
        assert max(results["gated"][rows]) < 4e-3, results["gated"]  # fp16: a rounding or two


def test_loader_races_natural_mma_after_magic_mma_for_16_bit_activations_alone(results):
    kinds = results["raced"]["torch.float16"]
    assert kinds[0] == "MagicMmaTiles" and "NaturalMmaTiles" in kinds
    assert kinds.index("NaturalMmaTiles") > kinds.index("MagicMmaTiles")
    assert "NaturalMmaTiles" not in results["raced"]["torch.float32"]


def test_loader_races_the_wave_split_at_three_stages_and_halved():
    from treadle.kernels.packed_int_natural import natural_candidates, wave_split

    # o_proj's shape at 32 tokens on 132 SMs: the wave split (8 K ranges) at three stages, and 4 at four stages
    wave = wave_split(4096, 4096, 3, 132)
    listed = natural_candidates(4096, 4096, 4, 128, 32, 132)
    assert (wave, 3) in [(t.split_k, t.num_stages) for t in listed]
    assert (wave // 2, 4) in [(t.split_k, t.num_stages) for t in listed]
