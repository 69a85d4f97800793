"""Triton kernels for LoRA's two halves, for a batch whose tokens use different adapters of different ranks (the
``triton`` LoRA backend, plugins/lora_backends/triton.py; the contract is core/lora/backend.py).

``shrink``: ``h[t] = scalings[s] * x[t] @ a[s].T`` (``[T, R]``, zero rows for tokens without an adapter);
``expand``: ``out[t] += h[t] @ b[s].T``, ``out`` possibly a strided column slice. ``s`` is token ``t``'s slot in
``adapter_ids`` (-1: none); ``ranks[s]`` bounds the work (``a`` and ``b`` are zero past it).

``add_delta`` is one linear layer's whole LoRA path in two launches: a fused layer's projections (q/k/v, gate/up:
up to :data:`MAX_PROJECTIONS`) stacked, ``a`` ``[slots, P * R, in]``, one shrink reads ``x`` once for all of
them; one expand adds every projection's delta into its columns of the layer's output in place (no zeroed buffer,
no separate add). The same kernels serve the two-call contract with one projection. Each row of ranks knows its
projection (``row // R``), each block of output columns its projection (the grid's blocks per projection, from the
segments' bounds), so one batch mixes adapters of any ranks per projection.

The form is picked by the number of tokens (and the stacked ranks) alone, so a CUDA graph captures one form,
whatever the ids. ``add_delta`` past ``LoRAKernelChoice.sort_above`` (64) tokens runs the **sorted** form
(kernels/lora_sorted.py: tensor-core tiles over the tokens in slot order, each adapter's weights read once per
block of sorted tokens); the forms below serve it up to there, and ``shrink``/``expand`` (and ``add_delta`` with a
larger ``sort_above``) at every size. (Past ``dense_above`` tokens the triton backend calls kernels/lora_dense.py's
``add_delta_dense`` instead, where its layers keep the dense copy of ``b``: cuBLAS GEMMs over every slot.)

- **gather** (decode: up to 64 tokens, and the shrink up to ``4096 // rows``): each program takes one token and a
  block of ranks (shrink) or of output columns (expand), loads its adapter's rows through the token's slot (one
  read of the slot per program) and reduces in float32 registers (no ``tl.dot``, which would pad one token to 16
  rows). Where one token per program would leave the GPU nearly idle (a few tokens: a skinny ``T x in x rank``
  GEMM), ``add_delta``'s shrink splits ``in`` over programs (split-K) and writes float32 partial sums that the
  expand adds up, scales and rounds as it loads them: no atomics, no extra launch. The expand's program streams a
  block of ``b`` rows (``[columns, R]``, contiguous) in one wide load. On Hopper both launch with PDL and load
  their weights while the kernel before finishes, and (``go_ahead``) let the kernel after them start as soon as
  their own wait returns. Programs past the slot's rank, and tokens without an adapter, load no weights. Their
  tiles and split-K reach are a :class:`~treadle.kernels.lora_choice.LoRAKernelChoice` (kernels/lora_choice.py).
- **slot-grouped expand** (up to 1024 tokens: large decode batches, small mixed ones): one program per slot,
  block of output columns and span of 256 tokens holds its adapter's block of ``b`` in registers and adds it to
  each of the slot's tokens in the span, so ``b`` is read once per adapter instead of once per token.
- **segmented** (more tokens: prefills and mixed batches): tensor-core tiles over blocks of consecutive tokens.
  The shrink has a program per block, slot and block of ranks that works only when the slot is in the block (a
  request's tokens are consecutive and share an adapter, so a block inside a request is one busy program; a block
  of many adapters' tokens is as many programs, side by side). The expand has a program per block of tokens and
  of columns that takes one pass per distinct slot in its block (the smallest remaining each time), each pass
  loading only its own rows. Nothing is sorted on the host.

Both accumulate in float32 and round once: ``h`` after the scaling (to ``x``'s dtype), ``out`` after adding the
delta to it. Nothing reads the ids on the host and the grids depend on shapes only, so all run under CUDA-graph
capture.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from treadle.kernels.lora_choice import DEFAULT, LoRAKernelChoice, choice_from_env  # noqa: F401  (the backend's)
from treadle.kernels.lora_dense import add_delta_dense  # noqa: F401  (the triton backend reads it here)
from treadle.kernels.lora_gather import gather_shrink_program
from treadle.kernels.lora_sorted import add_delta_sorted, sort_by_adapter, sorted_blocks, sorts
from treadle.kernels.lora_tiles import MAX_PROJECTIONS  # noqa: F401  (the triton backend reads it here)
from treadle.kernels.lora_warm import BatchVariant, variant_token_counts  # noqa: F401  (the backend's)
from treadle.kernels.lora_tiles import (dot, expand_segmented, ieee_dot, load_h, projection_stride, segment,
                                        segment_blocks)
from treadle.kernels.pdl import allow_next, wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled

# The gather kernels run up to 64 tokens (decode graphs), and the shrink's up to 4096 // rows tokens (256 at rank
# 16): one token per program, each reading its adapter's rows through L2. Past those the weights are read per
# block of tokens: the expand's slot-grouped kernel up to 1024 tokens (each program holds one adapter's block of
# ``b`` for a span of 256 tokens), then the segmented tiles of both. (add_delta's sorted form takes over past
# LoRAKernelChoice.sort_above tokens.)
GATHER_MAX_TOKENS = 64
_SHRINK_GATHER_ELEMENTS = 4096  # tokens x stacked ranks
GROUPED_MAX_TOKENS = 1024
_GROUPED_SPAN = 256
# A gather program's weight tile (LoRAKernelChoice.shrink_tile / expand_tile: 8192, 16 KB of bf16 per load, wide
# enough that a one-token shrink of in=4096 is one load per program, small enough for 4-8 warps' registers) and the
# programs a decode-sized launch aims for (busy_programs: 128, about an H100's SMs; fewer, and split-K / narrower
# column blocks spread the same bytes over more of them) come from the choice.
_SPLIT_TILE = 2048  # elements of a per split-K program (4 KB of bf16)


def shrink(x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
           ranks: torch.Tensor) -> torch.Tensor:
    """``[T, R]`` in ``x``'s dtype: ``scalings[s] * x[t] @ a[s].T`` per token, zero for ``adapter_ids[t] < 0``."""
    h = torch.empty((x.shape[0], a.shape[1]), dtype=x.dtype, device=x.device)
    _shrink(x, a, adapter_ids, scalings, ranks, a.shape[1], h.unsqueeze(0), True, DEFAULT)
    return h


