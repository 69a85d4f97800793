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


@triton.jit
def _w8a16_kernel(X, W, Scale, Y, M, N, K, stride_xm, stride_wn, stride_ym,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(0, K, BLOCK_K):
        k_mask = (k + offs_k) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    scale = tl.load(Scale + offs_n, mask=n_mask, other=0.0)
    y = acc * scale[None, :]
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], y.to(Y.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])


# (BLOCK_N, BLOCK_K, num_warps, num_stages) tried for W8A16 at load; small N blocks keep all SMs busy at M <= 16.
W8A16_CONFIGS = ((16, 512, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 3))


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 config: tuple[int, int, int, int]) -> torch.Tensor:
    """``x @ (weight * weight_scale).T`` for few rows of ``x`` (16-bit) and an FP8 ``weight`` [N, K]
    with float32 ``weight_scale`` [N, 1]: the weight is widened in registers, activations stay 16-bit."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, num_warps, num_stages = config
    block_m = 16
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m))
    _w8a16_kernel[grid](
        x, weight, weight_scale, y, m, n, k, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps, num_stages=num_stages,
    )
    return y
