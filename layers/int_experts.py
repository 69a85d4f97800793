"""Integer MoE experts (W4A16, W8A16): the fused experts of a GPTQ, AWQ or compressed-tensors checkpoint kept packed.

:class:`~treadle.layers.moe.FusedExperts` built with an :class:`IntWeightScheme` (``int_scheme``) holds, in
``layers/packed_int.py``'s panel layout (plain packing where a K is not whole panels: the torch path only):

- ``gate_up_proj`` int32 ``[E, 2I/tp, H * bits / 32]`` with ``gate_up_scales`` / ``gate_up_zeros``
  ``[E, 2I/tp, H / group]``;
- ``down_proj`` int32 ``[E, H, I/tp * bits / 32]`` with ``down_scales`` / ``down_zeros`` ``[E, H, I/tp / group]``.

Scales and zero points are in the model dtype; symmetric checkpoints store no zeros (None once loaded). Each
expert's weight arrives as its :class:`UnpackedWeight` (``PackedIntConfig.checkpoint_stream``); tensor parallelism
keeps a rank's rows of gate/up and its columns (whole groups) of down. :func:`fused_int_experts` runs them: the
Triton kernels of ``kernels/packed_int_moe.py`` on a GPU, elsewhere a loop over experts that dequantizes each one
as it runs (the reference). On a GPU the layer also holds ``dequant_scratch``, a 16-bit buffer of ``E * I/tp * H``
elements shared by every MoE layer (:func:`reserve_dequant_scratch`, at load: Mixtral-8x7B's is 0.94 GB), into
which large batches widen the experts of each GEMM (gate/up half by half) before the 16-bit grouped GEMM.
"""

from __future__ import annotations

import functools
import weakref
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from treadle.kernels.fused_ops import silu_mul, use_triton
from treadle.layers.linear import CheckpointError
from treadle.layers.linear_method import set_weight_attrs
from treadle.layers.packed_int import (
    PANEL_WORDS, IntWeightScheme, UnpackedWeight, pack_panels, pack_rows, unpack_last,
    unpack_panels,
)

if TYPE_CHECKING:
    from treadle.layers.moe import FusedExperts


def int_experts_fit(scheme: IntWeightScheme | None, hidden_size: int, local_size: int) -> bool:
    """Whether experts of ``hidden_size`` x ``local_size`` (this rank's intermediate size) keep ``scheme``'s packed
    weights: whole words and whole groups along both K dimensions, no act-order."""
    if scheme is None or scheme.act_order:
        return False
    per_word = 32 // scheme.bits
    return all(k % per_word == 0 and k % scheme.group(k) == 0 for k in (hidden_size, local_size)) and \
        scheme.group(hidden_size) == scheme.group(local_size)


