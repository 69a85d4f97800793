"""Triton kernels of ``exact_top_logits.py``: each row's ``k`` best logits recomputed from the 16-bit head
(imported only on a CUDA device, or under ``TRITON_INTERPRET=1`` in tests).

Two launches. The first cuts each row into chunks of ``_CHUNK`` columns, one program a chunk, which keeps its
chunk's ``k`` largest values and their columns (``k`` rounds of max, the lowest column among equal values). The
second runs one program per row and rank ``j < k``: it ranks the row's candidates the same way, takes the ``j``-th,
and writes ``x[row] @ weight[column]`` (float32 sums) over that logit. A row's candidates are disjoint columns, so
the ``k`` programs of a row write ``k`` different logits, and every program ranks from the first launch's copy, not
from the logits being rewritten.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_CHUNK = 2048


@triton.jit
def _chunk_top_kernel(Logits, Values, Columns, vocab, stride_row, chunks,
                      K: tl.constexpr, CHUNK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    cols = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(Logits + row * stride_row + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
    out = (row * chunks + chunk) * K
    for j in tl.static_range(K):
        best, at = _best(x, cols)
        tl.store(Values + out + j, best)
        tl.store(Columns + out + j, at)
        x = tl.where(cols == at, float("-inf"), x)


@triton.jit
def _best(values, columns):
    """The largest of ``values`` and its column (the lowest column among equal values)."""
    best = tl.max(values, 0)
    return best, tl.min(tl.where(values == best, columns, 2147483647), 0)


@triton.jit
def _recompute_kernel(Values, Columns, X, W, Logits, candidates, vocab, hidden, stride_x, stride_w, stride_row,
                      CANDIDATES: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    rank = tl.program_id(1)
    offs = tl.arange(0, CANDIDATES)
    mask = offs < candidates
    values = tl.load(Values + row * candidates + offs, mask=mask, other=float("-inf"))
    columns = tl.load(Columns + row * candidates + offs, mask=mask, other=2147483647)
    for _ in range(rank):  # drop the better ones, in the first launch's order
        _, better = _best(values, columns)
        values = tl.where(columns == better, float("-inf"), values)
    _, column = _best(values, columns)
    column = tl.minimum(column, vocab - 1).to(tl.int64)
    acc = tl.zeros([BLOCK_H], tl.float32)
    for start in range(0, hidden, BLOCK_H):
        h = start + tl.arange(0, BLOCK_H)
        x = tl.load(X + row * stride_x + h, mask=h < hidden, other=0.0).to(tl.float32)
        w = tl.load(W + column * stride_w + h, mask=h < hidden, other=0.0).to(tl.float32)
        acc += x * w
    tl.store(Logits + row * stride_row + column, tl.sum(acc, 0).to(Logits.dtype.element_ty))


def recompute_top_logits(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    """``exact_top_logits.recompute_top_logits`` for ``1 <= k <= vocab``, rows with unit column stride."""
    rows, vocab = logits.shape
    hidden = x.shape[1]
    chunks = triton.cdiv(vocab, _CHUNK)
    candidates = chunks * k
    values = torch.empty((rows, candidates), dtype=torch.float32, device=logits.device)
    columns = torch.empty((rows, candidates), dtype=torch.int32, device=logits.device)
    _chunk_top_kernel[(rows, chunks)](logits, values, columns, vocab, logits.stride(0), chunks,
                                      K=k, CHUNK=_CHUNK, num_warps=4)
    _recompute_kernel[(rows, k)](values, columns, x, weight, logits, candidates, vocab, hidden, x.stride(0),
                                 weight.stride(0), logits.stride(0),
                                 CANDIDATES=triton.next_power_of_2(candidates),
                                 BLOCK_H=min(triton.next_power_of_2(hidden), 4096), num_warps=4)
