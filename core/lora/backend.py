"""The ``lora_backends`` plugin kind: the kernels that add a batch's LoRA deltas to a linear layer's output.

The adapters resident on the device are stacked per layer and projection into slots: ``a`` ``[slots, R, in]``
and ``b`` ``[slots, out, R]`` with ``R`` the configured ``lora.max_rank`` (an adapter of rank ``r < R`` is
zero beyond ``r``; ``ranks[slot]`` says ``r`` so a kernel may skip the padding). Each token of a batch carries
its slot in ``adapter_ids`` (``[num_tokens]`` int64, :data:`~treadle.core.execution.batch_context.NO_ADAPTER`
for none), read from the step's batch context. The delta of token ``t`` is
``scalings[s] * (x[t] @ a[s].T) @ b[s].T`` for its slot ``s``, nothing for ``NO_ADAPTER``.

A backend is built by ``factory(max_slots, max_rank, device, dtype)`` and computes that in two calls, so a
fused projection (qkv, gate_up) shrinks once per sub-projection and expands into column slices of one output:

- :meth:`LoRABackend.shrink`: ``[num_tokens, R]`` = scaled ``x @ a[s].T`` per token;
- :meth:`LoRABackend.expand`: adds ``h @ b[s].T`` into ``out`` (which may be a column slice: a strided view).

Both must run under CUDA-graph capture (no host-device sync, no allocation that depends on values, and the
same kernels whatever the adapter ids are) and match the ``torch`` built-in's arithmetic
within the dtype's rounding.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch


class LoRABackend(ABC):
    """Shrink and expand for a batch of tokens whose adapters differ (module docstring)."""

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
