"""kernels/packed_int_natural.py's tensor-core kernel on a GPU at Llama-3.1-8B's shapes: at 1, 16, 32 and 64 tokens
(and a partial tile) its inline-PTX widening gives exactly what its plain-op twin gives (the CPU tests check the
twin) and matches the dequantized matmul, in bf16 and fp16, with and without zero points, split-K or not."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")
KINDS = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)]


def _weight(n: int, k: int, asym: bool, dtype: torch.dtype):
    from treadle.layers.packed_int import pack_panels

    gen = torch.Generator(device=DEVICE).manual_seed(n + k + asym)
    values = torch.randint(0, 16, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // 128, device=DEVICE, generator=gen) * 0.002 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // 128), device=DEVICE, generator=gen).to(dtype) if asym else None
    groups = torch.arange(k, device=DEVICE) // 128
    dense = (values.float() - (zeros.float()[:, groups] if asym else 8)) * scales.float()[:, groups]
    return pack_panels(values, 4), scales, zeros, dense


def _error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("dtype, asym", KINDS)
@pytest.mark.parametrize("n, k", [(6144, 4096), (4096, 14336)])  # qkv_proj, down_proj
def test_natural_mma_equals_its_twin_and_the_dequantized_matmul(n, k, asym, dtype):
    from treadle.kernels.packed_int_natural import natural_mma, natural_trials

    words, scales, zeros, dense = _weight(n, k, asym, dtype)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for rows in (1, 16, 21, 32, 64):
        x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
        expected = x.float() @ dense.t()
        trials = natural_trials(n, k, max(rows, 2), sm_count)
        # The first (one warp group, split-K for two programs per SM) and the first of two warp groups.
        for tiles in (trials[0], next(t for t in trials if t.num_warps == 8)):
            y = natural_mma(x, words, scales, zeros, 4, 128, tiles)
            twin = natural_mma(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, asm=False))
            assert torch.equal(y, twin), (rows, tiles)
            assert _error(y, expected) < 1e-2, (rows, tiles, _error(y, expected))
