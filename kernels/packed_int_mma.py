"""Candidate ``tl.dot`` kernels for panel-packed integer weights (``kernels/packed_int.py``'s layout) at 1 to 64
rows, for the GPU sweep (``python -m treadle.bench.quant_kernels --sweep``) to rank against ``int_dot``.

:func:`int_mma` differs from ``int_dot`` in three ways, each a switch of :class:`MmaTiles`:

- one ``tl.dot`` per K step over whole panels (``panels`` of them: 128 or 256 K values at 4 bits) instead of one
  per 16-column value slot: each packed word is loaded once per tile as part of a ``[BLOCK_N, panels, 16]`` block
  (64 contiguous bytes a row a panel), every slot shifted out at once and the result laid out in natural K order
  by a reshape (slot ``j`` of word ``c`` is column ``16j + c``), so the activations are one plain tile;
- ``swap``: the weight is the dot's first operand (``out.T`` tiles of ``[BLOCK_N, BLOCK_M]``), so a batch of a few
  tokens is the MMA's narrow side (Hopper's wgmma takes N down to 8 and its first operand from registers) rather
  than rows of padding;
- ``scale_in_regs``: the values become ``(u - zero) * scale`` in the activations' dtype before the dot (rounded
  as ``kernels/packed_int_dequant.py``'s ``dequantize`` rounds, any group that tiles the step); otherwise the dot
  multiplies the widened values (``128 + u`` from integer ops alone for 4-bit bf16/fp16) and each step's group
  takes its scale and zero after it, through the rows' activation sums (the step must lie in one group).

Split-K ranges' float32 partials are summed by the last of a tile's programs (``_store_or_reduce``).

:func:`load_candidates` lists what the loader times per row bucket: ``kernels/packed_int_magic.py``'s
``magic_mma`` first where it applies (4-bit values, groups of whole panels, 16-bit activations), these after it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.packed_int import (PANEL_WORDS, _group_scale_zero, _partials, _store_or_reduce, _widened,
                                        widening)
from treadle.kernels.packed_int_magic import MagicMmaTiles, magic_load_candidates
from treadle.kernels.small_batch import _arrivals


@dataclass(frozen=True)
class MmaTiles:
    """One :func:`int_mma` launch: ``block_m`` token rows (16, 32 or 64; rows past the batch are masked) by
    ``block_n`` weight rows per tile, ``panels`` 16-word panels per K step, ``split_k`` K ranges, the weight as the
    dot's first operand (``swap``), and whether the values are scaled before the dot (``scale_in_regs``).
    ``per_slot``: one panel a step, one dot per 16-column value slot (``int_dot``'s steps with the weight as the
    first operand: each slot's widening is elementwise on the loaded words, which lets the compiler feed Hopper's
    wgmma from registers instead of a round trip through shared memory)."""

    block_m: int
    block_n: int
    panels: int = 1
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = True
    scale_in_regs: bool = False
    per_slot: bool = False

    def fits(self, k: int, bits: int, group: int) -> bool:
        """Whether this launch tiles a K of ``k`` in groups of ``group``."""
        step = self.panels * PANEL_WORDS * 32 // bits
        if self.per_slot:
            return self.panels == 1 and self.swap and not self.scale_in_regs and k % (step * self.split_k) == 0
        if k % (step * self.split_k):
            return False
        if self.scale_in_regs:
            return step % group == 0 or group % step == 0
        return group % step == 0


def int_mma(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
            group: int, tiles: MmaTiles) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T`` with whole-panel ``tl.dot`` steps (see the module docstring)."""
    rows, k = x.shape
    n = weight.shape[0]
    if not tiles.fits(k, bits, group):
        raise ValueError(f"{tiles} does not tile K={k} of {bits}-bit values in groups of {group}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(rows, tiles.block_m), tiles.split_k)
    i16, magic, offset = widening(bits, x.dtype, not tiles.scale_in_regs)
    _int_mma_kernel[grid](
        x, weight, scales, zeros if zeros is not None else scales, out, _partials(tiles.split_k, rows, n, x.device),
        _arrivals(x.device, grid[0] * grid[1]), rows, n, k // tiles.split_k, x.stride(0), weight.stride(0),
        scales.stride(0), out.stride(0), BITS=bits, GROUP=group, HAS_ZEROS=zeros is not None,
        SPLIT_K=tiles.split_k, SWAP=tiles.swap, SCALE_IN_REGS=tiles.scale_in_regs, I16=i16, MAGIC16=magic,
        OFFSET16=offset, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PANELS=tiles.panels,
        PER_SLOT=tiles.per_slot, num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def mma_candidates(n: int, k: int, bits: int, group: int, rows: int, sm_count: int) -> list[MmaTiles]:
    """The :func:`int_mma` launches worth timing for a batch of ``rows`` (1 to 64) on an ``n`` x ``k`` weight:
    the narrowest token tile that holds the batch (and the next narrower one from 32 rows); per-slot dots with
    weight tiles of 64 to 256 rows, shallow and deep pipelines, and split-K from one program per SM to four (the
    per-slot dots of a panel run one after another, so more programs per SM hide their latency); whole-panel steps
    scaled after the dot (one panel) or before it (two); one unswapped control."""
    widest = 16 if rows <= 16 else 32 if rows <= 32 else 64
    candidates = []
    for block_m in sorted({widest, max(widest // 2, 16)}):
        def tiles(block_n: int, warps: int, stages: int, more: int = 1, **kind) -> MmaTiles:
            steps = k * bits // (32 * PANEL_WORDS * kind.get("panels", 1))
            return MmaTiles(block_m, block_n, split_k=_split(n, steps, block_n, sm_count) * more, num_warps=warps,
                            num_stages=stages, **kind)

        for block_n, warps in ((64, 4), (128, 4), (128, 8), (256, 8)):
            candidates += [tiles(block_n, warps, stages, more, per_slot=True) for stages in (3, 5) for more in (1, 2, 4)]
        for block_n, warps in ((64, 4), (128, 4), (128, 8)):
            candidates += [tiles(block_n, warps, 3), tiles(block_n, warps, 3, panels=2, scale_in_regs=True)]
        candidates.append(tiles(64, 4, 3, swap=False))
    return [t for t in dict.fromkeys(candidates) if t.fits(k, bits, group)]


def load_candidates(n: int, k: int, bits: int, group: int, rows: int, sm_count: int,
                    dtype: torch.dtype | None = None) -> list[MmaTiles | MagicMmaTiles]:
    """The few launches the loader times for a batch of about ``rows`` (16, 32 or 64), first the one to run
    untimed: with 16-bit activations (``dtype``), 4-bit values and groups of whole panels, ``magic_mma``'s first
    (``kernels/packed_int_magic.py``'s ``magic_load_candidates``); then the :func:`int_mma` kinds that won the H100
    sweep at Llama-3.1-8B's shapes (per-slot dots of 128 weight rows a tile at 16 rows, split-K for two programs per
    SM, or one or four; at 32 rows also whole-panel steps, two panels scaled before the dot on 64-row tiles or one
    after it on 128-row tiles)."""
    def tiles(block_m: int, block_n: int, programs: int = 1, **kind) -> MmaTiles:
        steps = k * bits // (32 * PANEL_WORDS * kind.get("panels", 1))
        return MmaTiles(block_m, block_n, split_k=_split(n, steps, block_n, programs * sm_count), **kind)

    if rows <= 16:
        listed = [tiles(16, 128, programs, per_slot=True) for programs in (2, 1, 4)] + [tiles(16, 64)]
    elif rows <= 32:
        listed = [tiles(32, 64, panels=2, scale_in_regs=True), tiles(32, 128), tiles(16, 128, per_slot=True),
                  tiles(32, 128, per_slot=True)]
    else:
        listed = [tiles(64, 128, per_slot=True), tiles(64, 128), tiles(64, 64, panels=2, scale_in_regs=True)]
    magic = magic_load_candidates(n, k, bits, group, rows, sm_count) if dtype is not None and widening(
        bits, dtype)[0] else []
    return magic + [t for t in dict.fromkeys(listed) if t.fits(k, bits, group)]


def _split(n: int, steps: int, block_n: int, programs: int) -> int:
    """K ranges (a power of two, up to 8, each whole steps) for at least ``programs`` programs."""
    split = 1
    while triton.cdiv(n, block_n) * split < programs and split < 8 and steps % (2 * split) == 0:
        split *= 2
    return split


@triton.jit
def _mma_step_weight(words, s_ptr, z_ptr, offs_n, n_mask, k0, stride_sn, dtype, BITS: tl.constexpr,
                     GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, SCALE_IN_REGS: tl.constexpr, I16: tl.constexpr,
                     MAGIC16: tl.constexpr, BLOCK_N: tl.constexpr, PANELS: tl.constexpr):
    """``[BLOCK_N, BLOCK_K]`` weight values of one K step in natural order, in ``dtype``: ``(u - zero) * scale``
    (SCALE_IN_REGS), else ``u`` plus the widening's offset."""
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    BLOCK_K: tl.constexpr = PANELS * 16 * PACK
    shifts = tl.arange(0, PACK) * BITS
    u = tl.reshape((words[:, :, None, :] >> shifts[None, None, :, None]) & MASK, [BLOCK_N, BLOCK_K])
    if not SCALE_IN_REGS:
        if I16:
            return (u | MAGIC16).to(tl.int16).to(dtype, bitcast=True)
        return ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0).to(dtype)
    G: tl.constexpr = BLOCK_K // GROUP if BLOCK_K > GROUP else 1
    g = k0 // GROUP + tl.arange(0, G)
    index = offs_n[:, None] * stride_sn + g[None, :]
    s = tl.load(s_ptr + index, mask=n_mask[:, None], other=0).to(tl.float32)
    if HAS_ZEROS:
        zero = tl.load(z_ptr + index, mask=n_mask[:, None], other=0).to(tl.float32) + 8388608.0
    else:
        zero = tl.full([BLOCK_N, G], 8388608.0 + (1 << (BITS - 1)), tl.float32)
    # 2**23 + u exactly, minus 2**23 + zero: (u - zero) exactly, then one rounding of the product, as dequantize.
    f = tl.reshape((u | 0x4B000000).to(tl.float32, bitcast=True), [BLOCK_N, G, BLOCK_K // G])
    return tl.reshape(((f - zero[:, :, None]) * s[:, :, None]).to(dtype), [BLOCK_N, BLOCK_K])


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _int_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, arrivals_ptr, M, N, k_per_split, stride_xm,
                    stride_wn, stride_sn, stride_om, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HAS_ZEROS: tl.constexpr, SPLIT_K: tl.constexpr, SWAP: tl.constexpr,
                    SCALE_IN_REGS: tl.constexpr, I16: tl.constexpr, MAGIC16: tl.constexpr, OFFSET16: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PANELS: tl.constexpr,
                    PER_SLOT: tl.constexpr):
    PACK: tl.constexpr = 32 // BITS
    BLOCK_K: tl.constexpr = PANELS * 16 * PACK
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_tile = (w_ptr + offs_n[:, None, None] * stride_wn + tl.arange(0, PANELS)[None, :, None] * 16
              + tl.arange(0, 16)[None, None, :])
    if SWAP:
        x_tile = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        x_tile = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    if PER_SLOT:
        acc = _slot_dots(x_ptr + offs_m[None, :] * stride_xm + tl.arange(0, 16)[:, None], m_mask,
                         w_ptr + offs_n[:, None] * stride_wn + tl.arange(0, 16)[None, :], s_ptr, z_ptr, offs_n,
                         n_mask, k_begin, k_begin + k_per_split, stride_sn, BITS, GROUP, HAS_ZEROS, I16, MAGIC16,
                         OFFSET16, BLOCK_M, BLOCK_N)
    else:
        for k0 in range(k_begin, k_begin + k_per_split, BLOCK_K):
            words = tl.load(w_tile + k0 // PACK, mask=n_mask[:, None, None], other=0, eviction_policy="evict_first")
            if SWAP:
                x = tl.load(x_tile + k0, mask=m_mask[None, :], other=0)
            else:
                x = tl.load(x_tile + k0, mask=m_mask[:, None], other=0)
            w = _mma_step_weight(words, s_ptr, z_ptr, offs_n, n_mask, k0, stride_sn, x.dtype, BITS, GROUP, HAS_ZEROS,
                                 SCALE_IN_REGS, I16, MAGIC16, BLOCK_N, PANELS)
            if SCALE_IN_REGS:
                if SWAP:
                    acc = tl.dot(w, x, acc)
                else:
                    acc = tl.dot(x, tl.trans(w), acc)
            else:
                s, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, k0 // GROUP, stride_sn, BITS, HAS_ZEROS,
                                            OFFSET16, BLOCK_N)
                if SWAP:
                    part = tl.dot(w, x)
                    x_sum = tl.sum(x.to(tl.float32), axis=0)
                    acc += s[:, None] * (part - zero[:, None] * x_sum[None, :])
                else:
                    part = tl.dot(x, tl.trans(w))
                    x_sum = tl.sum(x.to(tl.float32), axis=1)
                    acc += s[None, :] * (part - x_sum[:, None] * zero[None, :])
    if SWAP:
        tile = offs_m[None, :] * stride_om + offs_n[:, None]
        partial = offs_m[None, :] * N + offs_n[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
    else:
        tile = offs_m[:, None] * stride_om + offs_n[None, :]
        partial = offs_m[:, None] * N + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
    _store_or_reduce(acc, out_ptr + tile, partials_ptr + partial, M * N,
                     arrivals_ptr + pid_m * tl.num_programs(0) + pid_n, mask, pid_k, SPLIT_K)


@triton.jit
def _slot_dots(x_cols, m_mask, w_rows, s_ptr, z_ptr, offs_n, n_mask, k_begin, k_end, stride_sn, BITS: tl.constexpr,
               GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr, I16: tl.constexpr, MAGIC16: tl.constexpr,
               OFFSET16: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """float32 ``[BLOCK_N, BLOCK_M]`` sums over ``[k_begin, k_end)`` of the weight rows (``w_rows``: ``[BLOCK_N,
    16]`` pointers to a row's first panel) with the activation rows (``x_cols``: ``[16, BLOCK_M]`` pointers to
    their first 16 columns): per panel, value slot ``j`` of the words times the 16 activation columns it holds;
    each group's sums take its scale and zero (plus the widening's offset) through the rows' activation sums."""
    PACK: tl.constexpr = 32 // BITS
    PANEL: tl.constexpr = 16 * PACK
    JG: tl.constexpr = GROUP // 16 if GROUP // 16 < PACK else PACK
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(k_begin, k_end, PANEL):
        words = tl.load(w_rows + k0 // PACK, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        for j in tl.static_range(PACK):
            x = tl.load(x_cols + k0 + 16 * j, mask=m_mask[None, :], other=0)
            part = tl.dot(_widened(words, j, BITS, I16, MAGIC16, x.dtype), x, part)
            x_sum += tl.sum(x.to(tl.float32), axis=0)
            if (j + 1) % JG == 0:
                s, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, (k0 + 16 * (j + 1 - JG)) // GROUP,
                                            stride_sn, BITS, HAS_ZEROS, OFFSET16, BLOCK_N)
                acc += s[:, None] * (part - zero[:, None] * x_sum[None, :])
                part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
    return acc
