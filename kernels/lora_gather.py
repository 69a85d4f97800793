"""The gather shrink's program (kernels/lora.py), shared by its own kernel and by the small-batch matmul, which runs
it in extra programs of its launch (kernels/small_batch.py, ``beside``; kernels/lora_fused.py builds the job).

A program takes one token, a block of ``BLOCK_R`` stacked rank rows and one slice of ``in``: it loads its adapter's
rows through the token's slot and reduces them against the token's ``x`` in float32 registers, then stores the
scaled, rounded result (``FINAL``) or a float32 partial sum of its slice for the expand to add up.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from treadle.kernels.pdl import allow_next, wait_for_previous


class GemvShrink(NamedTuple):
    """A gather shrink (float32 partials, ``FINAL`` False) to run in extra programs of a small-batch matmul's
    launch: the matmul's ``x`` is its input, ``partials`` ``[split, T, rows]`` its output, ``programs`` = ``T *
    cdiv(rows, block_r) * split`` of them, each a ``[block_r, block_k]`` tile over ``k_per_split`` columns of
    ``in``, exactly as kernels/lora.py's ``_shrink_gather_kernel`` computes it (``ahead``: its looped form)."""

    a: torch.Tensor
    adapter_ids: torch.Tensor
    scalings: torch.Tensor
    ranks: torch.Tensor
    partials: torch.Tensor
    rank_dim: int
    proj_stride: int
    block_r: int
    block_k: int
    k_per_split: int
    ahead: int = 0

    @property
    def programs(self) -> int:
        split, tokens, rows = self.partials.shape
        return tokens * triton.cdiv(rows, self.block_r) * split


@triton.jit
def token_rows(Ids, Ranks, token, offs_r, rank_dim, rows, proj_stride):
    """Token ``token``'s slot (clamped to 0 for none) and, over stacked rows ``offs_r`` of ``a``, each row's
    projection, whether it exists and whether it is within the slot's rank of that projection (none without an
    adapter)."""
    slot = tl.load(Ids + token)
    with_adapter = slot >= 0
    slot = tl.maximum(slot, 0)
    proj = offs_r // rank_dim
    in_rows = offs_r < rows
    rank = tl.where(with_adapter, tl.load(Ranks + proj * proj_stride + slot, mask=in_rows, other=0), 0)
    return slot, proj, in_rows, offs_r - proj * rank_dim < rank


@triton.jit
def gather_shrink_program(token, r_block, k_slice, X, A, Ids, Scalings, Ranks, H, in_features, rank_dim, rows,
                          proj_stride, stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hs, stride_hm,
                          k_per_split, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FINAL: tl.constexpr,
                          PDL: tl.constexpr, GO_AHEAD: tl.constexpr, AHEAD: tl.constexpr = 0):
    """One gather-shrink program: ``token`` (int64), rows ``r_block * BLOCK_R`` on, slice ``k_slice`` of ``in``;
    ``AHEAD`` (the looped form): 1, the next chunk of ``a`` and ``x`` is loaded into registers before this one is
    reduced; more, that many stages of Triton's software pipeline."""
    offs_r = r_block * BLOCK_R + tl.arange(0, BLOCK_R)
    k_start = k_slice * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    offs_k = tl.arange(0, BLOCK_K)
    # Before the wait only what no kernel of this step writes: the ids (copied in before the step), ranks,
    # scalings and the adapter's first weight block (kernels/pdl.py). Out-of-rank rows and tokens without an
    # adapter mask every weight load, so they read nothing. Row r is rank r % R of projection r // R.
    slot, proj, in_rows, r_mask = token_rows(Ids, Ranks, token, offs_r, rank_dim, rows, proj_stride)
    scaling = tl.load(Scalings + proj * proj_stride + slot, mask=in_rows, other=0.0)
    x_limit = tl.where(tl.max(r_mask.to(tl.int32), axis=0) > 0, k_end, 0)  # an idle program reads no x
    a_rows = A + slot * stride_as + offs_r[:, None].to(tl.int64) * stride_ar
    k = k_start + offs_k
    w = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & (k < k_end)[None, :], other=0.0)
    wait_for_previous(PDL)
    # Everything before this kernel is complete now: the next kernel (the expand) may start and load its weights
    # while this one reads x and stores (kernels/pdl.py's contract holds for it).
    allow_next(GO_AHEAD)
    result = tl.zeros([BLOCK_R], dtype=tl.float32)
    k_stop = tl.maximum(x_limit, k_start)  # the looped forms: an idle program takes no step
    if AHEAD == 1:
        # Products summed per column in registers, reduced across the tile once at the end: the loop is loads and
        # FMAs, no shuffles or barriers a chunk.
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        x_row = X + token * stride_xm + tl.zeros([BLOCK_R, 1], dtype=tl.int32)  # x in a's tile layout (from L1)
        x = tl.load(x_row + k[None, :] * stride_xk, mask=(k < x_limit)[None, :], other=0.0)
        for k0 in range(k_start, k_stop, BLOCK_K):
            k = k0 + BLOCK_K + offs_k  # the next chunk (past the slice: nothing is read), in flight while this one
            w_next = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & (k < k_end)[None, :], other=0.0)
            x_next = tl.load(x_row + k[None, :] * stride_xk, mask=(k < x_limit)[None, :], other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)
            w, x = w_next, x_next
        result = tl.sum(acc, axis=1)
    elif AHEAD > 1:
        # Triton's pipeliner: the next AHEAD - 1 chunks of a and x copied into shared memory (cp.async) while this
        # one is multiplied.
        acc = tl.zeros([BLOCK_R, BLOCK_K], dtype=tl.float32)
        for k0 in tl.range(k_start, k_stop, BLOCK_K, num_stages=AHEAD):
            k = k0 + offs_k
            w = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & (k < k_end)[None, :], other=0.0)
            x = tl.load(X + token * stride_xm + k * stride_xk, mask=k < x_limit, other=0.0)
            acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
        result = tl.sum(acc, axis=1)
    else:
        for k0 in range(k_start, k_end, BLOCK_K):
            x = tl.load(X + token * stride_xm + (k0 + offs_k) * stride_xk, mask=k0 + offs_k < x_limit, other=0.0)
            result += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            k = k0 + BLOCK_K + offs_k  # the next block (past the slice: nothing is read)
            w = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & (k < k_end)[None, :], other=0.0)
    if FINAL:
        result = result * scaling
    result = tl.where(r_mask, result, 0.0)  # exact zeros past the rank, whatever an unused slot holds
    tl.store(H + k_slice * stride_hs + token * stride_hm + offs_r, result.to(H.dtype.element_ty), mask=in_rows)
