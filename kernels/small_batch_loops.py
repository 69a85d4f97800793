"""The K loops of kernels/small_batch.py's matmul: ``tl.dot`` tiles of 16-32 rows (``_rows``, ``_gate_up_rows`` for a
``[gate | up]`` weight's two halves at once) and the one-row GEMV (``_row``, ``_gate_up_row``) that widens weights
to float32 and sums along K, and the L2 request for a tile's first weight blocks (``_prefetch_tile_head``).

Imported only on a CUDA device (or under ``TRITON_INTERPRET=1`` in tests).
"""

from __future__ import annotations

import triton
import triton.language as tl

from treadle.kernels.pdl import allow_next, wait_for_previous


@triton.jit
def _prefetch_tile_head(W, offs_n, n_mask, k_start, k_end, stride_wn, BLOCK_K: tl.constexpr):
    """Asks L2 for the first two K blocks of weight rows ``offs_n`` (one request per 128-byte line)."""
    ELEMS_PER_LINE: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth
    LINES: tl.constexpr = 2 * BLOCK_K // ELEMS_PER_LINE
    cols = k_start + tl.arange(0, LINES) * ELEMS_PER_LINE
    lines = W + offs_n[:, None].to(tl.int64) * stride_wn + cols[None, :]
    lines = tl.where(n_mask[:, None] & (cols < k_end)[None, :], lines, W)
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [lines], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _rows(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, stride_xm, stride_wn,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT_FIRST: tl.constexpr):
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = (k + tl.arange(0, BLOCK_K)) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        if EVICT_FIRST:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        acc = _dot(x, w, acc, BLOCK_K)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc


@triton.jit
def _dot(x, w, acc, BLOCK_K: tl.constexpr):
    """``acc + x @ w.T`` (w widened to x's dtype). FP8 by FP8 adds each K step's tensor-core sums to the float32
    ``acc`` on the CUDA cores: Hopper's FP8 sums keep ~14 bits otherwise (Triton's default on sm_90). On the H100 the
    W8A8 tiles came within 0.07-0.12% of cuBLAS's precise sums over Llama-3.1-8B's projections instead of 0.23-0.24%,
    and FP8 decode of 16 / 32 requests took 4.64 / 5.21 ms a step against 4.61 / 5.18 (docs/quantization.md)."""
    if x.dtype.is_fp8():
        return tl.dot(x, tl.trans(w.to(x.dtype)), acc, max_num_imprecise_acc=BLOCK_K)
    return tl.dot(x, tl.trans(w.to(x.dtype)), acc)


@triton.jit
def _gate_up_rows(X, W, offs_m, offs_n, m_mask, n_mask, k_start, k_end, K, N, stride_xm, stride_wn,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVICT_FIRST: tl.constexpr):
    """``_rows`` for weight rows ``offs_n`` and ``N + offs_n`` at once: (gate, up) of rows ``offs_m`` of x."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    gate_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + N.to(tl.int64) * stride_wn
    gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        k_mask = (k + tl.arange(0, BLOCK_K)) < K
        x = tl.load(x_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w_mask = n_mask[:, None] & k_mask[None, :]
        if EVICT_FIRST:
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0, eviction_policy="evict_first")
        else:
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0)
        gate = _dot(x, w_gate, gate, BLOCK_K)
        up = _dot(x, w_up, up, BLOCK_K)
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    return gate, up


@triton.jit
def _row(X_row, W, offs_n, n_mask, k_start, k_end, K, stride_wn, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
         EVEN: tl.constexpr, PDL: tl.constexpr):
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X_row + offs_k
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    # The first weight block is read before waiting for the kernel before (kernels/pdl.py): the weight is not its.
    w = _weight_tile(w_ptrs, n_mask, k_start, K, BLOCK_K, EVEN)
    wait_for_previous(PDL)
    acc = tl.sum(w * _x_slice(x_ptrs, k_start, K, BLOCK_K, EVEN)[None, :], axis=1)
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
        x = _x_slice(x_ptrs, k, K, BLOCK_K, EVEN)
        acc += tl.sum(_weight_tile(w_ptrs, n_mask, k, K, BLOCK_K, EVEN) * x[None, :], axis=1)
    allow_next(PDL)  # after the weight loop: an earlier go-ahead measured slower (docs/lab/benchmarks-history.md)
    return acc


@triton.jit
def _gate_up_row(X_row, W, offs_n, n_mask, k_start, k_end, K, N, stride_wn, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, EVEN: tl.constexpr, PDL: tl.constexpr):
    """``_row`` for weight rows ``offs_n`` and ``N + offs_n`` at once: (gate, up) of one row of x."""
    offs_k = k_start + tl.arange(0, BLOCK_K)
    x_ptrs = X_row + offs_k
    gate_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + N.to(tl.int64) * stride_wn
    w_gate = _weight_tile(gate_ptrs, n_mask, k_start, K, BLOCK_K, EVEN)
    w_up = _weight_tile(up_ptrs, n_mask, k_start, K, BLOCK_K, EVEN)
    wait_for_previous(PDL)
    x = _x_slice(x_ptrs, k_start, K, BLOCK_K, EVEN)
    gate = tl.sum(w_gate * x[None, :], axis=1)
    up = tl.sum(w_up * x[None, :], axis=1)
    for k in range(k_start + BLOCK_K, k_end, BLOCK_K):
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
        x = _x_slice(x_ptrs, k, K, BLOCK_K, EVEN)
        gate += tl.sum(_weight_tile(gate_ptrs, n_mask, k, K, BLOCK_K, EVEN) * x[None, :], axis=1)
        up += tl.sum(_weight_tile(up_ptrs, n_mask, k, K, BLOCK_K, EVEN) * x[None, :], axis=1)
    allow_next(PDL)
    return gate, up


@triton.jit
def _x_slice(x_ptrs, k, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """One K step of a GEMV's row of x, in float32 (unmasked where the tiles fit the shape exactly)."""
    if EVEN:
        x = tl.load(x_ptrs)
    else:
        x = tl.load(x_ptrs, mask=(k + tl.arange(0, BLOCK_K)) < K, other=0.0)
    return x.to(tl.float32)


@triton.jit
def _weight_tile(w_ptrs, n_mask, k, K, BLOCK_K: tl.constexpr, EVEN: tl.constexpr):
    """One K step of a GEMV's weight tile, in float32. The weight is read once per step: evict_first keeps it
    from pushing x and the partials out of L2."""
    if EVEN:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
    else:
        k_mask = (k + tl.arange(0, BLOCK_K)) < K
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0, eviction_policy="evict_first")
    return w.to(tl.float32)
