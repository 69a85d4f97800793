"""kernels/packed_int_natural.py's launch options for 2 to 64 tokens on a GPU at Llama-3.1-8B's o_proj and qkv_proj
shapes: split-K's partials added by L2's atomic units (``atomic_sum``) give the dequantized matmul, call after call
and replayed from a CUDA graph (each tile's last program zeroes the sums again), within a float32 rounding of the
stored partials' sum; the early L2 request of more panels (``head_lines``), two pipeline stages, letting the next
kernel in before the loop (``next_early``) and the weight re-laid out a tile's K step contiguous (``tiled``) change
nothing. gate_up_proj's silu(gate) * up in the epilogue gives what the matmul and the separate silu_mul give."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


def _weight(n: int, k: int):
    from treadle.layers.packed_int import pack_panels

    gen = torch.Generator(device=DEVICE).manual_seed(n + k)
    values = torch.randint(0, 16, (n, k), device=DEVICE, generator=gen)
    scales = (torch.rand(n, k // 128, device=DEVICE, generator=gen) * 0.002 + 0.001).to(torch.bfloat16)
    groups = torch.arange(k, device=DEVICE) // 128
    dense = (values.float() - 8) * scales.float()[:, groups]
    return pack_panels(values, 4), scales, dense


def _error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected).norm() / expected.norm()).item()


@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096)])
def test_partials_added_atomically_give_the_matmul_call_after_call_and_in_a_graph(n, k):
    from treadle.kernels.packed_int_natural import NaturalMmaTiles, natural_mma, tile_panels, wave_split

    words, scales, dense = _weight(n, k)
    tiled_words = tile_panels(words, 128)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for rows in (2, 16, 32, 64):
        block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
        stored = NaturalMmaTiles(block_m, 128, wave_split(n, k, 2 if block_m > 32 else 3, sm_count))
        added = dataclasses.replace(stored, atomic_sum=True)
        x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
        expected = x.float() @ dense.t()
        reference = natural_mma(x, words, scales, None, 4, 128, stored)
        assert _error(reference, expected) < 1e-2, (rows, stored)
        for other in (dataclasses.replace(stored, head_lines=8), dataclasses.replace(stored, num_stages=2),
                      dataclasses.replace(stored, next_early=True)):
            assert torch.equal(natural_mma(x, words, scales, None, 4, 128, other), reference), (rows, other)
        tiled = dataclasses.replace(stored, tiled=True)
        assert torch.equal(natural_mma(x, tiled_words, scales, None, 4, 128, tiled), reference), rows
        for _ in range(2):  # the sums are zero again after each call
            y = natural_mma(x, words, scales, None, 4, 128, added)
            # the float32 sums differ in order only: a bf16 rounding apart at most
            assert (y.float() - reference.float()).abs().max() <= reference.float().abs().max() * 2 ** -7, rows
            assert _error(y, expected) < 1e-2, (rows, added)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = natural_mma(x, words, scales, None, 4, 128, added)
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert _error(replayed, expected) < 1e-2, rows


def test_silu_mul_in_the_epilogue_gives_the_matmul_then_silu_mul():
    # gate_up_proj's shape (gate and up 14336 rows each), one K range: what the loader races per row bucket
    from treadle.kernels.int_kernel_plan import SiluMulTiles, run_tiles
    from treadle.kernels.packed_int_natural import NaturalMmaTiles

    words, scales, dense = _weight(28672, 4096)
    for rows in (2, 16, 32, 64):
        tiles = NaturalMmaTiles(16 if rows <= 16 else 32 if rows <= 32 else 64, 128)
        x = torch.randn(rows, 4096, device=DEVICE, dtype=torch.bfloat16)
        unfused = run_tiles(x, words, scales, None, 4, 128, SiluMulTiles(tiles, False))
        fused = run_tiles(x, words, scales, None, 4, 128, SiluMulTiles(tiles, True))
        gate, up = (x.float() @ dense.t()).chunk(2, dim=-1)
        assert _error(unfused, torch.nn.functional.silu(gate) * up) < 1e-2, rows
        # rounded where the two kernels round: the same values but for exp's last bit here and there
        assert (fused == unfused).float().mean() > 0.999, rows
        assert (fused.float() - unfused.float()).abs().max() <= unfused.float().abs().max() * 2 ** -7, rows
