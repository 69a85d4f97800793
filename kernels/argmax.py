"""One Triton kernel for the greedy pick: each row's argmax over the vocabulary (imported only on a CUDA device, or
under ``TRITON_INTERPRET=1`` in tests).

``torch.argmax`` over a 128k vocabulary runs as one slow reduction, and the sampler's two-pass form
(``argmax_last_dim``'s CPU path) as five launches; both sit on the path of every synchronous decode step. Here one
program per row streams the row once, each lane keeping its first maximum, so the pick is ``torch.argmax``'s: the
lowest index among equal maxima, and the first NaN if there is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK = 4096


@triton.jit
def _argmax_kernel(X, Out, stride_row, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_at = tl.zeros([BLOCK], tl.int32)
    for start in range(0, vocab, BLOCK):
        at = start + offs
        x = tl.load(X + row * stride_row + at, mask=at < vocab, other=float("-inf")).to(tl.float32)
        # A lane keeps its first maximum; a NaN beats every number and the first NaN stays.
        take = (x > best) | ((x != x) & (best == best))
        best = tl.where(take, x, best)
        best_at = tl.where(take, at, best_at)
    nan_lane = best != best
    none_past = vocab  # larger than every index
    if tl.max(nan_lane.to(tl.int32), 0) > 0:
        pick = tl.min(tl.where(nan_lane, best_at, none_past), 0)
    else:
        pick = tl.min(tl.where(best == tl.max(best, 0), best_at, none_past), 0)
    tl.store(Out + row, pick.to(tl.int64))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(x, dim=-1)`` (int64) of a 16- or 32-bit float ``[rows, vocab]`` tensor with unit stride along
    the vocabulary (values are compared in float32)."""
    rows, vocab = x.shape
    out = torch.empty(rows, dtype=torch.int64, device=x.device)
    if rows:
        _argmax_kernel[(rows,)](x, out, x.stride(0), vocab, BLOCK=_BLOCK, num_warps=8)
    return out
