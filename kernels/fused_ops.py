"""Fused elementwise ops for the decoder layers: one GPU kernel each instead of many small ones.

On CUDA (with Triton installed) each op runs one Triton kernel; elsewhere it
runs the plain PyTorch reference. Both round in the same places as HF's Llama
(float32 math, results rounded to the activation dtype after the same steps),
so the fused path changes speed, not numerics beyond float reassociation.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F


def add_rmsnorm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual = x + residual`` (or ``x`` when None), then ``rmsnorm(residual)``; returns both."""
    if _use_triton(x):
        return _kernels().add_rmsnorm(x, residual, weight, eps)
    if residual is not None:
        x = x + residual
    return rmsnorm_reference(x, weight, eps), x


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    return weight * (x32 * torch.rsqrt(variance + eps)).to(x.dtype)


def rotary_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split a stacked ``[T, (H + 2 Hkv) D]`` projection into contiguous q, k (rotated) and v.

    ``cos``/``sin`` are ``[T, 1, D]`` in the activation dtype (HF's ``rotate_half`` layout).
    """
    if _use_triton(qkv):
        return _kernels().rotary_qkv(qkv, cos, sin, num_heads, num_kv_heads, head_dim)
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = apply_rotary_reference(q.view(-1, num_heads, head_dim), cos, sin)
    k = apply_rotary_reference(k.view(-1, num_kv_heads, head_dim), cos, sin)
    return q.reshape(-1, q_size), k.reshape(-1, kv_size), v.contiguous()


def rotary_qk_float32(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a stacked ``[T, 3 D]`` projection (``[q | k | v]``, ``num_heads`` heads each) with the rotary
    embedding applied in float32 and rounded once to the projection's dtype (HF's vision encoders): ``[T, D]`` each.

    ``cos``/``sin`` are ``[T, head_dim]`` float32 (HF's ``rotate_half`` layout)."""
    if _use_triton(qkv):
        return _kernels().rotary_qk_float32(qkv, cos, sin, num_heads)
    n, dim = qkv.shape[0], qkv.shape[1] // 3
    wide = qkv[:, :2 * dim].float().view(n, 2 * num_heads, -1)
    first, second = wide.chunk(2, dim=-1)
    turned = torch.cat([-second, first], dim=-1)
    rotated = (wide * cos[:, None, :] + turned * sin[:, None, :]).to(qkv.dtype).view(n, 2 * dim)
    return rotated[:, :dim], rotated[:, dim:]


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
    if _use_triton(gate_up):
        return _kernels().silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def use_triton(x: torch.Tensor) -> bool:
    """Whether the fused ops run Triton kernels for ``x``: on CUDA, with Triton installed and not disabled
    by ``TREADLE_DISABLE_FUSED_OPS=1``."""
    return _use_triton(x)


def _use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_available()


@functools.cache
def _triton_available() -> bool:
    if os.environ.get("TREADLE_DISABLE_FUSED_OPS") == "1":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernels():
    from treadle.kernels import fused as fused_kernels

    return fused_kernels
