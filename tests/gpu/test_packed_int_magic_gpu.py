"""kernels/packed_int_magic.py's and kernels/packed_int_natural.py's tensor-core kernels on a GPU at Llama-3.1-8B's
projection shapes: their inline-PTX widening (magic_mma's scaled after the dots or before them; natural_mma's at 1,
16, 32 and 64 tokens and a partial tile) gives exactly what its plain-op twin gives (the CPU tests check the twins)
and matches the dequantized matmul in bf16 and fp16, with and without zero points; today's GEMV with the subnormal
widening matches the plain one, epilogues included."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from packed_weights import random_weight, relative_error

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 14336)]  # Llama-3.1-8B's qkv and down projections
# (activations' dtype, zero points): both magic numbers, both ways of taking the zero.
KINDS = [(torch.bfloat16, False), (torch.bfloat16, True), (torch.float16, True)]


def _weight(n: int, k: int, asym: bool, dtype: torch.dtype):
    return random_weight(n, k, asym, dtype, DEVICE)


_error = relative_error


@pytest.mark.parametrize("dtype, asym", KINDS)
@pytest.mark.parametrize("n, k", SHAPES[1:])  # the sweep checks every shape's bf16 output too
def test_magic_mma_asm_equals_its_twin_and_the_reference(n, k, asym, dtype):
    from treadle.kernels.packed_int_magic import magic_mma, mma_trials

    words, scales, zeros, dense = _weight(n, k, asym, dtype)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    # One token on a 16-token tile (bf16 alone), a partial 32-token tile; each way of scaling.
    for rows in (1, 21) if dtype == torch.bfloat16 and not asym else (21,):
        x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
        expected = x.float() @ dense.t()
        for scaled in (False, True):
            tiles = next(t for t in mma_trials(n, k, rows, sm_count) if t.scaled == scaled)
            y = magic_mma(x, words, scales, zeros, 4, 128, tiles)
            twin = magic_mma(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, asm=False))
            assert torch.equal(y, twin), (rows, tiles)
            assert _error(y, expected) < 1e-2, (rows, tiles, _error(y, expected))


@pytest.mark.parametrize("dtype, asym", KINDS)
def test_natural_mma_equals_its_twin_and_the_dequantized_matmul(asym, dtype):
    # bf16 without zero points (the common checkpoints) at qkv_proj's shape: 1 to 64 tokens, a partial tile, the
    # loader's first launch and the registers capped, two warp groups at 32; each kind at down_proj's, 21 tokens.
    from treadle.kernels.packed_int_natural import natural_mma, natural_trials

    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    full = dtype == torch.bfloat16 and not asym
    for n, k in ((6144, 4096), (4096, 14336)) if full else ((4096, 14336),):
        words, scales, zeros, dense = _weight(n, k, asym, dtype)
        for rows in (1, 16, 21, 32, 64) if full and n == 6144 else (21,):
            x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
            expected = x.float() @ dense.t()
            trials = natural_trials(n, k, max(rows, 2), sm_count)
            launches = [trials[0]]
            if full and n == 6144:
                launches.append(next(t for t in trials if t.max_registers))
                launches += [t for t in trials if t.num_warps == 8][:1] if rows == 32 else []
            for tiles in launches:
                y = natural_mma(x, words, scales, zeros, 4, 128, tiles)
                twin = natural_mma(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, asm=False))
                assert torch.equal(y, twin), (rows, tiles)
                assert _error(y, expected) < 1e-2, (rows, tiles, _error(y, expected))


@pytest.mark.parametrize("epilogue", ["split-K", "silu_mul", "add_rmsnorm"])
def test_todays_gemv_with_subnormal_values_equals_it_closely(epilogue):
    # IntTiles.subnormal: the same kernel and epilogues, the values widened as float32 subnormals.
    from treadle.kernels.packed_int import IntTiles, int_gemv

    n, k = (28672, 4096) if epilogue == "silu_mul" else (4096, 14336)
    words, scales, zeros, _ = _weight(n, k, True, torch.bfloat16)
    x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
    tiles = IntTiles(0, 8, 64, 4 if epilogue == "split-K" else 1, 1)
    extra = {"silu_mul": True} if epilogue == "silu_mul" else {}
    if epilogue == "add_rmsnorm":
        extra = {"add_rmsnorm": (torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16),
                                 torch.rand(n, device=DEVICE, dtype=torch.bfloat16) + 0.5, 1e-5)}
    plain = int_gemv(x, words, scales, zeros, 4, 128, tiles, **extra)
    subnormal = int_gemv(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, subnormal=True), **extra)
    for a, b in zip(*(((y,) if isinstance(y, torch.Tensor) else y) for y in (plain, subnormal))):
        assert _error(b, a.float()) < 4e-3, (epilogue, _error(b, a.float()))
