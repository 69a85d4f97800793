"""kernels/packed_int_wide.py's W4A16 kernel for 65 to 1024 tokens on a GPU at Llama-3.1-8B's projection shapes:
its inline-PTX widening gives exactly what its plain-op twin gives (the CPU tests check the twin) and matches the
dequantized matmul at 96, 128, 300 and 512 tokens (partial token tiles, split-K, both launches the loader times),
in bf16 and fp16, with and without zero points, both orientations; and the plan's row buckets run it."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from packed_weights import random_weight, relative_error

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


def _weight(n: int, k: int, asym: bool, dtype: torch.dtype):
    return random_weight(n, k, asym, dtype, DEVICE)


_error = relative_error


@pytest.mark.parametrize("dtype, asym", [(torch.bfloat16, False), (torch.float16, True)])
def test_wide_mma_equals_its_twin_and_the_dequantized_matmul(dtype, asym):
    # bf16 without zero points at qkv_proj's shape (no split-K from 256 rows) and down_proj's (split-K at 96 and
    # 128 rows); fp16 with zero points at down_proj's.
    from treadle.kernels.packed_int_wide import wide_candidates, wide_mma

    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    shapes = ((6144, 4096), (4096, 14336)) if dtype == torch.bfloat16 else ((4096, 14336),)
    for n, k in shapes:
        words, scales, zeros, dense = _weight(n, k, asym, dtype)
        for rows in (96, 128, 300, 512) if dtype == torch.bfloat16 else (96, 300):
            x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
            expected = x.float() @ dense.t()
            launches = wide_candidates(n, k, 4, 128, rows, sm_count)
            assert len(launches) == 3 + (launches[0].split_k > 1)
            for tiles in launches:
                y = wide_mma(x, words, scales, zeros, 4, 128, tiles)
                assert _error(y, expected) < 1e-2, (n, rows, tiles, _error(y, expected))
                if rows == 300:  # the twins compile apart: once a shape
                    twin = wide_mma(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, asm=False))
                    assert torch.equal(y, twin), (n, rows, tiles)


def test_plan_buckets_run_wide_mma_then_the_dequantization():
    # A plan whose race kept wide_mma up to 256 rows: 200 rows run the 256 bucket's launch (exactly its output),
    # 600 the dequantization and the matmul; both match the dequantized matmul.
    from treadle.kernels.int_kernel_plan import plan_kernels
    from treadle.kernels.packed_int_dequant import DequantTiles
    from treadle.kernels.packed_int_wide import WideMmaTiles, wide_mma

    n, k = 4096, 4096
    words, scales, zeros, dense = _weight(n, k, False, torch.bfloat16)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count

    def pick(candidates: list, rows: int):
        keep_wide = isinstance(candidates[0], WideMmaTiles) and rows <= 256
        return candidates[0] if keep_wide or not isinstance(candidates[-1], DequantTiles) else candidates[-1]

    plan = plan_kernels(n, k, 4, 128, sm_count, pick, torch.bfloat16)
    assert [most for most, _ in plan.wide] == [128, 256] and plan.dot_max_rows == 64
    for rows in (200, 600):
        x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
        y = plan.run(x, words, scales, zeros, None)
        assert _error(y, x.float() @ dense.t()) < 1e-2, rows
        if rows == 200:
            assert torch.equal(y, wide_mma(x, words, scales, zeros, 4, 128, plan.wide[-1][1]))
