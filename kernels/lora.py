"""Triton kernels for LoRA's two halves, for a batch whose tokens use different adapters of different ranks (the
``triton`` LoRA backend, plugins/lora_backends/triton.py; the contract is core/lora/backend.py).

``shrink``: ``h[t] = scalings[s] * x[t] @ a[s].T`` (``[T, R]``, zero rows for tokens without an adapter);
``expand``: ``out[t] += h[t] @ b[s].T``, ``out`` possibly a strided column slice. ``s`` is token ``t``'s slot in
``adapter_ids`` (-1: none); ``ranks[s]`` bounds the work (``a`` and ``b`` are zero past it).

The form is picked by the number of tokens (and the padded rank) alone, so a CUDA graph captures one form,
whatever the ids:

- **gather** (decode: up to 64 tokens, and the shrink up to ``4096 // max_rank``): each program takes one token
  and a block of ranks (shrink) or of output columns (expand), loads its adapter's rows through the token's slot
  and reduces in float32 registers (no ``tl.dot``, which would pad one token to 16 rows). A shrink program reads a
  whole ``in`` row of ``a`` in one wide load, so a one-token step costs about one memory latency per kernel; on
  Hopper both launch with PDL and load their weights while the kernel before finishes. Programs past the slot's
  rank, and tokens without an adapter, load no weights.
- **slot-grouped expand** (up to 1024 tokens: large decode batches, small mixed ones): one program per slot,
  block of output columns and span of 256 tokens holds its adapter's block of ``b`` in registers and adds it to
  each of the slot's tokens in the span, so ``b`` is read once per adapter instead of once per token.
- **segmented** (more tokens: prefills and mixed batches): tensor-core tiles over blocks of consecutive tokens.
  The shrink has a program per block, slot and block of ranks that works only when the slot is in the block (a
  request's tokens are consecutive and share an adapter, so a block inside a request is one busy program; a block
  of many adapters' tokens is as many programs, side by side). The expand has a program per block of tokens and
  of columns that takes one pass per distinct slot in its block (the smallest remaining each time), each pass
  loading only its own rows. Nothing is sorted on the host.

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

# The gather kernels run up to 64 tokens (decode graphs), and the shrink's up to 4096 // max_rank tokens (256 at
# rank 16): one token per program, each reading its adapter's rows through L2. Past those the weights are read per
# block of tokens: the expand's slot-grouped kernel up to 1024 tokens (each program holds one adapter's block of
# ``b`` for a span of 256 tokens), then the segmented tiles of both.
GATHER_MAX_TOKENS = 64
_SHRINK_GATHER_ELEMENTS = 4096  # tokens x max_rank
GROUPED_MAX_TOKENS = 1024
_GROUPED_SPAN = 256
# Elements of one gather program's weight tile: 16 KB of bf16 per load, wide enough that a one-token shrink of
# in=4096 is one load per program, small enough for 4-8 warps' registers (a shrink of in=14336 takes one rank
# row of up to twice that: still one load).
_GATHER_TILE = 8192


def shrink(x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
           ranks: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` in ``x``'s dtype: ``scalings[s] * x[t] @ a[s].T`` per token, zero for ``adapter_ids[t] < 0``."""
    num_tokens, in_features = x.shape
    slots, rank_dim = a.shape[0], a.shape[1]
    h = torch.empty((num_tokens, rank_dim), dtype=x.dtype, device=x.device)
    if num_tokens == 0:
        return h
    common = (x, a, adapter_ids, scalings, ranks, h, num_tokens, in_features, rank_dim,
              x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), h.stride(0))
    if num_tokens <= max(GATHER_MAX_TOKENS, _SHRINK_GATHER_ELEMENTS // rank_dim):
        block_k = min(triton.next_power_of_2(in_features), 2 * _GATHER_TILE)
        block_r = max(1, min(triton.next_power_of_2(rank_dim), _GATHER_TILE // block_k))
        grid = (num_tokens, triton.cdiv(rank_dim, block_r))
        pdl = pdl_enabled(x.device)
        _shrink_gather_kernel[grid](*common, BLOCK_R=block_r, BLOCK_K=block_k, PDL=pdl, launch_pdl=pdl,
                                    num_warps=_gather_warps(block_r * block_k))
    else:
        block_m = 32 if num_tokens <= GROUPED_MAX_TOKENS else 64
        block_r = max(16, min(64, triton.next_power_of_2(rank_dim)))
        block_k = max(16, min(128, triton.next_power_of_2(in_features)))
        grid = (triton.cdiv(num_tokens, block_m), slots, triton.cdiv(rank_dim, block_r))
        _shrink_segmented_kernel[grid](*common, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
                                       IEEE=_ieee_dot(x), num_warps=4, num_stages=3)
    return h


def expand(h: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, ranks: torch.Tensor,
           out: torch.Tensor) -> None:
    """``out[t] += h[t] @ b[s].T`` per token with a slot; ``out`` may be any strided 2-D view."""
    num_tokens, rank_dim = h.shape
    slots, out_features = b.shape[0], b.shape[1]
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
        return
    block_n = max(16, min(128, triton.next_power_of_2(out_features)))
    tile_r = max(16, min(64, triton.next_power_of_2(rank_dim)))  # a tensor-core tile's ranks
    if num_tokens <= GROUPED_MAX_TOKENS and rank_dim <= tile_r:
        span = min(_GROUPED_SPAN, max(64, triton.next_power_of_2(num_tokens)))
        grid = (slots, triton.cdiv(out_features, block_n), triton.cdiv(num_tokens, span))
        _expand_grouped_kernel[grid](*common, SPAN=span, BLOCK_M=64, BLOCK_N=block_n, BLOCK_R=tile_r,
                                     IEEE=_ieee_dot(h), num_warps=4)
    else:
        grid = (triton.cdiv(num_tokens, 64), triton.cdiv(out_features, block_n))
        _expand_segmented_kernel[grid](*common, BLOCK_M=64, BLOCK_N=block_n, BLOCK_R=tile_r,
                                       IEEE=_ieee_dot(h), num_warps=4, num_stages=2)


def _gather_warps(tile: int) -> int:
    """Warps of a gather program: 32 weight elements per thread (a 16 KB bf16 tile: 8 warps)."""
    return max(1, min(16, tile // (32 * 32)))


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
    # One program per block of tokens, slot and block of ranks: it works only if the slot is in the block (one
    # slot for a block inside a request), so a block of many adapters' tokens is many programs, not a long one.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.program_id(1)
    r_start = tl.program_id(2) * BLOCK_R
    offs_r = r_start + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_tokens
    ids = tl.load(Ids + offs_m, mask=m_mask, other=-1)
    h_tile = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :]
    r_in = (offs_r < rank_dim)[None, :]
    if slot == 0:  # the first slot's programs also write the zero rows of tokens without an adapter
        tl.store(h_tile, tl.zeros([BLOCK_M, BLOCK_R], dtype=H.dtype.element_ty),
                 mask=(m_mask & (ids < 0))[:, None] & r_in)
    mine = ids == slot
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        rank = tl.load(Ranks + slot)
        r_mask = offs_r < rank
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        if r_start < rank:
            x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
            a_cols = A + slot * stride_as + offs_r[None, :].to(tl.int64) * stride_ar
            for k0 in range(0, in_features, BLOCK_K):
                k = k0 + offs_k
                k_mask = k < in_features
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=mine[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                acc = _dot(x, w, acc, IEEE)
        result = tl.where(r_mask[None, :], acc * tl.load(Scalings + slot), 0.0)
        tl.store(h_tile, result.to(H.dtype.element_ty), mask=mine[:, None] & r_in)


@triton.jit
def _expand_grouped_kernel(H, B, Ids, Ranks, Out, num_tokens, out_features, rank_dim,
                           stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                           SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           IEEE: tl.constexpr):
    # One program per slot, block of output columns and span of tokens: it loads its adapter's block of b once
    # and adds it to every token of the slot in the span, so b is read once per adapter, not once per token.
    slot = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    span_start = tl.program_id(2) * SPAN
    offs_span = span_start + tl.arange(0, SPAN)
    span_ids = tl.load(Ids + offs_span, mask=offs_span < num_tokens, other=-1)
    if tl.max((span_ids == slot).to(tl.int32), axis=0) > 0:
        rank = tl.load(Ranks + slot)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        n_mask = offs_n < out_features
        w = tl.load(B + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None] * stride_br,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        for m0 in tl.static_range(0, SPAN, BLOCK_M):
            offs_m = span_start + m0 + tl.arange(0, BLOCK_M)
            mine = tl.load(Ids + offs_m, mask=offs_m < num_tokens, other=-1) == slot
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                h = tl.load(H + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :] * stride_hr,
                            mask=mine[:, None] & r_mask[None, :], other=0.0)
                delta = _dot(h, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
                tile_mask = mine[:, None] & n_mask[None, :]
                where = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
                current = tl.load(where, mask=tile_mask, other=0.0)
                tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=tile_mask)


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
