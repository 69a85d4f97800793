"""kernels/packed_int_natural.py's launch options for 2 to 64 tokens on a GPU at Llama-3.1-8B's o_proj and qkv_proj
shapes: the loader's wave split and half of it give the dequantized matmul; the early L2 request of more panels
(``head_lines``) and two pipeline stages change nothing, and a CUDA graph replays it. gate_up_proj's
silu(gate) * up in the epilogue gives what the matmul and the separate silu_mul give."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from packed_weights import random_weight, relative_error

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEVICE = torch.device("cuda")


def _weight(n: int, k: int):
    words, scales, _, dense = random_weight(n, k, False, torch.bfloat16, DEVICE)
    return words, scales, dense


_error = relative_error


@pytest.mark.parametrize("n, k", [(4096, 4096), (6144, 4096)])
def test_the_wave_split_and_its_options_give_the_matmul_and_replay_in_a_graph(n, k):
    from treadle.kernels.packed_int_natural import NaturalMmaTiles, natural_mma, wave_split

    words, scales, dense = _weight(n, k)
    sm_count = torch.cuda.get_device_properties(DEVICE).multi_processor_count
    for rows in (2, 16, 32, 64):
        block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
        wave = NaturalMmaTiles(block_m, 128, wave_split(n, k, 2 if block_m > 32 else 3, sm_count))
        x = torch.randn(rows, k, device=DEVICE, dtype=torch.bfloat16)
        expected = x.float() @ dense.t()
        reference = natural_mma(x, words, scales, None, 4, 128, wave)
        assert _error(reference, expected) < 1e-2, (rows, wave)
        for other in (dataclasses.replace(wave, head_lines=8), dataclasses.replace(wave, num_stages=2)):
            assert torch.equal(natural_mma(x, words, scales, None, 4, 128, other), reference), (rows, other)
        half = dataclasses.replace(wave, split_k=max(wave.split_k // 2, 1))
        assert _error(natural_mma(x, words, scales, None, 4, 128, half), expected) < 1e-2, (rows, half)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = natural_mma(x, words, scales, None, 4, 128, half)
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
