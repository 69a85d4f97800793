"""Alternative forms of a layer's LoRA path (``add_delta``), chosen by a :class:`LoRAKernelChoice`, for the decode
sizes where kernels/lora.py's two launches (a shrink, an expand) cost more than the bytes they move.

- **fused** (a few tokens): shrink and expand in one launch. A program per token and chunk of output columns
  recomputes its token's ``h`` for its projection (``rank x in`` MACs, ``a`` read through L2 after the first
  program) and adds ``h @ b.T`` to its chunk a block of columns at a time (wide chunks: fewer recomputations,
  longer programs). A layer's LoRA is then one launch instead of two; at bs=1 the
  launch, not the 2.6 MB a Llama-3.1-8B layer's rank-16 adapter holds, is what costs.
- **barrier** (a few tokens): split-K shrink and expand in one launch. Each program takes a ticket (an atomic
  count) on arrival: the first tickets shrink a slice of ``in`` for a token into float32 partial sums and count
  themselves done; the others, a token's block of output columns each, load their block of ``b``, wait (spinning
  on that count) until every shrink is done, then add up the partials and expand. A ticket is taken only by a
  program that runs, so every shrink's program is running or done whenever an expand waits: no deadlock whatever
  the GPU's program order. The last program to finish resets the counts (one small buffer per layer).
- **grouped shrink** (from a chosen size up to ``GROUPED_MAX_TOKENS``): a program per slot, block of ranks and
  slice of ``in`` (split-K) runs its adapter's ``a`` slice over every span of tokens that has one of its tokens
  (``tl.dot`` over the span), writing float32 partial sums that kernels/lora.py's expand adds up. Each adapter's
  ``a`` is read once per step, where the segmented shrink reads it once per block of tokens and walks all of
  ``in`` in one program (bs=256 over 16 adapters: 128 programs, 112 serial steps for ``down_proj``).

Both keep the arithmetic of kernels/lora.py's ``add_delta`` (float32 sums, ``h`` scaled and rounded to ``out``'s
dtype once, ``out`` rounded once after the add), mixed ranks per projection, rows without an adapter untouched,
and grids from shapes only (CUDA graphs capture one form whatever the ids). :data:`DEFAULT` is what the ``triton``
backend runs; ``treadle bench lora --part kernels --sweep`` times the others side by side.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl

from treadle.kernels import lora
from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.pdl import wait_for_previous


@dataclass(frozen=True)
class LoRAKernelChoice:
    """Which form ``add_delta`` takes per number of tokens: ``fused_max_tokens`` (0: never) tokens or fewer run
    the fused kernel (at most ``max_rank`` 64): a program per token and chunk of ``fused_columns`` output columns,
    ``fused_block_n`` at a time, reading ``a`` in tiles of ``fused_tile`` elements; then, up to
    ``barrier_max_tokens`` (``max_rank`` 64 too), the barrier kernel: split-K shrink programs of
    ``barrier_split_k`` columns of ``in`` and expand programs of ``barrier_block_n`` columns, in one launch; more
    tokens, up to ``GROUPED_MAX_TOKENS``, take the grouped shrink past ``grouped_shrink_min_tokens`` (None: never)
    with slices of ``grouped_split_k`` columns of ``in``; everything else runs kernels/lora.py's forms."""

    fused_max_tokens: int = 0
    fused_columns: int = 256
    fused_block_n: int = 256
    fused_tile: int = 8192
    barrier_max_tokens: int = 0
    barrier_split_k: int = 512
    barrier_block_n: int = 256
    grouped_shrink_min_tokens: int | None = None
    grouped_split_k: int = 1024

    @property
    def name(self) -> str:
        parts = []
        if self.fused_max_tokens:
            parts.append(f"fused<={self.fused_max_tokens}/c{self.fused_columns}/n{self.fused_block_n}"
                         f"/t{self.fused_tile}")
        if self.barrier_max_tokens:
            parts.append(f"barrier<={self.barrier_max_tokens}/k{self.barrier_split_k}/n{self.barrier_block_n}")
        if self.grouped_shrink_min_tokens is not None:
            parts.append(f"grouped>{self.grouped_shrink_min_tokens}/k{self.grouped_split_k}")
        return "+".join(parts) or "two-launch"


