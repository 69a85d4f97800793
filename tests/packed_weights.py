"""Random 4-bit weights in the panel layout (``layers/packed_int.py``) and their dequantized form, for the GPU
tests of the W4A16 kernels (imported by name, as conftest.py puts this folder on the path)."""

from __future__ import annotations

import torch


def random_weight(n: int, k: int, asym: bool, dtype: torch.dtype, device: torch.device):
    """``(words, scales, zeros, dense)``: ``n`` x ``k`` random 4-bit values packed in panels, group-128 scales (and
    zero points with ``asym``, else the symmetric 8) in ``dtype``, and the float32 weight they stand for."""
    from treadle.layers.packed_int import pack_panels

    gen = torch.Generator(device=device).manual_seed(n + k + asym)
    values = torch.randint(0, 16, (n, k), device=device, generator=gen)
    scales = (torch.rand(n, k // 128, device=device, generator=gen) * 0.002 + 0.001).to(dtype)
    zeros = torch.randint(0, 16, (n, k // 128), device=device, generator=gen).to(dtype) if asym else None
    groups = torch.arange(k, device=device) // 128
    dense = (values.float() - (zeros.float()[:, groups] if asym else 8)) * scales.float()[:, groups]
    return pack_panels(values, 4), scales, zeros, dense


def relative_error(y: torch.Tensor, expected: torch.Tensor) -> float:
    return ((y.float() - expected).norm() / expected.norm()).item()
