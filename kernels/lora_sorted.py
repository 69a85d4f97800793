"""The sorted form of ``add_delta`` (kernels/lora.py): past ``LoRAKernelChoice.sort_above`` tokens, the kernels walk
the batch's tokens in slot order (``order``: one stable sort on the device a step, ``BatchContext.adapter_order``),
so a block of tokens holds one adapter or a few and each adapter's ``a`` and ``b`` tiles are read once per block
and multiplied on tensor cores, where the gather kernels read them once per token.

- the shrink: a program per block of 32 sorted tokens (64 past 1024), block of stacked ranks and slice of ``in``
  (about ``sort_programs`` programs: a few busy blocks would leave the GPU idle), one pass per distinct slot in the
  block; float32 partial sums, unscaled, in sorted rows;
- the expand: a program per block of 64 sorted tokens and group of ``sort_columns`` output columns of one
  projection; it adds up its rows' partial sums once (each row scaled by its slot's scaling, rounded once), then
  per column block sums one tensor-core product per distinct slot in the block (that slot's rows of ``h`` against
  its ``b``) and reads and writes ``out`` once. Ranks past one 64-rank tile take the segmented expand
  (kernels/lora_tiles.py) over the order.

Nothing reads the ids or the order on the host, and the grids depend on shapes only: CUDA graphs capture them.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from treadle.kernels.lora_choice import DEFAULT, LoRAKernelChoice
from treadle.kernels.lora_tiles import (dot, expand_segmented, ieee_dot, load_h, projection_stride, segment_blocks,
                                        segment_bounds)

_LARGE_BATCH = 1024  # tokens past which the shrink's blocks are 64 sorted tokens, not 32


def sort_by_adapter(adapter_ids: torch.Tensor) -> torch.Tensor:
    """The batch's token indices sorted by slot (stable; tokens without an adapter first): on the device, no sync."""
    return torch.argsort(adapter_ids, stable=True)


def sorts(num_tokens: int, choice: LoRAKernelChoice = DEFAULT) -> bool:
    """Whether ``add_delta`` runs the sorted form for a batch of ``num_tokens`` (``choice.sort_above``)."""
    return num_tokens > choice.sort_above


