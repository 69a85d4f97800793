"""A linear layer's LoRA delta at decode sizes split around the layer's matmul: the shrink runs in extra programs of
treadle's small-batch matmul's own launch (kernels/small_batch.py, ``beside``) or, beside a library matmul (cuBLAS)
or where its tile is too large for a matmul's launch, in a launch of its own (:meth:`SplitLoRA.apart`); either way
the expand carries the layer's epilogue.

:func:`split_lora` builds the job (a :class:`SplitLoRA`) from a layer's stacked adapters; the layer's matmul runs
its :attr:`SplitLoRA.beside` (the gather shrink of kernels/lora.py, the same tiles and float32 partial sums), or
the matmul runs alone and :meth:`SplitLoRA.apart` runs the shrink kernel itself, then one of:

- :meth:`SplitLoRA.add`: the plain gather expand into the output (``qkv_proj``; any layer);
- :meth:`SplitLoRA.silu_mul`: for a ``[gate | up]`` output, gate's and up's deltas added and ``silu(gate) * up``
  written, rounded as the unfused path rounds (each half rounded with its delta, then ``silu_mul``'s roundings);
- :meth:`SplitLoRA.add_rmsnorm`: the delta added, then the residual, and the row's RMSNorm by the last program of
  the row (``o_proj``/``down_proj``: the layer's next norm needs no kernel), rounded as the path it replaces: with
  ``gemv_warps`` (one token, where the one-token GEMV fuses its add + RMSNorm) the delta joins the residual first
  and the norm reduces as that GEMV's, else the delta joins the output and the norm reduces as
  ``fused.add_rmsnorm``'s kernel.

So a decoder layer with all seven projections adapted runs 8 launches at one token (4 matmuls with their shrinks,
4 expands with their epilogues) where the unfused path runs 13 (4 matmuls, 4 shrinks, 4 expands, the ``silu_mul``);
on library matmuls 12 where the unfused path runs 15 at 32 tokens (the ``silu_mul`` and both add + RMSNorm kernels
gone). Every kernel launches with PDL like the gather kernels (kernels/pdl.py).

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.fused import rmsnorm_row, rounded_add
from treadle.kernels.lora import (GATHER_MAX_TOKENS, _expand, _gather_expand_columns, _gather_shrink_blocks,
                                  _gather_warps, _shrink, token_b_block)
from treadle.kernels.lora_choice import LoRAKernelChoice
from treadle.kernels.lora_gather import GemvShrink
from treadle.kernels.lora_tiles import MAX_PROJECTIONS, load_h, projection_stride
from treadle.kernels.pdl import allow_next, wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.small_batch import _arrivals


def splits(num_tokens: int, projections: int, choice: LoRAKernelChoice) -> bool:
    """Whether ``add_delta`` would run the gather form for this batch (the form :class:`SplitLoRA` splits) and the
    choice lets it run split (``fuse_gemv``, up to ``fuse_max_tokens`` tokens)."""
    return bool(choice.fuse_gemv) and 0 < num_tokens <= min(GATHER_MAX_TOKENS, choice.sort_above,
                                                             choice.fuse_max_tokens) and projections <= MAX_PROJECTIONS


def split_lora(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
               ranks: torch.Tensor, segments: tuple[tuple[int, int], ...], choice: LoRAKernelChoice) -> "SplitLoRA":
    """A layer's stacked adapters (kernels/lora.py's ``add_delta`` arguments) as a shrink for the matmul's launch
    and an expand to run after it (call only where :func:`splits`)."""
    num_tokens, rows = x.shape[0], a.shape[1]
    blocks = _gather_shrink_blocks(num_tokens, rows, x.shape[1], True, choice)
    partials = torch.empty((blocks.split, num_tokens, rows), dtype=torch.float32, device=x.device)
    shrink = GemvShrink(a, adapter_ids, scalings, ranks, partials, b.shape[2], projection_stride(scalings),
                        blocks.block_r, blocks.block_k, blocks.k_per_split, blocks.ahead)
    return SplitLoRA(shrink, b, segments, choice)


@dataclass(frozen=True)
class SplitLoRA:
    """A layer's delta around its matmul: the :attr:`shrink`, run by the matmul's launch (:attr:`beside`) or apart
    (:meth:`apart`), then the expand with the layer's epilogue (module docstring)."""

    shrink: GemvShrink
    b: torch.Tensor
    segments: tuple[tuple[int, int], ...]
    choice: LoRAKernelChoice

    @property
    def beside(self) -> GemvShrink | None:
        """The shrink for a small-batch matmul's launch; None where its tile is larger than ``fuse_tile`` (it would
        take the launch's registers: the matmul runs alone and :meth:`apart` runs the shrink)."""
        shrink = self.shrink
        return shrink if shrink.block_r * shrink.block_k <= self.choice.fuse_tile else None

    def apart(self, x: torch.Tensor) -> None:
        """The shrink of ``x`` in a launch of its own (the unfused path's shrink kernel, the same partial sums), for
        a matmul that does not run :attr:`beside`: the library's, or a tile too large for the matmul's launch."""
        shrink = self.shrink
        _shrink(x, shrink.a, shrink.adapter_ids, shrink.scalings, shrink.ranks, shrink.rank_dim, shrink.partials,
                False, self.choice)

    def add(self, out: torch.Tensor) -> None:
        """``out`` (the layer's output) plus every projection's delta, in place."""
        shrink = self.shrink
        _expand(shrink.partials, shrink.scalings, self.b, shrink.adapter_ids, shrink.ranks, self.segments, out,
                self.choice)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate + delta) * (up + delta)`` ``[T, N]`` of a ``[gate | up]`` output ``[T, 2N]``."""
        (g0, g1), (u0, u1) = self.segments
        half = g1 - g0
        if len(self.segments) != 2 or g0 != 0 or u0 != half or u1 != 2 * half or gate_up.shape[1] != 2 * half:
            raise ValueError(f"silu_mul needs a [gate | up] layer of two equal halves, not segments {self.segments}")
        shrink, num_tokens = self.shrink, gate_up.shape[0]
        out = torch.empty((num_tokens, half), dtype=gate_up.dtype, device=gate_up.device)
        block_r, block_n = self._expand_tile(2 * half, half)
        block_n = max(16, min(block_n, self.choice.expand_tile // (2 * block_r)))  # gate's and up's blocks: one tile
        pdl = pdl_enabled(out.device)
        _expand_silu_mul_kernel[(num_tokens, triton.cdiv(half, block_n))](
            *self._expand_args(), gate_up, out, half, gate_up.stride(0), BLOCK_N=block_n, BLOCK_R=block_r,
            SPLIT=shrink.partials.shape[0], PDL=pdl, GO_AHEAD=pdl and bool(self.choice.go_ahead), launch_pdl=pdl,
            num_warps=_gather_warps(2 * block_r * block_n))
        return out

    def add_rmsnorm(self, y: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gemv_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(y + delta + residual) * norm_weight, y + delta + residual)`` for a layer of one projection,
        rounded as the one-token GEMV's fused add + RMSNorm with ``gemv_warps`` warps after the delta joined the
        residual (given), or as the delta added to ``y``, then ``fused.add_rmsnorm`` (None)."""
        if len(self.segments) != 1:
            raise ValueError(f"add_rmsnorm runs a layer of one projection, not segments {self.segments}")
        num_tokens, width = y.shape
        residual = residual if residual.stride(1) == 1 else residual.contiguous()
        normed = torch.empty((num_tokens, width), dtype=y.dtype, device=y.device)
        residual_out = torch.empty_like(normed)
        block_r, block_n = self._expand_tile(width, width)
        blocks = triton.cdiv(width, block_n)
        block_row = triton.next_power_of_2(width)
        pdl = pdl_enabled(y.device)
        _expand_add_rmsnorm_kernel[(num_tokens, blocks)](
            *self._expand_args(), y, residual, norm_weight, normed, residual_out, _arrivals(y.device, num_tokens), eps,
            width, blocks, y.stride(0), residual.stride(0), BLOCK_N=block_n, BLOCK_R=block_r,
            SPLIT=self.shrink.partials.shape[0], BLOCK_ROW=block_row, RESIDUAL_FIRST=gemv_warps is not None,
            PDL=pdl, GO_AHEAD=pdl and bool(self.choice.go_ahead), launch_pdl=pdl,
            # the norm's sum reduces over these warps: as the kernel this one stands in for
            num_warps=gemv_warps if gemv_warps is not None else min(16, max(1, block_row // 256)))
        return normed, residual_out

    def _expand_tile(self, columns: int, widest: int) -> tuple[int, int]:
        """``(BLOCK_R, BLOCK_N)``: the gather expand's tile for this layer (so each column's sum is the same)."""
        num_tokens, rank_dim = self.shrink.partials.shape[1], self.b.shape[2]
        block_r = max(2, triton.next_power_of_2(rank_dim))
        return block_r, _gather_expand_columns(num_tokens, columns, widest, block_r, self.choice)

    def _expand_args(self) -> tuple:
        shrink, b = self.shrink, self.b
        h = shrink.partials
        return (h, b, shrink.adapter_ids, shrink.scalings, shrink.ranks, shrink.rank_dim,
                projection_stride(shrink.ranks), h.stride(0), h.stride(1), h.stride(2), b.stride(0), b.stride(1),
                b.stride(2))


@triton.jit
def _delta(H, W, token, proj, r_mask, Scalings, slot, rank_dim, proj_stride, stride_hs, stride_hm, stride_hr, Out,
           BLOCK_R: tl.constexpr, SPLIT: tl.constexpr):
    """The float32 delta of ``W``'s rows (``[BLOCK_N, BLOCK_R]`` of ``b``) for ``token``: its partial sums added up,
    scaled and rounded to ``Out``'s dtype (as kernels/lora.py's gather expand)."""
    offs_r = tl.arange(0, BLOCK_R)
    scaling = tl.load(Scalings + proj * proj_stride + slot)
    h = load_h(H + token * stride_hm + (proj * rank_dim + offs_r) * stride_hr, r_mask, stride_hs, scaling, SPLIT,
               True)
    return tl.sum(W.to(tl.float32) * h.to(Out.dtype.element_ty).to(tl.float32)[None, :], axis=1)


@triton.jit
def _expand_silu_mul_kernel(H, B, Ids, Scalings, Ranks, rank_dim, proj_stride, stride_hs, stride_hm, stride_hr,
                            stride_bs, stride_bn, stride_br, Gate_up, Out, half, stride_gm,
                            BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr,
                            GO_AHEAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < half
    offs_r = tl.arange(0, BLOCK_R)
    # The adapter's blocks of b for gate's and up's columns before the wait (kernels/pdl.py); the matmul's output
    # and the partial sums after.
    slot, with_adapter, gate_r, w_gate = token_b_block(B, Ids, Ranks, token, 0, offs_n, n_mask, offs_r, proj_stride,
                                                       stride_bs, stride_bn, stride_br)
    slot, with_adapter, up_r, w_up = token_b_block(B, Ids, Ranks, token, 1, half + offs_n, n_mask, offs_r,
                                                   proj_stride, stride_bs, stride_bn, stride_br)
    wait_for_previous(PDL)
    allow_next(GO_AHEAD)
    row = Gate_up + token * stride_gm
    gate = tl.load(row + offs_n, mask=n_mask, other=0.0)
    up = tl.load(row + half + offs_n, mask=n_mask, other=0.0)
    dtype = gate.dtype
    if with_adapter:  # each half rounded with its delta, as the expand into the layer's output rounds it
        gate = (gate.to(tl.float32) + _delta(H, w_gate, token, 0, gate_r, Scalings, slot, rank_dim, proj_stride,
                                             stride_hs, stride_hm, stride_hr, Out, BLOCK_R, SPLIT)).to(dtype)
        up = (up.to(tl.float32) + _delta(H, w_up, token, 1, up_r, Scalings, slot, rank_dim, proj_stride, stride_hs,
                                         stride_hm, stride_hr, Out, BLOCK_R, SPLIT)).to(dtype)
    g = gate.to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)  # rounded as fused.silu_mul and the matmul's SiLU·mul epilogue
    tl.store(Out + token * half + offs_n, (silu.to(tl.float32) * up.to(tl.float32)).to(dtype), mask=n_mask)


@triton.jit
def _expand_add_rmsnorm_kernel(H, B, Ids, Scalings, Ranks, rank_dim, proj_stride, stride_hs, stride_hm, stride_hr,
                               stride_bs, stride_bn, stride_br, Y, Residual, Norm_weight, Normed, Residual_out,
                               Counts, eps, width, blocks, stride_ym, stride_rm,
                               BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, SPLIT: tl.constexpr,
                               BLOCK_ROW: tl.constexpr, RESIDUAL_FIRST: tl.constexpr, PDL: tl.constexpr,
                               GO_AHEAD: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < width
    offs_r = tl.arange(0, BLOCK_R)
    slot, with_adapter, r_mask, w = token_b_block(B, Ids, Ranks, token, 0, offs_n, n_mask, offs_r, proj_stride,
                                                  stride_bs, stride_bn, stride_br)
    wait_for_previous(PDL)
    allow_next(GO_AHEAD)
    y = tl.load(Y + token * stride_ym + offs_n, mask=n_mask, other=0.0)
    residual = tl.load(Residual + token * stride_rm + offs_n, mask=n_mask, other=0.0)
    if with_adapter:
        delta = _delta(H, w, token, 0, r_mask, Scalings, slot, rank_dim, proj_stride, stride_hs, stride_hm,
                       stride_hr, Y, BLOCK_R, SPLIT)
        if RESIDUAL_FIRST:  # as the delta added into the residual ahead of the GEMV's fused add + RMSNorm
            residual = (residual.to(tl.float32) + delta).to(y.dtype)
        else:  # as the delta added into the layer's output, then fused.add_rmsnorm
            y = (y.to(tl.float32) + delta).to(y.dtype)
    row_out = Residual_out + token * width
    tl.store(row_out + offs_n, rounded_add(y, residual), mask=n_mask)
    # The row's last program to store its block norms the row (the count's release/acquire makes the others'
    # stores visible), then resets the count for the next call.
    tl.debug_barrier()
    count = Counts + token
    if tl.atomic_add(count, 1, sem="acq_rel") == blocks - 1:
        cols = tl.arange(0, BLOCK_ROW)
        mask = cols < width
        summed = tl.load(row_out + cols, mask=mask, other=0.0, cache_modifier=".cg")
        weight = tl.load(Norm_weight + cols, mask=mask, other=0.0)
        tl.store(Normed + token * width + cols, rmsnorm_row(summed, weight, width, eps), mask=mask)
        tl.atomic_xchg(count, 0, sem="relaxed")