def expand(h: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, ranks: torch.Tensor,
           out: torch.Tensor) -> None:
    """``out[t] += h[t] @ b[s].T`` per token with a slot; ``out`` may be any strided 2-D view."""
    _expand(h.unsqueeze(0), None, b, adapter_ids, ranks, ((0, out.shape[1]),), out, DEFAULT)


def add_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
              ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor,
              choice: LoRAKernelChoice = DEFAULT, order: torch.Tensor | None = None) -> None:
    """A layer's stacked projections (``a`` ``[slots, P * R, in]``, ``b`` ``[slots, width, R]`` indexed by output
    column, ``scalings``/``ranks`` ``[P, slots]``, projection ``p`` on columns ``segments[p]``) added into ``out``
    in place: one shrink, one expand, tuned by ``choice``. ``order`` (optional): the tokens sorted by slot
    (:func:`sort_by_adapter`, computed once per step by the engine); batches the sorted form takes sort it here
    when it is not given."""
    num_tokens, rows = x.shape[0], a.shape[1]
    if num_tokens == 0:
        return
    if sorts(num_tokens, choice):
        add_delta_sorted(x, a, b, adapter_ids, sort_by_adapter(adapter_ids) if order is None else order, scalings,
                          ranks, segments, out, choice)
        return
    split = (_gather_shrink_blocks(num_tokens, rows, x.shape[1], True, choice)[3]
             if _shrink_gathers(num_tokens, rows) else 1)
    partials = torch.empty((split, num_tokens, rows), dtype=torch.float32, device=x.device)
    _shrink(x, a, adapter_ids, scalings, ranks, b.shape[2], partials, False, choice)
    _expand(partials, scalings, b, adapter_ids, ranks, segments, out, choice)