def choice_fields(text: str) -> dict[str, int | None]:
    """``fused_max_tokens=32,grouped_shrink_min_tokens=none`` -> those :class:`LoRAKernelChoice` fields."""
    known = {field.name for field in dataclasses.fields(LoRAKernelChoice)}
    fields: dict[str, int | None] = {}
    for pair in filter(None, (part.strip() for part in text.split(","))):
        key, _, value = (side.strip() for side in pair.partition("="))
        if key not in known or not value:
            raise ValueError(f"bad LoRA kernel choice {pair!r}: expected FIELD=N (or none), FIELD one of "
                             f"{', '.join(sorted(known))}")
        fields[key] = None if value.lower() == "none" else int(value)
    return fields


# What the triton backend runs: the two-launch forms until the GPU sweep picks; TREADLE_LORA_KERNELS (the same
# FIELD=N,... text as ``treadle bench lora --sweep --choice``) overrides it for A/B runs of the engine.
DEFAULT = LoRAKernelChoice(**choice_fields(os.environ.get("TREADLE_LORA_KERNELS", "")))
_FUSED_MAX_RANK = 64  # the one-launch kernels hold a token's stacked ranks in one register block


def add_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
              ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor,
              choice: LoRAKernelChoice = DEFAULT) -> None:
    """kernels/lora.py's ``add_delta`` (same arguments and result) in the form ``choice`` picks for this size."""
    num_tokens, rank_dim = x.shape[0], b.shape[2]
    if num_tokens == 0:
        return
    if num_tokens <= choice.fused_max_tokens and rank_dim <= _FUSED_MAX_RANK:
        _fused(x, a, b, adapter_ids, scalings, ranks, segments, out, choice)
        return
    if num_tokens <= choice.barrier_max_tokens and rank_dim <= _FUSED_MAX_RANK:
        _barrier(x, a, b, adapter_ids, scalings, ranks, segments, out, choice)
        return
    grouped_from = choice.grouped_shrink_min_tokens
    if grouped_from is not None and grouped_from < num_tokens <= lora.GROUPED_MAX_TOKENS:
        _grouped(x, a, b, adapter_ids, scalings, ranks, segments, out, choice.grouped_split_k)
        return
    lora.add_delta(x, a, b, adapter_ids, scalings, ranks, segments, out)


def _fused(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
           ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor,
           choice: LoRAKernelChoice) -> None:
    num_tokens, in_features = x.shape
    rank_dim = b.shape[2]
    block_r, block_k = _fused_blocks(rank_dim, in_features, choice.fused_tile)
    widest = triton.next_power_of_2(max(end - start for start, end in segments))
    block_n = max(16, min(choice.fused_block_n, widest))
    columns = max(block_n, min(choice.fused_columns, widest))
    bounds, blocks = lora._segment_blocks(segments, columns)
    pdl = pdl_enabled(x.device)
    _fused_kernel[(num_tokens, blocks)](
        x, a, b, adapter_ids, scalings, ranks, out, in_features, rank_dim, lora._projection_stride(ranks), columns,
        x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2),
        out.stride(0), out.stride(1), *bounds, BLOCK_N=block_n, BLOCK_R=block_r, BLOCK_K=block_k, PDL=pdl,
        launch_pdl=pdl, num_warps=lora._gather_warps(max(block_r * block_k, block_r * block_n)))


