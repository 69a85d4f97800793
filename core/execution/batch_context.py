"""BatchContext: per-step values a model's layers can read (each token's adapter, per-request tensors).

A step's context rides on ``ForwardBatch.batch_context`` (None: nothing to say). The model runner makes it
current around the model call (:func:`using_batch_context`), so any layer reads it with
:func:`current_batch_context` without every ``forward(x)`` taking it: a linear layer's output deltas
(``layers/linear.py``, ``LinearBase.add_output_delta``) receive it.

CUDA graphs capture their forward once, so a graph reads its context from static tensors
(:class:`StaticBatchContext`) that each replay's batch is copied into first. Which tensors those are is the
union of what the model's modules declare they read (:class:`ReadsBatchContext`, a
:class:`BatchContextLayout`): a model nothing of which reads the context captures no static context and
copies nothing per step.
"""

from __future__ import annotations

from contextvars import ContextVar, Token
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from treadle.core.execution.forward_batch import ForwardBatch

# The adapter id of a token that runs no adapter (and of CUDA-graph padding rows).
NO_ADAPTER = -1


@dataclass
class BatchContext:
    """Per-step values for one ForwardBatch's tokens, on the batch's device.

    ``token_requests`` [num_tokens] int64 is the batch row of each token's request; ``adapter_ids``
    [num_tokens] int64 (or None) each token's adapter slot, :data:`NO_ADAPTER` for none; ``per_request``
    maps names to ``[batch_size, ...]`` tensors and ``per_token`` to ``[num_tokens, ...]`` tensors;
    ``adapter_order`` [num_tokens] int64 (None without adapter ids, or where no reader wants it: every step for a
    LoRA backend whose ``adapter_order_above`` is None, else a step of no more tokens than that, or a CUDA graph of
    no more tokens than the layout's) the token indices sorted by ``adapter_ids`` (stable: :func:`adapter_order`),
    so LoRA kernels need not sort in every layer.
    Build one with :meth:`for_batch`.
    """

    token_requests: torch.Tensor
    adapter_ids: torch.Tensor | None = None
    per_request: dict[str, torch.Tensor] = field(default_factory=dict)
    per_token: dict[str, torch.Tensor] = field(default_factory=dict)
    adapter_order: torch.Tensor | None = None

    @classmethod
    def for_batch(cls, forward_batch: "ForwardBatch", request_adapter_ids: torch.Tensor | None = None,
                  per_request: Mapping[str, torch.Tensor] | None = None,
                  per_token: Mapping[str, torch.Tensor] | None = None,
                  adapter_order_above: int | None = 0) -> "BatchContext":
        """The context of ``forward_batch`` given each request's adapter slot (``[batch_size]``, expanded here to
        one per token) and named tensors; no host-device sync. The adapter ids are sorted into ``adapter_order`` for
        batches of more than ``adapter_order_above`` tokens (None: never; the model worker passes its LoRA
        backend's, :attr:`~treadle.core.lora.backend.LoRABackend.adapter_order_above`)."""
        token_requests = token_request_rows(forward_batch)
        adapter_ids = order = None
        if request_adapter_ids is not None:
            adapter_ids = request_adapter_ids.to(torch.int64).index_select(0, token_requests)
            if adapter_order_above is not None and forward_batch.num_tokens > adapter_order_above:
                order = adapter_order(adapter_ids)
        return cls(token_requests, adapter_ids, dict(per_request or {}), dict(per_token or {}), order)

    def request_values(self, name: str) -> torch.Tensor:
        """The per-request tensor ``name`` with one row per token (its request's row)."""
        return self.per_request[name].index_select(0, self.token_requests)


def adapter_order(adapter_ids: torch.Tensor) -> torch.Tensor:
    """The token indices sorted by adapter slot, stable (:data:`NO_ADAPTER` first): one sort on the device."""
    return torch.sort(adapter_ids, stable=True).indices


def token_request_rows(forward_batch: "ForwardBatch") -> torch.Tensor:
    """The batch row of each token's request (``[num_tokens]`` int64), from the extend lengths, or an equal number
    of tokens per request when the batch has none (a decode step)."""
    batch_size, num_tokens = forward_batch.batch_size, forward_batch.num_tokens
    rows = torch.arange(batch_size, dtype=torch.int64, device=forward_batch.input_ids.device)
    if forward_batch.extend_seq_lens is not None:
        return torch.repeat_interleave(rows, forward_batch.extend_seq_lens, output_size=num_tokens)
    per_request = num_tokens // max(batch_size, 1)
    return rows if per_request == 1 else rows.repeat_interleave(per_request)


# ------------------------------------------------------------------ the current context


_current: ContextVar[BatchContext | None] = ContextVar("treadle_batch_context", default=None)


def current_batch_context() -> BatchContext | None:
    """The context of the forward running now (None outside one, or for a batch without a context)."""
    return _current.get()


class using_batch_context:  # noqa: N801  (used like a function: ``with using_batch_context(ctx):``)
    """Makes ``context`` current for the ``with`` block (the previous one is restored after)."""

    __slots__ = ("_context", "_token")

    def __init__(self, context: BatchContext | None) -> None:
        self._context = context
        self._token: Token | None = None

    def __enter__(self) -> BatchContext | None:
        self._token = _current.set(self._context)
        return self._context

    def __exit__(self, *exc_info: Any) -> None:
        _current.reset(self._token)


# ------------------------------------------------------------------ what the model reads


