"""The candidate W4A16 ``tl.dot`` kernels (kernels/packed_int_mma.py) under TRITON_INTERPRET=1 on small shapes: every
launch the GPU sweep may time, and each switch (per-slot dots, whole-panel steps scaled after or before the dot,
groups smaller and larger than a step, the weight as either operand, split-K, zero points, 8 bits, the integer-only
widening on fp16) give ``x @ ((u - zero) * scale).T`` on the panel layout."""

from __future__ import annotations

import pytest

CHECKS = r"""
import json, torch
from treadle.kernels.packed_int_mma import MmaTiles, int_mma, mma_candidates
from treadle.layers.packed_int import pack_panels
torch.manual_seed(0)


def error(bits, group, n, k, rows, asym, dtype, tiles):
    values = torch.randint(0, 1 << bits, (n, k))
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).to(dtype)
    zeros = torch.randint(0, 1 << bits, (n, k // group)).to(dtype) if asym else None
    groups = torch.arange(k) // group
    weight = (values.float() - (zeros.float()[:, groups] if asym else 1 << (bits - 1))) * scales.float()[:, groups]
    x = torch.randn(rows, k).to(dtype)
    expected = x.float() @ weight.t()
    y = int_mma(x, pack_panels(values, bits), scales, zeros, bits, group, tiles)
    assert y.dtype == dtype and y.shape == (rows, n)
    return ((y.float() - expected).norm() / expected.norm()).item()


# Every candidate's kernel branch (warps and pipeline depth mean nothing to the interpreter).
distinct = {(t.block_m, t.block_n, t.panels, t.split_k > 1, t.swap, t.scale_in_regs, t.per_slot): t
            for t in mma_candidates(48, 256, 4, 128, 5, sm_count=4)}
candidates = {str(tiles): error(4, 128, 48, 256, 5, True, torch.float32, tiles) for tiles in distinct.values()}
switches = {}
for name, (bits, group, asym, dtype, tiles) in {
        "per-slot groups of 32": (4, 32, False, torch.float32, MmaTiles(16, 32, per_slot=True, split_k=2)),
        "per-slot 8-bit fp16": (8, 64, True, torch.float16, MmaTiles(16, 32, per_slot=True)),
        "panel after the dot fp16": (4, 256, True, torch.float16, MmaTiles(16, 32, split_k=2)),
        "panel before the dot, groups of 32": (4, 32, True, torch.float32, MmaTiles(16, 32, 2, scale_in_regs=True)),
        "panel before the dot, groups of 256, fp16": (4, 256, False, torch.float16, MmaTiles(32, 32, scale_in_regs=True)),
        "unswapped before the dot 8-bit": (8, 64, True, torch.float32,
                                           MmaTiles(16, 32, swap=False, scale_in_regs=True)),
        "unswapped after the dot fp16": (4, 128, False, torch.float16, MmaTiles(32, 64, split_k=2, swap=False)),
}.items():
    switches[name] = error(bits, group, 40, 512, 5, asym, dtype, tiles)
refused = not MmaTiles(16, 32, 2).fits(512, 4, 128) and not MmaTiles(16, 32, per_slot=True, panels=2).fits(512, 4, 128)
print("RESULTS " + json.dumps({"candidates": candidates, "switches": switches, "refused": refused}))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreted import interpreted_code_results

    return interpreted_code_results(CHECKS)


def test_every_candidate_the_sweep_times_is_exact(results):
    candidates = results["candidates"]
    assert len(candidates) >= 8 and any("per_slot=True" in name for name in candidates)
    assert any("scale_in_regs=True" in name for name in candidates) and any("swap=False" in name for name in candidates)
    assert all(error < 1e-5 for error in candidates.values()), candidates


def test_each_switch_gives_the_dequantized_matmul(results):
    for name, error in results["switches"].items():
        assert error < (2e-3 if "fp16" in name else 1e-5), (name, error)


def test_launches_that_do_not_tile_the_groups_are_refused(results):
    # Scaling after the dot needs each step inside one group; per-slot dots take one panel a step.
    assert results["refused"]
