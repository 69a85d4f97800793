"""A W4A16 tensor-core kernel that widens the 4-bit values with fewer instructions (``kernels/packed_int.py``'s
panel layout, unchanged), what the loader times first at 2 to 64 rows where it applies
(``kernels/packed_int_mma.py``'s ``load_candidates``).

:func:`magic_mma` (1 to 64 tokens, tensor cores, the weight as the dot's first operand): one panel (128 values a
row) per K step, dequantized once per program (the token tile holds the whole batch up to ``block_m``); each
word's eight values become four pairs of 16-bit ``128 + u`` (bf16; fp16 ``1024 + u``), each pair one shift and
one lop3 (``(w >> 4p) & 0x000F000F | 0x43004300``: values ``p`` and ``p + 4`` of the word in one register), by
inline PTX (``ASM``; its twin with plain Triton ops gives the same values on the CPU interpreter). Each pair is
the first operand of a dot of its own over the pair's 32 panel columns (``16p + c`` and ``16(p + 4) + c``), kept
in registers for Hopper's wgmma, the four dots of a panel chaining without waiting; the activations of those
columns load as one tile. The step's group takes its scale and zero (and the widening's offset, through the
tokens' activation sums) after the dots, or (``scaled``) before them, by a packed subtraction and multiplication
of each pair in the same PTX (``(u - zero) * scale`` rounded once, as ``kernels/packed_int_dequant.py``'s
``dequantize`` rounds), the dots then accumulating across steps. Split-K where the weight's row tiles leave the
SMs short of programs. SASS of the loop for sm_90 (128 weight rows by 16 tokens a panel, Triton 3.9): 421
instructions (scaled: 438) against ``int_mma``'s 661 (per-slot dots) and 769 (whole panels). A form with one dot
of 128 columns a panel (the widened tile through shared memory) lost to this one at every shape at 16 and 32 rows
on an H200 and was removed (commit ``178d66b`` has it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.packed_int import (PANEL_WORDS, _group_scale_zero, _partials, _split, _store_or_reduce,
                                        prefetch_args, widening)
from treadle.kernels.small_batch import _arrivals, _prefetch_share

PANEL = PANEL_WORDS * 8  # 4-bit values per panel


@dataclass(frozen=True)
class MagicMmaTiles:
    """One :func:`magic_mma` launch: ``block_m`` tokens (16, 32 or 64) by ``block_n`` weight rows a tile, one panel
    a K step, ``split_k`` K ranges; ``asm``: the widening in inline PTX (else the same values from plain ops);
    ``scaled``: the values become ``(u - zero) * scale`` before the dots (two more packed instructions a pair), which
    then accumulate across steps, instead of taking the step's scale after them."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True
    scaled: bool = False

    def fits(self, k: int, bits: int, group: int) -> bool:
        """Whether this launch tiles a K of ``k`` of ``bits``-bit values in groups of ``group``."""
        return bits == 4 and group % PANEL == 0 and k % (PANEL * self.split_k) == 0


