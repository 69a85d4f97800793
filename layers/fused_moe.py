"""Mixture-of-experts compute: route tokens to their top-k experts and run the experts' gated MLPs.

On CUDA (with Triton) the experts run as two grouped GEMMs over the token rows sorted by expert, or as two
GEMVs for a decode step of a few tokens (:mod:`treadle.kernels.fused_moe`); elsewhere a plain
PyTorch loop over experts runs, which rounds exactly as HF transformers' Mixtral does and is the reference for
the kernels.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from treadle.kernels.fp8_ops import dequantize
from treadle.kernels.fused_ops import silu_mul, use_triton


def route_top_k(router_logits: torch.Tensor, top_k: int, renormalize: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights float32 [T, k], expert ids int64 [T, k])``: softmax over experts (in float32), the top ``k``,
    rescaled to sum to one when ``renormalize`` (Mixtral; Qwen2-MoE's ``norm_topk_prob: false`` keeps them)."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` with ``e = topk_ids[t, k]``.

    ``x`` ``[T, H]``; ``w13`` ``[E, 2I, H]`` (gate rows then up rows); ``w2`` ``[E, H, I]``. FP8 experts come with
    float32 scales per weight row, ``w13_scale`` ``[E, 2I]`` and ``w2_scale`` ``[E, H]``.
    """
    if use_triton(x):
        return _kernels().fused_experts(x, w13, w2, topk_weights, topk_ids, w13_scale=w13_scale, w2_scale=w2_scale)
    return fused_experts_reference(x, w13, w2, topk_weights, topk_ids, w13_scale, w2_scale)


def fused_experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The PyTorch path: one gated MLP per expert over the rows routed to it, summed in expert order (FP8 experts
    dequantized to ``x``'s dtype as each one runs)."""
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    tokens = order // top_k
    weights = topk_weights.flatten()[order]
    # The per-expert row counts decide the loop on the host; this path runs on the CPU, where that costs nothing.
    counts = torch.bincount(flat_ids, minlength=num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start : start + count]
            gate_up, down = w13[expert], w2[expert]
            if w13_scale is not None:
                gate_up = dequantize(gate_up, w13_scale[expert, :, None], x.dtype)
                down = dequantize(down, w2_scale[expert, :, None], x.dtype)
            hidden = silu_mul(F.linear(x[rows], gate_up))
            expert_out = F.linear(hidden, down) * weights[start : start + count, None]
            out.index_add_(0, rows, expert_out.to(out.dtype))
        start += count
    return out


@functools.cache
def _kernels():
    from treadle.kernels import fused_moe as fused_moe_kernels

    return fused_moe_kernels
