"""The attention block of Llama-family decoders: QKV projection, q/k norms, rotary embedding, RadixAttention, output projection."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from treadle.core.execution.attention import RadixAttention
from treadle.core.execution.forward_batch import ForwardBatch
from treadle.kernels.fused_ops import rotary_qkv
from treadle.layers.linear import QKVParallelLinear, RowParallelLinear
from treadle.layers.norm import RMSNorm


class SelfAttention(nn.Module):
    """QKV projection, optional per-head q/k RMSNorm, rotary embedding, RadixAttention, output projection.

    ``num_heads``/``num_kv_heads`` are the model's totals; under tensor parallelism each
    rank runs its share of the heads (``self.num_heads``/``self.num_kv_heads`` per rank).
    ``qkv_bias`` and ``o_bias`` are separate because families differ (Qwen2: biased q/k/v, plain o_proj).
    ``qk_norm_eps`` (None: off) adds Qwen3's ``q_norm``/``k_norm``: an RMSNorm over each head's
    ``head_dim`` features, applied to q and k before the rotary embedding.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        layer_id: int,
        qkv_bias: bool = False,
        o_bias: bool = False,
        sliding_window_size: int | None = None,
        quant_config: Any = None,
        prefix: str = "",
        qk_norm_eps: float | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias,
            quant_config=quant_config, prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.o_proj = RowParallelLinear(
            num_heads * head_dim, hidden_size, o_bias, quant_config=quant_config, prefix=f"{prefix}.o_proj"
        )
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.attn = RadixAttention(
            self.num_heads, head_dim, head_dim**-0.5, self.num_kv_heads, layer_id,
            sliding_window_size=sliding_window_size,
        )

    def forward(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        return self.o_proj(self.attend(hidden_states, cos, sin, forward_batch))

    def attend(
        self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, forward_batch: ForwardBatch
    ) -> torch.Tensor:
        """The attention output before ``o_proj`` (which :class:`DecoderLayer` runs with the norm after it)."""
        qkv = self.qkv_proj(hidden_states)
        if self.q_norm is not None:
            qkv = self._norm_heads(qkv)
        if forward_batch.attn_backend.applies_rotary(forward_batch):
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return self.attn(q, k, v, forward_batch, rotary=(cos, sin))
        q, k, v = rotary_qkv(qkv, cos, sin, self.num_heads, self.num_kv_heads, self.head_dim)
        return self.attn(q, k, v, forward_batch)

    def _norm_heads(self, qkv: torch.Tensor) -> torch.Tensor:
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(-1, self.head_dim)).view(-1, self.q_size)
        k = self.k_norm(k.reshape(-1, self.head_dim)).view(-1, self.kv_size)
        return torch.cat((q, k, v), dim=-1)
