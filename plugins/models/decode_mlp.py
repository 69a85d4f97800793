"""Whether a decoder layer's one-token step runs ``o_proj`` through the next layer's norm as one kernel.

:func:`fused_mlp_step` runs ``decode_mlp_kernels.decode_mlp`` where it applies: one token, a :class:`GatedMLP`
without biases, no tensor parallelism, 16-bit or FP8 weights of the built-in linear methods, and every one of the
three layers chose a Triton GEMV for one row at load (so a GPU where Triton's GEMVs beat the library's).
``TREADLE_DECODE_MLP=0`` turns it off (the three kernels run as before), for A/B runs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch
from torch import nn

from treadle.plugins.models.fp8 import Fp8LinearMethod
from treadle.plugins.models.linear import LinearBase, UnquantizedLinearMethod

if TYPE_CHECKING:
    from treadle.plugins.models.layers import GatedMLP


def enabled() -> bool:
    """``TREADLE_DECODE_MLP`` is not ``0``."""
    return os.environ.get("TREADLE_DECODE_MLP", "1") != "0"


def fused_mlp_step(attended: torch.Tensor, residual: torch.Tensor, o_proj: LinearBase, post_norm: nn.Module,
                   mlp: GatedMLP, next_norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(next_norm(r), r)`` with ``s = o_proj(attended) + residual`` and ``r = mlp(post_norm(s)) + s``, in one
    kernel where it applies (see the module docstring); None otherwise."""
    if attended.dim() != 2 or attended.shape[0] != 1 or not enabled():
        return None
    layers = (o_proj, mlp.gate_up_proj, mlp.down_proj)
    if not all(_runs_triton_gemv(layer) for layer in layers) or len({layer.weight.dtype for layer in layers}) != 1:
        return None
    from treadle.plugins.models.decode_mlp_kernels import DecodeMlpWeights, decode_mlp, fits, tiles_for

    weights = DecodeMlpWeights(
        o_proj.weight, getattr(o_proj, "weight_scale", None), post_norm.weight, post_norm.eps,
        mlp.gate_up_proj.weight, getattr(mlp.gate_up_proj, "weight_scale", None),
        mlp.down_proj.weight, getattr(mlp.down_proj, "weight_scale", None), next_norm.weight, next_norm.eps)
    hidden, k_o = weights.o_proj.shape
    if not fits(tiles_for(weights.o_proj.dtype), hidden, k_o, weights.down.shape[1]):
        return None
    return decode_mlp(attended, residual, weights, prefetch=mlp.down_proj.l2_prefetch)


def _runs_triton_gemv(layer: LinearBase) -> bool:
    """A layer whose one-row matmul is the small-batch Triton GEMV, with nothing the fused kernel leaves out
    (bias, tensor parallelism, another quant method or a non-contiguous weight)."""
    config = layer.small_batch.for_rows(1) if layer.small_batch is not None else None
    return (config is not None and config.gemv and layer.bias is None and layer.tp_size == 1
            and type(layer.quant_method) in (UnquantizedLinearMethod, Fp8LinearMethod)
            and layer.weight.is_contiguous())
