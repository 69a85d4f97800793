"""Exact best logits for an FP8 output projection: the FP8 head proposes, the 16-bit weight decides.

An FP8 lm_head reads half the bytes of a 16-bit one (0.5 of Llama-3.1-8B's 1.05 GB each decode step) but moves
every logit by its weight's rounding, enough to swap near-equal tokens. The tokens that matter to greedy decoding,
to the top log-probs and to most of a sampling distribution's mass are each row's few best, and the FP8 logits rank
the right ones among their best few: so each row's ``k`` largest FP8 logits are recomputed as ``x @ weight.T`` from
the 16-bit weight (``k`` rows of it, a few kilobytes) and written back over the FP8 values. Greedy tokens are then
the 16-bit head's unless its best token ranks below ``k`` in FP8 (or an FP8 logit outside the ``k`` rises above the
recomputed ones), and the other logits keep the FP8 error.

On a GPU two Triton launches (``exact_top_logits_kernels.py``); elsewhere ``torch.topk`` and a batched product.
"""

from __future__ import annotations

import torch

from treadle.kernels.fused_ops import use_triton


def recompute_top_logits(logits: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    """In place: for each row of ``logits`` ``[rows, vocab]`` (the FP8 head's output for ``x`` ``[rows, hidden]``),
    its ``k`` largest values become ``x[row] @ weight[column]`` (``weight`` the head's 16-bit ``[vocab, hidden]``),
    summed in float32 and rounded to ``logits``' dtype."""
    rows, vocab = logits.shape
    k = min(k, vocab)
    if rows == 0 or k == 0:
        return
    if use_triton(logits):
        from treadle.kernels.exact_top_logits import recompute_top_logits as launch

        launch(logits, x, weight, k)
        return
    columns = torch.topk(logits, k, dim=-1, sorted=False).indices
    exact = torch.einsum("rkh,rh->rk", weight[columns].float(), x.float())
    logits.scatter_(-1, columns, exact.to(logits.dtype))
