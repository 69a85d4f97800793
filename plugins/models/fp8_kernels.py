"""Triton kernel for FP8 activations: per-token (row) dynamic quantization in one launch.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

from typing import NamedTuple

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
def _w8a16_kernel(X, W, Scale, Y, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym, stride_ysplit,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, GEMV: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Each split's range is a multiple of BLOCK_K, so masking against K alone never reads the next split.
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if GEMV:
        acc = _w8a16_row(X + pid_m.to(tl.int64) * stride_xm, W, offs_n, n_mask, k_start, k_end, K, stride_wn,
                         BLOCK_N, BLOCK_K)[None, :]
    else:
        acc = _w8a16_rows(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, stride_xm, stride_wn,
                          BLOCK_M, BLOCK_N, BLOCK_K)
    y_ptrs = Y + pid_k * stride_ysplit + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    y_mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        scale = tl.load(Scale + offs_n, mask=n_mask, other=0.0)
        tl.store(y_ptrs, (acc * scale[None, :]).to(Y.dtype.element_ty), mask=y_mask)
    else:
        tl.store(y_ptrs, acc, mask=y_mask)


@triton.jit
def _w8a16_rows(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, stride_xm, stride_wn,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = (k + tl.arange(0, BLOCK_K)) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _w8a16_row(X_row, W, offs_n, n_mask, k_start, k_end, K, stride_wn,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # One row needs no tensor cores: tl.dot would pad it to 16 rows and hold them in registers.
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X_row + offs_k
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = (k + tl.arange(0, BLOCK_K)) < K
        x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(w * x[None, :], axis=1)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _split_k_sum_kernel(Partials, Scale, Y, numel, N, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for split in tl.static_range(SPLIT_K):
        acc += tl.load(Partials + split * numel + offs, mask=mask, other=0.0)
    scale = tl.load(Scale + offs % N, mask=mask, other=0.0)
    tl.store(Y + offs, (acc * scale).to(Y.dtype.element_ty), mask=mask)


_SUM_BLOCK = 512


class W8A16Config(NamedTuple):
    """One launch config of :func:`w8a16_matmul`.

    ``split_k`` > 1 splits K into that many contiguous ranges (each a multiple of ``block_k``) reduced by
    separate programs into float32 partials, which a second kernel sums, scales and casts; 1 is a single
    kernel. ``gemv`` runs one row of ``x`` without ``tl.dot`` (weights widened to float32, products summed
    along K); it applies only when ``x`` has one row, more rows use ``tl.dot`` with the same tiles.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    gemv: bool = False

    def __str__(self) -> str:
        label = f"{self.block_n}/{self.block_k}/{self.num_warps}/{self.num_stages}"
        if self.split_k > 1:
            label += f" split-k {self.split_k}"
        return label + (" gemv" if self.gemv else "")


# Tried at load per weight shape (fp8.py); the first is the default. On an H100 the GEMVs won at one row
# for Llama-3.1-8B's projections (7.7 us for 6144 x 4096 against 14.5 us for the best tl.dot tiles), split-K
# tl.dot at 16 rows for all but the widest (28672 x 4096): the narrow shapes fill too few waves of programs
# over the SMs without splitting K.
W8A16_CONFIGS = (
    W8A16Config(32, 256, 4, 3, split_k=4),
    W8A16Config(32, 256, 4, 4),
    W8A16Config(64, 128, 4, 3, split_k=8),
    W8A16Config(32, 512, 4, 3, split_k=2),
    W8A16Config(8, 1024, 4, 3, gemv=True),
    W8A16Config(8, 1024, 4, 3, split_k=2, gemv=True),
    W8A16Config(16, 512, 4, 3, split_k=4, gemv=True),
    W8A16Config(64, 512, 4, 3, gemv=True),
    W8A16Config(64, 512, 4, 3, split_k=8, gemv=True),
)


def w8a16_matmul(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor,
                 config: W8A16Config) -> torch.Tensor:
    """``x @ (weight * weight_scale).T`` for few rows of ``x`` (16-bit) and an FP8 ``weight`` [N, K]
    with float32 ``weight_scale`` [N, 1]: the weight is widened in registers, activations stay 16-bit."""
    m, k = x.shape
    n = weight.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    gemv = config.gemv and m == 1
    block_m = 1 if gemv else 16
    split_k = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    # Split-K programs write unscaled float32 partials [split_k, M, N]; the sum kernel finishes them.
    out = y if split_k == 1 else torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m), split_k)
    _w8a16_kernel[grid](
        x, weight, weight_scale, out, m, n, k, k_per_split, x.stride(0), weight.stride(0), out.stride(-2),
        out.stride(0) if split_k > 1 else 0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k, GEMV=gemv,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        _split_k_sum_kernel[(triton.cdiv(m * n, _SUM_BLOCK),)](
            out, weight_scale, y, m * n, n, SPLIT_K=split_k, BLOCK=_SUM_BLOCK, num_warps=4,
        )
    return y
