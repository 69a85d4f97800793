"""Triton fused-MoE kernels behind :func:`treadle.layers.fused_moe.fused_experts`.

The ``T * k`` (token, expert) assignments are sorted by expert and each expert's run is padded to
a multiple of ``BLOCK_M`` (:func:`align_by_expert`, one or two small kernels), so every block of ``BLOCK_M``
sorted rows belongs to one expert. One grouped-GEMM kernel then multiplies each block by its expert's weight:
first ``x @ w13[e].T`` (the gate and up projections), then, after ``silu(gate) * up``,
``act @ w2[e].T`` scaled by the routing weight. Everything stays on the device: no host sync,
so the layer can be captured in a CUDA graph.

FP8 experts on a GPU multiply FP8 by FP8 in the grouped GEMM (W8A8): the rows it reads (the tokens, then the
activated intermediate) are quantized per row first (``fp8_ops.quantize_per_token``: dynamic scales, as the dense
FP8 layers' ``torch._scaled_mm`` takes them) and each tile's float32 sums are scaled by both scales. Tiles of 64+
rows run on Hopper's FP8 tensor cores; Triton widens 16-row tiles' operands to f16 (exactly) for its mma. Widening the
weights to 16 bits instead (W8A16: the GEMVs below, the interpreter, ``TREADLE_MOE_W8A8=0``) made a Mixtral-8x7B
prefill compute-bound on the conversions (docs/lab/benchmarks-history.md).

A decode step of a few tokens (fewer assignments than experts; FP8 experts up to 0.75 per expert: :func:`takes_gemv`)
takes two GEMV kernels instead (:func:`fused_experts_gemv`): each program streams a few rows of one assignment's expert
weight, the first with ``silu(gate) * up`` in its epilogue, the second summing the token's ``k`` routed outputs, so
nothing is sorted or padded. A tile of 16 rows holding one token reads the weight at a third of the bandwidth;
an expert hit twice is read twice, which the GEMV's speed repays while few experts repeat.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from treadle.kernels.fused_ops import silu_mul
from treadle.kernels.small_batch import _gate_up_row, _row, _store_silu_mul


@dataclass(frozen=True)
class BlockConfig:
    """Tile sizes and launch settings of the grouped GEMM (``block_m`` also pads each expert's run)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_rows: int, dtype: torch.dtype, fp8_rows: bool = False) -> BlockConfig:
    """Tiles by the number of (token, expert) rows. ``bench/fused_moe.py --sweep`` at Mixtral-8x7B's shapes on an
    H100 (docs/lab/benchmarks-history.md): 128-row tiles take 8192 rows in 6.7 ms against 9.5 ms with 64; the smaller
    sizes keep their first guesses (the sweep found at most ~10% there, within one run's noise). ``fp8_rows``: the
    W8A8 GEMM, whose K steps load as many bytes at twice the elements."""
    block_k = 128 if fp8_rows else 32 if dtype == torch.float32 else 64
    if num_rows <= 512:
        return BlockConfig(16, 64, block_k)
    if num_rows < 4096:
        return BlockConfig(64, 128, block_k, num_warps=8)
    return BlockConfig(128, 128, block_k, num_warps=8)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    config: BlockConfig | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as :func:`treadle.layers.fused_moe.fused_experts`; ``config`` overrides the tiles.
    FP8 experts come with float32 scales per output row (``w13_scale`` ``[E, 2I]``, ``w2_scale`` ``[E, H]``): the
    GEMVs widen the weights in registers and scale each product row (W8A16), the grouped GEMM on a GPU quantizes
    its rows per row and multiplies FP8 by FP8 (W8A8, see the module docstring)."""
    x = x.contiguous()
    num_tokens, hidden_size = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    num_rows = num_tokens * top_k
    if num_tokens == 0:
        return torch.zeros_like(x)
    if (config is None and takes_gemv(num_tokens, top_k, num_experts, fp8=w13_scale is not None)
            and w13.stride(2) == 1 and w2.stride(2) == 1):
        return fused_experts_gemv(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)
    w8a8 = w13_scale is not None and x.is_cuda and w8a8_enabled()
    config = config or default_config(num_rows, x.dtype, fp8_rows=w8a8)
    sorted_rows, block_experts = align_by_expert(topk_ids, num_experts, config.block_m)
    gate_up = torch.empty((num_rows, two_inter), dtype=x.dtype, device=x.device)
    _grouped_gemm(*_rows_for(x, w8a8), w13, gate_up, sorted_rows, block_experts, config, a_row_divisor=top_k,
                  row_weights=None, scale=w13_scale)
    activated = silu_mul(gate_up)
    down = torch.empty((num_rows, hidden_size), dtype=x.dtype, device=x.device)
    _grouped_gemm(*_rows_for(activated, w8a8), w2, down, sorted_rows, block_experts, config, a_row_divisor=1,
                  row_weights=topk_weights.reshape(-1).to(torch.float32), scale=w2_scale)
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1)


def w8a8_enabled() -> bool:
    """Whether FP8 experts' grouped GEMM multiplies FP8 by FP8 on a GPU (``TREADLE_MOE_W8A8=0``: widen the weights
    instead, for A/B runs)."""
    return os.environ.get("TREADLE_MOE_W8A8", "1") != "0"


def _rows_for(a: torch.Tensor, w8a8: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The grouped GEMM's rows: ``a`` as it is, or (W8A8) quantized per row with its float32 scales ``[M, 1]``."""
    if not w8a8:
        return a, None
    from treadle.kernels.fp8_ops import quantize_per_token

    return quantize_per_token(a)


