"""The adapters resident on the device: per linear layer and projection, ``slots`` adapters stacked, and the output
delta that adds each token's adapter to the layer (``layer.add_output_delta``).

Every targeted projection (the model's q/k/v/o/gate/up/down) gets ``a`` ``[slots, max_rank, in]`` and ``b``
``[slots, out, max_rank]`` of this tensor-parallel rank's share, as the ``lora_backends`` contract describes
(core/lora/backend.py): views into its layer's stacked tensors (a fused qkv / gate_up layer's projections one above
the other, so the backend adds them all with one shrink and one expand). A column-parallel projection holds its rows of ``B`` (the rows of the base weight this rank
holds, KV heads replicated as the base's are), a row-parallel one its columns of ``A`` (its delta is a partial sum
that the layer's all-reduce adds up with the other ranks'). Loading an adapter into a slot copies its tensors in,
zeros beyond its rank; a projection the adapter leaves alone is zero in that slot.

The layers are found by what they offer (``add_output_delta``, ``in_features``, ``shard_ids``), so core imports no
layer module.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch import nn

from treadle.core.distributed.parallel import tp_kv_head_start
from treadle.core.execution.batch_context import BatchContext, BatchContextLayout
from treadle.core.lora.adapter import PROJECTIONS, LoRAAdapter
from treadle.core.lora.backend import LoRABackend, StackedLoRA, scaled_transpose

READS = BatchContextLayout(adapter_ids=True)  # plus the order, past the backend's adapter_order_above


@dataclass
class ProjectionSlots:
    """One projection's stacked adapters: its HF name, its device tensors, and where this rank's share sits in
    the full ``A`` (``in_start`` + ``a.shape[2]`` columns), the full ``B`` (``out_start`` + ``b.shape[1]`` rows)
    and the layer's output (``out_offset``)."""

    name: str
    a: torch.Tensor
    b: torch.Tensor
    scalings: torch.Tensor
    ranks: torch.Tensor
    in_start: int
    out_start: int
    out_offset: int
    dense_b: torch.Tensor | None = None  # [slots, R, rows]: b transposed and scaled (StackedLoRA.dense_b)

    @property
    def out_rows(self) -> int:
        return int(self.b.shape[1])

    def load(self, slot: int, adapter: LoRAAdapter | None) -> None:
        """Put ``adapter``'s change of this projection in ``slot`` (zeros when it has none, or for None)."""
        module = adapter.modules.get(self.name) if adapter is not None else None
        with torch.inference_mode():
            self.a[slot].zero_()
            self.b[slot].zero_()
            if self.dense_b is not None:
                self.dense_b[slot].zero_()
            if module is None:
                self.scalings[slot] = 0.0
                self.ranks[slot] = 0
                return
            rank, cols, rows = module.rank, self.a.shape[2], self.b.shape[1]
            self.a[slot, :rank].copy_(module.a[:, self.in_start:self.in_start + cols], non_blocking=True)
            self.b[slot, :, :rank].copy_(module.b[self.out_start:self.out_start + rows], non_blocking=True)
            self.scalings[slot] = module.scaling
            self.ranks[slot] = rank
            if self.dense_b is not None:  # zero past the rank, as b is
                self.dense_b[slot].copy_(scaled_transpose(self.b[slot], module.scaling))


class LayerSlots:
    """The projections of one linear layer (one, or the shards of a stacked qkv / gate_up layer), stacked as the
    backend's :class:`~treadle.core.lora.backend.StackedLoRA` (each projection's tensors are views into it), and
    the in-place delta that adds them into the layer's output."""

    def __init__(self, layer: nn.Module, named: list[tuple[str, Any]], backend: LoRABackend, slots: int,
                 max_rank: int, device: torch.device, dtype: torch.dtype) -> None:
        self.layer = layer
        self.backend = backend
        shapes = [_projection_shape(layer, shard) for _, shard in named]
        in_features, in_start = shapes[0][0], shapes[0][1]
        width = max(out_offset + rows for *_, out_offset, rows in shapes)
        count = len(named)
        with torch.inference_mode():
            self.weights = StackedLoRA(
                a=torch.zeros(slots, count * max_rank, in_features, dtype=dtype, device=device),
                b=torch.zeros(slots, width, max_rank, dtype=dtype, device=device),
                scalings=torch.zeros(count, slots, dtype=torch.float32, device=device),
                ranks=torch.zeros(count, slots, dtype=torch.int32, device=device),
                segments=tuple((out_offset, out_offset + rows) for *_, out_offset, rows in shapes),
                dense_b=(torch.zeros(slots, max_rank, width, dtype=dtype, device=device)
                         if backend.wants_dense_b else None))
        self.projections = []
        for p, ((name, _), (_, _, out_start, out_offset, _)) in enumerate(zip(named, shapes)):
            a, b, scalings, ranks = self.weights.projection(p)
            start, end = self.weights.segments[p]
            dense_b = None if self.weights.dense_b is None else self.weights.dense_b[:, :, start:end]
            self.projections.append(ProjectionSlots(name, a, b, scalings, ranks, in_start, out_start, out_offset,
                                                    dense_b))
        reads = dataclasses.replace(READS, adapter_order_above=backend.adapter_order_above)
        self.remove = layer.add_output_delta(self.delta, reads, in_place=True, split=self.split)

    def delta(self, x: torch.Tensor, context: BatchContext | None, out: torch.Tensor) -> None:
        """Add each token's adapter change of this layer's output into ``out`` (nothing when no token of this step
        has an adapter)."""
        if context is None or context.adapter_ids is None:
            return
        if self.backend.adapter_order_above is not None:
            self.backend.add_delta(x, self.weights, context.adapter_ids, out, order=context.adapter_order)
            return
        self.backend.add_delta(x, self.weights, context.adapter_ids, out)

    def split(self, x: torch.Tensor, context: BatchContext | None) -> Any:
        """The delta in two halves around the layer's matmul kernel (the backend's ``split_delta``), or None:
        :meth:`delta` runs (it adds nothing when no token of this step has an adapter)."""
        if context is None or context.adapter_ids is None:
            return None
        split_delta = getattr(self.backend, "split_delta", None)  # a backend written before it: none
        return None if split_delta is None else split_delta(x, self.weights, context.adapter_ids)