@dataclass(frozen=True)
class ContextTensor:
    """The shape of one row of a named context tensor (after the row dimension) and its dtype."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32


@dataclass(frozen=True)
class BatchContextLayout:
    """Which context tensors a module reads: ``adapter_ids``, and named per-request and per-token tensors
    (``token_requests`` is always there), and ``adapter_order`` for batches of more than ``adapter_order_above``
    tokens (None: never). CUDA graphs capture static copies of exactly these (a graph of fewer tokens gets no
    order, and its replays sort nothing)."""

    adapter_ids: bool = False
    per_request: Mapping[str, ContextTensor] = field(default_factory=dict)
    per_token: Mapping[str, ContextTensor] = field(default_factory=dict)
    adapter_order_above: int | None = None

    def merge(self, other: "BatchContextLayout") -> "BatchContextLayout":
        """Everything either layout reads; a name both read with different shapes or dtypes is an error."""
        above = [n for n in (self.adapter_order_above, other.adapter_order_above) if n is not None]
        return BatchContextLayout(self.adapter_ids or other.adapter_ids,
                                  _merged("per-request", self.per_request, other.per_request),
                                  _merged("per-token", self.per_token, other.per_token),
                                  min(above) if above else None)


def _merged(kind: str, ours: Mapping[str, ContextTensor], theirs: Mapping[str, ContextTensor]
            ) -> dict[str, ContextTensor]:
    merged = dict(ours)
    for name, spec in theirs.items():
        if merged.setdefault(name, spec) != spec:
            raise ValueError(f"{kind} context tensor '{name}' is read as {merged[name]} and as {spec}; "
                             "every reader must agree on its shape and dtype")
    return merged


@runtime_checkable
class ReadsBatchContext(Protocol):
    """A module whose forward reads the current :class:`BatchContext`; ``batch_context_reads`` says which
    tensors (None: none at the moment)."""

    batch_context_reads: BatchContextLayout | None


def model_context_layout(model: nn.Module) -> BatchContextLayout | None:
    """What the modules of ``model`` read from the context, merged (None: nothing reads it)."""
    layout = None
    for module in model.modules():
        if isinstance(module, ReadsBatchContext) and module.batch_context_reads is not None:
            reads = module.batch_context_reads
            layout = reads if layout is None else layout.merge(reads)
    return layout


# ------------------------------------------------------------------ CUDA graphs


class StaticBatchContext:
    """The context a CUDA graph is captured with: static tensors of up to ``max_tokens`` / ``max_requests`` rows
    for a :class:`BatchContextLayout`. :meth:`view` is what a capture makes current; :meth:`load` copies a
    batch's context into the first rows before a replay and fills the padding rows (no adapter, zeros)."""

    def __init__(self, layout: BatchContextLayout, max_tokens: int, max_requests: int,
                 device: torch.device | str) -> None:
        self.layout = layout
        with torch.inference_mode():
            self.token_requests = torch.zeros(max_tokens, dtype=torch.int64, device=device)
            self.adapter_ids = (torch.full((max_tokens,), NO_ADAPTER, dtype=torch.int64, device=device)
                                if layout.adapter_ids else None)
            # The padded ids sorted (values unused) and their order: refilled by each load past the layout's
            # adapter_order_above tokens, read by the graphs of those sizes.
            sorts = layout.adapter_ids and layout.adapter_order_above is not None
            self.sorted_ids = torch.empty_like(self.adapter_ids) if sorts else None
            self.adapter_order = torch.arange(max_tokens, dtype=torch.int64, device=device) if sorts else None
            self.per_request = {name: torch.zeros((max_requests, *spec.shape), dtype=spec.dtype, device=device)
                                for name, spec in layout.per_request.items()}
            self.per_token = {name: torch.zeros((max_tokens, *spec.shape), dtype=spec.dtype, device=device)
                              for name, spec in layout.per_token.items()}

    def view(self, num_tokens: int, batch_size: int) -> BatchContext:
        """The first ``num_tokens`` / ``batch_size`` rows as a context."""
        return BatchContext(
            self.token_requests[:num_tokens],
            None if self.adapter_ids is None else self.adapter_ids[:num_tokens],
            {name: tensor[:batch_size] for name, tensor in self.per_request.items()},
            {name: tensor[:num_tokens] for name, tensor in self.per_token.items()},
            self.adapter_order[:num_tokens] if self._sorts(num_tokens) else None,
        )

    def _sorts(self, num_tokens: int) -> bool:
        return self.adapter_order is not None and num_tokens > self.layout.adapter_order_above

    def load(self, forward_batch: "ForwardBatch", padded_tokens: int, padded_batch_size: int) -> None:
        """Copy ``forward_batch``'s context (an empty one where it has none) into the first rows; the rows up to
        the graph's padded sizes run no adapter and read zeros and request row 0."""
        context = forward_batch.batch_context or BatchContext.for_batch(forward_batch)
        tokens, requests = forward_batch.num_tokens, forward_batch.batch_size
        self.token_requests[:tokens].copy_(context.token_requests)
        self.token_requests[tokens:padded_tokens].zero_()
        if self.adapter_ids is not None:
            _copy_or_fill(self.adapter_ids, context.adapter_ids, tokens, padded_tokens, NO_ADAPTER)
        if self._sorts(padded_tokens):
            torch.sort(self.adapter_ids[:padded_tokens], stable=True,
                       out=(self.sorted_ids[:padded_tokens], self.adapter_order[:padded_tokens]))
        for name, static in self.per_request.items():
            _copy_or_fill(static, context.per_request.get(name), requests, padded_batch_size, 0)
        for name, static in self.per_token.items():
            _copy_or_fill(static, context.per_token.get(name), tokens, padded_tokens, 0)


def _copy_or_fill(static: torch.Tensor, source: torch.Tensor | None, rows: int, padded_rows: int,
                  fill: int) -> None:
    if source is None:
        static[:padded_rows].fill_(fill)
        return
    static[:rows].copy_(source)
    static[rows:padded_rows].fill_(fill)