def _barrier(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
             ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor,
             choice: LoRAKernelChoice) -> None:
    num_tokens, in_features = x.shape
    rows, rank_dim = a.shape[1], b.shape[2]
    k_per_split = min(choice.barrier_split_k, in_features)
    split = triton.cdiv(in_features, k_per_split)
    block_rows = max(2, triton.next_power_of_2(rows))
    block_k = max(16, min(triton.next_power_of_2(k_per_split), 8192 // block_rows))
    block_n = max(16, min(choice.barrier_block_n, triton.next_power_of_2(max(e - s for s, e in segments))))
    bounds, blocks = lora._segment_blocks(segments, block_n)
    partials = torch.empty((split, num_tokens, rows), dtype=torch.float32, device=x.device)
    pdl = pdl_enabled(x.device)
    _barrier_kernel[(num_tokens * (split + blocks),)](
        x, a, b, adapter_ids, scalings, ranks, out, partials, _counts(a), num_tokens, in_features, rank_dim, rows,
        lora._projection_stride(ranks), k_per_split, split, blocks, x.stride(0), x.stride(1), a.stride(0),
        a.stride(1), a.stride(2), b.stride(0), b.stride(1), b.stride(2), out.stride(0), out.stride(1),
        partials.stride(0), partials.stride(1), *bounds, BLOCK_N=block_n, BLOCK_R=max(2, triton.next_power_of_2(
            rank_dim)), BLOCK_ROWS=block_rows, BLOCK_K=block_k, SPLIT=split, PDL=pdl, launch_pdl=pdl,
        num_warps=lora._gather_warps(max(block_rows * block_k, block_n * rank_dim)))


def _grouped(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
             ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor, split_k: int) -> None:
    num_tokens, in_features = x.shape
    rows, rank_dim = a.shape[1], b.shape[2]
    k_per_split = min(split_k, in_features)
    split = triton.cdiv(in_features, k_per_split)
    partials = torch.empty((split, num_tokens, rows), dtype=torch.float32, device=x.device)
    block_r = max(16, min(64, triton.next_power_of_2(rows)))
    grid = (a.shape[0], triton.cdiv(rows, block_r), split)
    _shrink_grouped_kernel[grid](x, a, adapter_ids, ranks, partials, num_tokens, in_features, rank_dim, rows,
                                 lora._projection_stride(ranks), k_per_split, x.stride(0), x.stride(1), a.stride(0),
                                 a.stride(1), a.stride(2), partials.stride(0), partials.stride(1),
                                 BLOCK_M=16 if num_tokens <= 64 else 32, BLOCK_R=block_r, BLOCK_K=128,
                                 IEEE=lora._ieee_dot(x), num_warps=4, num_stages=3)
    lora._expand(partials, scalings, b, adapter_ids, ranks, segments, out)


_COUNTS: dict[Any, torch.Tensor] = {}


def _counts(a: torch.Tensor) -> torch.Tensor:
    """The barrier kernel's three counts (tickets, shrinks done, programs done) for the layer whose adapters are
    ``a``: zero between launches (the last program resets them), one buffer per layer so that no two launches
    share one."""
    key = (a.device, a.data_ptr())
    if key not in _COUNTS:
        _COUNTS[key] = torch.zeros(3, dtype=torch.int32, device=a.device)
    return _COUNTS[key]


@functools.lru_cache(maxsize=None)
def _fused_blocks(rank_dim: int, in_features: int, tile: int) -> tuple[int, int]:
    """``(BLOCK_R, BLOCK_K)``: every rank of a projection, and ``in`` in tiles of ``tile`` elements of ``a``."""
    block_r = max(2, triton.next_power_of_2(rank_dim))
    return block_r, max(16, min(triton.next_power_of_2(in_features), tile // block_r))


@triton.jit
def _fused_kernel(X, A, B, Ids, Scalings, Ranks, Out, in_features, rank_dim, proj_stride, columns,
                  stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_bs, stride_bn, stride_br,
                  stride_om, stride_on, s0, e0, s1, e1, s2, e2, first1, first2,
                  BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    # A program per token and chunk of ``columns`` output columns of one projection: it computes the token's h for
    # that projection, then adds h @ b.T to its chunk BLOCK_N columns at a time.
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    proj = (block >= first1).to(tl.int32) + (block >= first2).to(tl.int32)
    start = tl.where(proj == 0, s0, tl.where(proj == 1, s1, s2))
    chunk_start = start + (block - tl.where(proj == 0, 0, tl.where(proj == 1, first1, first2))) * columns
    chunk_end = tl.minimum(chunk_start + columns, tl.where(proj == 0, e0, tl.where(proj == 1, e1, e2)))
    offs_r = tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = chunk_start + tl.arange(0, BLOCK_N)
    # Weights only before the wait (kernels/pdl.py): the token's slot (filled before the step), its rank, its first
    # block of b and its first tile of a. Tokens without an adapter and ranks past the slot's load nothing.
    slot = tl.load(Ids + token)
    with_adapter = slot >= 0
    slot = tl.maximum(slot, 0)
    rank = tl.where(with_adapter, tl.load(Ranks + proj * proj_stride + slot), 0)
    r_mask = offs_r < rank
    b_rows = B + slot * stride_bs + offs_r[None, :] * stride_br
    w_b = tl.load(b_rows + offs_n[:, None].to(tl.int64) * stride_bn,
                  mask=(offs_n < chunk_end)[:, None] & r_mask[None, :], other=0.0)
    a_rows = A + slot * stride_as + (proj * rank_dim + offs_r)[:, None].to(tl.int64) * stride_ar
    w_a = tl.load(a_rows + offs_k[None, :] * stride_ak, mask=r_mask[:, None] & (offs_k < in_features)[None, :],
                  other=0.0)
    wait_for_previous(PDL)
    if rank > 0:  # rows without an adapter (or whose adapter leaves this projection alone) are not touched
        h = tl.zeros([BLOCK_R], dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            xs = tl.load(X + token * stride_xm + (k0 + offs_k) * stride_xk, mask=k0 + offs_k < in_features,
                         other=0.0)
            h += tl.sum(w_a.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
            k = k0 + BLOCK_K + offs_k
            w_a = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & (k < in_features)[None, :],
                          other=0.0)
        h = (h * tl.load(Scalings + proj * proj_stride + slot)).to(Out.dtype.element_ty)  # rounded as the shrink's
        for n0 in range(chunk_start, chunk_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < chunk_end
            where = Out + token * stride_om + offs_n * stride_on
            current = tl.load(where, mask=n_mask, other=0.0)
            delta = tl.sum(w_b.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
            tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=n_mask)
            following = offs_n + BLOCK_N
            w_b = tl.load(b_rows + following[:, None].to(tl.int64) * stride_bn,
                          mask=(following < chunk_end)[:, None] & r_mask[None, :], other=0.0)


@triton.jit
def _shrink_grouped_kernel(X, A, Ids, Ranks, H, num_tokens, in_features, rank_dim, rows, proj_stride, k_per_split,
                           stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hs, stride_hm,
                           BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    # One program per slot, block of ranks and slice of in: its adapter's slice of a meets every span of tokens
    # that holds one of the slot's tokens, so a is read from memory once per step (the spans' re-reads hit L2).
    slot = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    k_start = tl.program_id(2) * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    offs_k = tl.arange(0, BLOCK_K)
    in_rows = offs_r < rows
    proj = offs_r // rank_dim
    rank = tl.load(Ranks + proj * proj_stride + slot, mask=in_rows, other=0)
    r_mask = offs_r - proj * rank_dim < rank
    if tl.max(r_mask.to(tl.int32), axis=0) > 0:
        a_cols = A + slot * stride_as + offs_r[None, :].to(tl.int64) * stride_ar
        for m0 in range(0, num_tokens, BLOCK_M):
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mine = tl.load(Ids + offs_m, mask=offs_m < num_tokens, other=-1) == slot
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
                acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
                for k0 in range(k_start, k_end, BLOCK_K):
                    k = k0 + offs_k
                    k_mask = k < k_end
                    xs = tl.load(x_rows + k[None, :] * stride_xk, mask=mine[:, None] & k_mask[None, :], other=0.0)
                    w = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                    acc = lora._dot(xs, w, acc, IEEE)
                # Unscaled float32 partial sums; the expand reads only the slot's tokens' rows within the rank.
                tl.store(H + tl.program_id(2) * stride_hs + offs_m[:, None].to(tl.int64) * stride_hm +
                         offs_r[None, :], tl.where(r_mask[None, :], acc, 0.0), mask=mine[:, None] & in_rows[None, :])


@triton.jit
def _barrier_kernel(X, A, B, Ids, Scalings, Ranks, Out, Partials, Counts, num_tokens, in_features, rank_dim, rows,
                    proj_stride, k_per_split, split, column_blocks, stride_xm, stride_xk, stride_as, stride_ar,
                    stride_ak, stride_bs, stride_bn, stride_br, stride_om, stride_on, stride_ps, stride_pm,
                    s0, e0, s1, e1, s2, e2, first1, first2,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT: tl.constexpr, PDL: tl.constexpr):
    # The counts are reset by the previous launch's last program: read them only after the wait.
    wait_for_previous(PDL)
    ticket = tl.atomic_add(Counts, 1, sem="relaxed")
    shrinks = num_tokens * split
    if ticket < shrinks:
        _barrier_shrink(X, A, Ids, Ranks, Partials, Counts, ticket // split, ticket % split, in_features, rank_dim,
                        rows, proj_stride, k_per_split, stride_xm, stride_xk, stride_as, stride_ar, stride_ak,
                        stride_ps, stride_pm, BLOCK_ROWS, BLOCK_K)
    else:
        expand = ticket - shrinks
        _barrier_expand(B, Ids, Scalings, Ranks, Out, Partials, Counts, expand // column_blocks,
                        expand % column_blocks, shrinks, rank_dim, proj_stride, stride_bs, stride_bn, stride_br,
                        stride_om, stride_on, stride_ps, stride_pm, s0, e0, s1, e1, s2, e2, first1, first2,
                        BLOCK_N, BLOCK_R, SPLIT)
    if tl.atomic_add(Counts + 2, 1, sem="acq_rel") == shrinks + num_tokens * column_blocks - 1:
        tl.atomic_xchg(Counts, 0, sem="relaxed")  # every program has its ticket and has passed the wait
        tl.atomic_xchg(Counts + 1, 0, sem="relaxed")
        tl.atomic_xchg(Counts + 2, 0, sem="relaxed")


@triton.jit
def _barrier_shrink(X, A, Ids, Ranks, Partials, Counts, token, part, in_features, rank_dim, rows, proj_stride,
                    k_per_split, stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_ps, stride_pm,
                    BLOCK_ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
    """A slice of ``in`` for one token, every stacked row: float32 partial sums, then counted done."""
    token = token.to(tl.int64)
    offs_r = tl.arange(0, BLOCK_ROWS)
    offs_k = tl.arange(0, BLOCK_K)
    k_start = part * k_per_split
    k_end = tl.minimum(k_start + k_per_split, in_features)
    slot, proj, in_rows, r_mask = lora.token_rows(Ids, Ranks, token, offs_r, rank_dim, rows, proj_stride)
    a_rows = A + slot * stride_as + offs_r[:, None].to(tl.int64) * stride_ar
    result = tl.zeros([BLOCK_ROWS], dtype=tl.float32)
    if tl.max(r_mask.to(tl.int32), axis=0) > 0:
        for k0 in range(k_start, k_end, BLOCK_K):
            k = k0 + offs_k
            k_mask = k < k_end
            w = tl.load(a_rows + k[None, :] * stride_ak, mask=r_mask[:, None] & k_mask[None, :], other=0.0)
            xs = tl.load(X + token * stride_xm + k * stride_xk, mask=k_mask, other=0.0)
            result += tl.sum(w.to(tl.float32) * xs.to(tl.float32)[None, :], axis=1)
    tl.store(Partials + part * stride_ps + token * stride_pm + offs_r, result, mask=in_rows)
    tl.debug_barrier()  # every thread's part is stored before the count releases it
    tl.atomic_add(Counts + 1, 1, sem="release")


@triton.jit
def _barrier_expand(B, Ids, Scalings, Ranks, Out, Partials, Counts, token, block, shrinks, rank_dim, proj_stride,
                    stride_bs, stride_bn, stride_br, stride_om, stride_on, stride_ps, stride_pm,
                    s0, e0, s1, e1, s2, e2, first1, first2,
                    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr):
    """A block of output columns for one token: its block of ``b`` loaded, then, once every shrink is done, the
    partials added up, scaled, rounded and expanded into ``out``."""
    token = token.to(tl.int64)
    proj, offs_n, n_mask = lora._segment(block, s0, e0, s1, e1, s2, e2, first1, first2, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    slot, with_adapter, r_mask, w = lora.token_b_block(B, Ids, Ranks, token, proj, offs_n, n_mask, offs_r,
                                                       proj_stride, stride_bs, stride_bn, stride_br)
    done = tl.atomic_add(Counts + 1, 0, sem="acquire")
    while done < shrinks:
        done = tl.atomic_add(Counts + 1, 0, sem="acquire")
    tl.debug_barrier()
    if tl.max(r_mask.to(tl.int32), axis=0) > 0:  # rows without an adapter (or rank 0 here) are not touched
        h_ptrs = Partials + token * stride_pm + proj * rank_dim + offs_r
        h = tl.load(h_ptrs, mask=r_mask, other=0.0, cache_modifier=".cg")
        for s in tl.static_range(1, SPLIT):
            h += tl.load(h_ptrs + s * stride_ps, mask=r_mask, other=0.0, cache_modifier=".cg")
        where = Out + token * stride_om + offs_n * stride_on
        current = tl.load(where, mask=n_mask, other=0.0)
        h = (h * tl.load(Scalings + proj * proj_stride + slot)).to(current.dtype)  # rounded as the shrink's is
        delta = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=n_mask)
