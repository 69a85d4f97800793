"""Per-request changes to a linear layer's output (``LinearBase.add_output_delta``): what one is, and adding them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch

from treadle.core.execution.batch_context import BatchContextLayout, current_batch_context

# fn(x, context): what to add to the layer's output for input x, or None (nothing this step); an in-place delta's
# fn(x, context, out) adds it into out itself.
DeltaFn = Callable[..., "torch.Tensor | None"]
# split(x, context): the delta as a SplitDelta, or None (run fn).
SplitFn = Callable[..., "SplitDelta | None"]


class SplitDelta(Protocol):
    """A delta in two halves around the layer's matmul (``OutputDelta.split``): :attr:`beside` is what the linear
    method's matmul kernel runs in its own launch (``LinearMethod.apply_split``; the LoRA shrink), or :meth:`apart`
    runs it in a launch of its own (a library matmul, or a ``beside`` of None); one of the other methods the rest,
    after the matmul, on its output."""

    beside: Any  # None: the first half cannot run in a matmul's launch (the method calls ``apart``)

    def apart(self, x: torch.Tensor) -> None:
        """Runs the first half on the layer's input ``x`` in a launch of its own (a delta without this method runs
        only where the matmul runs :attr:`beside`)."""

    def add(self, out: torch.Tensor) -> None:
        """Adds the delta into the layer's output ``out``."""

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` of ``[gate | up]`` = ``gate_up`` plus the delta."""

    def add_rmsnorm(self, y: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    gemv_warps: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rmsnorm(s) * norm_weight, s)`` for ``s = y + delta + residual``, rounded as the path it replaces:
        ``gemv_warps`` given, the delta joins the residual first and the norm sums as a one-token GEMV of that many
        warps fusing add + RMSNorm does; None, the delta joins ``y``, then a separate add + RMSNorm."""


@dataclass(frozen=True)
class OutputDelta:
    """A per-request change to a linear layer's output: ``fn(x, context)`` returns what to add (a tensor
    broadcastable to this rank's output, or None: nothing this step); ``reads`` says which context tensors
    ``fn`` reads, so CUDA graphs capture static copies of them (None: none). ``in_place``: ``fn(x, context, out)``
    adds its change into the layer's output ``out`` itself (no tensor of the change, no separate add).
    ``split`` (optional): ``split(x, context)`` gives the change as a :class:`SplitDelta` whose first half the
    layer's matmul kernel runs in its own launch, or None (``fn`` runs); asked only where the layer has no other
    delta and its linear method runs such a kernel for ``x`` (``LinearMethod.apply_split``)."""

    fn: DeltaFn
    reads: BatchContextLayout | None = None
    in_place: bool = False
    split: SplitFn | None = None


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


def apply_split(layer: Any, x: torch.Tensor, silu_mul: bool = False,
                add_rmsnorm: tuple[torch.Tensor, torch.Tensor, float] | None = None) -> Any:
    """What the unbiased ``layer``'s quant method's ``apply`` (``silu_mul``: ``apply_silu_mul``; ``add_rmsnorm`` =
    ``(residual, norm_weight, eps)``: ``apply_add_rmsnorm``) returns, with its one delta split around the method's
    kernel (``OutputDelta.split``, ``LinearMethod.apply_split``); None where that does not run (nothing ran: the
    caller adds the deltas apart)."""
    deltas = layer.output_deltas
    apply = getattr(layer.quant_method, "apply_split", None)  # a third-party method written before it: none
    if len(deltas) != 1 or deltas[0].split is None or apply is None:
        return None
    split = deltas[0].split
    return apply(layer, x, lambda: split(x, current_batch_context()), silu_mul=silu_mul, add_rmsnorm=add_rmsnorm)


def merged_reads(deltas: Sequence[OutputDelta]) -> BatchContextLayout | None:
    """Everything ``deltas`` read from the batch context (None: nothing)."""
    merged = None
    for delta in deltas:
        if delta.reads is not None:
            merged = delta.reads if merged is None else merged.merge(delta.reads)
    return merged
