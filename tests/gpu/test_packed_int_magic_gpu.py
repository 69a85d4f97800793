"""The sweep's W4A16 candidates (kernels/packed_int_magic.py) on a GPU at Llama-3.1-8B's projection shapes: the
tensor-core kernel's inline-PTX widening (scaled after the dot or before it, one dot a panel or four) gives exactly
what its plain-op twin gives (the CPU tests check the twin), and both kernels match the dequantized matmul in bf16
and fp16, with and without zero points; today's GEMV with the subnormal widening matches it, epilogues included."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")
SHAPES = [(6144, 4096), (4096, 14336)]  # Llama-3.1-8B's qkv and down projections
# (activations' dtype, zero points): both magic numbers, both ways of taking the zero.
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
@pytest.mark.parametrize("n, k", SHAPES[1:])  # the sweep checks every shape's bf16 output too
def test_magic_mma_asm_equals_its_twin_and_the_reference(n, k, asym, dtype):
    from treadle.kernels.packed_int_magic import magic_mma, mma_trials

    words, scales, zeros, dense = _weight(n, k, asym, dtype)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    # One token on a 16-token tile (bf16 alone), a partial 32-token tile; each way of scaling and of cutting a panel.
    for rows in (1, 21) if dtype == torch.bfloat16 and not asym else (21,):
        x = torch.randn(rows, k, device=DEVICE, dtype=dtype)
        expected = x.float() @ dense.t()
        for scaled, pair_dots in ((False, False), (True, False), (False, True), (True, True)):
            tiles = next(t for t in mma_trials(n, k, rows, sm_count) if (t.scaled, t.pair_dots) == (scaled, pair_dots))
            y = magic_mma(x, words, scales, zeros, 4, 128, tiles)
            twin = magic_mma(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, asm=False))
            assert torch.equal(y, twin), (rows, tiles)
            assert _error(y, expected) < 1e-2, (rows, tiles, _error(y, expected))


@pytest.mark.parametrize("dtype, asym", KINDS[:2])
@pytest.mark.parametrize("n, k", SHAPES[:1])  # the sweep checks every shape's bf16 output too
def test_magic_gemv_matches_the_reference_as_today_does(n, k, asym, dtype):
    from treadle.kernels.packed_int import gemv_candidates, int_gemv
    from treadle.kernels.packed_int_magic import gemv_trials, magic_gemv

    words, scales, zeros, dense = _weight(n, k, asym, dtype)
    x = torch.randn(1, k, device=DEVICE, dtype=dtype)
    expected = x.float() @ dense.t()
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    today = _error(int_gemv(x, words, scales, zeros, 4, 128, gemv_candidates(n, k, 4, sm_count)[0]), expected)
    trials = gemv_trials(n, k, sm_count)
    for tiles in trials[:3] + trials[-1:]:  # subnormals, and the offsets (the last)
        error = _error(magic_gemv(x, words, scales, zeros, 4, 128, tiles), expected)
        assert error < max(2 * today, 4e-3), (tiles, error, today)


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


@pytest.mark.parametrize("epilogue", ["none", "split-K", "silu_mul", "add_rmsnorm"])
def test_lean_gemv_equals_the_subnormal_one_closely(epilogue):
    # IntTiles.lean (kernels/packed_int_lean.py): every lean launch the sweep times (the loader times none), bf16
    # activations (their power of two added to the exponent) with zero points and without, against the dequantized
    # matmul and the subnormal GEMV; with the fused epilogues, against the subnormal GEMV's.
    from treadle.bench.quant_sweep import trials
    from treadle.kernels.packed_int import IntTiles, int_gemv

    n, k = (28672, 4096) if epilogue == "silu_mul" else (4096, 14336) if epilogue != "none" else (6144, 4096)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for asym in (False, True):
        words, scales, zeros, dense = _weight(n, k, asym, torch.bfloat16)
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        x[0, ::5] = 0
        if epilogue == "none":
            expected = x.float() @ dense.t()
            lean_trials = [t for t in trials(n, k, 1, sm_count) if t.lean]
            assert lean_trials
            for tiles in lean_trials:
                error = _error(int_gemv(x, words, scales, zeros, 4, 128, tiles), expected)
                assert error < 4e-3, (tiles, error)
            continue
        tiles = IntTiles(0, 16, 128, 2 if epilogue == "split-K" else 1, 1, subnormal=True)
        extra = {"silu_mul": True} if epilogue == "silu_mul" else {}
        if epilogue == "add_rmsnorm":
            extra = {"add_rmsnorm": (torch.randn(1, n, device=DEVICE, dtype=torch.bfloat16),
                                     torch.rand(n, device=DEVICE, dtype=torch.bfloat16) + 0.5, 1e-5)}
        subnormal = int_gemv(x, words, scales, zeros, 4, 128, tiles, **extra)
        lean = int_gemv(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, subnormal=False, lean=True),
                        **extra)
        for a, b in zip(*(((y,) if isinstance(y, torch.Tensor) else y) for y in (subnormal, lean))):
            assert _error(b, a.float()) < 4e-3, (epilogue, asym, _error(b, a.float()))


@pytest.mark.parametrize("epilogue", ["none", "split-K", "silu_mul"])
def test_hmma_gemv_matches_the_lean_one(epilogue):
    # IntTiles.hmma (kernels/packed_int_hmma.py): the tensor-core loop, which the CPU cannot run, against the lean
    # loop on the same tiles, with zero points and without, 8 and 16 rows a program, and the reference.
    from treadle.kernels.packed_int import IntTiles, int_gemv

    n, k = (28672, 4096) if epilogue == "silu_mul" else (4096, 14336)
    for asym in (False, True):
        words, scales, zeros, dense = _weight(n, k, asym, torch.bfloat16)
        x = torch.randn(1, k, device=DEVICE, dtype=torch.bfloat16)
        for block_n in (16, 8):
            tiles = IntTiles(0, block_n, 128, 7 if epilogue == "split-K" else 1, 1, lean=True)
            extra = {"silu_mul": True} if epilogue == "silu_mul" else {}
            lean = int_gemv(x, words, scales, zeros, 4, 128, tiles, **extra)
            hmma = int_gemv(x, words, scales, zeros, 4, 128, dataclasses.replace(tiles, lean=False, hmma=True),
                            **extra)
            assert _error(hmma, lean.float()) < 4e-3, (epilogue, asym, block_n, _error(hmma, lean.float()))
            if epilogue == "none":
                assert _error(hmma, x.float() @ dense.t()) < 4e-3