def magic_mma(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
              group: int, tiles: MagicMmaTiles, prefetch: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T`` (4-bit, 16-bit activations) on the tensor cores, the weight tile widened
    by pairs (module docstring); ``prefetch`` as :func:`~treadle.kernels.packed_int.int_gemv`'s."""
    rows, k = x.shape
    n = weight.shape[0]
    i16, magic, offset = widening(bits, x.dtype)
    if not i16 or not tiles.fits(k, bits, group):
        raise ValueError(f"{tiles} does not run K={k} of {bits}-bit values in groups of {group} on {x.dtype}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(rows, tiles.block_m), tiles.split_k)
    _magic_mma_kernel[grid](
        x, weight, scales, zeros if zeros is not None else scales, out, _partials(tiles.split_k, rows, n, x.device),
        _arrivals(x.device, grid[0] * grid[1]), rows, n, k // tiles.split_k, x.stride(0), weight.stride(0),
        scales.stride(0), out.stride(0), GROUP=group, HAS_ZEROS=zeros is not None, SPLIT_K=tiles.split_k,
        MAGIC16=magic, OFFSET16=offset, ASM=tiles.asm, SCALED=tiles.scaled, BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, **prefetch_args(prefetch, grid[0] * grid[1] * grid[2], weight),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages)
    return out


def magic_load_candidates(n: int, k: int, bits: int, group: int, rows: int, sm_count: int) -> list[MagicMmaTiles]:
    """:func:`magic_mma`'s launches the loader times for a batch of about ``rows`` (``kernels/packed_int_mma.py``'s
    ``load_candidates`` lists them first): its values widened by pairs in inline PTX and scaled before four dots a
    panel (the round-1 sweep's best form, or within 0.1 us of it, at every shape, 16 and 32 rows), 128 weight rows a
    tile; at 16 rows split-K for two programs per SM on 4 or 8 warps (the first within 1.2 us of each shape's best
    on an H200), and the same scaled after the dots (down_proj's best); at 32 rows split-K for two or one program
    per SM, and 64-row tiles (qkv's second); at 64 rows (not swept) the like on a 64-token tile."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    steps = k // PANEL

    def tiles(block_n: int, programs: int, warps: int = 4, scaled: bool = True) -> MagicMmaTiles:
        return MagicMmaTiles(block_m, block_n, _split(n, steps, block_n, 1, programs * sm_count), warps,
                             scaled=scaled)

    if rows <= 16:
        listed = [tiles(128, 2), tiles(128, 2, 8), tiles(128, 2, 8, scaled=False)]
    elif rows <= 32:
        listed = [tiles(128, 2), tiles(128, 1), tiles(64, 1)]
    else:
        listed = [tiles(128, 2), tiles(128, 1), tiles(128, 2, 8)]
    return [t for t in dict.fromkeys(listed) if t.fits(k, bits, group)]


def mma_trials(n: int, k: int, rows: int, sm_count: int) -> list[MagicMmaTiles]:
    """The :func:`magic_mma` launches the sweep times for ``rows`` tokens (1 to 64): the narrowest token tile that
    holds them, weight tiles of 64 or 128 rows (4 or 8 warps), split-K for one or two programs per SM; scaled after
    the dots or before them; the first with the plain-op widening too."""
    block_m = 16 if rows <= 16 else 32 if rows <= 32 else 64
    steps, listed = k // PANEL, []
    for block_n, warps in ((64, 4), (128, 4), (128, 8)):
        for programs in (1, 2):
            split = _split(n, steps, block_n, 1, programs * sm_count)  # K ranges of whole panels
            listed += [MagicMmaTiles(block_m, block_n, split, warps, scaled=scaled) for scaled in (False, True)]
    # A control: the first launch with the plain-op widening (the inline PTX's gain, and a fallback).
    listed.append(dataclasses.replace(listed[0], asm=False))
    return [t for t in dict.fromkeys(listed) if t.fits(k, 4, 128)]


@triton.jit
def _value(words, J: tl.constexpr, zero, scale, MAGIC16: tl.constexpr, SCALED: tl.constexpr, dtype: tl.constexpr):
    """The plain-op twin of one value of the inline PTX: ``(u - zero) * scale`` rounded once, or ``OFFSET16 + u``."""
    u = (words >> (4 * J)) & 15
    if SCALED:
        return ((u.to(tl.float32) - zero[:, None]) * scale[:, None]).to(dtype)
    return (u | MAGIC16).to(tl.int16).to(dtype, bitcast=True)


# One pair of a shifted word ($1): & 0x000F000F | magic; scaled, then minus (magic + zero) ($3), times scale ($5).
def _pair_asm(magic: int, scaled: str = "") -> str:
    lop3 = f"0x000F000F, {magic * 0x10001:#x}, 0xEA;"
    if not scaled:
        return "lop3.b32 $0, $1, " + lop3
    return f"{{ .reg .b32 t; lop3.b32 t, $1, {lop3} sub.rn.{scaled} t, t, $3; mul.rn.{scaled} $0, t, $5; }}"


_PAIR_BF16 = tl.constexpr(_pair_asm(0x4300))
_PAIR_FP16 = tl.constexpr(_pair_asm(0x6400))
_SCALED_PAIR_BF16 = tl.constexpr(_pair_asm(0x4300, "bf16x2"))
_SCALED_PAIR_FP16 = tl.constexpr(_pair_asm(0x6400, "f16x2"))


@triton.jit
def scaled_pair(twice, zero, scale, MAGIC16: tl.constexpr, dtype: tl.constexpr):
    """``(u - zero) * scale`` in ``dtype`` (rounded once) of the 4-bit values in bits 0-3 and 16-19 of each register
    of ``twice`` (``[BLOCK_N, ..., 2]``, the same register twice: pack=2 takes both operands of an instance from one),
    by the inline PTX; ``zero`` and ``scale`` float32 per row."""
    zero2 = ((zero.to(tl.int32) | MAGIC16) * 0x10001)[:, None, None] + tl.zeros_like(twice)
    bits = scale.to(dtype).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    scale2 = (bits * 0x10001)[:, None, None] + tl.zeros_like(twice)
    if MAGIC16 == 0x4300:
        pair = tl.inline_asm_elementwise(_SCALED_PAIR_BF16, "=r,r,r,r,r,r,r", [twice, zero2, scale2],
                                         dtype=tl.bfloat16, is_pure=True, pack=2)
    else:
        pair = tl.inline_asm_elementwise(_SCALED_PAIR_FP16, "=r,r,r,r,r,r,r", [twice, zero2, scale2],
                                         dtype=tl.float16, is_pure=True, pack=2)
    return pair


@triton.jit
def _pair(words, zero, scale, P: tl.constexpr, MAGIC16: tl.constexpr, ASM: tl.constexpr, SCALED: tl.constexpr,
          dtype: tl.constexpr):
    """``[BLOCK_N, 16, 2]``: values ``P`` and ``P + 4`` of each word widened to ``dtype``, ``OFFSET16 + u``
    (``SCALED``: ``(u - zero) * scale``, ``zero`` and ``scale`` float32 per row), the two halves of one register
    from one lop3 of the word shifted (and a subtraction and a multiplication of both halves at once), for a dot
    over their 32 columns (``16 * (P + 4h) + c`` at ``[c, h]``)."""
    if ASM:
        twice = tl.join(words >> (4 * P), words >> (4 * P))  # pack=2: both operands of an instance, one word
        if SCALED:
            pair = scaled_pair(twice, zero, scale, MAGIC16, dtype)
        elif MAGIC16 == 0x4300:
            pair = tl.inline_asm_elementwise(_PAIR_BF16, "=r,r,r", [twice], dtype=tl.bfloat16, is_pure=True, pack=2)
        else:
            pair = tl.inline_asm_elementwise(_PAIR_FP16, "=r,r,r", [twice], dtype=tl.float16, is_pure=True, pack=2)
    else:
        pair = tl.join(_value(words, P, zero, scale, MAGIC16, SCALED, dtype),
                       _value(words, P + 4, zero, scale, MAGIC16, SCALED, dtype))
    return pair


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _magic_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, arrivals_ptr, M, N, k_per_split, stride_xm,
                      stride_wn, stride_sn, stride_om, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                      SPLIT_K: tl.constexpr, MAGIC16: tl.constexpr, OFFSET16: tl.constexpr, ASM: tl.constexpr,
                      SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, prefetch_ptr,
                      prefetch_lines, first_prefetcher, PREFETCH: tl.constexpr, PREFETCH_BLOCK: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_tile = w_ptr + offs_n[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    # [16, 2, BLOCK_M] activations of pair p's columns (16 * (p + 4h) + c at [c, h]).
    x_pair = (x_ptr + offs_m[None, None, :] * stride_xm + tl.arange(0, 16)[:, None, None]
              + 64 * tl.arange(0, 2)[None, :, None])
    for k0 in range(k_begin, k_begin + k_per_split, 128):
        words = tl.load(w_tile + k0 // 8, mask=n_mask[:, None], other=0, eviction_policy="evict_first")
        s, zero = _group_scale_zero(s_ptr, z_ptr, offs_n, n_mask, k0 // GROUP, stride_sn, 4, HAS_ZEROS,
                                    0.0 if SCALED else OFFSET16, BLOCK_N)
        # Four dots of 32 columns, one a pair: the widened operand stays in registers (Hopper's wgmma reads its
        # first operand from there), the dots chain without waiting.
        if SCALED:  # the values dequantized before the dots, which accumulate
            for p in tl.static_range(4):
                x = tl.reshape(tl.load(x_pair + k0 + 16 * p, mask=m_mask[None, None, :], other=0), [32, BLOCK_M])
                w = tl.reshape(_pair(words, zero, s, p, MAGIC16, ASM, True, x.dtype), [BLOCK_N, 32])
                acc = tl.dot(w, x, acc)
        else:  # the step's scale and zero (and the widening's offset) after the dots
            part = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            x_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
            for p in tl.static_range(4):
                x = tl.reshape(tl.load(x_pair + k0 + 16 * p, mask=m_mask[None, None, :], other=0), [32, BLOCK_M])
                w = tl.reshape(_pair(words, zero, s, p, MAGIC16, ASM, False, x.dtype), [BLOCK_N, 32])
                part = tl.dot(w, x, part)
                x_sum += tl.sum(x.to(tl.float32), axis=0)
            acc += s[:, None] * (part - zero[:, None] * x_sum[None, :])
    tile = offs_m[None, :] * stride_om + offs_n[:, None]
    _store_or_reduce(acc, out_ptr + tile, partials_ptr + offs_m[None, :] * N + offs_n[:, None], M * N,
                     arrivals_ptr + pid_m * tl.num_programs(0) + pid_n, n_mask[:, None] & m_mask[None, :], pid_k,
                     SPLIT_K)
    if PREFETCH:  # the next weight's head into L2 as the last programs finish (kernels/packed_int.py's GEMV too)
        _prefetch_share(prefetch_ptr, prefetch_lines, first_prefetcher, PREFETCH_BLOCK)