def model_projections(model: nn.Module) -> Iterator[tuple[nn.Module, list[tuple[str, Any]]]]:
    """Each linear layer of ``model`` an adapter may change, with the HF names of its projections and their shard
    ids (None for a layer of one projection)."""
    for module_name, layer in model.named_modules():
        if not (hasattr(layer, "add_output_delta") and hasattr(layer, "in_features")):
            continue
        parent = module_name.rpartition(".")[0]
        shard_ids = getattr(layer, "shard_ids", None)
        named = ([(f"{parent}.{shard}" if parent else shard, shard) for shard in shard_ids] if shard_ids
                 else [(module_name, None)])
        named = [(name, shard) for name, shard in named if name.rpartition(".")[2] in PROJECTIONS]
        if named:
            yield layer, named


def projection_shapes(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Every projection's HF name -> its full ``(out_features, in_features)``."""
    shapes = {}
    for layer, named in model_projections(model):
        for name, shard in named:
            out_features = layer.full_sizes[shard] if shard is not None else layer.out_features
            shapes[name] = (int(out_features), int(layer.in_features))
    return shapes


def build_layer_slots(model: nn.Module, backend: LoRABackend, slots: int, max_rank: int, device: torch.device,
                      dtype: torch.dtype) -> dict[str, ProjectionSlots]:
    """Stacked buffers for every projection of ``model`` and their deltas registered on the layers; the
    projections by HF name."""
    return projections_by_name(build_layers(model, backend, slots, max_rank, device, dtype))


def build_layers(model: nn.Module, backend: LoRABackend, slots: int, max_rank: int, device: torch.device,
                 dtype: torch.dtype) -> list[LayerSlots]:
    """A :class:`LayerSlots` (stacked buffers, delta registered) for every linear layer of ``model`` an adapter may
    change."""
    return [LayerSlots(layer, named, backend, slots, max_rank, device, dtype) for layer, named in
            model_projections(model)]


def projections_by_name(layers: list[LayerSlots]) -> dict[str, ProjectionSlots]:
    """Every projection of ``layers`` by its HF name."""
    return {projection.name: projection for layer in layers for projection in layer.projections}


def _projection_shape(layer: nn.Module, shard: Any) -> tuple[int, int, int, int, int]:
    """``(in_features, in_start, out_start, out_offset, rows)`` of one projection's share on this rank: its columns
    of ``A`` (from ``in_start``), its rows of ``B`` (from ``out_start``) and where they sit in the layer's output."""
    tp_rank, tp_size = int(getattr(layer, "tp_rank", 0)), int(getattr(layer, "tp_size", 1))
    in_features, in_start, out_offset = int(layer.in_features), 0, 0
    if shard is not None:  # a stacked column-parallel layer: this shard's rows, at its offset in the output
        out_offset, rows = layer.shards[shard]
        out_start = _shard_row_start(layer, shard, rows, tp_rank, tp_size)
    elif getattr(layer, "splits_output", True):
        rows = int(layer.out_features) // tp_size
        out_start = tp_rank * rows
    else:  # row-parallel: this rank's columns of A; B whole
        rows, out_start = int(layer.out_features), 0
        in_features //= tp_size
        in_start = tp_rank * in_features
    return in_features, in_start, out_start, out_offset, rows


def _shard_row_start(layer: nn.Module, shard: Any, rows: int, tp_rank: int, tp_size: int) -> int:
    """The first row of the full projection this rank holds: KV heads are replicated when fewer than the ranks."""
    query = getattr(layer, "query_shard", None)
    if query is not None and shard != query:
        return tp_kv_head_start(layer.total_num_kv_heads, tp_rank, tp_size) * layer.head_size
    return tp_rank * rows
