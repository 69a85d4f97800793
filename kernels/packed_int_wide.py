"""A W4A16 tensor-core kernel for 65 to ``WIDE_MAX_ROWS`` tokens that never writes a 16-bit weight: what
``kernels/int_kernel_plan.py`` races at load against ``dequantize_linear`` (the weight dequantized into a buffer,
then the library matmul) per row bucket above 64 (128, 256, 512, 1024).

:func:`wide_mma` is ``kernels/packed_int_natural.py``'s ``natural_mma`` (same widening, ``_panel``: each panel of
128 values a weight row becomes the wgmma's first operand straight from registers, rounded as ``dequantize``
rounds) with 128 tokens a tile (the wgmma's N) instead of 16 to 64, so that one widening feeds eight times the
multiply-adds of a 16-token tile and the kernel is bound by the tensor cores, not by the widening. 128 weight
rows a warp group: one warp group (4 warps, 128 rows) or two (8 warps, 256 rows) a program. The accumulator is
128 float32 registers a thread; 256 tokens a tile would be 256 and spill (sm_90 SASS, ``python -m
treadle.bench.mma_sass``), so wider batches are more token tiles. Program order: a program's token tile varies
fastest, so the programs that run at once share their weight tiles (one read from memory, the other token tiles'
from L2) and the activations (at most 8 MB at 1024 tokens) stay in L2. Split-K (``natural_mma``'s sum of the
partials) only where the tiles leave the SMs short of programs (o_proj and down_proj at 128 tokens).

The other orientation (``WideMmaTiles.tokens_m``) is raced too: the tokens the wgmma's M (two warp groups of 64)
read from shared memory as the pipeline copied them, the widened panel stored to shared memory (STS) as the
second operand, each step's wgmmas waited for before the next panel overwrites it. 64 accumulator registers a
thread instead of 128, so with 128 registers a thread (no spills) and two pipeline stages two programs of eight
warps fit an SM, and one's widening runs while the other's wgmmas do; the widening is shared by 128 tokens as in
the register orientation, the store and the wait per step are its cost.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.packed_int import _partials, widening
from treadle.kernels.packed_int_natural import PANEL, NaturalMmaTiles, _panel, _scale_zero, _sum_or_store
from treadle.kernels.pdl import allow_next, wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.small_batch import _arrivals

# The most rows a wide_mma launch is timed for (the loader's last row bucket); larger batches (prefill chunks)
# run dequantize_linear.
WIDE_MAX_ROWS = 1024
# The row buckets above 64 the loader times, each against dequantize_linear.
WIDE_BUCKETS = (128, 256, 512, WIDE_MAX_ROWS)


@dataclass(frozen=True)
class WideMmaTiles:
    """One :func:`wide_mma` launch: ``block_m`` tokens (64 or 128) by ``block_n`` weight rows (128 a warp group)
    a tile, one panel a K step, ``split_k`` K ranges, ``num_stages`` pipeline stages of the packed words and
    activations (three: two programs of one warp group an SM in 227 KB of shared memory); ``asm`` as
    ``NaturalMmaTiles.asm``; ``tokens_m``: the other orientation (the tokens the wgmma's M, 64 a warp group, from
    shared memory; the widened panel stored to shared memory as its second operand); ``max_registers`` a thread
    (0: the compiler's choice)."""

    block_m: int
    block_n: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    asm: bool = True
    tokens_m: bool = False
    max_registers: int = 0

    fits = NaturalMmaTiles.fits  # the same K steps and sum of the partials as natural_mma's
    sum_chunk = NaturalMmaTiles.sum_chunk


def wide_mma(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int,
             group: int, tiles: WideMmaTiles) -> torch.Tensor:
    """``x [M, K] @ dequantized(weight).T`` (4-bit, 16-bit activations) on the tensor cores, the weight widened in
    registers tile by tile (module docstring)."""
    rows, k = x.shape
    n = weight.shape[0]
    i16, magic, _ = widening(bits, x.dtype)
    if not i16 or not tiles.fits(k, bits, group):
        raise ValueError(f"{tiles} does not run K={k} of {bits}-bit values in groups of {group} on {x.dtype}")
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    n_tiles, m_tiles = triton.cdiv(n, tiles.block_n), triton.cdiv(rows, tiles.block_m)
    pdl = pdl_enabled(x.device)
    _wide_mma_kernel[(n_tiles * m_tiles, tiles.split_k)](
        x, weight, scales, zeros if zeros is not None else scales, out, _partials(tiles.split_k, rows, n, x.device),
        _arrivals(x.device, n_tiles * m_tiles), rows, n, k // tiles.split_k, x.stride(0), weight.stride(0),
        scales.stride(0), out.stride(0), GROUP=group, HAS_ZEROS=zeros is not None, SPLIT_K=tiles.split_k,
        SUM_CHUNK=tiles.sum_chunk(), MAGIC16=magic, ASM=tiles.asm, EVEN_N=n % tiles.block_n == 0,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PDL=pdl, TOKENS_M=tiles.tokens_m, launch_pdl=pdl,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        **({"maxnreg": tiles.max_registers} if tiles.max_registers else {}))
    return out


def wide_candidates(n: int, k: int, bits: int, group: int, rows: int, sm_count: int) -> list[WideMmaTiles]:
    """The :func:`wide_mma` launches the loader times for a batch of about ``rows`` (above 64): 128 tokens by 128
    weight rows on one warp group (two programs an SM), then by 256 rows on two (one an SM, half the activation
    reads per weight byte), then the other orientation, 128 tokens (two warp groups of 64) by 128 rows, two pipeline
    stages and 128 registers a thread (two programs an SM: one's widening runs while the other's wgmmas do; sm_90
    SASS: no spills); each with split-K where the tiles are fewer than the programs the SMs hold, the first also
    with half as many K ranges (the partials cost memory traffic: a part-empty wave may be cheaper)."""
    listed = []
    for block_n, warps, per_sm, tokens_m in ((128, 4, 2, False), (256, 8, 1, False), (128, 8, 2, True)):
        tiles = triton.cdiv(n, block_n) * triton.cdiv(rows, 128)
        split = _wide_split(tiles, k // PANEL, per_sm * sm_count)
        listed.append(WideMmaTiles(128, block_n, split, warps, 2 if tokens_m else 3, tokens_m=tokens_m,
                                   max_registers=128 if tokens_m else 0))
    if listed[0].split_k > 1:
        listed.append(dataclasses.replace(listed[0], split_k=listed[0].split_k // 2))
    return [t for t in dict.fromkeys(listed) if t.fits(k, bits, group)]


def _wide_split(tiles: int, steps: int, programs: int) -> int:
    """K ranges (a power of two up to 8, each at least four whole steps): doubled while the ``tiles`` times them
    still fit in the ``programs`` the SMs hold at once (a second, partial wave costs more than a split saves)."""
    split = 1
    while tiles * split * 2 <= programs and split < 8 and steps % (2 * split) == 0 and steps // (2 * split) >= 4:
        split *= 2
    return split


@triton.jit(do_not_specialize=["M"])  # one compile for every batch size
def _wide_mma_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, partials_ptr, arrivals_ptr, M, N, k_per_split,
                     stride_xm, stride_wn, stride_sn, stride_om, GROUP: tl.constexpr, HAS_ZEROS: tl.constexpr,
                     SPLIT_K: tl.constexpr, SUM_CHUNK: tl.constexpr, MAGIC16: tl.constexpr, ASM: tl.constexpr,
                     EVEN_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
                     TOKENS_M: tl.constexpr):
    m_tiles = tl.cdiv(M, BLOCK_M)
    pid_m = tl.program_id(0) % m_tiles  # the token tile fastest: programs running at once share weight tiles
    pid_n = tl.program_id(0) // m_tiles
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    w_tile = w_ptr + offs_n[:, None] * stride_wn + tl.arange(0, 16)[None, :]
    if TOKENS_M:
        x_panel = x_ptr + offs_m[:, None] * stride_xm + tl.arange(0, 128)[None, :]  # [BLOCK_M, 128]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        x_panel = x_ptr + offs_m[None, :] * stride_xm + tl.arange(0, 128)[:, None]  # [128, BLOCK_M]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    k_begin = pid_k * k_per_split
    k_end = k_begin + k_per_split
    s_next, zero_next = _scale_zero(s_ptr, z_ptr, offs_n, n_mask, k_begin // GROUP, stride_sn, HAS_ZEROS, EVEN_N,
                                    BLOCK_N)
    wait_for_previous(PDL)  # the activations are the kernel before's output
    for k0 in range(k_begin, k_end, 128):
        panel = w_tile + tl.multiple_of(k0 // 8, 16)
        if EVEN_N:
            words = tl.load(panel)
        else:
            words = tl.load(panel, mask=n_mask[:, None], other=0)
        s, zero = s_next, zero_next
        s_next, zero_next = _scale_zero(s_ptr, z_ptr, offs_n, n_mask, tl.minimum(k0 + 128, k_end - 128) // GROUP,
                                        stride_sn, HAS_ZEROS, EVEN_N, BLOCK_N)
        if TOKENS_M:
            x = tl.load(x_panel + k0, mask=m_mask[:, None], other=0)
            acc = tl.dot(x, tl.trans(_panel(words, zero, s, MAGIC16, ASM, x.dtype, BLOCK_N)), acc)
        else:
            x = tl.load(x_panel + k0, mask=m_mask[None, :], other=0)
            acc = tl.dot(_panel(words, zero, s, MAGIC16, ASM, x.dtype, BLOCK_N), x, acc)
    allow_next(PDL)
    if TOKENS_M:
        tile = offs_m[:, None] * stride_om + offs_n[None, :]
        mask = m_mask[:, None] & n_mask[None, :]
        _sum_or_store(acc, out_ptr + tile, partials_ptr + offs_m[:, None] * N + offs_n[None, :], M * N,
                      arrivals_ptr + tl.program_id(0), mask, pid_k, SPLIT_K, SUM_CHUNK)
    else:
        tile = offs_m[None, :] * stride_om + offs_n[:, None]
        mask = n_mask[:, None] & m_mask[None, :]
        _sum_or_store(acc, out_ptr + tile, partials_ptr + offs_m[None, :] * N + offs_n[:, None], M * N,
                      arrivals_ptr + tl.program_id(0), mask, pid_k, SPLIT_K, SUM_CHUNK)
