"""The ``lora_backends`` plugin kind: the kernels that add a batch's LoRA deltas to a linear layer's output.

The adapters resident on the device are stacked per layer and projection into slots: ``a`` ``[slots, R, in]``
and ``b`` ``[slots, out, R]`` with ``R`` the configured ``lora.max_rank`` (an adapter of rank ``r < R`` is
zero beyond ``r``; ``ranks[slot]`` says ``r`` so a kernel may skip the padding). Each token of a batch carries
its slot in ``adapter_ids`` (``[num_tokens]`` int64, :data:`~treadle.core.execution.batch_context.NO_ADAPTER`
for none), read from the step's batch context. The delta of token ``t`` is
``scalings[s] * (x[t] @ a[s].T) @ b[s].T`` for its slot ``s``, nothing for ``NO_ADAPTER``.

A backend is built by ``factory(max_slots, max_rank, device, dtype)`` and computes that in two calls:

- :meth:`LoRABackend.shrink`: ``[num_tokens, R]`` = scaled ``x @ a[s].T`` per token;
- :meth:`LoRABackend.expand`: adds ``h @ b[s].T`` into ``out`` (which may be a column slice: a strided view).

The engine calls :meth:`LoRABackend.add_delta` once per linear layer: a fused layer's projections (q/k/v of a
``qkv_proj``, gate/up of a ``gate_up_proj``) stacked in one :class:`StackedLoRA`, their deltas added into the
layer's output in place. Its default shrinks and expands each projection in turn through the two calls above, so a
backend that has only those works unchanged; the built-ins override it to shrink every projection in one kernel
(reading ``x`` once) and expand into the output in another, with no separate add. A backend whose
``adapter_order_above`` is a number ``n`` also receives ``order=``: for batches of more than ``n`` tokens the
step's token indices sorted by slot (stable, tokens without an adapter first; ``BatchContext.adapter_order``),
sorted once a step on the device, so kernels can work on blocks of tokens that share an adapter without sorting
in every layer; ``order`` may be None (a smaller batch, or a step whose context has none). A backend whose
``wants_dense_b`` is true gets :attr:`StackedLoRA.dense_b` too (a second copy of ``b``, transposed and scaled, kept
current by whoever loads the slots), for a form that multiplies every slot's ``B`` in one library GEMM.

A backend may also offer :meth:`LoRABackend.split_delta`: the delta in two halves around the layer's own matmul
kernel, the first (the shrink) run in the matmul's launch (``beside``) or in its own (``apart(x)``, beside a library
matmul), the second (the expand) carrying the layer's epilogue (SiLU·mul, add + RMSNorm), where the layer's linear
method can split (the ``triton`` backend's at decode sizes: two launches a layer on the small-batch matmul, three on
cuBLAS). None, the default: the engine calls ``add_delta``.

A backend whose kernels compile at first use may implement :meth:`LoRABackend.warm_up`: the engine calls it once at
start (the slots built, before serving) with every layer's :class:`StackedLoRA` and the most tokens a step can hold,
so that every kernel a batch of 1 to that many tokens can launch is compiled before the first request rather than
on it (the default does nothing). It must change no adapter slot: it reads the weights and writes only scratch
tensors of its own.

All of them must run under CUDA-graph capture (no host-device sync, no allocation that depends on values, and the
same kernels whatever the adapter ids are) and match the ``torch`` built-in's arithmetic within the dtype's
rounding.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass(frozen=True)
class StackedLoRA:
    """The adapters of one linear layer, its ``P`` projections stacked: ``a`` ``[slots, P * R, in]`` (projection
    ``p``'s ``A`` in rows ``p * R`` to ``(p + 1) * R``), ``b`` ``[slots, width, R]`` whose row ``n`` is output column
    ``n`` (projection ``p``'s ``B`` in the rows of its columns, ``segments[p]`` = ``(start, end)``), ``scalings``
    ``[P, slots]`` float32 and ``ranks`` ``[P, slots]`` int32 (0: the slot's adapter leaves the projection alone).

    ``dense_b`` (None unless the backend ``wants_dense_b``): ``[slots, R, width]``, each slot's ``b`` transposed with
    its projection's scaling folded in (``dense_b[s, r, n] = scalings[p, s] * b[s, n, r]`` for ``n`` in
    ``segments[p]``), so ``dense_b.view(slots * R, width)`` is every slot's ``B`` stacked along the reduction: one
    GEMM expands a batch over all slots (:meth:`with_dense_b` computes it)."""

    a: torch.Tensor
    b: torch.Tensor
    scalings: torch.Tensor
    ranks: torch.Tensor
    segments: tuple[tuple[int, int], ...]
    dense_b: torch.Tensor | None = None

    @property
    def rank_dim(self) -> int:
        """``R``: the padded rank of every projection (``lora.max_rank``)."""
        return int(self.b.shape[2])

    def projection(self, p: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projection ``p``'s ``a`` ``[slots, R, in]``, ``b`` ``[slots, end - start, R]``, scalings and ranks
        (views into the stacked tensors)."""
        rank, (start, end) = self.rank_dim, self.segments[p]
        return self.a[:, p * rank:(p + 1) * rank], self.b[:, start:end], self.scalings[p], self.ranks[p]

    def with_dense_b(self) -> "StackedLoRA":
        """These weights with :attr:`dense_b` computed from ``b`` and ``scalings`` (rounded once, to ``b``'s
        dtype)."""
        dense_b = torch.zeros(self.b.shape[0], self.b.shape[2], self.b.shape[1], dtype=self.b.dtype,
                              device=self.b.device)
        for p, (start, end) in enumerate(self.segments):
            dense_b[:, :, start:end] = scaled_transpose(self.b[:, start:end], self.scalings[p].view(-1, 1, 1))
        return dataclasses.replace(self, dense_b=dense_b)


def scaled_transpose(b: torch.Tensor, scaling: torch.Tensor | float) -> torch.Tensor:
    """``b`` ``[..., rows, R]`` times ``scaling`` in float32, as ``[..., R, rows]`` rounded once to ``b``'s dtype: what
    :attr:`StackedLoRA.dense_b` holds of each slot's ``b``."""
    return (b.float() * scaling).transpose(-2, -1).to(b.dtype)


class LoRABackend(ABC):
    """Shrink and expand for a batch of tokens whose adapters differ (module docstring)."""

    #: :meth:`add_delta` takes ``order=`` (the batch's tokens sorted by slot, for batches of more tokens than
    #: this; module docstring); None: it takes no ``order``, and no step sorts its adapters for it.
    adapter_order_above: int | None = None
    #: The layers' :class:`StackedLoRA` carry ``dense_b`` (a second copy of every slot's ``B``: the same memory
    #: again) for this backend's ``add_delta``.
    wants_dense_b: bool = False

    @abstractmethod
    def shrink(self, x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
               ranks: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, in]``, ``a`` ``[slots, R, in]``, ``adapter_ids`` ``[T]``, ``scalings`` ``[slots]``
        float32, ``ranks`` ``[slots]`` int -> ``[T, R]`` (``x``'s dtype): zero rows for ``NO_ADAPTER``."""

    @abstractmethod
    def expand(self, h: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, ranks: torch.Tensor,
               out: torch.Tensor) -> None:
        """``out[t] += h[t] @ b[s].T`` for each token's slot ``s`` (``b`` ``[slots, out_features, R]``); rows
        of ``NO_ADAPTER`` are left as they are. ``out`` may be a strided column slice of a wider output."""

    def add_delta(self, x: torch.Tensor, weights: StackedLoRA, adapter_ids: torch.Tensor, out: torch.Tensor) -> None:
        """``out[t, start:end] += scalings[p, s] * (x[t] @ a_p[s].T) @ b_p[s].T`` for every projection ``p`` of
        ``weights`` (its columns ``segments[p]``) and each token's slot ``s``: the layer's output ``out`` changed in
        place, rows of ``NO_ADAPTER`` and columns outside the segments left as they are. The default runs
        :meth:`shrink` and :meth:`expand` per projection."""
        for p, (start, end) in enumerate(weights.segments):
            a, b, scalings, ranks = weights.projection(p)
            self.expand(self.shrink(x, a, adapter_ids, scalings, ranks), b, adapter_ids, ranks, out[:, start:end])

    def warm_up(self, layers: Sequence[StackedLoRA], max_tokens: int) -> int:
        """Launch, once, every kernel variant that :meth:`add_delta` would compile at first use for a batch of 1 to
        ``max_tokens`` tokens on these layers, reading their weights and writing only scratch tensors (``adapter_ids``
        of :data:`~treadle.core.execution.batch_context.NO_ADAPTER` suit: the kernels compile whatever the ids).
        Called once at engine start, after the CUDA graphs are captured (whose sizes, and the one-token steps
        :meth:`split_delta` serves, their capture compiled). Returns the number of batches run (the default: 0)."""
        return 0

    def split_delta(self, x: torch.Tensor, weights: StackedLoRA, adapter_ids: torch.Tensor) -> Any:
        """:meth:`add_delta`'s change in two halves around the layer's matmul kernel (a ``SplitDelta``,
        layers/output_delta.py: ``beside``, what the linear method's kernel runs in its own launch, or None;
        ``apart(x)``, the same in a launch of its own, for a library matmul; then ``add``, ``silu_mul`` or
        ``add_rmsnorm`` after it), or None (the default): the engine calls :meth:`add_delta`. Asked only where the
        layer's method can split for ``x`` (its own kernel, or its library matmul with ``apart``); the halves must
        give what :meth:`add_delta` (then SiLU·mul, or add + RMSNorm) gives."""
        return None
