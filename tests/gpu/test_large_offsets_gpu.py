"""The fused Triton kernels on prefills whose element offsets pass 2**31 (an unchunked long prompt).

With 32-bit offsets ``row * stride`` wrapped around: SiLU·mul of Llama-3.1-8B (28,672 columns) read and wrote
the wrong memory from 74,899 tokens on (an illegal memory access, or silently wrong activations). Each case
takes the smallest row count past the limit and checks the last rows against the PyTorch reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from treadle.kernels.fused_ops import apply_rotary_reference, rmsnorm_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LIMIT = 2**31
LAST = 4  # rows compared with the reference


def _rows_past_limit(row_elements: int) -> int:
    return LIMIT // row_elements + 2


def test_silu_mul_past_two_to_the_31_elements() -> None:
    from treadle.kernels.fused import silu_mul

    width = 2 * 14336
    gate_up = torch.randn(_rows_past_limit(width), width, device="cuda", dtype=torch.bfloat16)
    out = silu_mul(gate_up)
    gate, up = gate_up[-LAST:].chunk(2, dim=-1)
    torch.testing.assert_close(out[-LAST:], F.silu(gate) * up)


def test_add_rmsnorm_past_two_to_the_31_elements() -> None:
    from treadle.kernels.fused import add_rmsnorm

    hidden = 4096
    rows = _rows_past_limit(hidden)
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    out, residual_out = add_rmsnorm(x, residual, weight, 1e-5)
    summed = x[-LAST:] + residual[-LAST:]
    torch.testing.assert_close(residual_out[-LAST:], summed)
    torch.testing.assert_close(out[-LAST:], rmsnorm_reference(summed, weight, 1e-5))


def test_rotary_qkv_past_two_to_the_31_elements() -> None:
    from treadle.kernels.fused import rotary_qkv

    heads, kv_heads, head_dim = 32, 8, 128
    width = (heads + 2 * kv_heads) * head_dim
    tokens = _rows_past_limit(width)
    qkv = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
    angles = torch.rand(tokens, 1, head_dim // 2, device="cuda") * 6.28
    cos = torch.cat([angles.cos()] * 2, dim=-1).to(torch.bfloat16)
    sin = torch.cat([angles.sin()] * 2, dim=-1).to(torch.bfloat16)
    q, k, v = rotary_qkv(qkv, cos, sin, heads, kv_heads, head_dim)
    tail = qkv[-LAST:]
    q_ref = apply_rotary_reference(tail[:, :heads * head_dim].view(-1, heads, head_dim), cos[-LAST:], sin[-LAST:])
    k_ref = apply_rotary_reference(tail[:, heads * head_dim:(heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim),
                                   cos[-LAST:], sin[-LAST:])
    torch.testing.assert_close(q[-LAST:], q_ref.reshape(LAST, -1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(k[-LAST:], k_ref.reshape(LAST, -1), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(v[-LAST:], tail[:, (heads + kv_heads) * head_dim:])
