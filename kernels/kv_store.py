"""One Triton kernel that writes a step's K and V into a layer's KV buffers (imported only on a CUDA device, or
under ``TRITON_INTERPRET=1`` in tests).

``KVCache.set_kv_buffer`` would otherwise run two index-put kernels per layer (plus the divide, clamp and cast of
an FP8 cache): at a batch of one token a decode step is dozens of such tiny launches. Values are rounded exactly
as the torch path rounds them: to FP8, ``x / scale`` is computed in float32 and rounded to ``x``'s dtype first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_kv_kernel(K, V, K_cache, V_cache, Loc, stride_k, stride_v, width, k_scale, v_scale, fp8_max,
                     BLOCK: tl.constexpr, TO_FP8: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + row).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < width
    k = tl.load(K + row * stride_k + offs, mask=mask)
    v = tl.load(V + row * stride_v + offs, mask=mask)
    if TO_FP8:
        k = saturate_to_fp8(k, k_scale, fp8_max).to(K_cache.dtype.element_ty, fp_downcast_rounding="rtne")
        v = saturate_to_fp8(v, v_scale, fp8_max).to(V_cache.dtype.element_ty, fp_downcast_rounding="rtne")
    tl.store(K_cache + slot * width + offs, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + slot * width + offs, v.to(V_cache.dtype.element_ty), mask=mask)


@triton.jit
def saturate_to_fp8(x, scale, fp8_max):
    """``x / scale`` as an FP8 cache stores it, in float32, before the cast: torch computes the quotient
    rounded to ``x``'s dtype and clamps it to the FP8 range (a cast would turn it into NaN)."""
    scaled = (x.to(tl.float32) / scale).to(x.dtype).to(tl.float32)
    return tl.minimum(tl.maximum(scaled, -fp8_max), fp8_max)


def store_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: float, v_scale: float) -> None:
    """``k_cache[loc] = k`` and ``v_cache[loc] = v`` for buffers ``[slots, heads, head_dim]`` (contiguous) and
    ``k``/``v`` with one token per row (``[n, heads * head_dim]`` or ``[n, heads, head_dim]``, unit stride
    within a row); an FP8 cache stores ``x / scale`` saturated to its range."""
    n = loc.shape[0]
    if n == 0:
        return
    width = k_cache.shape[1] * k_cache.shape[2]
    k2, v2 = k.reshape(n, width), v.reshape(n, width)
    k2, v2 = (x if x.stride(1) == 1 else x.contiguous() for x in (k2, v2))
    to_fp8 = k_cache.dtype in (torch.float8_e4m3fn,)
    block = triton.next_power_of_2(width)
    _store_kv_kernel[(n,)](
        k2, v2, k_cache, v_cache, loc, k2.stride(0), v2.stride(0), width, float(k_scale), float(v_scale),
        float(torch.finfo(k_cache.dtype).max) if to_fp8 else 0.0,
        BLOCK=block, TO_FP8=to_fp8, num_warps=4 if block <= 2048 else 8,
    )