def _shrink(x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor, ranks: torch.Tensor,
            rank_dim: int, h: torch.Tensor, final: bool, choice: LoRAKernelChoice) -> None:
    """Into ``h`` ``[split, T, rows]``: the scaled, rounded shrink (``final``, split 1) or float32 partial sums of
    ``split`` slices of ``in``, unscaled (for :func:`_expand` to finish)."""
    num_tokens, in_features = x.shape
    slots, rows = a.shape[0], a.shape[1]
    if num_tokens == 0:
        return
    common = (x, a, adapter_ids, scalings, ranks, h, num_tokens, in_features, rank_dim, rows,
              projection_stride(scalings), x.stride(0), x.stride(1), a.stride(0), a.stride(1), a.stride(2),
              h.stride(0), h.stride(1))
    if _shrink_gathers(num_tokens, rows):
        blocks = _gather_shrink_blocks(num_tokens, rows, in_features, not final, choice)
        if blocks.split != h.shape[0]:
            raise ValueError(f"the shrink takes {blocks.split} slices of in here, not {h.shape[0]}")
        grid = (num_tokens, triton.cdiv(rows, blocks.block_r), blocks.split)
        pdl = pdl_enabled(x.device)
        _shrink_gather_kernel[grid](*common, blocks.k_per_split, BLOCK_R=blocks.block_r, BLOCK_K=blocks.block_k,
                                    FINAL=final, PDL=pdl, GO_AHEAD=pdl and bool(choice.go_ahead), AHEAD=blocks.ahead,
                                    launch_pdl=pdl,
                                    num_warps=blocks.warps or _gather_warps(blocks.block_r * blocks.block_k))
    else:
        block_m = _segmented_block_m(num_tokens)
        block_r = max(16, min(64, triton.next_power_of_2(rows)))
        block_k = max(16, min(128, triton.next_power_of_2(in_features)))
        grid = (triton.cdiv(num_tokens, block_m), slots, triton.cdiv(rows, block_r))
        _shrink_segmented_kernel[grid](*common, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k, FINAL=final,
                                       IEEE=ieee_dot(x), num_warps=4, num_stages=3)


def _expand(h: torch.Tensor, scalings: torch.Tensor | None, b: torch.Tensor, adapter_ids: torch.Tensor,
            ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], out: torch.Tensor,
            choice: LoRAKernelChoice) -> None:
    """``out`` += each projection's delta in its columns; ``h`` ``[split, T, rows]``: partial sums to add up and
    scale (``scalings`` given) or the finished shrink (``scalings`` None, split 1)."""
    split, num_tokens, _ = h.shape
    slots, rank_dim = b.shape[0], b.shape[2]
    if num_tokens == 0:
        return
    partial = scalings is not None
    proj_stride = projection_stride(ranks)
    common = (h, b, adapter_ids, scalings if partial else ranks, ranks, out, num_tokens, rank_dim, proj_stride,
              h.stride(0), h.stride(1), h.stride(2), b.stride(0), b.stride(1), b.stride(2), out.stride(0),
              out.stride(1))
    flags = {"SPLIT": split, "PARTIAL": partial}
    if num_tokens <= GATHER_MAX_TOKENS:
        block_r = max(2, triton.next_power_of_2(rank_dim))
        widest = max(end - start for start, end in segments)
        block_n = _gather_expand_columns(num_tokens, sum(e - s for s, e in segments), widest, block_r, choice)
        bounds, blocks = segment_blocks(segments, block_n)
        pdl = pdl_enabled(h.device)
        _expand_gather_kernel[(num_tokens, blocks)](*common, *bounds, BLOCK_N=block_n, BLOCK_R=block_r, **flags,
                                                    PDL=pdl, GO_AHEAD=pdl and bool(choice.go_ahead),
                                                    launch_pdl=pdl,
                                                    num_warps=min(choice.expand_max_warps,
                                                                  _gather_warps(block_r * block_n)))
        return
    block_n = max(16, min(128, triton.next_power_of_2(max(end - start for start, end in segments))))
    bounds, blocks = segment_blocks(segments, block_n)
    tile_r = max(16, min(64, triton.next_power_of_2(rank_dim)))  # a tensor-core tile's ranks
    span = _grouped_span(num_tokens, rank_dim)
    if span:
        grid = (slots, blocks, triton.cdiv(num_tokens, span))
        _expand_grouped_kernel[grid](*common, *bounds, SPAN=span, BLOCK_M=64, BLOCK_N=block_n, BLOCK_R=tile_r,
                                     **flags, IEEE=ieee_dot(out), num_warps=4)
    else:
        expand_segmented(h, scalings, b, adapter_ids, ranks, segments, out, None)