# Where the GEMVs stop paying, on an H100 (docs/lab/benchmarks-history.md, "Fused MoE"; CUDA-graph replays): 16-bit
# experts once there are as many assignments as experts (Mixtral-8x7B at 4 tokens, Qwen3-30B-A3B at 16); FP8
# experts, whose grouped GEMM is W8A8, past 0.75 assignments per expert (`bench/fused_moe.py --fp8`, JSON
# `fused_moe_..._20261126_fp8_threshold_*.json`: Mixtral-8x7B's GEMVs 0.235 against 0.274 ms at 2 tokens, even at 4,
# 0.419 against 0.336 at 6; Qwen3-30B-A3B's 0.114 against 0.120 at 8 tokens, even at 10, 0.151 against 0.144 at 12).
GEMV_ROWS_PER_EXPERT_16BIT = 1.0  # fewer assignments per expert than this
GEMV_ROWS_PER_EXPERT_FP8 = 0.75  # at most this many
GEMV_MAX_TOKENS = 24
_GEMV_ROWS = 4  # weight rows per program


def takes_gemv(num_tokens: int, top_k: int, num_experts: int, fp8: bool = False) -> bool:
    """Whether a batch of ``num_tokens`` runs the GEMVs (:func:`fused_experts_gemv`) rather than the grouped GEMM."""
    if num_tokens > GEMV_MAX_TOKENS:
        return False
    if fp8:
        return num_tokens * top_k <= GEMV_ROWS_PER_EXPERT_FP8 * num_experts
    return num_tokens * top_k < GEMV_ROWS_PER_EXPERT_16BIT * num_experts


