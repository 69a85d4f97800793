"""RMSNorm, with the residual add fused in (as HF Llama: float32 statistics, the input's dtype out)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treadle.kernels.fused_ops import add_rmsnorm


class RMSNorm(nn.Module):
    """Root-mean-square layer norm; statistics in float32, result in the input's dtype (as HF Llama).

    Given a ``residual`` it first adds it (``x + residual``) and returns ``(normed, sum)``,
    one fused kernel on the GPU.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        normed, summed = add_rmsnorm(x, residual, self.weight, self.eps)
        return normed if residual is None else (normed, summed)
