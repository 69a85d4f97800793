"""Pearson's chi-square for the sampling tests (imported by name, see conftest.py)."""

from __future__ import annotations

import math

import torch


def chi_square_passes(samples: torch.Tensor, expected: torch.Tensor) -> bool:
    """Pearson's chi-square against ``expected`` over tokens with expected count >= 5, at significance 1e-4
    (Wilson-Hilferty's quantile); a token with zero expected probability must never appear."""
    counts = torch.bincount(samples, minlength=expected.numel()).double()
    n = int(counts.sum())
    if counts[expected == 0].sum() > 0:
        return False
    cells = expected * n >= 5
    statistic = float((((counts - expected * n) ** 2) / (expected * n))[cells].sum())
    df = int(cells.sum()) - 1
    z = 3.719  # the standard normal's 1 - 1e-4 quantile
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return statistic < critical