def fused_experts_gemv(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`fused_experts` for a few tokens as two GEMVs per (token, expert) assignment, rounded where the
    grouped path rounds (the gate/up products, ``silu(gate) * up``, each routed output); no sorting. The experts'
    weights must have unit stride along their last dim."""
    x = x.contiguous()
    num_tokens, hidden_size = x.shape
    _, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).contiguous()
    activated = torch.empty((num_tokens * top_k, inter), dtype=x.dtype, device=x.device)
    block_k = min(2048, triton.next_power_of_2(hidden_size))
    _moe_gate_up_gemv_kernel[(num_tokens * top_k, triton.cdiv(inter, _GEMV_ROWS))](
        x, w13, w13_scale if w13_scale is not None else x, ids, activated, hidden_size, inter, top_k,
        w13.stride(0), w13.stride(1), BLOCK_N=_GEMV_ROWS, BLOCK_K=block_k,
        EVEN=hidden_size % block_k == 0 and inter % _GEMV_ROWS == 0, HAS_SCALE=w13_scale is not None, num_warps=4,
    )
    out = torch.empty_like(x)
    block_k = min(2048, triton.next_power_of_2(inter))
    _moe_down_gemv_kernel[(num_tokens, triton.cdiv(hidden_size, _GEMV_ROWS))](
        activated, w2, w2_scale if w2_scale is not None else x, ids,
        topk_weights.reshape(-1).to(torch.float32).contiguous(), out, hidden_size, inter, w2.stride(0), w2.stride(1),
        TOP_K=top_k, BLOCK_N=_GEMV_ROWS, BLOCK_K=block_k,
        EVEN=inter % block_k == 0 and hidden_size % _GEMV_ROWS == 0, HAS_SCALE=w2_scale is not None, num_warps=4,
    )
    return out


@triton.jit
def _moe_gate_up_gemv_kernel(X, W13, Scale, Ids, Out, K, inter, top_k, stride_we, stride_wn,
                             BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                             HAS_SCALE: tl.constexpr):
    # The dense one-token GEMV's loop and gated epilogue (small_batch_kernels), on this assignment's expert.
    assignment = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < inter
    expert = tl.load(Ids + assignment).to(tl.int64)
    token = (assignment // top_k).to(tl.int64)
    gate, up = _gate_up_row(X + token * K, W13 + expert * stride_we, offs_n, n_mask, 0, K, K, inter, stride_wn,
                            BLOCK_N, BLOCK_K, EVEN, False)
    # FP8 experts: one scale per weight row ([E, 2I], gate rows then up rows, as the dense kernel reads them).
    one_row = tl.arange(0, 1)
    _store_silu_mul(Out + assignment.to(tl.int64) * inter, Scale + expert * 2 * inter, gate[None, :], up[None, :],
                    one_row, offs_n, one_row < 1, n_mask, inter, inter, HAS_SCALE)


@triton.jit
def _moe_down_gemv_kernel(Act, W2, Scale, Ids, Route_weights, Out, hidden, K, stride_we, stride_wn,
                          TOP_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
                          HAS_SCALE: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < hidden
    dtype = Out.dtype.element_ty
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        assignment = token * TOP_K + j
        expert = tl.load(Ids + assignment).to(tl.int64)
        acc = _row(Act + assignment * K, W2 + expert * stride_we, offs_n, n_mask, 0, K, K, stride_wn, BLOCK_N,
                   BLOCK_K, EVEN, False)
        if HAS_SCALE:  # FP8 experts: one scale per weight row ([E, H])
            acc = acc * tl.load(Scale + expert * hidden + offs_n, mask=n_mask, other=0.0)
        # Each routed output rounded as the grouped path stores it, then summed in float32 as its sum over k does.
        total += (acc * tl.load(Route_weights + assignment)).to(dtype).to(tl.float32)
    tl.store(Out + token * hidden + offs_n, total.to(dtype), mask=n_mask)


# Assignments per program of the align kernels: one program sorts up to _ALIGN_CHUNK (512 tokens at top-8); above,
# a first launch counts each chunk's experts. Every program of the second reads all chunks' counts, so chunks stay
# large. One chunk size for every batch, so each BLOCK_M compiles the kernels once (a fewer-row batch masks the rest:
# a single program's histogram, far cheaper than another JIT compile on the first batch of each size).
_ALIGN_CHUNK = 4096
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # CPU tensors run the kernels too (the CPU tests)
_ALIGN_TILE = 4096  # elements of the (blocks x experts) and (blocks x slots) tiles that place the blocks


def align_by_expert(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the flattened assignments by expert, padding each expert's run to a multiple of ``block_m``.

    Returns ``sorted_rows`` (assignment index ``t * k + j`` per sorted slot; ``T * k`` marks padding) and
    ``block_experts`` (the expert of each block of ``block_m`` slots; -1 for blocks past the end), both int64.
    Sizes are upper bounds known without reading the routing on the host, so a CUDA graph can capture it.

    On CUDA (or under the Triton interpreter) Triton kernels sort: one launch up to 4096 assignments, two above.
    They claim the slots of an expert's run with atomic adds, so the rows within one run come in any order (each
    row of a grouped-GEMM tile is computed on its own); the set of rows in each block is the one
    :func:`align_by_expert_reference` (the PyTorch path, run elsewhere) puts there.
    """
    if not topk_ids.is_cuda and not _INTERPRETED:
        return align_by_expert_reference(topk_ids, num_experts, block_m)
    flat_ids = topk_ids.reshape(-1).contiguous()
    num_rows = flat_ids.numel()
    device = flat_ids.device
    max_blocks = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)
    chunk = _ALIGN_CHUNK
    num_chunks = max(1, triton.cdiv(num_rows, chunk))
    # At least a bin per lane of a warp, which the GPU's histogram lowering assumes.
    experts_pow2 = max(32, triton.next_power_of_2(num_experts))
    cursors = torch.empty((num_chunks, experts_pow2), dtype=torch.int32, device=device)
    chunk_counts = cursors
    if num_chunks > 1:
        chunk_counts = torch.empty_like(cursors)
        _count_experts_kernel[(num_chunks,)](flat_ids, chunk_counts, num_rows, CHUNK=chunk, EXPERTS_POW2=experts_pow2)
    sorted_rows = torch.empty(max_blocks * block_m, dtype=torch.int64, device=device)
    block_experts = torch.empty(max_blocks, dtype=torch.int64, device=device)
    _align_kernel[(num_chunks,)](
        flat_ids, chunk_counts, cursors, sorted_rows, block_experts, num_rows, num_experts, num_chunks, max_blocks,
        BLOCK_M=block_m, CHUNK=chunk, EXPERTS_POW2=experts_pow2, SINGLE_CHUNK=num_chunks == 1,
        BLOCKS=max(1, _ALIGN_TILE // max(experts_pow2, block_m)),
    )
    return sorted_rows, block_experts


def align_by_expert_reference(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`align_by_expert` in PyTorch ops, each expert's rows in assignment order (a stable sort)."""
    flat_ids = topk_ids.reshape(-1)
    num_rows = flat_ids.numel()
    device = flat_ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    first_in_run = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat_ids, stable=True)
    sorted_experts = flat_ids[order]
    rank_in_run = torch.arange(num_rows, device=device) - first_in_run[sorted_experts]
    slots = padded_ends[sorted_experts] - padded[sorted_experts] + rank_in_run
    max_blocks = triton.cdiv(num_rows, block_m) + min(num_experts, num_rows)
    sorted_rows = torch.full((max_blocks * block_m,), num_rows, dtype=torch.int64, device=device)
    sorted_rows[slots] = order
    block_starts = torch.arange(max_blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True)
    block_experts = torch.where(block_experts < num_experts, block_experts, -1)
    return sorted_rows, block_experts


# The sizes that change from batch to batch are not specialized on (divisible by 16 or not, 1 or not): prefill runs
# eagerly at any size above the piecewise graphs' largest, and each new specialization compiled mid-run (0.4-1.6 s
# for a step of Qwen3-30B-A3B's 1,189 tokens on the H100, docs/lab/benchmarks-history.md). They only bound masks and loops.
@triton.jit(do_not_specialize=["num_rows"])
def _count_experts_kernel(Ids, Chunk_counts, num_rows, CHUNK: tl.constexpr, EXPERTS_POW2: tl.constexpr):
    chunk = tl.program_id(0)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_rows
    ids = tl.load(Ids + offs, mask=mask, other=0).to(tl.int32)
    counts = tl.histogram(ids, EXPERTS_POW2, mask=mask)
    tl.store(Chunk_counts + chunk * EXPERTS_POW2 + tl.arange(0, EXPERTS_POW2), counts)


@triton.jit(do_not_specialize=["num_rows", "num_chunks", "max_blocks"])
def _align_kernel(Ids, Chunk_counts, Cursors, Sorted_rows, Block_experts, num_rows, num_experts, num_chunks,
                  max_blocks, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                  SINGLE_CHUNK: tl.constexpr, BLOCKS: tl.constexpr):
    # Each program places its chunk's assignments in their experts' runs, then writes the expert and the
    # padding of every num_programs-th group of BLOCKS blocks. The two write disjoint slots of Sorted_rows.
    chunk = tl.program_id(0)
    experts = tl.arange(0, EXPERTS_POW2)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    mask = offs < num_rows
    ids = tl.load(Ids + offs, mask=mask, other=0).to(tl.int32)
    if SINGLE_CHUNK:
        counts = tl.histogram(ids, EXPERTS_POW2, mask=mask)
        earlier = tl.zeros_like(counts)
    else:
        counts = tl.zeros([EXPERTS_POW2], tl.int32)
        earlier = tl.zeros([EXPERTS_POW2], tl.int32)  # each expert's assignments in the chunks before this one
        for first in range(0, num_chunks, 16):  # 16 chunks' counts per load
            chunks = first + tl.arange(0, 16)
            tile = tl.load(Chunk_counts + chunks[:, None] * EXPERTS_POW2 + experts[None, :],
                           mask=(chunks < num_chunks)[:, None], other=0)
            counts += tl.sum(tile, 0)
            earlier += tl.sum(tl.where((chunks < chunk)[:, None], tile, 0), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    padded_ends = tl.cumsum(padded, 0)
    starts = padded_ends - padded
    cursors = Cursors + chunk * EXPERTS_POW2  # this chunk's next free slot per expert
    tl.store(cursors + experts, starts + earlier)
    tl.debug_barrier()  # every thread's cursor is stored before any claims a slot from it
    # Relaxed: the claim only needs to be atomic; the default acq_rel fences the GPU's memory at every add.
    slots = tl.atomic_add(cursors + ids, 1, mask=mask, sem="relaxed")
    tl.store(Sorted_rows + slots, offs.to(tl.int64), mask=mask)

    # A block's expert is the number of padded runs ending at or before it (EXPERTS_POW2 past the last run, where
    # the empty experts beyond num_experts end); its slots past that expert's rows are padding.
    block_ends = padded_ends // BLOCK_M
    row_ends = starts + counts
    for first in range(chunk * BLOCKS, max_blocks, tl.num_programs(0) * BLOCKS):
        blocks = first + tl.arange(0, BLOCKS)
        block_mask = blocks < max_blocks
        expert = tl.sum((block_ends[None, :] <= blocks[:, None]).to(tl.int32), 1)
        rows_end = tl.sum(tl.where(experts[None, :] == expert[:, None], row_ends[None, :], 0), 1)
        tl.store(Block_experts + blocks, tl.where(expert < num_experts, expert, -1).to(tl.int64), mask=block_mask)
        block_slots = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tl.store(Sorted_rows + block_slots, tl.full([BLOCKS, BLOCK_M], num_rows, tl.int64),
                 mask=block_mask[:, None] & (block_slots >= rows_end[:, None]))


def _grouped_gemm(
    a: torch.Tensor,
    a_scale: torch.Tensor | None,
    weights: torch.Tensor,
    out: torch.Tensor,
    sorted_rows: torch.Tensor,
    block_experts: torch.Tensor,
    config: BlockConfig,
    a_row_divisor: int,
    row_weights: torch.Tensor | None,
    scale: torch.Tensor | None = None,
) -> None:
    """``out[r] = a[r // a_row_divisor] @ weights[expert(r)].T`` (times ``row_weights[r]``) for each sorted row ``r``;
    FP8 ``weights`` have a float32 ``scale`` ``[E, N]`` per weight row, and FP8 rows ``a`` (then FP8 ``weights``
    too) a float32 ``a_scale`` ``[M, 1]`` per row."""
    _, n, k = weights.shape
    grid = (block_experts.numel(), triton.cdiv(n, config.block_n))
    _grouped_gemm_kernel[grid](
        a, weights, out, row_weights if row_weights is not None else out, sorted_rows, block_experts,
        scale if scale is not None else out, a_scale if a_scale is not None else out, n, k, out.shape[0],
        a_row_divisor, a.stride(0), weights.stride(0), weights.stride(1), weights.stride(2), out.stride(0),
        MUL_ROW_WEIGHT=row_weights is not None, HAS_SCALE=scale is not None, FP8_ROWS=a_scale is not None,
        # float32 models get true float32 products (no TF32), so the GPU path matches the reference.
        IEEE_FP32=a.dtype == torch.float32,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )


@triton.jit(do_not_specialize=["num_rows"])
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, row_weight_ptr, sorted_rows_ptr, block_experts_ptr, scale_ptr, a_scale_ptr,
    N, K, num_rows, a_row_divisor,
    stride_am, stride_be, stride_bn, stride_bk, stride_cm,
    MUL_ROW_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr, FP8_ROWS: tl.constexpr, IEEE_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_experts_ptr + pid_m)
    if expert < 0:
        return
    # 64-bit: a row times the output stride (2 x intermediate for gate/up) passes 2**31 at tens of thousands of rows.
    rows = tl.load(sorted_rows_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    a_rows = tl.where(row_mask, rows // a_row_divisor, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None] * stride_bk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k_start
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if HAS_SCALE and not FP8_ROWS:
            b = b.to(a.dtype)  # FP8 widened exactly; its row scale is applied to the sums below
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            # FP8 rows: Hopper's FP8 tensor cores keep ~14 bits of the running sums (Triton's default on sm_90).
            # Promoting each K step's sums to float32 on the CUDA cores (max_num_imprecise_acc=BLOCK_K) cut the
            # error against exact sums from 1.8% to 0.6% on Mixtral's shapes but made the GEMM 14-42% slower
            # (docs/quantization.md).
            acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_bk
    if HAS_SCALE:
        acc = acc * tl.load(scale_ptr + expert.to(tl.int64) * N + offs_n, mask=n_mask, other=0.0)[None, :]
    if FP8_ROWS:
        acc = acc * tl.load(a_scale_ptr + a_rows, mask=row_mask, other=0.0)[:, None]
    if MUL_ROW_WEIGHT:
        row_weight = tl.load(row_weight_ptr + rows, mask=row_mask, other=0.0)
        acc = acc * row_weight[:, None]
    c_ptrs = c_ptr + rows[:, None] * stride_cm + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])
