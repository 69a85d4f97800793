"""The ``triton`` LoRA backend: treadle's Triton shrink and expand kernels (kernels/lora.py) for batches whose tokens
use different adapters of different ranks, decode (one token per program, gathered through its slot) and prefill
(tensor-core tiles over blocks of tokens that share an adapter) alike. ``add_delta`` is a layer's whole LoRA path in
two launches: one shrink for its stacked projections, one expand into the layer's output in place; past
``LoRAKernelChoice.sort_above`` tokens over the tokens sorted by adapter (``order=``, sorted once a step); past
``dense_above`` (up to ``dense_max_tokens``) tokens as cuBLAS GEMMs over every slot at once (kernels/lora_dense.py),
where the slots' stack is small enough (``dense_max_stack``) that the layers keep the dense copy of ``B`` it reads.

Registered even where Triton is missing (so ``treadle plugins`` lists it); building it there fails with the
install hint. Triton is imported only when the backend is built.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import torch

from treadle.core.execution.batch_context import NO_ADAPTER
from treadle.core.hookspecs import Register, hookimpl
from treadle.core.lora.backend import LoRABackend, StackedLoRA


class TritonLoRABackend(LoRABackend):
    """Shrink and expand as Triton kernels on a CUDA device (or the CPU under ``TRITON_INTERPRET=1``, for tests);
    the contract is :class:`~treadle.core.lora.backend.LoRABackend`'s."""

    def __init__(self, max_slots: int, max_rank: int, device: torch.device | str, dtype: torch.dtype) -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda" and not _interpreting():
            raise RuntimeError(
                f"the triton LoRA backend runs on a CUDA device, not '{self.device}'; use lora.backend: torch there "
                "(or set TRITON_INTERPRET=1 to run the kernels slowly on the CPU for testing)"
            )
        self.max_slots, self.max_rank, self.dtype = max_slots, max_rank, dtype
        self._kernels = _import_kernels()
        # Kernels compile at first use on CUDA (the interpreter compiles nothing): warm_up runs them at start.
        self.compiles = self.device.type == "cuda"
        # add_delta's forms, tiles and PDL hand-over (kernels/lora_choice.py), TREADLE_LORA_KERNELS read when built
        self.kernel_choice = self._kernels.choice_from_env()
        self._split_kernels: Any = None

    def shrink(self, x: torch.Tensor, a: torch.Tensor, adapter_ids: torch.Tensor, scalings: torch.Tensor,
               ranks: torch.Tensor) -> torch.Tensor:
        return self._kernels.shrink(x, a, adapter_ids, scalings, ranks)

    def expand(self, h: torch.Tensor, b: torch.Tensor, adapter_ids: torch.Tensor, ranks: torch.Tensor,
               out: torch.Tensor) -> None:
        self._kernels.expand(h, b, adapter_ids, ranks, out)

    @property
    def wants_dense_b(self) -> bool:
        """The layers keep ``StackedLoRA.dense_b`` for the dense form where the stack of slots is small enough."""
        return self.max_slots * self.max_rank <= self.kernel_choice.dense_max_stack

    @property
    def adapter_order_above(self) -> int:
        """Batches of more tokens than this run the sorted form (kernels/lora_sorted.py), over ``order=``."""
        return self.kernel_choice.sort_above

    def add_delta(self, x: torch.Tensor, weights: StackedLoRA, adapter_ids: torch.Tensor, out: torch.Tensor,
                  order: torch.Tensor | None = None) -> None:
        if self._dense(x.shape[0], weights):
            self._kernels.add_delta_dense(x, weights.a, weights.dense_b, adapter_ids, weights.segments, out)
            return
        if len(weights.segments) > self._kernels.MAX_PROJECTIONS:  # no such layer among the model families
            super().add_delta(x, weights, adapter_ids, out)
            return
        self._kernels.add_delta(x, weights.a, weights.b, adapter_ids, weights.scalings, weights.ranks,
                                weights.segments, out, self.kernel_choice, order)

    def split_delta(self, x: torch.Tensor, weights: StackedLoRA, adapter_ids: torch.Tensor) -> Any:
        """Where ``add_delta`` runs the gather form (decode sizes) and ``fuse_gemv`` is on: the gather shrink for the
        small-batch matmul's launch (or a launch of its own beside a library matmul) and an expand that carries the
        layer's epilogue (kernels/lora_fused.py)."""
        if self._split_kernels is None:  # imported at the first split, as the other kernels when the backend is built
            from treadle.kernels import lora_fused

            self._split_kernels = lora_fused
        num_tokens = x.shape[0]
        if (self._dense(num_tokens, weights)
                or not self._split_kernels.splits(num_tokens, len(weights.segments), self.kernel_choice)):
            return None
        return self._split_kernels.split_lora(x, weights.a, weights.b, adapter_ids, weights.scalings, weights.ranks,
                                              weights.segments, self.kernel_choice)

    def warm_up(self, layers: Sequence[StackedLoRA], max_tokens: int) -> int:
        """``add_delta`` once for every batch size of 1 to ``max_tokens`` tokens that compiles kernels of its own
        (kernels/lora_warm.py), on one layer of each shape (layers of one shape share their compiled kernels):
        every token of no adapter, scratch inputs and outputs (zeros, allocated once for the largest), the layers'
        weights only read. Nothing to compile off CUDA (the interpreter): ``compiles`` False skips it."""
        if not self.compiles:
            return 0
        by_shape: dict[tuple, StackedLoRA] = {}
        for weights in layers:
            by_shape.setdefault(_shape(weights), weights)
        batches = [(weights, num_tokens) for weights in by_shape.values()
                   for num_tokens in self.warm_up_sizes(weights, max_tokens)]
        if not batches:
            return 0
        most = max(num_tokens for _, num_tokens in batches)
        x_flat = torch.zeros(max(n * w.a.shape[2] for w, n in batches), dtype=self.dtype, device=self.device)
        out_flat = torch.zeros(max(n * w.b.shape[1] for w, n in batches), dtype=self.dtype, device=self.device)
        ids = torch.full((most,), NO_ADAPTER, dtype=torch.int64, device=self.device)
        order = torch.arange(most, dtype=torch.int64, device=self.device)
        for weights, num_tokens in batches:
            in_features, width = weights.a.shape[2], weights.b.shape[1]
            out = out_flat[:num_tokens * width].view(num_tokens, width)
            sorted_order = order[:num_tokens] if num_tokens > self.adapter_order_above else None
            self.add_delta(x_flat[:num_tokens * in_features].view(num_tokens, in_features), weights, ids[:num_tokens],
                           out, order=sorted_order)
        return len(batches)

    def warm_up_sizes(self, weights: StackedLoRA, max_tokens: int) -> list[int]:
        """The batch sizes of 1 to ``max_tokens`` whose ``add_delta`` on a layer of ``weights``' shape launches kernels
        no smaller size launches (the smallest of each)."""
        choice, rows, in_features = self.kernel_choice, weights.a.shape[1], weights.a.shape[2]

        def variant(num_tokens: int) -> Any:
            if self._dense(num_tokens, weights):  # its launches take no stride that grows with the batch
                return self._kernels.BatchVariant("dense", "dense", None)
            launches = self._kernels.add_delta_variant(num_tokens, rows, in_features, weights.rank_dim,
                                                       weights.segments, choice)
            # The sorted form resumes past the dense window: the sizes after it are a run of their own.
            return self._kernels.BatchVariant((num_tokens > choice.dense_above, launches), launches, num_tokens * rows)

        return self._kernels.variant_token_counts(variant, max_tokens)

    def _dense(self, num_tokens: int, weights: StackedLoRA) -> bool:
        """Whether a batch of ``num_tokens`` takes the dense form (kernels/lora_dense.py)."""
        choice = self.kernel_choice
        return (weights.dense_b is not None and choice.dense_above < num_tokens <= choice.dense_max_tokens
                and weights.a.shape[0] * weights.rank_dim <= choice.dense_max_stack)


def _shape(weights: StackedLoRA) -> tuple:
    """What the kernels compiled for a layer depend on besides the batch: its tensors' shapes, strides and dtypes."""
    tensors = (weights.a, weights.b, weights.scalings, weights.ranks, weights.dense_b)
    return weights.segments, tuple(None if t is None else (t.shape, t.stride(), t.dtype) for t in tensors)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _import_kernels() -> Any:
    try:
        from treadle.kernels import lora
    except ImportError as exc:
        raise RuntimeError(
            f"the triton LoRA backend needs Triton, which could not be imported ({exc}); "
            "pip install triton  (or: pip install 'treadle[triton]')"
        ) from exc
    return lora


@hookimpl
def treadle_register_lora_backends(register: Register) -> None:
    register("triton", TritonLoRABackend)
