"""Per-request changes to a linear layer's output (``LinearBase.add_output_delta``): what one is, and adding them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from treadle.core.execution.batch_context import BatchContextLayout, current_batch_context

# fn(x, context): what to add to the layer's output for input x, or None (nothing this step); an in-place delta's
# fn(x, context, out) adds it into out itself.
DeltaFn = Callable[..., "torch.Tensor | None"]


@dataclass(frozen=True)
class OutputDelta:
    """A per-request change to a linear layer's output: ``fn(x, context)`` returns what to add (a tensor
    broadcastable to this rank's output, or None: nothing this step); ``reads`` says which context tensors
    ``fn`` reads, so CUDA graphs capture static copies of them (None: none). ``in_place``: ``fn(x, context, out)``
    adds its change into the layer's output ``out`` itself (no tensor of the change, no separate add)."""

    fn: DeltaFn
    reads: BatchContextLayout | None = None
    in_place: bool = False


def add_deltas(deltas: Sequence[OutputDelta], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """``y`` plus each delta of ``x`` under the current batch context, in order."""
    context = current_batch_context()
    for delta in deltas:
        if delta.in_place:
            delta.fn(x, context, y)
            continue
        change = delta.fn(x, context)
        if change is not None:
            y = y + change
    return y


def merged_reads(deltas: Sequence[OutputDelta]) -> BatchContextLayout | None:
    """Everything ``deltas`` read from the batch context (None: nothing)."""
    merged = None
    for delta in deltas:
        if delta.reads is not None:
            merged = delta.reads if merged is None else merged.merge(delta.reads)
    return merged
