"""What kernels/lora.py's forms and kernels/lora_sorted.py's share: the stacked projections' column segments,
tensor-core products, the shrink's partial sums as the expand reads them, and the segmented expand (tiles of 64
tokens by a block of output columns, one pass per distinct slot in the tile; with ``order``, over sorted rows).

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

MAX_PROJECTIONS = 3  # a layer's stacked projections one add_delta handles (q/k/v)


def segment_blocks(segments: tuple[tuple[int, int], ...], block_n: int) -> tuple[tuple[int, ...], int]:
    """The expand kernels' segment arguments (three projections' column bounds, then the first block of the second
    and third) and the number of column blocks; missing projections are empty."""
    if len(segments) > MAX_PROJECTIONS:
        raise ValueError(f"add_delta stacks at most {MAX_PROJECTIONS} projections, not {len(segments)}")
    end = segments[-1][1]
    padded = list(segments) + [(end, end)] * (MAX_PROJECTIONS - len(segments))
    counts = [triton.cdiv(stop - start, block_n) for start, stop in padded]
    bounds = tuple(v for pair in padded for v in pair) + (counts[0], counts[0] + counts[1])
    return bounds, sum(counts)


def projection_stride(per_projection: torch.Tensor) -> int:
    """Elements between projections of ``[P, slots]`` scalings/ranks (0 for one projection's ``[slots]``)."""
    return per_projection.stride(0) if per_projection.dim() == 2 else 0


def ieee_dot(x: torch.Tensor) -> bool:
    """Whether the tiles multiply in exact float32: for float32 models (not TF32), and under the interpreter, whose
    16-bit ``tl.dot`` is wrong (Triton 3.9); widening 16-bit inputs is exact, so the sums stay the GPU's."""
    return x.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def segment(block, s0, e0, s1, e1, s2, e2, first1, first2, BLOCK_N: tl.constexpr):
    """A block of output columns' projection, its columns and their mask (projection p on columns [s_p, e_p),
    its blocks from first_p on)."""
    proj, start, end = segment_bounds(block, s0, e0, s1, e1, s2, e2, first1, first2, BLOCK_N)
    offs_n = start + tl.arange(0, BLOCK_N)
    return proj, offs_n, offs_n < end


@triton.jit
def segment_bounds(block, s0, e0, s1, e1, s2, e2, first1, first2, WIDTH: tl.constexpr):
    """A block of ``WIDTH`` output columns' projection, its first column and its projection's end."""
    proj = (block >= first1).to(tl.int32) + (block >= first2).to(tl.int32)
    start = tl.where(proj == 0, s0, tl.where(proj == 1, s1, s2))
    end = tl.where(proj == 0, e0, tl.where(proj == 1, e1, e2))
    first = tl.where(proj == 0, 0, tl.where(proj == 1, first1, first2))
    return proj, start + (block - first) * WIDTH, end


@triton.jit
def load_h(ptrs, mask, stride_hs, scaling, SPLIT: tl.constexpr, PARTIAL: tl.constexpr):
    """The shrink's values at ``ptrs``: as stored, or the sum of ``SPLIT`` float32 partials times ``scaling``."""
    if PARTIAL:
        acc = tl.load(ptrs, mask=mask, other=0.0)
        for s in tl.static_range(1, SPLIT):
            acc += tl.load(ptrs + s * stride_hs, mask=mask, other=0.0)
        return acc * scaling
    return tl.load(ptrs, mask=mask, other=0.0)


def expand_segmented(h: torch.Tensor, scalings: torch.Tensor | None, b: torch.Tensor, adapter_ids: torch.Tensor,
                      ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor,
                      order: torch.Tensor | None) -> None:
    """The segmented expand: tiles of 64 tokens (``h``'s rows; with ``order``, sorted rows whose token is
    ``order[row]``) by a block of output columns, one pass per distinct slot in the tile."""
    split, num_tokens, _ = h.shape
    rank_dim = b.shape[2]
    partial = scalings is not None
    block_n = max(16, min(128, triton.next_power_of_2(max(end - start for start, end in segments))))
    bounds, blocks = segment_blocks(segments, block_n)
    tile_r = max(16, min(64, triton.next_power_of_2(rank_dim)))
    grid = (triton.cdiv(num_tokens, 64), blocks)
    _expand_segmented_kernel[grid](h, b, adapter_ids, order if order is not None else adapter_ids,
                                   scalings if partial else ranks, ranks, out, num_tokens, rank_dim,
                                   projection_stride(ranks), h.stride(0), h.stride(1), h.stride(2), b.stride(0),
                                   b.stride(1), b.stride(2), out.stride(0), out.stride(1), *bounds, BLOCK_M=64,
                                   BLOCK_N=block_n, BLOCK_R=tile_r, SPLIT=split, PARTIAL=partial,
                                   SORTED=order is not None, IEEE=ieee_dot(out), num_warps=4, num_stages=2)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
def _expand_segmented_kernel(H, B, Ids, Order, Scalings, Ranks, Out, num_tokens, rank_dim, proj_stride,
                             stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                             s0, e0, s1, e1, s2, e2, first1, first2,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                             SPLIT: tl.constexpr, PARTIAL: tl.constexpr, SORTED: tl.constexpr, IEEE: tl.constexpr):
    # Row m of h is token m, or (SORTED) token Order[m]: h is in sorted rows, out in the batch's.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    proj, offs_n, n_mask = segment(tl.program_id(1), s0, e0, s1, e1, s2, e2, first1, first2, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    m_mask = offs_m < num_tokens
    if SORTED:
        tokens = tl.load(Order + offs_m, mask=m_mask, other=0)
    else:
        tokens = offs_m
    ids = tl.load(Ids + tokens, mask=m_mask, other=-1)
    with_adapter = ids >= 0
    remaining = with_adapter
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    h_rows = H + offs_m[:, None].to(tl.int64) * stride_hm + proj * rank_dim * stride_hr
    while tl.max(remaining.to(tl.int32), axis=0) > 0:
        slot = tl.min(tl.where(remaining, ids, 2**62), axis=0)
        mine = remaining & (ids == slot)
        rank = tl.load(Ranks + proj * proj_stride + slot)
        scaling = tl.load(Scalings + proj * proj_stride + slot)
        b_cols = B + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn
        for r0 in range(0, rank, BLOCK_R):
            r = r0 + offs_r
            r_mask = r < rank
            h = load_h(h_rows + r[None, :] * stride_hr, mine[:, None] & r_mask[None, :], stride_hs, scaling, SPLIT,
                        PARTIAL)
            if PARTIAL:
                h = h.to(Out.dtype.element_ty)
            w = tl.load(b_cols + r[:, None] * stride_br, mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            acc = dot(h, w, acc, IEEE)
        remaining = remaining & (ids != slot)
    # Rows without an adapter are neither read nor written.
    tile_mask = with_adapter[:, None] & n_mask[None, :]
    where = Out + tokens[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    current = tl.load(where, mask=tile_mask, other=0.0)
    tl.store(where, (current.to(tl.float32) + acc).to(current.dtype), mask=tile_mask)
