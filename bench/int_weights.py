"""Llama-3.1-8B's projection shapes and random W4A16 weights in the panel layout, for the integer-kernel benchmarks
(``bench/quant_kernels.py``, ``bench/quant_sweep.py``)."""

from __future__ import annotations

import torch

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096),
          "down_proj": (4096, 14336)}
LAYERS = 32  # Llama-3.1-8B's decoder layers


def candidates(n: int, k: int, rows: int, device: torch.device, explore: bool) -> list:
    """For one row the GEMV configs the loader times (``layers/int_kernel_choice.py``), for more ``int_dot``'s
    (``tile_candidates``: the loader times them at 64 rows, and only the first at 16 and 32); with ``explore`` a
    wider grid of plain ones besides."""
    from treadle.kernels.packed_int import IntTiles, gemv_candidates, tile_candidates

    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    if rows == 1:
        listed = gemv_candidates(n, k, 4, sm_count)
        if explore:
            listed += [IntTiles(0, block_n, block_w, split, warps) for block_n in (8, 16, 32, 64)
                       for block_w in (16, 32, 64) for split in (1, 2, 4, 8) for warps in (1, 2, 4)
                       if (k // 8) % (block_w * split) == 0 and block_n * block_w <= 32 * 32 * warps]
        return list(dict.fromkeys(listed))
    listed = tile_candidates(n, k, 4, 16 if rows <= 16 else 32 if rows <= 32 else 64, sm_count)
    if explore:
        listed += [IntTiles(block_m, block_n, 16, split, warps, i16) for block_m in (16, 32, 64)
                   for block_n in (32, 64, 128) for split in (1, 2, 4) for warps in (4, 8) for i16 in (True, False)
                   if block_m >= min(rows, 64) // 2]
    return list(dict.fromkeys(listed))


class PackedWeight:
    """A random W4A16 weight in the kernels' layout, with copies to cycle through."""

    def __init__(self, n: int, k: int, zeros: bool, device: torch.device) -> None:
        self.words = copies(torch.randint(-2**31, 2**31 - 1, (n, k // 8), dtype=torch.int32, device=device))
        self.scales = (torch.rand(n, k // 128, device=device) * 0.002 + 0.001).to(torch.bfloat16)
        self.zeros = torch.randint(0, 16, (n, k // 128), device=device).to(torch.bfloat16) if zeros else None
        self.bytes = self.words[0].numel() * 4 + self.scales.numel() * 2 * (2 if zeros else 1)

    def run(self, x: torch.Tensor, i: int, tiles) -> torch.Tensor:
        """``x @ weight.T`` with copy ``i`` of the weight, by the kernel ``tiles`` configures."""
        from treadle.kernels.int_kernel_plan import run_tiles

        return run_tiles(x, self.words[i % len(self.words)], self.scales, self.zeros, 4, 128, tiles)


def copies(weight: torch.Tensor) -> list[torch.Tensor]:
    from treadle.layers.small_batch import weight_copies

    return weight_copies(weight)


def copy_bandwidth(device: torch.device) -> float:
    """Bytes per second of a device-to-device copy of 1 GiB (read plus write)."""
    source = torch.empty(1 << 28, dtype=torch.float32, device=device)
    target = torch.empty_like(source)
    for _ in range(3):
        target.copy_(source)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        target.copy_(source)
    end.record()
    end.synchronize()
    return 2 * source.numel() * 4 * 10 / (start.elapsed_time(end) / 1e3)
