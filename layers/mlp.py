"""The gated MLP of Llama-family decoders, tensor-parallel over its intermediate dimension."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treadle.kernels.fused_ops import silu_mul
from treadle.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """``down(silu(gate(x)) * up(x))`` with gate and up in one matmul; tensor-parallel over the intermediate dim."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, quant_config: Any = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, {"gate_proj": intermediate_size, "up_proj": intermediate_size}, bias,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj",
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, quant_config=quant_config, prefix=f"{prefix}.down_proj"
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self._activated(x))

    def forward_into_norm(self, x: torch.Tensor, residual: torch.Tensor,
                          norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor, bool]:
        """``(*norm(self(x), residual), True)`` where ``down_proj``'s kernel can add the residual and run the norm
        (``norm`` an RMSNorm; one-token GEMVs on a GPU: a kernel launch less per layer), else
        ``(self(x), residual, False)``."""
        activated = self._activated(x)
        fused = self.down_proj.forward_add_rmsnorm(activated, residual, norm)
        if fused is not None:
            return fused[0], fused[1], True
        return self.down_proj(activated), residual, False

    def _activated(self, x: torch.Tensor) -> torch.Tensor:
        activated = self.gate_up_proj.forward_silu_mul(x)
        return activated if activated is not None else silu_mul(self.gate_up_proj(x))
