"""Triton kernels for LoRA's two halves, for a batch whose tokens use different adapters of different ranks (the
``triton`` LoRA backend, plugins/lora_backends/triton.py; the contract is core/lora/backend.py).

``shrink``: ``h[t] = scalings[s] * x[t] @ a[s].T`` (``[T, R]``, zero rows for tokens without an adapter);
``expand``: ``out[t] += h[t] @ b[s].T``, ``out`` possibly a strided column slice. ``s`` is token ``t``'s slot in
``adapter_ids`` (-1: none); ``ranks[s]`` bounds the work (``a`` and ``b`` are zero past it).

Two forms of each, picked by the number of tokens alone (so a CUDA graph captures one form, whatever the ids):

- **gather** (up to ``GATHER_MAX_TOKENS`` tokens: decode): each program takes one token and a block of ranks
  (shrink) or of output columns (expand), loads its adapter's rows through the token's slot and reduces in float32
  registers (no ``tl.dot``, which would pad one token to 16 rows). A shrink program reads a whole ``in`` row of
  ``a`` in one or a few wide loads, so a one-token step costs about one memory latency per kernel. Programs past
  the slot's rank, and tokens without an adapter, load nothing.
- **segmented** (more tokens: prefill, mixed and large decode batches): tensor-core tiles over blocks of
  ``BLOCK_M`` consecutive tokens. A request's tokens are consecutive and share an adapter, so most blocks hold one
  slot and take one pass; a block that holds several takes one pass per distinct slot (the smallest remaining
  each time), each pass loading only its own rows. Nothing is sorted on the host.

Both accumulate in float32 and round once: ``h`` after the scaling, ``out`` after adding the delta to it. Nothing
reads the ids on the host and the grids depend on shapes only, so both run under CUDA-graph capture.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.pdl import wait_for_previous

# Up to this many tokens the gather kernels run (one token per program); above, the segmented tiles. At 64
# tokens a gather shrink reads each token's adapter rows through L2 (64 x 128 KB at rank 16, in 4096) and its
# expand 64 small programs per column block: still cheaper than a 16-row tile per distinct adapter when
# every token has its own (bs=64 decode), and decode graphs of more tokens share adapters more.
GATHER_MAX_TOKENS = 64
# Elements of one gather program's weight tile: 16 KB of bf16 per load, wide enough that a one-token shrink of
# in=4096 is one load per program, small enough for 4-8 warps' registers (a shrink of in=14336 takes one rank
# row of up to twice that: still one load).
_GATHER_TILE = 8192


def shrink(x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
           ranks: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` in ``x``'s dtype: ``scalings[s] * x[t] @ a[s].T`` per token, zero for ``adapter_ids[t] < 0``."""
    num_tokens, in_features = x.shape
    rank_dim = a.shape[1]
    h = torch.empty((num_tokens, rank_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return h
    common = (x, a, adapter_ids, scalings, ranks, h, num_tokens, in_features, rank_dim,
              x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0))
    if num_tokens <= GATHER_MAX_TOKENS:
        block_k = min(triton.next_power_of_2(in_features), 2 * _GATHER_TILE)
        block_r = max(1, min(triton.next_power_of_2(rank_dim), _GATHER_TILE // block_k))
        grid = (num_tokens, triton.cdiv(rank_dim, block_r))
        pdl = pdl_enabled(x.device)
        _shrink_gather_kernel[grid](*common, BLOCK_R=block_r, BLOCK_K=block_k, PDL=pdl, launch_pdl=pdl,
                                    num_warps=_gather_warps(block_r * block_k))
    else:
        block_m = _segment_rows(num_tokens)
        block_r = max(16, min(64, triton.next_power_of_2(rank_dim)))
        block_k = max(16, min(128, triton.next_power_of_2(in_features)))
        grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(rank_dim, block_r))
        _shrink_segmented_kernel[grid](*common, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                                       IEEE=_ieee_dot(x), num_warps=4, num_stages=3)
    return h


def expand(h: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, ranks: torch.Tensor,
           out: torch.Tensor) -> None:
    """``out[t] += h[t] @ b[s].T`` per token with a slot; ``out`` may be any strided 2-D view."""
    num_tokens, rank_dim = h.shape
    out_features = b.shape[1]
    if num_tokens == 0:
        return
    common = (h, b, adapter_ids, ranks, out, num_tokens, out_features, rank_dim,
              h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1))
    if num_tokens <= GATHER_MAX_TOKENS:
        block_r = max(2, triton.next_power_of_2(rank_dim))
        block_n = max(16, min(triton.next_power_of_2(out_features), _GATHER_TILE // block_r))
        grid = (num_tokens, triton.cdiv(out_features, block_n))
        pdl = pdl_enabled(h.device)
        _expand_gather_kernel[grid](*common, BLOCK_N=block_n, BLOCK_R=block_r, PDL=pdl, launch_pdl=pdl,
                                    num_warps=_gather_warps(block_r * block_n))
    else:
        block_m = _segment_rows(num_tokens)
        block_r = max(16, min(64, triton.next_power_of_2(rank_dim)))
        block_n = max(16, min(128, triton.next_power_of_2(out_features)))
        grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(out_features, block_n))
        _expand_segmented_kernel[grid](*common, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
                                       IEEE=_ieee_dot(h), num_warps=4, num_stages=2)


def _gather_warps(tile: int) -> int:
    """Warps of a gather program: 32 weight elements per thread (a 16 KB bf16 tile: 8 warps)."""
    return max(1, min(16, tile // (32 * 32)))


def _segment_rows(num_tokens: int) -> int:
    """Token rows per segmented tile: small blocks while a batch may be many short requests (each a pass of its
    own), 64 for long prefills (enough rows per weight tile; at 8192 tokens, one wave of 128 shrink programs)."""
    if num_tokens <= 256:
        return 16
    return 32 if num_tokens <= 1024 else 64


def _ieee_dot(x: torch.Tensor) -> bool:
    """Whether the tiles multiply in exact float32: for float32 models (not TF32), and under the interpreter, whose
    16-bit ``tl.dot`` is wrong (Triton 3.9); widening 16-bit inputs is exact, so the sums stay the GPU's."""
    return x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _shrink_gather_kernel(X, A, Ids, Scalings, Ranks, H, num_tokens, in_features, rank_dim,
                          stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hm,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    # Before the wait only what no kernel of this step writes: the ids (copied in before the step), ranks,
    # scalings and the adapter's first weight block (kernels/pdl.py). Out-of-rank rows and tokens without an
    # adapter mask every weight load, so they read nothing.
    slot = tl.load(Ids + token)
    with_adapter = slot >= 0
    slot = tl.maximum(slot, 0)
    rank = tl.where(with_adapter, tl.load(Ranks + slot), 0)
    scaling = tl.load(Scalings + slot)
    r_mask = offs_r < rank
    x_limit = tl.where(tl.program_id(1) * BLOCK_R < rank, in_features, 0)  # an idle program reads no x
    rows = A + slot * stride_as + offs_r[:, None].to(tl.int64) * stride_ar
    w = tl.load(rows + offs_k[None, :] * stride_ak, mask=r_mask[:, None] & (offs_k < in_features)[None, :], other=0.0)
    wait_for_previous(PDL)
    result = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        x = tl.load(X + token * stride_xm + (k0 + offs_k) * stride_xk, mask=k0 + offs_k < x_limit, other=0.0)
        result += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
        k = k0 + BLOCK_K + offs_k  # the next block (past in_features: nothing is read)
        w = tl.load(rows + k[None, :] * stride_ak, mask=r_mask[:, None] & (k < in_features)[None, :], other=0.0)
    result = tl.where(r_mask, result * scaling, 0.0)  # exact zeros past the rank, whatever an unused slot holds
    tl.store(H + token * stride_hm + offs_r, result.to(H.dtype.element_ty), mask=offs_r < rank_dim)


@triton.jit
def _expand_gather_kernel(H, B, Ids, Ranks, Out, num_tokens, out_features, rank_dim,
                          stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    n_mask = offs_n < out_features
    # The adapter's weight block before the wait, as in the shrink; h and out after it.
    slot = tl.load(Ids + token)
    with_adapter = slot >= 0
    slot = tl.maximum(slot, 0)
    rank = tl.where(with_adapter, tl.load(Ranks + slot), 0)
    r_mask = offs_r < rank
    w = tl.load(B + slot * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br,
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    wait_for_previous(PDL)
    if with_adapter:  # rows without an adapter are not touched
        h = tl.load(H + token * stride_hm + offs_r * stride_hr, mask=r_mask, other=0.0).to(tl.float32)
        delta = tl.sum(w.to(tl.float32) * h[None, :], axis=1)
        where = Out + token * stride_om + offs_n * stride_on
        current = tl.load(where, mask=n_mask, other=0.0)
        tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=n_mask)


@triton.jit
def _shrink_segmented_kernel(X, A, Ids, Scalings, Ranks, H, num_tokens, in_features, rank_dim,
                             stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hm,
                             BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                             IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    r_start = tl.program_id(1) * BLOCK_R
    offs_r = r_start + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_tokens
    ids = tl.load(Ids + offs_m, mask=m_mask, other=-1)
    remaining = ids >= 0
    result = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
    # One pass per distinct slot in the block (one for a block inside a request), smallest first.
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot = tl.min(tl.where(remaining, ids, 2**62), axis=0)
        mine = remaining & (ids == slot)
        rank = tl.load(Ranks + slot)
        if r_start < rank:
            r_mask = offs_r < rank
            a_cols = A + slot * stride_as + offs_r[None, :].to(tl.int64) * stride_ar
            acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
            for k0 in range(0, in_features, BLOCK_K):
                k = k0 + offs_k
                k_mask = k < in_features
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=mine[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                acc = _dot(x, w, acc, IEEE)
            result += acc * tl.load(Scalings + slot)  # rows of other slots loaded zeros: they add nothing
        remaining = remaining & (ids != slot)
    store_mask = m_mask[:, None] & (offs_r < rank_dim)[None, :]
    tl.store(H + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :], result.to(H.dtype.element_ty),
             mask=store_mask)


@triton.jit
def _expand_segmented_kernel(H, B, Ids, Ranks, Out, num_tokens, out_features, rank_dim,
                             stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             IEEE: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < num_tokens
    n_mask = offs_n < out_features
    ids = tl.load(Ids + offs_m, mask=m_mask, other=-1)
    with_adapter = ids >= 0
    remaining = with_adapter
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h_rows = H + offs_m[:, None].to(tl.int64) * stride_hm
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot = tl.min(tl.where(remaining, ids, 2**62), axis=0)
        mine = remaining & (ids == slot)
        rank = tl.load(Ranks + slot)
        b_cols = B + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r
            r_mask = r < rank
            h = tl.load(h_rows + r[None, :] * stride_hr, mask=mine[:, None] & r_mask[None, :], other=0.0)
            w = tl.load(b_cols + r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = _dot(h, w, acc, IEEE)
        remaining = remaining & (ids != slot)
    # Rows without an adapter are neither read nor written.
    tile_mask = with_adapter[:, None] & n_mask[None, :]
    where = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    current = tl.load(where, mask=tile_mask, other=0.0)
    tl.store(where, (current.to(tl.float32) + acc).to(current.dtype), mask=tile_mask)