def add_delta_sorted(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor,
                      order: torch.Tensor, scalings: torch.Tensor, ranks: torch.Tensor,
                      segments: tuple[tuple[int, int], ...], out: torch.Tensor, choice: LoRAKernelChoice) -> None:
    """``add_delta`` over the tokens in ``order``: blocks of sorted tokens hold one or a few adapters, so each
    adapter's ``a`` and ``b`` tiles are read once per block and multiplied on tensor cores; the shrink splits
    ``in`` over programs (float32 partials in sorted rows) so a few busy blocks still fill the GPU."""
    num_tokens, in_features = x.shape
    rows = a.shape[1]
    block_m, block_r, block_k, split, k_per_split = sorted_blocks(num_tokens, rows, in_features, choice)
    partials = torch.empty((split, num_tokens, rows), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(num_tokens, block_m), triton.cdiv(rows, block_r), split)
    _shrink_sorted_kernel[grid](x, a, adapter_ids, order, ranks, partials, num_tokens, in_features, b.shape[2], rows,
                                projection_stride(ranks), x.stride(0), x.stride(1), a.stride(0), a.stride(1),
                                a.stride(2), partials.stride(0), partials.stride(1), k_per_split, BLOCK_M=block_m,
                                BLOCK_R=block_r, BLOCK_K=block_k, IEEE=ieee_dot(x), num_warps=4, num_stages=3)
    tile_r = max(16, min(64, triton.next_power_of_2(b.shape[2])))
    if b.shape[2] > tile_r:  # ranks past one tensor-core tile: the segmented expand's loop over rank tiles
        expand_segmented(partials, scalings, b, adapter_ids, ranks, segments, out, order)
        return
    widest = max(end - start for start, end in segments)
    block_n = max(16, min(128, triton.next_power_of_2(widest)))
    group = max(1, min(choice.sort_columns // block_n, triton.cdiv(widest, block_n)))
    bounds, groups = segment_blocks(segments, group * block_n)
    _expand_sorted_kernel[(triton.cdiv(num_tokens, 64), groups)](
        partials, b, adapter_ids, order, scalings, ranks, out, num_tokens, b.shape[2], projection_stride(ranks),
        partials.stride(0), partials.stride(1), partials.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), *bounds, GROUP=group, BLOCK_M=64, BLOCK_N=block_n, BLOCK_R=tile_r, SPLIT=split,
        IEEE=ieee_dot(out), num_warps=4)


class SortedBlocks(NamedTuple):
    """The sorted shrink's launch: ``[block_m, block_k]`` tiles of sorted tokens' ``x`` against ``[block_k,
    block_r]`` tiles of ``a``, ``split`` slices of ``k_per_split`` columns of ``in`` (the expand adds them up)."""

    block_m: int
    block_r: int
    block_k: int
    split: int
    k_per_split: int


def sorted_blocks(num_tokens: int, rows: int, in_features: int, choice: LoRAKernelChoice = DEFAULT) -> SortedBlocks:
    """The sorted form's :class:`SortedBlocks` for a batch of ``num_tokens`` over ``rows`` stacked rank rows."""
    block_m = 32 if num_tokens <= _LARGE_BATCH else 64
    block_r = max(16, min(64, triton.next_power_of_2(rows)))
    block_k = max(16, min(128, triton.next_power_of_2(in_features)))
    split, k_per_split = _sorted_split(num_tokens, rows, in_features, block_m, block_r, block_k, choice)
    return SortedBlocks(block_m, block_r, block_k, split, k_per_split)


def _sorted_split(num_tokens: int, rows: int, in_features: int, block_m: int, block_r: int, block_k: int,
                  choice: LoRAKernelChoice) -> tuple[int, int]:
    """``(slices, columns per slice)`` of ``in`` for the sorted shrink: about ``choice.sort_programs`` programs,
    a power of two of slices (at most 32: the expand adds them up unrolled), whole ``block_k`` blocks each."""
    blocks = triton.cdiv(num_tokens, block_m) * triton.cdiv(rows, block_r)
    k_blocks = triton.cdiv(in_features, block_k)
    wanted = max(1, min(32, k_blocks, choice.sort_programs // blocks))
    split = 1 << (wanted.bit_length() - 1)
    k_per_split = triton.cdiv(k_blocks, split) * block_k
    return triton.cdiv(in_features, k_per_split), k_per_split


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
def _shrink_sorted_kernel(X, A, Ids, Order, Ranks, H, num_tokens, in_features, rank_dim, rows, proj_stride,
                          stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hs, stride_hm, k_per_split,
                          BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # One program per block of sorted rows, block of ranks and slice of in: one pass per distinct slot in the
    # block (sorted, a block holds one or a few), each reading that slot's a once. Float32 partial sums, unscaled,
    # in sorted rows of slice program_id(2) of H; rows without an adapter are not written (the expand skips them).
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_tokens
    tokens = tl.load(Order + offs_m, mask=m_mask, other=0)
    ids = tl.load(Ids + tokens, mask=m_mask, other=-1)
    in_rows = offs_r < rows
    proj = offs_r // rank_dim
    x_rows = X + tokens[:, None].to(tl.int64) * stride_xm
    h_tile = H + tl.program_id(2) * stride_hs + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :]
    remaining = ids >= 0
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot = tl.min(tl.where(remaining, ids, 2**62), axis=0)
        mine = remaining & (ids == slot)
        rank = tl.load(Ranks + proj * proj_stride + slot, mask=in_rows, other=0)
        r_mask = offs_r - proj * rank_dim < rank
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        if tl.max(r_mask.to(tl.int32), axis=0) > 0:
            a_cols = A + slot * stride_as + offs_r[None, :].to(tl.int64) * stride_ar
            for k0 in range(k_start, k_end, BLOCK_K):
                k = k0 + offs_k
                k_mask = k < k_end
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=mine[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                acc = dot(x, w, acc, IEEE)
        tl.store(h_tile, tl.where(r_mask[None, :], acc, 0.0), mask=mine[:, None] & in_rows[None, :])
        remaining = remaining & (ids != slot)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
def _expand_sorted_kernel(H, B, Ids, Order, Scalings, Ranks, Out, num_tokens, rank_dim, proj_stride,
                          stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                          s0, e0, s1, e1, s2, e2, first1, first2,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                          SPLIT: tl.constexpr, IEEE: tl.constexpr):
    # One program per block of sorted rows and group of GROUP column blocks of one projection. Its rows' partial
    # sums are added up, scaled (each row by its slot's scaling) and rounded once, for every slot at once (the
    # ranks fit one tile); then per column block one tensor-core product per distinct slot in the block (its rows
    # of h against its b), summed, and one read and write of out.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    proj, col_start, end = segment_bounds(tl.program_id(1), s0, e0, s1, e1, s2, e2, first1, first2,
                                           GROUP * BLOCK_N)
    m_mask = offs_m < num_tokens
    tokens = tl.load(Order + offs_m, mask=m_mask, other=0)
    ids = tl.load(Ids + tokens, mask=m_mask, other=-1)
    slots = tl.maximum(ids, 0)
    rank = tl.load(Ranks + proj * proj_stride + slots, mask=ids >= 0, other=0)
    scaling = tl.load(Scalings + proj * proj_stride + slots, mask=ids >= 0, other=0.0)
    changed = rank > 0  # rows whose slot's adapter changes this projection; the others are not touched
    offs_r = tl.arange(0, BLOCK_R)
    h_rows = H + offs_m[:, None].to(tl.int64) * stride_hm + (proj * rank_dim + offs_r[None, :]) * stride_hr
    h = load_h(h_rows, changed[:, None] & (offs_r[None, :] < rank[:, None]), stride_hs, scaling[:, None], SPLIT,
               True).to(Out.dtype.element_ty)
    out_rows = Out + tokens[:, None].to(tl.int64) * stride_om
    for n0 in range(col_start, tl.minimum(col_start + GROUP * BLOCK_N, end), BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        remaining = changed
        while tl.max(remaining.to(tl.int32), axis=0) > 0:
            slot = tl.min(tl.where(remaining, ids, 2**62), axis=0)
            mine = remaining & (ids == slot)
            slot_rank = tl.load(Ranks + proj * proj_stride + slot)
            w = tl.load(B + slot * stride_bs + offs_r[:, None] * stride_br + offs_n[None, :].to(tl.int64) * stride_bn,
                        mask=(offs_r < slot_rank)[:, None] & n_mask[None, :], other=0.0)
            acc = dot(tl.where(mine[:, None], h, tl.zeros_like(h)), w, acc, IEEE)
            remaining = remaining & (ids != slot)
        where = out_rows + offs_n[None, :] * stride_on
        tile_mask = changed[:, None] & n_mask[None, :]
        current = tl.load(where, mask=tile_mask, other=0.0)
        tl.store(where, (current.to(tl.float32) + acc).to(current.dtype), mask=tile_mask)