def create_int_expert_params(experts: "FusedExperts", scheme: IntWeightScheme) -> None:
    """The packed weights, scales and zero points of ``experts`` (zeros start at the symmetric midpoint)."""
    e, hidden, local = experts.num_experts, experts.hidden_size, experts.local_size
    per_word, group = 32 // scheme.bits, scheme.group(hidden)
    experts.int_scheme, experts.int_group = scheme, group
    experts.panels = all(k % (PANEL_WORDS * per_word) == 0 for k in (hidden, local))
    shapes = {"gate_up": (2 * local, hidden), "down": (hidden, local)}
    for name, (n, k) in shapes.items():
        words = nn.Parameter(torch.zeros(e, n, k // per_word, dtype=torch.int32), requires_grad=False)
        scales = nn.Parameter(torch.ones(e, n, k // group), requires_grad=False)
        zeros = nn.Parameter(torch.full((e, n, k // group), float(1 << (scheme.bits - 1))), requires_grad=False)
        set_weight_attrs(words, keep_dtype=True)
        setattr(experts, f"{name}_proj", words)
        setattr(experts, f"{name}_scales", scales)
        setattr(experts, f"{name}_zeros", zeros)
    experts.quant_method = _FinishLoadedExperts()
    experts.loaded_int = False


def load_int_expert(experts: "FusedExperts", expert: int, shard: str, unpacked: UnpackedWeight) -> None:
    """One expert's gate, up or down weight into this rank's rows (gate/up) or columns (down) of the packed
    tensors."""
    hidden, inter, start, local = experts.hidden_size, experts.intermediate_size, experts.local_start, \
        experts.local_size
    expected = (hidden, inter) if shard == "down" else (inter, hidden)
    if tuple(unpacked.values.shape) != expected:
        raise CheckpointError(f"holds a {tuple(unpacked.values.shape)} weight but the model expects {expected}")
    scheme, group = experts.int_scheme, experts.int_group
    zeros = unpacked.zeros if unpacked.zeros is not None else torch.full_like(
        unpacked.scales, float(1 << (scheme.bits - 1)))
    if shard == "down":
        values, cols = unpacked.values[:, start:start + local], slice(start // group, (start + local) // group)
        scales, zeros, rows, name = unpacked.scales[:, cols], zeros[:, cols], slice(None), "down"
    else:
        values, scales, zeros = (t[start:start + local] for t in (unpacked.values, unpacked.scales, zeros))
        rows, name = slice(0, local) if shard == "gate" else slice(local, 2 * local), "gate_up"
    pack = pack_panels if experts.panels else pack_rows
    experts.loaded_int = True
    with torch.no_grad():
        getattr(experts, f"{name}_proj").data[expert, rows] = pack(values.contiguous(), scheme.bits)
        getattr(experts, f"{name}_scales").data[expert, rows] = scales
        getattr(experts, f"{name}_zeros").data[expert, rows] = zeros


def leave_int_experts(experts: "FusedExperts") -> None:
    """Turn ``experts`` (packed, nothing loaded yet) into 16-bit ones in the model dtype: their checkpoint stores
    them unquantized (a method that quantized only the attention and dense layers)."""
    if experts.loaded_int:
        raise CheckpointError("is a 16-bit expert weight but other experts of this layer are quantized")
    dtype, device = experts.gate_up_scales.dtype, experts.gate_up_scales.device
    for name in ("gate_up", "down"):
        words = getattr(experts, f"{name}_proj")
        shape = (*words.shape[:2], words.shape[2] * 32 // experts.int_scheme.bits)
        setattr(experts, f"{name}_proj", nn.Parameter(torch.empty(shape, dtype=dtype, device=device),
                                                      requires_grad=False))
        delattr(experts, f"{name}_scales")
        delattr(experts, f"{name}_zeros")
    experts.int_scheme = None
    del experts.quant_method


class _FinishLoadedExperts:
    """Once loaded: zero points that are all the midpoint (a symmetric checkpoint, or dummy weights) go, so the
    kernels use the constant; and the layer takes its share of the dequant scratch (:func:`reserve_dequant_scratch`)."""

    def process_weights_after_loading(self, experts: "FusedExperts") -> None:
        half = float(1 << (experts.int_scheme.bits - 1))
        if all(bool((zeros == half).all()) for zeros in (experts.gate_up_zeros, experts.down_zeros)):
            experts.gate_up_zeros = experts.down_zeros = None
        reserve_dequant_scratch(experts)


# The 16-bit scratch that large batches widen a layer's experts into (kernels/packed_int_moe.py's ``dequant`` form):
# one per device and dtype, shared by every MoE layer of the model; each layer holds a reference, so it lives as
# long as a model that uses it.
_SCRATCHES: "weakref.WeakValueDictionary[tuple[torch.device, torch.dtype], torch.Tensor]" = \
    weakref.WeakValueDictionary()


def reserve_dequant_scratch(experts: "FusedExperts") -> None:
    """Give ``experts`` (packed, on a GPU) the shared scratch of at least ``E * I/tp * H`` elements of the model dtype
    that its larger batches widen into (gate/up half by half): allocated here, at load, so the KV pool (sized from
    the memory left after loading) counts it; none where the dequant form is off
    (``TREADLE_INT_MOE_DEQUANT_ROWS=0``)."""
    words = experts.gate_up_proj
    experts.dequant_scratch = None
    if not (use_triton(words) and experts.panels) or not _kernels().dequant_rows_per_expert():
        return
    dtype = experts.gate_up_scales.dtype
    needed = experts.num_experts * experts.local_size * experts.hidden_size
    key = (words.device, dtype)
    scratch = _SCRATCHES.get(key)
    if scratch is None or scratch.numel() < needed:
        scratch = torch.empty(needed, dtype=dtype, device=words.device)
        _SCRATCHES[key] = scratch
    experts.dequant_scratch = scratch


@functools.cache
def _kernels():
    from treadle.kernels import packed_int_moe

    return packed_int_moe


def dequantize_expert(words: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, bits: int, group: int,
                      panels: bool, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight [N, K] in ``dtype`` from its packed words, scales and zero points."""
    values = (unpack_panels if panels else unpack_last)(words, bits).to(torch.float32)
    groups = torch.arange(values.shape[1], device=values.device) // group
    zero = float(1 << (bits - 1)) if zeros is None else zeros.to(torch.float32).index_select(1, groups)
    return ((values - zero) * scales.to(torch.float32).index_select(1, groups)).to(dtype)


def fused_int_experts(x: torch.Tensor, experts: "FusedExperts", topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor) -> torch.Tensor:
    """``sum_k topk_weights[t, k] * down_e(silu(gate_e(x_t)) * up_e(x_t))`` on the packed experts."""
    bits, group = experts.int_scheme.bits, experts.int_group
    if use_triton(x) and experts.panels:
        scratch = getattr(experts, "dequant_scratch", None)
        if scratch is not None and scratch.dtype != x.dtype:
            scratch = None
        return _kernels().fused_int_experts(
            x, experts.gate_up_proj, experts.gate_up_scales, experts.gate_up_zeros, experts.down_proj,
            experts.down_scales, experts.down_zeros, topk_weights, topk_ids, bits, group, scratch)
    return fused_int_experts_reference(x, experts, topk_weights, topk_ids)


def fused_int_experts_reference(x: torch.Tensor, experts: "FusedExperts", topk_weights: torch.Tensor,
                                topk_ids: torch.Tensor) -> torch.Tensor:
    """The PyTorch path: each routed expert's weights dequantized to ``x``'s dtype as it runs, its gated MLP over
    its rows, summed in expert order (as ``layers/fused_moe.py``'s reference sums 16-bit experts)."""
    bits, group, panels = experts.int_scheme.bits, experts.int_group, experts.panels
    out = torch.zeros_like(x)
    flat_ids = topk_ids.flatten()
    order = torch.argsort(flat_ids, stable=True)
    tokens, weights = order // topk_ids.shape[1], topk_weights.flatten()[order]
    # The per-expert row counts decide the loop on the host; this path runs on the CPU, where that costs nothing.
    counts = torch.bincount(flat_ids, minlength=experts.num_experts).tolist()
    start = 0
    for expert, count in enumerate(counts):
        if count:
            rows = tokens[start:start + count]
            gate_up, down = (dequantize_expert(
                getattr(experts, f"{name}_proj")[expert], getattr(experts, f"{name}_scales")[expert],
                None if getattr(experts, f"{name}_zeros") is None else getattr(experts, f"{name}_zeros")[expert],
                bits, group, panels, x.dtype) for name in ("gate_up", "down"))
            hidden = silu_mul(F.linear(x[rows], gate_up))
            out.index_add_(0, rows, (F.linear(hidden, down) * weights[start:start + count, None]).to(out.dtype))
        start += count
    return out