def _shrink_gathers(num_tokens: int, rows: int) -> bool:
    return num_tokens <= max(GATHER_MAX_TOKENS, _SHRINK_GATHER_ELEMENTS // rows)


def _segmented_block_m(num_tokens: int) -> int:
    """Tokens a segmented shrink program takes."""
    return 32 if num_tokens <= GROUPED_MAX_TOKENS else 64


def _grouped_span(num_tokens: int, rank_dim: int) -> int:
    """Tokens a slot-grouped expand program covers past the gather form's batches, or 0: the segmented expand (more
    tokens, or ranks past one tensor-core tile)."""
    if num_tokens > GROUPED_MAX_TOKENS or rank_dim > max(16, min(64, triton.next_power_of_2(rank_dim))):
        return 0
    return min(_GROUPED_SPAN, max(64, triton.next_power_of_2(num_tokens)))


def add_delta_variant(num_tokens: int, rows: int, in_features: int, rank_dim: int,
                      segments: tuple[tuple[int, int], ...], choice: LoRAKernelChoice = DEFAULT) -> tuple:
    """What :func:`add_delta`'s launches for a batch of ``num_tokens`` depend on beyond the layer's shape (``rows``
    stacked rank rows of ``rank_dim``, ``in_features``, ``segments``): the form and its token-dependent blocks,
    different wherever two batch sizes launch different constexprs or options (Triton compiles each once; equal
    values launch the same). Each part is monotone in ``num_tokens`` while the parts before it stay the same, so a
    value is taken by one run of consecutive batch sizes. Not included: the specialization of the partial sums'
    stride ``num_tokens * rows`` (an integer argument Triton specializes: 1, a multiple of 16, or neither)."""
    if sorts(num_tokens, choice):
        blocks = sorted_blocks(num_tokens, rows, in_features, choice)
        return ("sorted", blocks.block_m, blocks.split)
    if not _shrink_gathers(num_tokens, rows):
        shrink: tuple = ("segmented", _segmented_block_m(num_tokens))
        split = 1
    else:
        blocks = _gather_shrink_blocks(num_tokens, rows, in_features, True, choice)
        shrink, split = ("gather", *blocks), blocks.split
    if num_tokens > GATHER_MAX_TOKENS:
        return ("unsorted", shrink, split, "grouped" if _grouped_span(num_tokens, rank_dim) else "segmented",
                _grouped_span(num_tokens, rank_dim))
    widest = max(end - start for start, end in segments)
    block_n = _gather_expand_columns(num_tokens, sum(e - s for s, e in segments), widest,
                                     max(2, triton.next_power_of_2(rank_dim)), choice)
    return ("unsorted", shrink, split, "gather", block_n)


class ShrinkBlocks(NamedTuple):
    """A gather shrink's launch: ``[block_r, block_k]`` tiles of ``a`` over ``k_per_split`` columns of ``in`` a
    program, ``split`` slices of ``in``; ``ahead``: 0, or the looped form's pipeline (``shrink_loop_stages``: 1,
    each program loads its next chunk of ``a`` and ``x`` into registers before reducing this one; more, that many
    stages of Triton's software pipeline); ``warps``: its own launch's warps (0: by the tile, ``_gather_warps``)."""

    block_r: int
    block_k: int
    k_per_split: int
    split: int
    ahead: int = 0
    warps: int = 0


@functools.lru_cache(maxsize=None)
def _gather_shrink_blocks(num_tokens: int, rows: int, in_features: int, splittable: bool,
                          choice: LoRAKernelChoice = DEFAULT) -> ShrinkBlocks:
    """A gather shrink's :class:`ShrinkBlocks`: a ``shrink_tile`` of ``a`` per program, a whole row of ``in`` per
    load; where that would give fewer than ``busy_programs`` programs and partial sums may be returned
    (``splittable``), 4 KB tiles over slices of ``split_k`` columns of ``in``; past ``shrink_loop_above`` tokens
    (not split-K) the looped form (:func:`_loop_blocks`). Two forms per layer shape by default, whatever the batch:
    each is compiled once."""
    tile, split_k = choice.shrink_tile, choice.split_k
    full_k = min(triton.next_power_of_2(in_features), 2 * tile)
    if not splittable or num_tokens * rows * in_features >= choice.busy_programs * tile or full_k <= split_k:
        if num_tokens > choice.shrink_loop_above:
            return _loop_blocks(num_tokens, rows, in_features, splittable, choice)
        return ShrinkBlocks(max(1, min(triton.next_power_of_2(rows), tile // full_k)), full_k, in_features, 1)
    block_r = max(1, min(triton.next_power_of_2(rows), _SPLIT_TILE // split_k))
    return ShrinkBlocks(block_r, split_k, split_k, triton.cdiv(in_features, split_k))


def _loop_blocks(num_tokens: int, rows: int, in_features: int, splittable: bool,
                 choice: LoRAKernelChoice) -> ShrinkBlocks:
    """The looped form: ``shrink_loop_rows`` stacked rows a program (each token's ``x`` read once per that many),
    chunks of ``shrink_loop_k`` columns, ``shrink_loop_warps`` warps; where partial sums may be returned, ``in`` in
    slices of whole chunks, as many as reach ``shrink_loop_programs`` programs and at most ``shrink_loop_chunks``
    chunks a program."""
    block_r = min(triton.next_power_of_2(rows), choice.shrink_loop_rows)
    block_k = min(triton.next_power_of_2(in_features), choice.shrink_loop_k)
    chunks = triton.cdiv(in_features, block_k)
    programs = num_tokens * triton.cdiv(rows, block_r)
    wanted = max(triton.cdiv(choice.shrink_loop_programs, programs), triton.cdiv(chunks, choice.shrink_loop_chunks))
    slices = min(chunks, wanted) if splittable else 1
    k_per_split = triton.cdiv(chunks, slices) * block_k
    return ShrinkBlocks(block_r, block_k, k_per_split, triton.cdiv(in_features, k_per_split),
                        choice.shrink_loop_stages, choice.shrink_loop_warps)


@functools.lru_cache(maxsize=None)
def _gather_expand_columns(num_tokens: int, columns: int, widest: int, block_r: int,
                           choice: LoRAKernelChoice) -> int:
    """Output columns per gather-expand program: an ``expand_tile`` block of ``b`` (``expand_wide_tile`` for a layer
    of more than ``expand_wide_above`` columns), or 64 where that would give fewer than ``busy_programs`` programs."""
    tile = choice.expand_wide_tile if columns > choice.expand_wide_above else choice.expand_tile
    block_n = max(16, min(triton.next_power_of_2(widest), tile // block_r))
    return min(block_n, 64) if num_tokens * triton.cdiv(columns, block_n) < choice.busy_programs else block_n


def _gather_warps(tile: int) -> int:
    """Warps of a gather program: 32 weight elements per thread (a 16 KB bf16 tile: 8 warps)."""
    return max(1, min(16, tile // (32 * 32)))


@triton.jit
def token_b_block(B, Ids, Ranks, token, proj, offs_n, n_mask, offs_r, proj_stride, stride_bs, stride_bn, stride_br):
    """Token ``token``'s slot (clamped to 0 for none), whether it has an adapter, its projection's rank mask over
    ``offs_r`` and its block of ``b`` (rows ``offs_n``; nothing loaded past the rank or without an adapter)."""
    slot = tl.load(Ids + token)
    with_adapter = slot >= 0
    slot = tl.maximum(slot, 0)
    rank = tl.where(with_adapter, tl.load(Ranks + proj * proj_stride + slot), 0)
    r_mask = offs_r < rank
    w = tl.load(B + slot * stride_bs + offs_n[:, None].to(tl.int64) * stride_bn + offs_r[None, :] * stride_br,
                mask=n_mask[:, None] & r_mask[None, :], other=0.0)
    return slot, with_adapter, r_mask, w


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every decode batch size
def _shrink_gather_kernel(X, A, Ids, Scalings, Ranks, H, num_tokens, in_features, rank_dim, rows, proj_stride,
                          stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hs, stride_hm, k_per_split,
                          BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, FINAL: tl.constexpr, PDL: tl.constexpr,
                          GO_AHEAD: tl.constexpr, AHEAD: tl.constexpr):
    # The program's body is shared with the small-batch matmul, which runs it beside its own (lora_gather.py).
    gather_shrink_program(tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2), X, A, Ids, Scalings,
                          Ranks, H, in_features, rank_dim, rows, proj_stride, stride_xm, stride_xk, stride_as,
                          stride_ar, stride_ak, stride_hs, stride_hm, k_per_split, BLOCK_R, BLOCK_K, FINAL, PDL,
                          GO_AHEAD, AHEAD)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every decode batch size
def _expand_gather_kernel(H, B, Ids, Scalings, Ranks, Out, num_tokens, rank_dim, proj_stride,
                          stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                          s0, e0, s1, e1, s2, e2, first1, first2,
                          BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, PARTIAL: tl.constexpr,
                          PDL: tl.constexpr, GO_AHEAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    proj, offs_n, n_mask = segment(tl.program_id(1), s0, e0, s1, e1, s2, e2, first1, first2, BLOCK_N)
    offs_r = tl.arange(0, BLOCK_R)
    # The adapter's block of b (its columns' rows, contiguous) before the wait, as in the shrink; h and out after.
    slot, with_adapter, r_mask, w = token_b_block(B, Ids, Ranks, token, proj, offs_n, n_mask, offs_r, proj_stride,
                                                  stride_bs, stride_bn, stride_br)
    wait_for_previous(PDL)
    allow_next(GO_AHEAD)  # as in the shrink: the next kernel's programs start while this one adds its delta
    if with_adapter:  # rows without an adapter are not touched
        scaling = tl.load(Scalings + proj * proj_stride + slot)
        h = load_h(H + token * stride_hm + (proj * rank_dim + offs_r) * stride_hr, r_mask, stride_hs, scaling,
                    SPLIT, PARTIAL)
        where = Out + token * stride_om + offs_n * stride_on
        current = tl.load(where, mask=n_mask, other=0.0)
        if PARTIAL:  # rounded once, as the finished shrink is
            h = h.to(current.dtype)
        delta = tl.sum(w.to(tl.float32) * h.to(tl.float32)[None, :], axis=1)
        tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=n_mask)


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
def _shrink_segmented_kernel(X, A, Ids, Scalings, Ranks, H, num_tokens, in_features, rank_dim, rows, proj_stride,
                             stride_xm, stride_xk, stride_as, stride_ar, stride_ak, stride_hs, stride_hm,
                             BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                             FINAL: tl.constexpr, IEEE: tl.constexpr):
    # One program per block of tokens, slot and block of ranks: it works only if the slot is in the block (one
    # slot for a block inside a request), so a block of many adapters' tokens is many programs, not a long one.
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    slot = tl.program_id(1)
    offs_r = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < num_tokens
    ids = tl.load(Ids + offs_m, mask=m_mask, other=-1)
    h_tile = H + offs_m[:, None].to(tl.int64) * stride_hm + offs_r[None, :]
    in_rows = offs_r < rows
    if slot == 0:  # the first slot's programs also write the zero rows of tokens without an adapter
        tl.store(h_tile, tl.zeros([BLOCK_M, BLOCK_R], dtype=H.dtype.element_ty),
                 mask=(m_mask & (ids < 0))[:, None] & in_rows[None, :])
    mine = ids == slot
    if tl.max(mine.to(tl.int32), axis=0) > 0:
        proj = offs_r // rank_dim
        rank = tl.load(Ranks + proj * proj_stride + slot, mask=in_rows, other=0)
        r_mask = offs_r - proj * rank_dim < rank
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        if tl.max(r_mask.to(tl.int32), axis=0) > 0:
            x_rows = X + offs_m[:, None].to(tl.int64) * stride_xm
            a_cols = A + slot * stride_as + offs_r[None, :].to(tl.int64) * stride_ar
            for k0 in range(0, in_features, BLOCK_K):
                k = k0 + offs_k
                k_mask = k < in_features
                x = tl.load(x_rows + k[None, :] * stride_xk, mask=mine[:, None] & k_mask[None, :], other=0.0)
                w = tl.load(a_cols + k[:, None] * stride_ak, mask=k_mask[:, None] & r_mask[None, :], other=0.0)
                acc = dot(x, w, acc, IEEE)
        if FINAL:
            acc = acc * tl.load(Scalings + proj * proj_stride + slot, mask=in_rows, other=0.0)[None, :]
        result = tl.where(r_mask[None, :], acc, 0.0)
        tl.store(h_tile, result.to(H.dtype.element_ty), mask=mine[:, None] & in_rows[None, :])


@triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
def _expand_grouped_kernel(H, B, Ids, Scalings, Ranks, Out, num_tokens, rank_dim, proj_stride,
                           stride_hs, stride_hm, stride_hr, stride_bs, stride_bn, stride_br, stride_om, stride_on,
                           s0, e0, s1, e1, s2, e2, first1, first2,
                           SPAN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                           SPLIT: tl.constexpr, PARTIAL: tl.constexpr, IEEE: tl.constexpr):
    # One program per slot, block of output columns and span of tokens: it loads its adapter's block of b once
    # and adds it to every token of the slot in the span, so b is read once per adapter, not once per token.
    slot = tl.program_id(0)
    proj, offs_n, n_mask = segment(tl.program_id(1), s0, e0, s1, e1, s2, e2, first1, first2, BLOCK_N)
    span_start = tl.program_id(2) * SPAN
    offs_span = span_start + tl.arange(0, SPAN)
    span_ids = tl.load(Ids + offs_span, mask=offs_span < num_tokens, other=-1)
    if tl.max((span_ids == slot).to(tl.int32), axis=0) > 0:
        rank = tl.load(Ranks + proj * proj_stride + slot)
        scaling = tl.load(Scalings + proj * proj_stride + slot)
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        w = tl.load(B + slot * stride_bs + offs_n[None, :].to(tl.int64) * stride_bn + offs_r[:, None] * stride_br,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)
        for m0 in tl.static_range(0, SPAN, BLOCK_M):
            offs_m = span_start + m0 + tl.arange(0, BLOCK_M)
            mine = tl.load(Ids + offs_m, mask=offs_m < num_tokens, other=-1) == slot
            if tl.max(mine.to(tl.int32), axis=0) > 0:
                h = load_h(H + offs_m[:, None].to(tl.int64) * stride_hm + (proj * rank_dim + offs_r[None, :]) *
                            stride_hr, mine[:, None] & r_mask[None, :], stride_hs, scaling, SPLIT, PARTIAL)
                if PARTIAL:
                    h = h.to(Out.dtype.element_ty)
                delta = dot(h, w, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), IEEE)
                tile_mask = mine[:, None] & n_mask[None, :]
                where = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
                current = tl.load(where, mask=tile_mask, other=0.0)
                tl.store(where, (current.to(tl.float32) + delta).to(current.dtype), mask=tile_mask)
