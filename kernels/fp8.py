"""Triton kernel for FP8 activations: per-token (row) dynamic quantization in one launch.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 1024


@triton.jit
def _per_token_quant_kernel(X, Q, Scale, stride_x, stride_q, K, fp8_max, min_scale,
                            BLOCK: tl.constexpr, SINGLE_PASS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x
    q_row = Q + row * stride_q
    if SINGLE_PASS:
        offs = tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0) / fp8_max, min_scale)
        q = tl.clamp(x / scale, -fp8_max, fp8_max)
        tl.store(q_row + offs, q.to(Q.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros([BLOCK], tl.float32)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.abs(x))
        scale = tl.maximum(tl.max(amax, 0) / fp8_max, min_scale)
        for start in range(0, K, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < K
            x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            q = tl.clamp(x / scale, -fp8_max, fp8_max)
            tl.store(q_row + offs, q.to(Q.dtype.element_ty), mask=mask)
    tl.store(Scale + row, scale)


def per_token_quant(x: torch.Tensor, fp8_dtype: torch.dtype, fp8_max: float, min_scale: float
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] (unit stride on K) → (FP8 [M, K], float32 scales [M, 1]) with ``x ≈ q * scale`` per row."""
    m, k = x.shape
    q = torch.empty((m, k), dtype=fp8_dtype, device=x.device)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    single = k <= 8192
    block = triton.next_power_of_2(k) if single else _BLOCK
    _per_token_quant_kernel[(m,)](
        x, q, scale, x.stride(0), q.stride(0), k, fp8_max, min_scale,
        BLOCK=block, SINGLE_PASS=single, num_warps=4 if block <= 4096 else 8,
    )
    return q, scale
