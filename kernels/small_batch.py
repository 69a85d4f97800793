"""Triton matmul for decode-sized batches: ``y = x @ (weight * scale).T`` streaming the weight once.

A batch of a few tokens is bound by reading the weight, not by arithmetic, and cuBLAS leaves bandwidth unused
on some of the shapes decode runs (narrow outputs fill one or two waves of SMs). This kernel reads the weight
[N, K] in tiles of ``block_n`` rows, optionally splits K into ``split_k`` ranges (float32 partials that the
last of a tile's programs to finish sums, so narrow shapes fill the SMs in one kernel), and for one row of ``x``
has a GEMV form without ``tl.dot`` (which would pad the row to 16). The weight is 16-bit (the model dtype) or
FP8 with a float32 scale per output row, widened in registers; activations stay 16-bit. ``small_batch.py``
times the configs per weight shape at load and keeps the fastest (or the library matmul when it wins). FP8
layers use it up to 32 rows, 16-bit layers too wherever it times faster than cuBLAS at load.

Given the head of the next layer's weight (``prefetch``), the kernel's last programs ask L2 for it as they finish,
so the memory works through the gap between the two kernels (``small_batch.chain_l2_prefetch``). The GEMV and
the 16-bit tiles are launched with programmatic dependent launch on Hopper (``kernels/pdl.py``): while the kernel
before finishes, the GEMV loads its first weight block and a tile asks L2 for its first two; each lets the next
kernel start once its own weight loop is done. The K loops are kernels/small_batch_loops.py.

Given a LoRA shrink (``beside``, kernels/lora_gather.py), extra programs placed first in the grid run it on the same
``x`` (kernels/lora_fused.py: a layer's LoRA in two launches); without one the kernel compiles as before.

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from treadle.kernels.pdl import allow_next, wait_for_previous
from treadle.kernels.pdl import enabled as pdl_enabled
from treadle.kernels.fp8_ops import quantize_per_token
from treadle.kernels.fused import rmsnorm_row, rounded_add
from treadle.kernels.lora_gather import GemvShrink, gather_shrink_program
from treadle.kernels.small_batch_loops import _gate_up_row, _gate_up_rows, _prefetch_tile_head, _row, _rows


@triton.jit
def _small_batch_kernel(X, W, Scale, Y, Partials, Arrivals, Residual, Norm_weight, Normed, Residual_out, eps,
                        M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        SPLIT_K: tl.constexpr, GEMV: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN: tl.constexpr,
                        Prefetch, prefetch_lines, first_prefetcher,
                        SILU_MUL: tl.constexpr, EVICT_ROWS: tl.constexpr, ADD_RMSNORM: tl.constexpr,
                        BLOCK_ROW: tl.constexpr, PREFETCH: tl.constexpr, PREFETCH_BLOCK: tl.constexpr,
                        X_scale, W8A8: tl.constexpr, PDL: tl.constexpr,
                        La, Lids, Lscalings, Lranks, Lpartials, l_rank_dim, l_rows, l_proj_stride, l_stride_as,
                        l_stride_ar, l_stride_ak, l_stride_hs, l_stride_hm, l_k_per_split, l_columns, l_programs,
                        l_r_blocks, l_slices, LORA: tl.constexpr, L_BLOCK_R: tl.constexpr, L_BLOCK_K: tl.constexpr,
                        L_AHEAD: tl.constexpr):
    if LORA:
        # The first l_columns programs of every (row block, split) run a LoRA shrink beside the matmul
        # (lora_gather.py): low program ids, so they run with the matmul's first wave. They wait (PDL) before reading
        # x, as the matmul's programs do, and let the next kernel start by exiting. The matmul's programs keep
        # their indices and their tile counters (counted over the matmul's columns, not the grid's).
        if tl.program_id(0) < l_columns:
            shrink = tl.program_id(0) + l_columns * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
            if shrink < l_programs:
                per_token = l_r_blocks * l_slices
                gather_shrink_program((shrink // per_token).to(tl.int64), shrink % per_token // l_slices,
                                      shrink % l_slices, X, La, Lids, Lscalings, Lranks, Lpartials, K, l_rank_dim,
                                      l_rows, l_proj_stride, stride_xm, 1, l_stride_as, l_stride_ar, l_stride_ak,
                                      l_stride_hs, l_stride_hm, l_k_per_split, L_BLOCK_R, L_BLOCK_K, False, PDL,
                                      False, L_AHEAD)
        else:
            _matmul_program(l_columns, X, W, Scale, Y,
                            Partials, Arrivals, Residual, Norm_weight, Normed, Residual_out, eps, M, N, K, k_per_split,
                            stride_xm, stride_wn, stride_ym, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GEMV, HAS_SCALE, EVEN,
                            SILU_MUL, EVICT_ROWS, ADD_RMSNORM, BLOCK_ROW, X_scale, W8A8, PDL)
    else:
        _matmul_program(0, X, W, Scale, Y, Partials, Arrivals, Residual,
                        Norm_weight, Normed, Residual_out, eps, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                        BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K, GEMV, HAS_SCALE, EVEN, SILU_MUL, EVICT_ROWS, ADD_RMSNORM,
                        BLOCK_ROW, X_scale, W8A8, PDL)
    if PREFETCH:
        _prefetch_share(Prefetch, prefetch_lines, first_prefetcher, PREFETCH_BLOCK)


@triton.jit
def _matmul_program(columns_before, X, W, Scale, Y, Partials, Arrivals, Residual, Norm_weight, Normed,
                    Residual_out, eps, M, N, K, k_per_split, stride_xm, stride_wn, stride_ym,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    SPLIT_K: tl.constexpr, GEMV: tl.constexpr, HAS_SCALE: tl.constexpr, EVEN: tl.constexpr,
                    SILU_MUL: tl.constexpr, EVICT_ROWS: tl.constexpr, ADD_RMSNORM: tl.constexpr,
                    BLOCK_ROW: tl.constexpr, X_scale, W8A8: tl.constexpr, PDL: tl.constexpr):
    """The matmul's program: output columns ``program_id(0) - columns_before`` (the programs before run
    something else), rows ``program_id(1)``, split ``program_id(2)``."""
    pid_n = tl.program_id(0) - columns_before
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    # Each split's range is a multiple of BLOCK_K, so masking against K alone never reads the next split.
    k_start = pid_k * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if not GEMV:
        # Launched with PDL, the tile asks L2 for its first weight blocks while the kernel before it finishes.
        if PDL:
            _prefetch_tile_head(W, offs_n, n_mask, k_start, k_end, stride_wn, BLOCK_K)
            if SILU_MUL:
                _prefetch_tile_head(W + N.to(tl.int64) * stride_wn, offs_n, n_mask, k_start, k_end, stride_wn,
                                    BLOCK_K)
        wait_for_previous(PDL)
    if SILU_MUL:
        if GEMV:
            gate, up = _gate_up_row(X + pid_m.to(tl.int64) * stride_xm, W, offs_n, n_mask, k_start, k_end, K, N,
                                    stride_wn, BLOCK_N, BLOCK_K, EVEN, PDL)
            gate, up = gate[None, :], up[None, :]
        else:
            gate, up = _gate_up_rows(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, N, stride_xm, stride_wn,
                                     BLOCK_M, BLOCK_N, BLOCK_K, EVICT_ROWS)
            allow_next(PDL)
        if W8A8:
            row_scale = tl.load(X_scale + offs_m, mask=m_mask, other=0.0)[:, None]
            gate, up = gate * row_scale, up * row_scale
        _store_silu_mul(Y, Scale, gate, up, offs_m, offs_n, m_mask, n_mask, N, stride_ym, HAS_SCALE)
    else:
        if GEMV:
            acc = _row(X + pid_m.to(tl.int64) * stride_xm, W, offs_n, n_mask, k_start, k_end, K, stride_wn,
                       BLOCK_N, BLOCK_K, EVEN, PDL)[None, :]
        else:
            acc = _rows(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, stride_xm, stride_wn,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVICT_ROWS)
            allow_next(PDL)
        tile_mask = m_mask[:, None] & n_mask[None, :]
        if W8A8:  # the FP8 rows' own scales; a split's partial is scaled alike, so the sum needs nothing more
            acc = acc * tl.load(X_scale + offs_m, mask=m_mask, other=0.0)[:, None]
        if SPLIT_K > 1:
            # Every split stores its float32 partial tile [SPLIT_K, M, N] and counts itself in; the last of the
            # tile's splits to arrive sums them (the release/acquire of the count makes the others' stores
            # visible), so no second kernel is launched. It resets the count for the next call.
            tile_offs = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(Partials + pid_k * M * N + tile_offs, acc, mask=tile_mask)
            arrival = Arrivals + pid_m * (tl.num_programs(0) - columns_before) + pid_n
            if tl.atomic_add(arrival, 1, sem="acq_rel") == SPLIT_K - 1:
                acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for split in tl.static_range(SPLIT_K):
                    acc += tl.load(Partials + split * M * N + tile_offs, mask=tile_mask, other=0.0,
                                   cache_modifier=".cg")
                tl.atomic_xchg(arrival, 0, sem="relaxed")
                _store_tile(Y, Scale, acc, offs_m, offs_n, n_mask, tile_mask, stride_ym, HAS_SCALE)
                if ADD_RMSNORM:
                    _add_rmsnorm_when_last(Y, Arrivals, Residual, Norm_weight, Normed, Residual_out, eps, N,
                                           BLOCK_ROW, columns_before)
        else:
            _store_tile(Y, Scale, acc, offs_m, offs_n, n_mask, tile_mask, stride_ym, HAS_SCALE)
            if ADD_RMSNORM:
                _add_rmsnorm_when_last(Y, Arrivals, Residual, Norm_weight, Normed, Residual_out, eps, N, BLOCK_ROW,
                                       columns_before)


@triton.jit
def _prefetch_share(Prefetch, lines, first_prefetcher, BLOCK: tl.constexpr):
    """Programs from ``first_prefetcher`` on (in launch order) each ask L2 for their share of the ``lines``
    128-byte lines at ``Prefetch`` (the next layer's weight) as they finish: the memory that this kernel's
    last programs and the next launch leave idle fetches what the next kernel reads first."""
    program = tl.program_id(0) + tl.num_programs(0) * (tl.program_id(1) + tl.num_programs(1) * tl.program_id(2))
    me = program - first_prefetcher
    if me >= 0:
        programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        per = tl.cdiv(lines, programs - first_prefetcher)
        start = me * per
        end = tl.minimum(start + per, lines)
        for first in range(start, end, BLOCK):
            line = tl.minimum(first + tl.arange(0, BLOCK), end - 1)
            tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l",
                                      [Prefetch + line.to(tl.int64) * 128], dtype=tl.int32, is_pure=False,
                                      pack=1)


@triton.jit
def _add_rmsnorm_when_last(Y, Arrivals, Residual, Norm_weight, Normed, Residual_out, eps, N,
                           BLOCK_ROW: tl.constexpr, columns_before=0):
    """For one row of output: the program that stores its last tile (counted on the counter after the tiles', the
    grid's columns from ``columns_before`` on) computes ``residual_out = y + residual`` and ``normed = rmsnorm(residual_out) * weight``, rounded as
    ``fused_ops.add_rmsnorm`` rounds them, so the layer's next norm needs no kernel of its own."""
    tl.debug_barrier()  # every thread's part of the tile is stored before the count releases it
    tiles = tl.num_programs(0) - columns_before
    done = Arrivals + tiles
    if tl.atomic_add(done, 1, sem="acq_rel") == tiles - 1:
        cols = tl.arange(0, BLOCK_ROW)
        mask = cols < N
        weight = tl.load(Norm_weight + cols, mask=mask, other=0.0)
        residual = tl.load(Residual + cols, mask=mask, other=0.0)
        y = tl.load(Y + cols, mask=mask, other=0.0, cache_modifier=".cg")  # the other programs' stores, in L2
        x = rounded_add(y, residual)
        tl.store(Residual_out + cols, x, mask=mask)
        tl.store(Normed + cols, rmsnorm_row(x, weight, N, eps), mask=mask)
        tl.atomic_xchg(done, 0, sem="relaxed")


@triton.jit
def _store_silu_mul(Y, Scale, gate, up, offs_m, offs_n, m_mask, n_mask, N, stride_ym, HAS_SCALE: tl.constexpr):
    """Stores ``silu(gate) * up`` for the rows ``offs_m`` and columns ``offs_n`` of a weight ``[gate | up]`` of 2N
    rows (``gate`` and ``up`` the float32 products with its two halves)."""
    if HAS_SCALE:
        gate = gate * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[None, :]
        up = up * tl.load(Scale + N + offs_n, mask=n_mask, other=0.0)[None, :]
    # Rounded where the separate matmul and silu_mul kernels round, so the result is the same.
    dtype = Y.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype)
    out = (silu.to(tl.float32) * up.to(dtype).to(tl.float32)).to(dtype)
    tl.store(Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :], out,
             mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _store_tile(Y, Scale, acc, offs_m, offs_n, n_mask, tile_mask, stride_ym, HAS_SCALE: tl.constexpr):
    if HAS_SCALE:
        acc = acc * tl.load(Scale + offs_n, mask=n_mask, other=0.0)[None, :]
    y_ptrs = Y + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
    tl.store(y_ptrs, acc.to(Y.dtype.element_ty), mask=tile_mask)


def fuses_silu_mul(config: SmallBatchConfig) -> bool:
    """Whether ``config`` can compute a gated MLP's ``silu(gate) * up`` in its kernel: no split-K, and a
    ``tl.dot`` tile that still has 16 columns of each half."""
    return config.split_k == 1 and (config.gemv or config.block_n >= 32)


class SmallBatchConfig(NamedTuple):
    """One launch config of :func:`small_batch_matmul`.

    ``split_k`` > 1 splits K into that many contiguous ranges (each a multiple of ``block_k``) reduced by
    separate programs into float32 partials, which the last of them to finish sums, scales and casts; 1 has
    no partials. ``gemv`` runs each row of ``x`` without ``tl.dot`` (weights widened to float32, products summed
    along K), one program per row and tile: meant for one row, as more rows read each weight tile once per row.
    Other configs use ``tl.dot`` (16 rows of ``x`` per program, 32 for batches of 17 to 32). ``w8a8`` (FP8 weights
    only): ``x`` is quantized per token to FP8 first (one more launch) and the tiles multiply FP8 by FP8 on 64-row
    tiles, with both scales applied to the float32 result; the others widen an FP8 weight to 16 bits.
    """

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    gemv: bool = False
    w8a8: bool = False

    def __str__(self) -> str:
        label = f"{self.block_n}/{self.block_k}/{self.num_warps}/{self.num_stages}"
        if self.split_k > 1:
            label += f" split-k {self.split_k}"
        return label + (" gemv" if self.gemv else "") + (" w8a8" if self.w8a8 else "")


# Tried at load per weight shape (small_batch.py). On an H100 the GEMVs win at one row for Llama-3.1-8B's FP8
# projections (docs/lab/benchmarks-history.md, FP8: tiles of 4-8 rows x 1-2k columns, split-K 2 for the 14336-wide
# down_proj); at 2-32 rows the W8A8 tiles win for qkv, o_proj and gate_up (64 x 256, 32 x 512, 128 x 256) and
# split-K tiles that widen the weight for down_proj (32 x 256 split-K 4 at 16 rows, 64 x 128 split-K 4 at 32).
FP8_CONFIGS = (
    SmallBatchConfig(32, 256, 4, 3, split_k=4),
    SmallBatchConfig(32, 256, 4, 4),
    SmallBatchConfig(64, 128, 4, 4, split_k=4),
    SmallBatchConfig(64, 128, 4, 3, split_k=8),
    SmallBatchConfig(32, 512, 4, 3, split_k=2),
    SmallBatchConfig(64, 256, 4, 4, w8a8=True),
    SmallBatchConfig(32, 512, 4, 4, w8a8=True),
    SmallBatchConfig(128, 256, 4, 4, w8a8=True),
    SmallBatchConfig(4, 2048, 4, 3, gemv=True),
    SmallBatchConfig(8, 2048, 8, 4, gemv=True),
    SmallBatchConfig(8, 1024, 4, 4, gemv=True),
    SmallBatchConfig(8, 1024, 4, 4, split_k=2, gemv=True),
    SmallBatchConfig(16, 512, 4, 4, split_k=4, gemv=True),
)

# 16-bit weights: tl.dot tiles with half the elements of FP8's, so each load moves as many bytes, the two that
# read Llama-3.1-8B's gate_up and down_proj faster than cuBLAS at 32 rows on an H100 (128 x 128 and 32 x 256 tiles,
# docs/lab/benchmarks-history.md), and the one-row GEMVs, which read 16 KB tiles of 4 rows (10% faster than cuBLAS per
# layer).
SIXTEEN_BIT_CONFIGS = (
    SmallBatchConfig(32, 128, 4, 4, split_k=4),
    SmallBatchConfig(32, 128, 4, 4),
    SmallBatchConfig(128, 128, 4, 4),
    SmallBatchConfig(32, 256, 4, 4),
    SmallBatchConfig(64, 64, 4, 4, split_k=8),
    SmallBatchConfig(32, 256, 4, 3, split_k=2),
    SmallBatchConfig(4, 2048, 8, 4, gemv=True),
    SmallBatchConfig(4, 1024, 4, 3, gemv=True),
    SmallBatchConfig(2, 2048, 8, 4, gemv=True),
    SmallBatchConfig(8, 512, 4, 3, split_k=2, gemv=True),
    SmallBatchConfig(16, 256, 4, 3, split_k=4, gemv=True),
)


def small_batch_matmul(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None,
                       config: SmallBatchConfig, silu_mul: bool = False,
                       add_rmsnorm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                       prefetch: torch.Tensor | None = None, beside: GemvShrink | None = None) -> Any:
    """``x @ (weight * scale).T`` for few rows of ``x`` (16-bit, unit stride on K) and a ``weight`` [N, K] in
    16 bits or FP8, with ``scale`` None or float32 [N, 1]; the result has ``x``'s dtype. ``silu_mul``: the
    weight is ``[gate | up]`` (2N rows) and the result ``silu(gate) * up`` [M, N], in the same kernel (configs
    without split-K, see :func:`fuses_silu_mul`; each program reads ``block_n / 2`` rows of each half).
    ``add_rmsnorm`` = ``(residual, norm_weight, eps)`` for one row of ``x`` and a GEMV config: returns
    ``(rmsnorm(y + residual) * norm_weight, y + residual)`` instead, the norm computed by the program that finishes
    the row last.
    ``prefetch``: bytes (a uint8 tensor, see :func:`l2_prefetch_bytes`) the kernel's last programs ask L2 to
    fetch as they finish, for the kernel that runs next. A ``w8a8`` config quantizes ``x`` per token first
    (:func:`fp8_ops.quantize_per_token`). ``beside``: a LoRA shrink of ``x`` (kernels/lora_gather.py) run by extra
    programs placed first in this launch (16-bit configs, no epilogue)."""
    m, k = x.shape
    n = weight.shape[0]
    out_dtype = x.dtype
    x_scale = None
    if config.w8a8:
        if config.gemv or weight.element_size() != 1:
            raise ValueError(f"w8a8 runs FP8 weights through tl.dot tiles, not {config} on {weight.dtype}")
        x, x_scale = quantize_per_token(x)
    if silu_mul:
        if not fuses_silu_mul(config):
            raise ValueError(f"silu_mul runs configs without split-K (tl.dot tiles of 32+ columns), not {config}")
        n //= 2
        config = config._replace(block_n=max(config.block_n // 2, 1))
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    # W8A8 tiles pad the rows to 64, the least a Hopper warpgroup multiplies FP8 by (wgmma; narrower tiles
    # widen both operands to 16 bits first): the padding costs tensor-core time, which a bandwidth-bound
    # matmul has to spare.
    block_m = 1 if config.gemv else 64 if config.w8a8 else (16 if m <= 16 else 32)
    split_k = config.split_k
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    grid = (triton.cdiv(n, config.block_n), triton.cdiv(m, block_m), split_k)
    arrivals = _arrivals(x.device, grid[0] * grid[1] + 1)  # one counter per output tile, one for the rows' norm
    lora = _beside_args(beside, x, config, silu_mul or add_rmsnorm is not None, grid)
    grid = (grid[0] + lora["l_columns"], grid[1], grid[2])
    partials = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else y
    has_scale = scale is not None
    if add_rmsnorm is not None:
        if m != 1 or not config.gemv or silu_mul:
            raise ValueError(f"add_rmsnorm runs one row through a GEMV config, not {m} rows through {config}")
        residual, norm_weight, eps = add_rmsnorm
        normed, residual_out = torch.empty_like(y), torch.empty_like(y)
    else:
        residual = norm_weight = normed = residual_out = y  # unread placeholders
        eps = 0.0
    # Tiles that cover N and every split's K range exactly need no bounds masks (the GEMV form then loads whole
    # vectors unpredicated).
    even = n % config.block_n == 0 and k % config.block_k == 0 and k_per_split * split_k == k
    programs = grid[0] * grid[1] * grid[2]
    # Launched with PDL (kernels/pdl.py): the kernel reads (the GEMV) or asks L2 for (the tiles) its first weight
    # blocks while the kernel before it finishes. Not FP8's tiles: with PDL FP8 decode of 16-32 requests was
    # 3-6% slower on the H100, 16-bit tiles 1-3% faster (docs/lab/benchmarks-history.md).
    pdl = pdl_enabled(x.device) and (config.gemv or weight.element_size() == 2)
    lines = prefetch.numel() // 128 if prefetch is not None else 0
    first_prefetcher = max(programs - _prefetching_programs(x.device), 0) if lines else 0
    _small_batch_kernel[grid](
        x, weight, scale if has_scale else weight, y, partials, arrivals,
        residual, norm_weight, normed, residual_out, eps,
        m, n, k, k_per_split, x.stride(0), weight.stride(0), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k, GEMV=config.gemv,
        HAS_SCALE=has_scale, EVEN=even, SILU_MUL=silu_mul,
        # The tl.dot tiles read a 16-bit weight once per step with evict_first too (like the GEMVs); FP8's were
        # slower with it on an H200 (docs/lab/benchmarks-history.md).
        EVICT_ROWS=weight.element_size() == 2,
        ADD_RMSNORM=add_rmsnorm is not None, BLOCK_ROW=triton.next_power_of_2(n) if add_rmsnorm is not None else 1,
        Prefetch=prefetch if lines else weight, prefetch_lines=lines,
        first_prefetcher=first_prefetcher, PREFETCH=lines > 0,
        PREFETCH_BLOCK=min(256, triton.next_power_of_2(max(triton.cdiv(lines, programs - first_prefetcher), 1))),
        X_scale=x_scale if x_scale is not None else weight, W8A8=config.w8a8,
        PDL=pdl, launch_pdl=pdl, **lora,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return y if add_rmsnorm is None else (normed, residual_out)


def _beside_args(beside: GemvShrink | None, x: torch.Tensor, config: SmallBatchConfig, epilogue: bool,
                 grid: tuple[int, int, int]) -> dict[str, Any]:
    """The kernel's LoRA arguments: ``beside``'s shrink in ``l_columns`` extra programs ahead of each (row block,
    split) of the matmul's grid, or the LORA=False placeholders."""
    if beside is None:
        return dict(La=x, Lids=x, Lscalings=x, Lranks=x, Lpartials=x, l_rank_dim=0, l_rows=0, l_proj_stride=0,
                    l_stride_as=0, l_stride_ar=0, l_stride_ak=0, l_stride_hs=0, l_stride_hm=0, l_k_per_split=0,
                    l_columns=0, l_programs=0, l_r_blocks=0, l_slices=0, LORA=False, L_BLOCK_R=1, L_BLOCK_K=1,
                    L_AHEAD=0)
    if config.w8a8 or epilogue:
        raise ValueError(f"a LoRA shrink runs beside a 16-bit matmul without an epilogue, not {config}")
    a, partials = beside.a, beside.partials
    programs = beside.programs
    return dict(La=a, Lids=beside.adapter_ids, Lscalings=beside.scalings, Lranks=beside.ranks, Lpartials=partials,
                l_rank_dim=beside.rank_dim, l_rows=a.shape[1], l_proj_stride=beside.proj_stride,
                l_stride_as=a.stride(0), l_stride_ar=a.stride(1), l_stride_ak=a.stride(2),
                l_stride_hs=partials.stride(0), l_stride_hm=partials.stride(1), l_k_per_split=beside.k_per_split,
                l_columns=triton.cdiv(programs, grid[1] * grid[2]), l_programs=programs,
                l_r_blocks=triton.cdiv(a.shape[1], beside.block_r), l_slices=partials.shape[0], LORA=True,
                L_BLOCK_R=beside.block_r, L_BLOCK_K=beside.block_k, L_AHEAD=beside.ahead)


_arrival_counts: dict[torch.device, torch.Tensor] = {}


def _arrivals(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 counters, one per output tile, that split-K programs count their arrivals in (each call's
    last program resets its tile's). One set per device, shared by every call: the model's kernels run one after
    another on one stream. Allocated at the first call, which happens while the layers time their configs at
    load (``small_batch.choose``), before any CUDA graph is captured."""
    counts = _arrival_counts.get(device)
    if counts is None or counts.numel() < tiles:
        counts = _arrival_counts[device] = torch.zeros(max(tiles, 1 << 16), dtype=torch.int32, device=device)
    return counts


_prefetching: dict[torch.device, int] = {}


def _prefetching_programs(device: torch.device) -> int:
    """How many of a kernel's last programs share its L2 prefetch: twice the SMs, the programs of its last waves
    (on an H100, 264 did as well as 132 and better than 528, 1024 or all, docs/lab/benchmarks-history.md)."""
    if device not in _prefetching:
        _prefetching[device] = 2 * torch.cuda.get_device_properties(device).multi_processor_count
    return _prefetching[device]
