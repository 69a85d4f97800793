"""PiecewiseGraphRunner: prefill (extend) forwards through CUDA graphs cut at every attention call.

An eager prefill of a few hundred tokens is bound by the host: ~450 kernel launches
through Python take longer than the GPU takes to run them. Its attention cannot
be captured whole (each batch has its own request lengths and the backend plans
for them), but everything between two attention calls is row-wise and depends
only on the token count. So for a ladder of token counts
(:func:`treadle.core.auto_size.piecewise_token_sizes`, up to
``runtime.piecewise_cuda_graph_max_tokens``) the model's trunk
(``model.forward_hidden``) is captured as one graph per stretch between attention
calls: a stand-in attention backend ends the current graph at each call, after
copying q, k and v into static buffers and writing k, v into the KV cache at a
static copy of ``out_cache_loc``, and begins the next, whose input is a static
attention-output buffer. A replay runs piece 0, the real backend's attention on
the static q/k/v rows of the real tokens (told the KV cache is written), piece 1,
and so on; the logits rows are then computed eagerly (``model.compute_logits``),
since their number varies with the batch. Only the attention kernels run
through the host per layer: the KV write (``KVCache.set_kv_buffer``) replays.

A batch of ``n`` tokens replays the pieces of the smallest captured size ``>= n``;
rows past ``n`` hold stale values that only feed rows past ``n`` (everything in a
piece is per row) and write their K/V to padding slot 0. A model opts in by
having ``forward_hidden`` and ``compute_logits``; any attention backend works,
as it runs eagerly.
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from treadle.core.auto_size import piecewise_token_sizes
from treadle.core.execution.batch_context import StaticBatchContext, model_context_layout, using_batch_context
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode
from treadle.core.execution.model_protocol import SplitForwardModel  # noqa: F401  (its home before model_protocol)

if TYPE_CHECKING:
    from treadle.core.execution.attention import AttentionBackend, RadixAttention
    from treadle.core.execution.attention_context import AttentionContext

logger = logging.getLogger(__name__)


@dataclass
class _Cut:
    """One attention call between two pieces: its layer and the static buffers its inputs and output use."""

    layer: "RadixAttention"
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor


@dataclass
class _Pieces:
    """The graphs of one token count: ``len(cuts) + 1`` pieces, and the static rows of the trunk's outputs."""

    size: int
    graphs: list[torch.cuda.CUDAGraph] = field(default_factory=list)
    cuts: list[_Cut] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    output_is_tuple: bool = True


class _AttentionCut:
    """Stands in for the attention backend while the trunk is warmed up or captured.

    It computes nothing: it returns the static attention-output rows, so the next
    piece reads them. While capturing it also copies q, k, v into their static
    buffers and ends the current graph, then begins the next.
    """

    def __init__(self, runner: "PiecewiseGraphRunner", num_tokens: int) -> None:
        self.runner = runner
        self.num_tokens = num_tokens
        self.pieces: _Pieces | None = None  # set while capturing

    def applies_rotary(self, forward_batch: ForwardBatch) -> bool:
        return False  # the pieces' q and k are rotated; the real backend runs on them between pieces

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: "RadixAttention",
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        n = self.num_tokens
        static = self.runner.static_rows
        cut = _Cut(layer, static("q", q, n), static("k", k, n), static("v", v, n),
                   static("attn_out", q, n))
        if self.pieces is not None:
            cut.q.copy_(q)
            cut.k.copy_(k)
            cut.v.copy_(v)
            if save_kv_cache:
                forward_batch.kv_cache.set_kv_buffer(layer.layer_id, self.runner.out_cache_loc[:n], cut.k, cut.v)
            self.pieces.graphs[-1].capture_end()
            self.pieces.cuts.append(cut)
            self.pieces.graphs.append(self.runner.begin_graph())
        return cut.out


