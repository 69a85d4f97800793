"""Tensor-parallel linear and embedding layers, and the weight loaders that shard checkpoints into them.

Each layer holds only this rank's part of the weight (``core.parallel`` says
which rank of how many); at tp 1 it holds the whole weight and runs exactly
what ``nn.Linear``/``nn.Embedding`` would. Every parameter carries a
``weight_loader(param, loaded, shard_id=None)`` that receives the FULL
checkpoint tensor (or a safetensors lazy slice, so a rank reads only its rows)
and copies this rank's slice, and a ``full_shards`` list
``[(shard_id, full shape), ...]`` describing the tp-1 tensor it is cut from
(dummy weights use it to give every tp size the same values).

- :class:`ColumnParallelLinear`: output features split over ranks, no communication.
- :class:`MergedColumnParallelLinear`: several projections of one input stacked
  (``gate_proj`` + ``up_proj``), each split over ranks, so a rank holds
  ``[gate_r | up_r]``.
- :class:`QKVParallelLinear`: q/k/v stacked, split by heads; KV heads are
  replicated when there are fewer of them than ranks.
- :class:`RowParallelLinear`: input features split; one all-reduce of the output.
- :class:`VocabParallelEmbedding` / :class:`ParallelLMHead`: vocabulary rows split;
  masked lookup + all-reduce, and logits all-gathered for sampling.

The matmul itself is delegated to ``layer.quant_method`` (``create_weights``,
``process_weights_after_loading``, ``apply``), chosen at construction from a
``quant_config`` (None means :class:`UnquantizedLinearMethod`), so a quantization
scheme plugs in without touching the layers.

Like ``nn.Linear``, every linear layer reports ``in_features`` and ``out_features`` (the whole layer's, not
this rank's share) and holds its parameters as ``weight`` and ``bias`` (None when unbiased).

Per-request deltas: ``layer.add_output_delta(fn)`` adds ``fn(x, context)`` to the layer's output from then on,
``context`` being the step's :class:`~treadle.core.execution.batch_context.BatchContext` (a LoRA adapter is
``x @ A[adapter].T @ B[adapter].T`` per token; ``in_place=True``: ``fn(x, context, out)`` adds into the output
itself); the fused decode paths step aside for a layer that has one, except that in-place deltas join the residual
ahead of a fused add + RMSNorm the quant method says will run (``fuses_add_rmsnorm``), and a delta that splits
(``split=``: the LoRA shrink in the matmul's launch or apart, its expand carrying SiLU·mul or add + RMSNorm) runs
around the method's matmul where it can (``LinearMethod.apply_split``). A layer without deltas pays one attribute
check per call.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from treadle.core.execution.batch_context import BatchContextLayout
from treadle.core.distributed.parallel import (
    get_tp_rank,
    get_tp_size,
    tp_all_gather,
    tp_all_reduce,
    tp_all_reduce_add_rmsnorm,
    tp_head_counts,
    tp_kv_head_start,
)
from treadle.core.loading.quantization import QuantizationConfig
from treadle.layers import small_batch
from treadle.layers.output_delta import DeltaFn, OutputDelta, SplitFn, add_deltas, apply_split, merged_reads
from treadle.layers.linear_method import (  # noqa: F401  (re-exported)
    LinearMethod,
    UnquantizedLinearMethod,
    set_weight_attrs,
)


class CheckpointError(ValueError):
    """Checkpoint tensors do not match the model: unexpected names, missing ones, or wrong shapes."""


# ------------------------------------------------------------------ quantization hook


def quant_method_for(layer: nn.Module, quant_config: Any, prefix: str) -> LinearMethod:
    """The layer's method under ``quant_config``: core's QuantizationConfig picks a built-in method (FP8);
    any other object is asked ``quant_config.get_quant_method(layer, prefix)``; None means unquantized."""
    if quant_config is None:
        return UnquantizedLinearMethod()
    if isinstance(quant_config, QuantizationConfig):
        from treadle.layers.fp8 import linear_method

        method = linear_method(quant_config, layer, prefix)
    else:
        method = quant_config.get_quant_method(layer, prefix)
    return method if method is not None else UnquantizedLinearMethod()


# ------------------------------------------------------------------ linear layers


class LinearBase(nn.Module):
    """A linear layer whose matmul is ``self.quant_method.apply``; subclasses decide the sharding."""

    # Set once loaded: the Triton kernels its quant method chose for decode-sized batches (small_batch.choose), and
    # the head of the next layer's weight those kernels prefetch into L2 (small_batch.chain_l2_prefetch).
    small_batch: small_batch.SmallBatchKernels | None = None
    l2_prefetch: torch.Tensor | None = None
    # Whether tensor parallelism splits the output features (column-parallel) rather than the input ones.
    splits_output = True
    # Added to the output, in order (add_output_delta); empty: the forward checks this tuple and nothing else.
    output_deltas: tuple[OutputDelta, ...] = ()

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, quant_config: Any = None, prefix: str = ""
    ) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        # As nn.Linear names them: the whole layer's sizes, on every rank.
        self.in_features, self.out_features = input_size, output_size
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.params_dtype = torch.get_default_dtype()
        self.quant_method = quant_method_for(self, quant_config, prefix)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_deltas:
            return self._apply_with_deltas(x, self.bias)
        return self.quant_method.apply(self, x, self.bias)

    def add_output_delta(self, fn: DeltaFn, reads: BatchContextLayout | None = None, *,
                         in_place: bool = False, split: SplitFn | None = None) -> Callable[[], None]:
        """Add ``fn(x, context)`` to this layer's output from now on (``x`` this rank's input, ``context`` the
        step's BatchContext or None; see :class:`OutputDelta`); with ``in_place``, ``fn(x, context, out)`` adds
        into the output ``out`` itself. Column-parallel layers add this rank's slice of the output; a row-parallel
        one adds this rank's partial sum, before the all-reduce. Register before the model runner captures CUDA
        graphs. ``split``: the delta in two halves around the matmul's own kernel, where the quant method runs one
        (see :class:`OutputDelta`). Returns a function that removes the delta again."""
        delta = OutputDelta(fn, reads, in_place, split)
        self.output_deltas = self.output_deltas + (delta,)

        def remove() -> None:
            self.output_deltas = tuple(d for d in self.output_deltas if d is not delta)

        return remove

    @property
    def batch_context_reads(self) -> BatchContextLayout | None:
        """What this layer's deltas read from the batch context (treadle.core.execution.batch_context)."""
        return merged_reads(self.output_deltas)

    def add_output_deltas(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` plus every registered delta of ``x`` under the current batch context."""
        return add_deltas(self.output_deltas, x, y)

    def _apply_with_deltas(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The matmul plus the deltas: split around the method's kernel where it can (no bias), else one after."""
        if bias is None:
            y = apply_split(self, x)
            if y is not None:
                return y
        return self.add_output_deltas(x, self.quant_method.apply(self, x, bias))

    def _add_bias(self, rows: int, full_shards: list[tuple[str | None, tuple[int, ...]]], loader: Callable) -> None:
        if rows == 0:
            self.register_parameter("bias", None)
            return
        bias = nn.Parameter(torch.empty(rows, dtype=self.params_dtype), requires_grad=False)
        set_weight_attrs(bias, weight_loader=loader, full_shards=full_shards)
        self.register_parameter("bias", bias)


class ColumnParallelLinear(LinearBase):
    """``y = x A^T + b`` with A's output rows split over the ranks; each rank returns its slice of y
    (``gather_output=True`` all-gathers the full y)."""

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, gather_output: bool = False,
        quant_config: Any = None, prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, bias, quant_config, prefix)
        self.output_size_per_partition = _divide(output_size, self.tp_size, f"{prefix or 'layer'} output size")
        self.gather_output = gather_output
        self.quant_method.create_weights(
            self, input_size, [self.output_size_per_partition], input_size, output_size, self.params_dtype
        )
        _describe_weight(self, weight_loader=self.weight_loader,
                         full_shards=[(None, (output_size, input_size))])
        self._add_bias(self.output_size_per_partition if bias else 0, [(None, (output_size,))], self.weight_loader)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.output_deltas:
            y = self._apply_with_deltas(x, self.bias)
        else:
            y = self.quant_method.apply(self, x, self.bias)
        return tp_all_gather(y) if self.gather_output else y

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        rows = self.output_size_per_partition
        _check_full_shape(param, loaded, (self.output_size,) + tuple(param.shape[1:]))
        _copy_into(param.data, narrow_loaded(loaded, 0, self.tp_rank * rows, rows))


class MergedColumnParallelLinear(LinearBase):
    """Several projections of the same input in one matmul; ``output_sizes`` maps each shard id (the HF
    projection name, e.g. ``gate_proj``) to its full size. Each is split over the ranks, so rank r holds
    the r-th slice of every shard, stacked in order; ``shards[id] = (row offset, rows)`` on this rank."""

    def __init__(
        self, input_size: int, output_sizes: dict[str, int], bias: bool = False,
        quant_config: Any = None, prefix: str = "",
    ) -> None:
        super().__init__(input_size, sum(output_sizes.values()), bias, quant_config, prefix)
        self.full_sizes = dict(output_sizes)
        per_rank = {
            shard_id: _divide(size, self.tp_size, f"{prefix or 'layer'} {shard_id} size")
            for shard_id, size in output_sizes.items()
        }
        self.shards = _offsets(per_rank)
        self.shard_ids = tuple(output_sizes)
        self._init_stacked(input_size, per_rank, bias)

    def _init_stacked(self, input_size: int, per_rank: dict[str, int], bias: bool) -> None:
        self.output_size_per_partition = sum(per_rank.values())
        self.quant_method.create_weights(
            self, input_size, list(per_rank.values()), input_size, self.output_size, self.params_dtype
        )
        _describe_weight(self, weight_loader=self.weight_loader,
                         full_shards=[(s, (self.full_sizes[s], input_size)) for s in self.shard_ids])
        self._add_bias(self.output_size_per_partition if bias else 0,
                       [(s, (self.full_sizes[s],)) for s in self.shard_ids], self.weight_loader)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        if shard_id not in self.shards:
            raise CheckpointError(f"unknown shard '{shard_id}' for a stacked projection; expected one of {self.shard_ids}")
        offset, rows = self.shards[shard_id]
        _check_full_shape(param, loaded, (self.full_sizes[shard_id],) + tuple(param.shape[1:]))
        start = self._source_row(shard_id, rows)
        _copy_into(param.data.narrow(0, offset, rows), narrow_loaded(loaded, 0, start, rows))

    def _source_row(self, shard_id: str, rows: int) -> int:
        return self.tp_rank * rows

    def forward_silu_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """``silu(first shard) * second shard`` of this layer's output (a gated MLP's ``gate_up_proj``) in one
        kernel where the quant method has one for this batch (one-token GEMVs on a GPU: a kernel launch less per
        layer); None: run the layer, then ``silu_mul``."""
        apply = getattr(self.quant_method, "apply_silu_mul", None)
        if apply is None or len(self.shard_ids) != 2 or self.bias is not None:
            return None
        # A layer with output deltas runs unfused (its matmul, the deltas, then silu_mul) unless its delta splits
        # around the matmul's kernel: then the delta's second half runs SiLU·mul.
        return apply_split(self, x, silu_mul=True) if self.output_deltas else apply(self, x)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections stacked, split over the ranks by heads.

    Rank r holds ``num_heads = total_num_heads / tp`` query heads and
    ``num_kv_heads`` KV heads: ``total_num_kv_heads / tp``, or 1 (a replica) when
    there are fewer KV heads than ranks. ``shard_ids`` names the q, k, v projections
    in the checkpoint.
    """

    def __init__(
        self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
        bias: bool = False, quant_config: Any = None, prefix: str = "",
        shard_ids: tuple[str, str, str] = ("q_proj", "k_proj", "v_proj"),
    ) -> None:
        tp_size = get_tp_size()
        self.head_size = head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads
        num_heads, num_kv_heads = tp_head_counts(total_num_heads, total_num_kv_heads, tp_size)
        q_id, k_id, v_id = shard_ids
        full = {q_id: total_num_heads * head_size, k_id: total_num_kv_heads * head_size,
                v_id: total_num_kv_heads * head_size}
        LinearBase.__init__(self, hidden_size, sum(full.values()), bias, quant_config, prefix)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.q_size = num_heads * head_size
        self.kv_size = num_kv_heads * head_size
        self.full_sizes = full
        self.shard_ids = shard_ids
        self.query_shard = q_id
        per_rank = {q_id: self.q_size, k_id: self.kv_size, v_id: self.kv_size}
        self.shards = _offsets(per_rank)
        self._init_stacked(hidden_size, per_rank, bias)

    def _source_row(self, shard_id: str, rows: int) -> int:
        if shard_id == self.query_shard:
            return self.tp_rank * rows
        return tp_kv_head_start(self.total_num_kv_heads, self.tp_rank, self.tp_size) * self.head_size


class RowParallelLinear(LinearBase):
    """``y = x A^T + b`` with A's input columns split over the ranks: each rank multiplies its slice of x
    (the output of a column-parallel layer) and one all-reduce sums the partial results; the bias is
    added once, after the sum."""

    splits_output = False

    def __init__(
        self, input_size: int, output_size: int, bias: bool = False, reduce_results: bool = True,
        quant_config: Any = None, prefix: str = "",
    ) -> None:
        super().__init__(input_size, output_size, bias, quant_config, prefix)
        self.input_size_per_partition = _divide(input_size, self.tp_size, f"{prefix or 'layer'} input size")
        self.reduce_results = reduce_results
        self.quant_method.create_weights(
            self, self.input_size_per_partition, [output_size], input_size, output_size, self.params_dtype
        )
        _describe_weight(self, weight_loader=self.weight_loader,
                         full_shards=[(None, (output_size, input_size))])
        self._add_bias(output_size if bias else 0, [(None, (output_size,))], default_weight_loader)

    def forward_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor,
                            norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``norm(self(x), residual)`` — the residual add and RMSNorm after the layer (``norm`` an RMSNorm with
        ``weight`` and ``eps``), computed in the layer's own kernel where the quant method has one for this batch
        (one-token GEMVs on a GPU: a kernel launch less per layer); None: run the layer, then the norm."""
        if self.tp_size != 1:
            return self._all_reduce_add_rmsnorm(x, residual, norm)
        apply = getattr(self.quant_method, "apply_add_rmsnorm", None)
        if apply is None or self.bias is not None:
            return None
        if self.output_deltas:
            fused = apply_split(self, x, add_rmsnorm=(residual, norm.weight, norm.eps))
            return fused if fused is not None else self._add_rmsnorm_with_deltas(x, residual, norm, apply)
        return apply(self, x, residual, norm.weight, norm.eps)

    def _add_rmsnorm_with_deltas(self, x: torch.Tensor, residual: torch.Tensor, norm: nn.Module,
                                 apply: Callable) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The in-place deltas added into ``residual`` first, then the kernel adds this layer's matmul to it: the
        same sum, a kernel less than the matmul, the deltas and the norm apart. Only where the method says its
        kernel runs for ``x`` (else None, ``residual`` untouched: the caller runs the layer, then the norm)."""
        fuses = getattr(self.quant_method, "fuses_add_rmsnorm", None)
        if fuses is None or not all(d.in_place for d in self.output_deltas) or not fuses(self, x):
            return None
        add_deltas(self.output_deltas, x, residual)
        fused = apply(self, x, residual, norm.weight, norm.eps)
        if fused is None:
            raise RuntimeError(f"{type(self.quant_method).__name__}.fuses_add_rmsnorm promised a kernel that "
                               "apply_add_rmsnorm did not run")
        return fused

    def _all_reduce_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor,
                                norm: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Under tensor parallelism the peer all-reduce may run the add and the norm in its own pass.
        if not self.reduce_results or self.bias is not None or not hasattr(norm, "eps"):
            return None
        y = self._apply_with_deltas(x, None) if self.output_deltas else self.quant_method.apply(self, x, None)
        fused = tp_all_reduce_add_rmsnorm(y, residual, norm.weight, norm.eps)
        return fused if fused is not None else norm(tp_all_reduce(y), residual)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return LinearBase.forward(self, x)
        y = self._apply_with_deltas(x, None) if self.output_deltas else self.quant_method.apply(self, x, None)
        if self.reduce_results:
            y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        cols = self.input_size_per_partition
        _check_full_shape(param, loaded, (param.shape[0], self.input_size))
        _copy_into(param.data, narrow_loaded(loaded, 1, self.tp_rank * cols, cols))


# ------------------------------------------------------------------ vocabulary


class VocabParallelEmbedding(nn.Module):
    """Token embedding with the vocabulary rows split over the ranks (the last rank's part padded with
    zero rows when the vocabulary does not divide); a rank looks up the ids it owns, zeros the others,
    and an all-reduce assembles the rows."""

    def __init__(self, num_embeddings: int, embedding_dim: int) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.tp_rank = get_tp_rank()
        self.tp_size = get_tp_size()
        self.rows_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = self.tp_rank * self.rows_per_partition
        self.vocab_end = min(self.vocab_start + self.rows_per_partition, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.rows_per_partition, embedding_dim), requires_grad=False)
        set_weight_attrs(self.weight, weight_loader=self.weight_loader,
                         full_shards=[(None, (num_embeddings, embedding_dim))])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        owned = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(owned, input_ids - self.vocab_start, 0)
        rows = F.embedding(local_ids, self.weight).masked_fill(~owned.unsqueeze(-1), 0)
        return tp_all_reduce(rows)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
        _check_full_shape(param, loaded, (self.num_embeddings, self.embedding_dim))
        rows = max(self.vocab_end - self.vocab_start, 0)
        with torch.no_grad():
            param.data[rows:].zero_()
        _copy_into(param.data.narrow(0, 0, rows), narrow_loaded(loaded, 0, self.vocab_start, rows))


class ParallelLMHead(VocabParallelEmbedding):
    """Output projection to the vocabulary, split like :class:`VocabParallelEmbedding` (so the two can share
    one weight); ``forward`` returns the full ``[tokens, vocab]`` logits on every rank (all-gathered).

    With a ``quant_config`` that asks for it (``model.quantize_lm_head``, on by default with FP8 weights, and with
    integer weights on GPUs with FP8 matmuls, where the head's rows and columns are multiples of 16) the weight is
    quantized to FP8 once loaded, through ``quant_method`` like a linear layer's; a tied embedding keeps its own
    16-bit weight. The FP8 head recomputes each row's best logits from the 16-bit weight
    (``model.lm_head_exact_top``, ``exact_top_logits.py``).
    """

    small_batch: small_batch.SmallBatchKernels | None = None  # as on LinearBase
    l2_prefetch: torch.Tensor | None = None
    bias = None  # as an unbiased nn.Linear's

    def __init__(self, num_embeddings: int, embedding_dim: int, quant_config: Any = None) -> None:
        super().__init__(num_embeddings, embedding_dim)
        # As the nn.Linear this head stands in for names them: hidden size in, the whole vocabulary out.
        self.in_features, self.out_features = embedding_dim, num_embeddings
        # Unquantized, the one-token GEMV may beat cuBLAS here too (330 against 370 us for Llama-3.1-8B's 128k
        # vocabulary on an H100).
        self.quant_method: LinearMethod = UnquantizedLinearMethod()
        if self._fp8(quant_config):
            from treadle.layers.fp8 import lm_head_method

            self.quant_method = lm_head_method(quant_config.lm_head_exact_top)

    def _fp8(self, quant_config: Any) -> bool:
        """Whether this head is FP8: its quant_config's ``lm_head`` (core's QuantizationConfig, or an integer
        method's ``layers/packed_int.py`` PackedIntConfig) asks for it, or is ``"auto"`` and the head is shaped as
        the FP8 matmuls need."""
        lm_head = getattr(quant_config, "lm_head", False)
        if not lm_head or getattr(quant_config, "dequantize", False):
            return False
        return lm_head is True or (self.rows_per_partition % 16 == 0 and self.embedding_dim % 16 == 0)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = self.quant_method.apply(self, hidden_states)
        if self.tp_size == 1:
            return logits
        return tp_all_gather(logits)[..., : self.num_embeddings]


# ------------------------------------------------------------------ loading helpers


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: str | None = None) -> None:
    """Copy a whole (unsharded) checkpoint tensor into ``param``."""
    _check_full_shape(param, loaded, tuple(param.shape))
    _copy_into(param.data, loaded if isinstance(loaded, torch.Tensor) else loaded[...])


def full_shards(param: nn.Parameter) -> list[tuple[str | None, tuple[int, ...]]]:
    """The tp-1 tensors ``param`` is cut from: ``[(shard_id, full shape)]`` (itself when unsharded)."""
    return getattr(param, "full_shards", None) or [(None, tuple(param.shape))]


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a checkpoint tensor or a safetensors lazy slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_loaded(loaded: Any, dim: int, start: int, length: int) -> torch.Tensor:
    """``loaded[start:start+length]`` along ``dim`` as a tensor; a lazy slice reads only those rows/columns."""
    if isinstance(loaded, torch.Tensor):
        return loaded.narrow(dim, start, length)
    index = (slice(None),) * dim + (slice(start, start + length),)
    return loaded[index]


def _describe_weight(layer: nn.Module, **attrs: Any) -> None:
    """Loading metadata for the layer's ``weight``; a method whose parameters carry their own checkpoint names and
    loaders (packed int4 weights: ``qweight``, ``scales``...) has no ``weight`` until it repacks them."""
    weight = getattr(layer, "weight", None)
    if weight is not None:
        set_weight_attrs(weight, **attrs)


def _check_full_shape(param: nn.Parameter, loaded: Any, expected: tuple[int, ...]) -> None:
    shape = loaded_shape(loaded)
    if shape != tuple(expected):
        raise CheckpointError(f"has shape {shape} but the model expects {tuple(expected)}")


def _copy_into(destination: torch.Tensor, source: torch.Tensor) -> None:
    with torch.no_grad():
        destination.copy_(source)


def _divide(size: int, tp_size: int, what: str) -> int:
    if size % tp_size != 0:
        raise ValueError(f"{what} {size} is not divisible by parallel.tp_size={tp_size}")
    return size // tp_size


def _offsets(sizes: dict[str, int]) -> dict[str, tuple[int, int]]:
    shards, offset = {}, 0
    for shard_id, rows in sizes.items():
        shards[shard_id] = (offset, rows)
        offset += rows
    return shards
