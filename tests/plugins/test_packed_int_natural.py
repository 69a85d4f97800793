"""kernels/packed_int_natural.py's tensor-core kernel under TRITON_INTERPRET=1 on small shapes: the plain-op twin of
its inline-PTX widening (the PTX itself runs on GPUs only: tests/gpu/test_packed_int_natural_gpu.py) against
``x @ ((u - zero) * scale).T`` on the panel layout, through the plan's ``run_tiles``; where the loader races it.
fp16 activations: the interpreter's bf16 ``tl.dot`` of converted values is wrong (a Triton interpreter limit)."""

from __future__ import annotations

import pytest

CHECKS = r"""
import json, torch
from treadle.kernels.int_kernel_plan import batch_candidates, run_tiles
from treadle.kernels.packed_int_natural import NaturalMmaTiles, natural_mma
from treadle.layers.packed_int import pack_panels
torch.manual_seed(0)


def error(n, k, rows, group, asym, tiles):
    values = torch.randint(0, 16, (n, k))
    scales = (torch.rand(n, k // group) * 0.01 + 0.001).half()
    zeros = torch.randint(0, 16, (n, k // group)).half() if asym else None
    groups = torch.arange(k) // group
    weight = (values.float() - (zeros.float()[:, groups] if asym else 8)) * scales.float()[:, groups]
    x = torch.randn(rows, k).half()
    expected = x.float() @ weight.t()
    y = run_tiles(x, pack_panels(values, 4), scales, zeros, 4, group, tiles)
    assert y.dtype == torch.float16 and y.shape == (rows, n)
    return ((y.float() - expected).norm() / expected.norm()).item()


errors = {}
capped = NaturalMmaTiles(16, 32, 2, asm=False, max_registers=128)
for name, (tiles, n, rows, group, asym) in {
        "16-token tile, 5 tokens, split-K, zeros, registers capped": (capped, 40, 5, 128, True),
        "32-token tile, 20 tokens, groups of 256": (NaturalMmaTiles(32, 64, asm=False), 40, 20, 256, False),
        "16-token tiles, 20 tokens (two tiles), four K ranges": (NaturalMmaTiles(16, 32, 4, asm=False), 40, 20, 128,
                                                                 True),
        # one warp: each partial 64 registers a thread, summed one by one
        "64-token tile, 40 tokens, whole row tiles, four K ranges": (NaturalMmaTiles(64, 64, 4, 1, asm=False), 64, 40,
                                                                     128, False),
}.items():
    errors[name] = error(n, 512, rows, group, asym, tiles)
refused = []
for dtype, group in ((torch.float32, 128), (torch.float16, 64)):
    try:
        natural_mma(torch.zeros(2, 512, dtype=dtype), torch.zeros(8, 64, dtype=torch.int32),
                    torch.ones(8, 512 // group, dtype=dtype), None, 4, group, NaturalMmaTiles(16, 32))
    except ValueError:
        refused.append(True)
raced = {str(dtype): [type(t).__name__ for t in batch_candidates(4096, 4096, 4, 128, 32, 132, dtype)]
         for dtype in (torch.float16, torch.float32)}
print("RESULTS " + json.dumps({"errors": errors, "refused": refused, "raced": raced}))
"""


@pytest.fixture(scope="module")
def results() -> dict:
    from interpreted import interpreted_code_results

    return interpreted_code_results(CHECKS)


def test_natural_order_twin_gives_the_dequantized_matmul(results):
    assert len(results["errors"]) == 4
    for name, error in results["errors"].items():
        assert error < 2e-3, (name, error)


def test_activations_or_groups_it_does_not_take_are_refused(results):
    assert results["refused"] == [True, True]


def test_loader_races_it_after_magic_mma_for_16_bit_activations_alone(results):
    kinds = results["raced"]["torch.float16"]
    assert kinds[0] == "MagicMmaTiles" and "NaturalMmaTiles" in kinds
    assert kinds.index("NaturalMmaTiles") > kinds.index("MagicMmaTiles")
    assert "NaturalMmaTiles" not in results["raced"]["torch.float32"]