class PiecewiseGraphRunner:
    """Extend batches of up to ``max_tokens`` tokens through piecewise CUDA graphs (see the module docstring).

    ``can_run(forward_batch)`` says whether a batch can replay; ``replay(forward_batch)``
    copies its token ids and positions into the static inputs, prepares the attention
    backend's metadata for the real batch and returns its logits. It needs the model, the attention
    backend, the pools (``context``) and the largest token count to capture; ``memory_pool`` may be the
    decode graphs' (``CudaGraphRunner.memory_pool``), to share their blocks.
    """

    def __init__(self, model: SplitForwardModel, attn_backend: "AttentionBackend", context: "AttentionContext",
                 max_tokens: int, memory_pool: Any = None) -> None:
        self.model: SplitForwardModel = model
        self.attn_backend = attn_backend
        self.context = context
        self.device = context.device
        self.sizes = piecewise_token_sizes(max_tokens)
        self.max_tokens = self.sizes[-1]
        with torch.inference_mode():
            self.input_ids = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
            self.positions = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
            self.out_cache_loc = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
        # Static buffers of max_tokens rows, one per (role, width, dtype), allocated while warming up.
        self._static: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}
        # What the layers read from the batch context, as static inputs (None: nothing reads it). An extend batch
        # has at most as many requests as tokens.
        layout = model_context_layout(self.model)
        self.batch_context = (StaticBatchContext(layout, self.max_tokens, self.max_tokens, self.device)
                              if layout is not None else None)
        self.memory_pool = memory_pool if memory_pool is not None else torch.cuda.graph_pool_handle()
        self.pieces: dict[int, _Pieces] = {}
        self._stream = torch.cuda.Stream(device=self.device)
        self.capture()

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        """Capture every token count's pieces, largest first, in one memory pool."""
        from tqdm.auto import tqdm

        with torch.inference_mode(), torch.cuda.device(self.device):
            for size in tqdm(sorted(self.sizes, reverse=True), desc="capturing prefill CUDA graphs",
                             unit="size", leave=False):
                self.pieces[size] = self._capture_one(size)
        torch.cuda.synchronize(self.device)
        logger.info("captured piecewise prefill CUDA graphs for %d token counts up to %d (%d pieces each)",
                    len(self.sizes), self.max_tokens, len(self.pieces[self.max_tokens].graphs))

    def static_rows(self, role: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """The first ``rows`` rows of the static buffer for ``role`` shaped like ``like``'s rows."""
        key = (role, int(like[0].numel()) if like.dim() > 1 else 1, like.dtype)
        buffer = self._static.get(key)
        if buffer is None:
            if torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"piecewise CUDA graphs: no static buffer for {key} (the warm-up missed it)")
            buffer = torch.zeros((self.max_tokens, *like.shape[1:]), dtype=like.dtype, device=self.device)
            self._static[key] = buffer
        return buffer[:rows].view(rows, *like.shape[1:])

    def begin_graph(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.memory_pool)
        return graph

    def _capture_one(self, size: int) -> _Pieces:
        cut = _AttentionCut(self, size)
        forward_batch = self._static_forward_batch(size, cut)

        context = self.batch_context.view(size, size) if self.batch_context is not None else None

        def run() -> Any:
            with using_batch_context(context):
                return self.model.forward_hidden(forward_batch.input_ids, forward_batch.positions, forward_batch)

        # Warm-up outside the capture (Triton compilation, cuBLAS handles); it also allocates the static buffers.
        for index, tensor in enumerate(_as_tuple(run())):
            self.static_rows(f"out{index}", tensor, size)
        torch.cuda.synchronize(self.device)

        pieces = _Pieces(size)
        cut.pieces = pieces
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            pieces.graphs.append(self.begin_graph())
            try:
                hidden = run()
                pieces.output_is_tuple = isinstance(hidden, tuple)
                for index, tensor in enumerate(_as_tuple(hidden)):
                    out = self.static_rows(f"out{index}", tensor, size)
                    out.copy_(tensor)
                    pieces.outputs.append(out)
                pieces.graphs[-1].capture_end()
            except BaseException:
                if torch.cuda.is_current_stream_capturing():
                    pieces.graphs[-1].capture_end()
                raise
        torch.cuda.current_stream(self.device).wait_stream(stream)
        return pieces

    def _static_forward_batch(self, size: int, attention: _AttentionCut) -> ForwardBatch:
        context = self.context
        device = self.device
        lengths = torch.tensor([size], dtype=torch.int64)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=1,
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            req_pool_indices=torch.zeros(1, dtype=torch.int64, device=device),
            seq_lens=lengths.to(device),
            seq_lens_cpu=lengths,
            out_cache_loc=self.out_cache_loc[:size],
            seq_lens_sum=size,
            logits_indices=torch.tensor([size - 1], dtype=torch.int64, device=device),
            req_to_token_pool=context.req_to_token_pool,
            kv_cache=context.kv_cache,
            attn_backend=attention,  # type: ignore[arg-type]
            extend_seq_lens=lengths.to(device),
            extend_prefix_lens=torch.zeros(1, dtype=torch.int64, device=device),
            extend_start_loc=torch.zeros(1, dtype=torch.int64, device=device),
            extend_seq_lens_cpu=[size],
            extend_prefix_lens_cpu=[0],
        )

    def release(self) -> None:
        """Free every captured piece (the runner cannot replay afterwards)."""
        for pieces in self.pieces.values():
            for graph in pieces.graphs:
                graph.reset()
        self.pieces.clear()

    # ------------------------------------------------------------------- replay

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        # A step with images runs eagerly: its vision encoder and M-RoPE positions are not captured.
        return (forward_batch.forward_mode.is_extend() and 0 < forward_batch.num_tokens <= self.max_tokens
                and forward_batch.multimodal is None)

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Float32 logits for ``forward_batch.logits_indices`` of an extend batch, through the pieces."""
        n = forward_batch.num_tokens
        pieces = self.pieces[self.sizes[bisect.bisect_left(self.sizes, n)]]
        self.input_ids[:n].copy_(forward_batch.input_ids)
        self.positions[:n].copy_(forward_batch.positions)
        self.out_cache_loc[:n].copy_(forward_batch.out_cache_loc)
        self.out_cache_loc[n:pieces.size].zero_()  # padding rows write to padding slot 0
        if self.batch_context is not None:
            self.batch_context.load(forward_batch, pieces.size, pieces.size)
        backend = self.attn_backend
        backend.init_forward_metadata(forward_batch)
        for graph, cut in zip(pieces.graphs, pieces.cuts):
            graph.replay()  # ends with this layer's K/V written to the cache
            out = backend.forward(cut.q[:n], cut.k[:n], cut.v[:n], cut.layer, forward_batch, save_kv_cache=False)
            cut.out[:n].copy_(out.view(n, *cut.out.shape[1:]))
        pieces.graphs[-1].replay()
        outputs = tuple(out[:n] for out in pieces.outputs)
        return self.model.compute_logits(outputs if pieces.output_is_tuple else outputs[0], forward_batch)


def _as_tuple(value: Any) -> tuple[torch.Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)
