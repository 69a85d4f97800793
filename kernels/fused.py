"""Triton kernels behind :mod:`treadle.kernels.fused_ops` (imported only when Triton is used)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.pdl import wait_for_previous


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, residual_out_ptr,
    n_cols, eps, stride_x, stride_residual,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # row * stride passes 2**31 elements in prefills of a few 100k tokens
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    # Issued first: at a few rows the kernel is a chain of dependent steps, and this load depends on none (it is
    # read even before waiting for the kernel before, kernels/pdl.py).
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    wait_for_previous(PDL)
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = rounded_add(x, tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0))
    tl.store(residual_out_ptr + row * n_cols + cols, x, mask=mask)
    tl.store(out_ptr + row * n_cols + cols, rmsnorm_row(x, weight, n_cols, eps), mask=mask)


@triton.jit
def rounded_add(x, residual):
    """``x + residual`` in float32, rounded to x's dtype like a torch add."""
    return (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)


@triton.jit
def rmsnorm_row(x, weight, n_cols, eps):
    """``weight * rmsnorm(x)`` of one row (masked-out columns zero), rounded where HF's Llama rounds: statistics in
    float32, the normed row and the product in x's dtype. Also the norm that a small-batch GEMV runs in its last
    program (``small_batch_kernels``)."""
    x32 = x.to(tl.float32)
    variance = tl.sum(x32 * x32, axis=0) / n_cols
    normed = (x32 * tl.rsqrt(variance + eps)).to(x.dtype)
    return (weight.to(tl.float32) * normed.to(tl.float32)).to(x.dtype)


def add_rmsnorm(x, residual, weight, eps):
    n_rows, n_cols = x.shape
    out = torch.empty((n_rows, n_cols), dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    block = triton.next_power_of_2(n_cols)
    pdl = pdl_enabled(x.device)
    _add_rmsnorm_kernel[(n_rows,)](
        x, residual if residual is not None else x, weight, out, residual_out,
        n_cols, eps, x.stride(0), residual.stride(0) if residual is not None else 0,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        PDL=pdl, launch_pdl=pdl,
    )
    return out, residual_out


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, cos, sin, num_heads, HEADS: tl.constexpr, HALF: tl.constexpr):
    heads = tl.arange(0, HEADS)[:, None]
    offs = tl.arange(0, HALF)[None, :]
    mask = heads < num_heads
    src = src_ptr + heads * (2 * HALF) + offs
    x1 = tl.load(src, mask=mask, other=0.0)
    x2 = tl.load(src + HALF, mask=mask, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    # HF: x * cos + rotate_half(x) * sin, each product and the sum rounded to the dtype.
    out1 = ((x1f * cos).to(dtype).to(tl.float32) + (-x2f * sin).to(dtype).to(tl.float32)).to(dtype)
    out2 = ((x2f * cos).to(dtype).to(tl.float32) + (x1f * sin).to(dtype).to(tl.float32)).to(dtype)
    dst = dst_ptr + heads * (2 * HALF) + offs
    tl.store(dst, out1, mask=mask)
    tl.store(dst + HALF, out2, mask=mask)


@triton.jit
def _rotary_qkv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, q_ptr, k_ptr, v_ptr,
    stride_qkv, stride_cos, num_heads, num_kv_heads,
    HEADS: tl.constexpr, KV_HEADS: tl.constexpr, HALF: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, HALF)[None, :]
    cos = tl.load(cos_ptr + token * stride_cos + offs).to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cos + offs).to(tl.float32)
    row = qkv_ptr + token * stride_qkv
    q_size = num_heads * 2 * HALF
    kv_size = num_kv_heads * 2 * HALF
    _rotate_heads(row, q_ptr + token * q_size, cos, sin, num_heads, HEADS, HALF)
    _rotate_heads(row + q_size, k_ptr + token * kv_size, cos, sin, num_kv_heads, KV_HEADS, HALF)
    kv_heads = tl.arange(0, KV_HEADS)[:, None]
    v_offs = kv_heads * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :]
    v_mask = kv_heads < num_kv_heads
    v = tl.load(row + q_size + kv_size + v_offs, mask=v_mask)
    tl.store(v_ptr + token * kv_size + v_offs, v, mask=v_mask)


def rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim):
    num_tokens = qkv.shape[0]
    q = torch.empty((num_tokens, num_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    k = torch.empty((num_tokens, num_kv_heads * head_dim), dtype=qkv.dtype, device=qkv.device)
    v = torch.empty_like(k)
    # The kernel reads each token's angles as one contiguous row; a caller's table may be strided (a transposed
    # product is column-major).
    cos2d = cos.reshape(num_tokens, head_dim).contiguous()
    sin2d = sin.reshape(num_tokens, head_dim).contiguous()
    _rotary_qkv_kernel[(num_tokens,)](
        qkv, cos2d, sin2d, q, k, v, qkv.stride(0), cos2d.stride(0), num_heads, num_kv_heads,
        HEADS=triton.next_power_of_2(num_heads), KV_HEADS=triton.next_power_of_2(num_kv_heads),
        HALF=head_dim // 2, num_warps=4,
    )
    return q, k, v


@triton.jit
def _rotary_qk_float32_kernel(
    qkv_ptr, cos_ptr, sin_ptr, out_ptr, stride_qkv, num_heads, half,
    HEADS: tl.constexpr, BLOCK: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)  # 0: q, 1: k
    heads = tl.arange(0, HEADS)[:, None]
    offs = tl.arange(0, BLOCK)[None, :]
    in_half = offs < half
    mask = (heads < num_heads) & in_half
    head_dim = 2 * half
    angles = token * head_dim + offs
    cos1 = tl.load(cos_ptr + angles, mask=in_half, other=0.0)
    cos2 = tl.load(cos_ptr + angles + half, mask=in_half, other=0.0)
    sin1 = tl.load(sin_ptr + angles, mask=in_half, other=0.0)
    sin2 = tl.load(sin_ptr + angles + half, mask=in_half, other=0.0)
    features = part * num_heads * head_dim + heads * head_dim + offs
    x1 = tl.load(qkv_ptr + token * stride_qkv + features, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(qkv_ptr + token * stride_qkv + features + half, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + token * 2 * num_heads * head_dim + features
    dtype = out_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos1 - x2 * sin1).to(dtype), mask=mask)
    tl.store(dst + half, (x2 * cos2 + x1 * sin2).to(dtype), mask=mask)


def rotary_qk_float32(qkv, cos, sin, num_heads):
    num_tokens, dim = qkv.shape[0], qkv.shape[1] // 3
    half = dim // num_heads // 2
    out = torch.empty((num_tokens, 2 * dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rotary_qk_float32_kernel[(num_tokens, 2)](
            qkv, cos.contiguous(), sin.contiguous(), out, qkv.stride(0), num_heads, half,
            HEADS=triton.next_power_of_2(num_heads), BLOCK=triton.next_power_of_2(half), num_warps=4,
        )
    return out[:, :dim], out[:, dim:]


@triton.jit
def _silu_mul_kernel(gate_up_ptr, out_ptr, n_cols, stride, BLOCK: tl.constexpr):
    # 64-bit: row * stride passes 2**31 at 74,899 tokens of Llama-3.1-8B (stride 28,672), fewer for larger models.
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    gate = tl.load(gate_up_ptr + row * stride + cols, mask=mask, other=0.0)
    up = tl.load(gate_up_ptr + row * stride + n_cols + cols, mask=mask, other=0.0)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate.dtype)  # rounded like F.silu's output
    out = (silu.to(tl.float32) * up.to(tl.float32)).to(gate.dtype)
    tl.store(out_ptr + row * n_cols + cols, out, mask=mask)


def silu_mul(gate_up):
    n_rows, width = gate_up.shape
    n_cols = width // 2
    out = torch.empty((n_rows, n_cols), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    _silu_mul_kernel[(n_rows, triton.cdiv(n_cols, block))](gate_up, out, n_cols, gate_up.stride(0), BLOCK=block,
                                                           num_warps=4)
    return out
