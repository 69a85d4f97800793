"""CudaGraphRunner: captures the decode forward once per batch size and replays it.

A decode step of a small batch is dominated by kernel launches, not by work:
replaying a captured CUDA graph launches the whole forward at once. Graphs are
captured for a ladder of batch sizes (:func:`treadle.core.auto_size.graph_batch_sizes`:
1, 2, 4, 8, every 8 to 64, every 16 to 256, every 32 beyond, up to
``runtime.cuda_graph_max_bs``, which by default is the running-request limit, so
every decode batch has a graph); a batch of ``n`` requests replays the graph of
the smallest captured size ``>= n``, its extra rows padded: token 0, KV written
to padding slot 0, request row 0, sequence length
``attn_backend.get_cuda_graph_seq_len_fill_value()``. With ``runtime.cuda_graph_prune``
(the default) each graph is then timed with empty contexts and a size whose graph is
slower than the next larger one kept is dropped (:func:`faster_sizes`): the library matmul
picks its kernel per row count: on an H100 an 8B Llama layer's projections took 1.4 times as
long at 448 rows as at 480 (``python -m treadle.bench.matmul_rate``). Larger batches and every
extend batch run eagerly here (small extend batches replay piecewise graphs:
:mod:`treadle.core.execution.piecewise_graph`).

A worker that verifies draft tokens (speculative decoding) asks for TARGET_VERIFY graphs too
(``verify_tokens_per_req``): for each ``tokens_per_req`` t a graph per batch size of the same ladder, whose
``bs * t`` new tokens all produce logits; padding rows attend over ``fill + t - 1`` keys, so their prefix
is never negative. Verify graphs are not pruned. Plain decode is captured and replayed exactly as without
them. All graphs share one memory pool, captured largest first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from treadle.core.auto_size import graph_batch_sizes
from treadle.core.execution.batch_context import StaticBatchContext, model_context_layout, using_batch_context
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from treadle.core.execution.attention import AttentionBackend
    from treadle.core.execution.attention_context import AttentionContext

logger = logging.getLogger(__name__)


# A size is dropped only when its graph is this much slower than the next larger one kept: replays of
# neighbouring small sizes differ by less than timing noise, and those are kept.
PRUNE_TOLERANCE = 0.02
PRUNE_REPLAYS = 3


def capture_batch_sizes(max_bs: int) -> list[int]:
    """The batch sizes to capture, up to and including ``max_bs`` (see ``graph_batch_sizes``)."""
    return graph_batch_sizes(max_bs)


def faster_sizes(seconds: dict[int, float], tolerance: float = PRUNE_TOLERANCE) -> list[int]:
    """The batch sizes worth keeping, from each size's seconds per replay: walking down from the largest
    (always kept), a size is kept unless it takes more than ``tolerance`` longer than the next larger size
    kept, whose graph its batches then replay, padded."""
    kept: list[int] = []
    for bs in sorted(seconds, reverse=True):
        if not kept or seconds[bs] <= seconds[kept[-1]] * (1 + tolerance):
            kept.append(bs)
    return sorted(kept)


def replay_seconds(graph: torch.cuda.CUDAGraph, replays: int) -> float:
    """Device seconds per replay of ``graph``: one untimed replay, then ``replays`` timed back to back with CUDA
    events on the current stream (waits for them)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / replays / 1e3


class CudaGraphRunner:
    """Decode through captured CUDA graphs: static padded inputs, one graph per batch size.

    ``can_run(forward_batch)`` says whether a decode batch can replay; ``replay(forward_batch)``
    copies its inputs into the static buffers (device-to-device, no host sync), lets
    the attention backend update its metadata, replays, and returns the logits
    rows of the real requests. The returned tensor is a view into the graph's
    output and is overwritten by the next replay. ``can_run_verify``/``replay_verify`` do the same for
    TARGET_VERIFY batches of a captured ``tokens_per_req``.

    It needs the model, the attention backend and the pools (``context``), and ``max_bs``: decode never
    holds more requests than the scheduler runs at once, nor more than ``runtime.cuda_graph_max_bs``.
    """

    def __init__(self, model: nn.Module, attn_backend: "AttentionBackend", context: "AttentionContext",
                 max_bs: int, *, prune: bool = True, verify_tokens_per_req: Sequence[int] = (),
                 verify_max_bs: int | None = None, verify_trees: bool = False) -> None:
        self.model = model
        self.attn_backend = attn_backend
        self.context = context
        self.device = context.device
        self.prune = prune
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.seq_len_fill_value = int(self.attn_backend.get_cuda_graph_seq_len_fill_value())
        verify_sizes = sorted({int(t) for t in verify_tokens_per_req if int(t) > 1}, reverse=True)
        if verify_sizes and not getattr(attn_backend, "supports_verify_cuda_graph", False):
            raise ValueError(f"attention backend {type(attn_backend).__name__} cannot capture TARGET_VERIFY steps "
                             "in CUDA graphs (supports_verify_cuda_graph is False); verify steps run eagerly there")

        device, max_bs = self.device, self.max_bs
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.seq_lens = torch.full((max_bs,), self.seq_len_fill_value, dtype=torch.int64, device=device)
            self.out_cache_loc = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.logits_indices = torch.arange(max_bs, dtype=torch.int64, device=device)
        self.seq_lens_cpu = torch.full((max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        # What the layers read from the batch context, as static inputs (None: nothing reads it).
        layout = model_context_layout(self.model)
        self.batch_context = StaticBatchContext(layout, max_bs, max_bs, device) if layout is not None else None
        if verify_sizes and self.batch_context is not None:
            raise ValueError("TARGET_VERIFY CUDA graphs do not carry a batch context yet: a model whose layers read "
                             "one (per-request deltas) runs its verify steps eagerly; capture no verify graphs")

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.seconds_per_replay: dict[int, float] = {}  # per captured size, when pruned
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_pool = None
        # Once, before any capture: every graph points at what this allocates.
        self.attn_backend.init_cuda_graph_state(max_bs, max_bs * max([1, *verify_sizes]))
        # By tokens_per_req, captured largest first; batch sizes up to the first captured one >= verify_max_bs.
        verify_bs = [bs for bs in self.batch_sizes if bs < (verify_max_bs or max_bs)]
        verify_bs += [bs for bs in self.batch_sizes if bs >= (verify_max_bs or max_bs)][:1]
        # Draft trees (speculative.topk > 1): every verify step carries a tree mask, a static input of its graphs.
        self.verify_trees = verify_trees
        self.verify = {t: _VerifyGraphs(self, t, verify_bs, verify_trees) for t in verify_sizes}
        self.capture()

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        """Capture the verify graphs asked for, then one decode graph per batch size, largest first, sharing one
        memory pool."""
        from tqdm.auto import tqdm

        stream = torch.cuda.Stream(device=self.device)
        sizes = sorted(self.batch_sizes, reverse=True)
        with torch.inference_mode(), torch.cuda.device(self.device):
            for verify in self.verify.values():
                for bs in tqdm(verify.batch_sizes[::-1],
                               desc=f"capturing verify CUDA graphs ({verify.tokens_per_req} tokens)",
                               unit="graph", leave=False):
                    verify.capture(bs, stream)
            for bs in tqdm(sizes, desc="capturing CUDA graphs", unit="graph", leave=False):
                self.graphs[bs], self.outputs[bs] = self._capture_one(bs, stream)
        torch.cuda.synchronize(self.device)
        if self.prune and len(sizes) > 1:
            self._prune()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)
        if self.verify:
            logger.info("captured TARGET_VERIFY CUDA graphs for %s tokens per request, batch sizes %s",
                        sorted(self.verify), next(iter(self.verify.values())).batch_sizes)

    def _prune(self) -> None:
        """Drop the sizes whose graph is slower than a larger one's (``faster_sizes``); every rank of a
        tensor-parallel group keeps rank 0's choice, since their graphs' collectives must match."""
        from treadle.core.distributed.parallel import tp_broadcast_object

        with torch.inference_mode(), torch.cuda.device(self.device):
            seconds = {bs: self._replay_seconds(bs) for bs in self.batch_sizes}
        kept = tp_broadcast_object(faster_sizes(seconds))
        dropped = [bs for bs in self.batch_sizes if bs not in kept]
        for bs in dropped:
            self.graphs.pop(bs).reset()
            del self.outputs[bs]
        self.batch_sizes = kept
        self.seconds_per_replay = seconds
        if dropped:
            logger.info("dropped the decode CUDA graphs of batch sizes %s: each was slower than a larger one's "
                        "(ms per replay: %s)", dropped,
                        ", ".join(f"{bs}: {1e3 * seconds[bs]:.2f}" for bs in sorted(seconds)))

    def _replay_seconds(self, bs: int) -> float:
        """Seconds per replay of the ``bs`` graph over fill-length contexts: what padding costs per size."""
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs], bs * self.seq_len_fill_value, ForwardMode.DECODE,
            seq_lens_cpu=self.seq_lens_cpu[:bs],
        )
        return replay_seconds(self.graphs[bs], PRUNE_REPLAYS)

    def _capture_one(self, bs: int, stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        forward_batch = self._static_forward_batch(bs)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, bs, self.req_pool_indices[:bs], self.seq_lens[:bs], ForwardMode.DECODE
        )

        context = self.batch_context.view(bs, bs) if self.batch_context is not None else None

        def run() -> torch.Tensor:
            with using_batch_context(context):
                return self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

        return self.record(run, stream)

    def record(self, run: Callable[[], torch.Tensor], stream: torch.cuda.Stream
               ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Capture ``run()`` (after two warm-up runs) into a graph of the shared pool; returns it and its output."""
        # Warm-up outside the capture: lazy initialisation (cuBLAS handles, Triton
        # compilation, rotary tables moving to the device) must not be recorded.
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool, stream=stream):
            output = run()
        if self.memory_pool is None:
            self.memory_pool = graph.pool()
        return graph, output

    def _static_forward_batch(self, bs: int) -> ForwardBatch:
        context = self.context
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE,
            batch_size=bs,
            input_ids=self.input_ids[:bs],
            positions=self.positions[:bs],
            req_pool_indices=self.req_pool_indices[:bs],
            seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs],
            out_cache_loc=self.out_cache_loc[:bs],
            seq_lens_sum=bs * self.seq_len_fill_value,
            logits_indices=self.logits_indices[:bs],
            req_to_token_pool=context.req_to_token_pool,
            kv_cache=context.kv_cache,
            attn_backend=self.attn_backend,
        )

    # ------------------------------------------------------------------- replay

    def release(self) -> None:
        """Free every captured graph (the runner cannot replay afterwards)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        for verify in self.verify.values():
            verify.release()
        self.verify = {}

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.forward_mode.is_decode()
            and 0 < forward_batch.batch_size <= self.max_bs
            and forward_batch.num_tokens == forward_batch.batch_size
            and int(forward_batch.logits_indices.shape[0]) == forward_batch.batch_size
        )

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[batch_size, vocab]`` of a decode batch, through the captured graph."""
        raw_bs = forward_batch.batch_size
        bs = self.batch_sizes[bisect.bisect_left(self.batch_sizes, raw_bs)]
        padding = bs - raw_bs
        # The logits rows of a decode batch are every row in order (can_run): the static arange holds them.
        seq_lens_cpu = _copy_inputs(self, forward_batch, raw_bs, bs, 1, self.seq_len_fill_value)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs,
            self.req_pool_indices[:bs],
            self.seq_lens[:bs],
            forward_batch.seq_lens_sum + padding * self.seq_len_fill_value,
            ForwardMode.DECODE,
            seq_lens_cpu=seq_lens_cpu,
        )
        if self.batch_context is not None:
            self.batch_context.load(forward_batch, bs, bs)
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_bs]

    # ------------------------------------------------------------ verify steps

    def can_run_verify(self, forward_batch: ForwardBatch) -> bool:
        return (
            forward_batch.forward_mode.is_verify()
            and (forward_batch.tree_mask is not None) == self.verify_trees
            and forward_batch.tokens_per_req in self.verify
            and 0 < forward_batch.batch_size <= self.verify[forward_batch.tokens_per_req].max_bs
        )

    def replay_verify(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits ``[batch_size * tokens_per_req, vocab]`` of a TARGET_VERIFY batch, through its captured graph."""
        return self.verify[forward_batch.tokens_per_req].replay(forward_batch)


class _VerifyGraphs:
    """The TARGET_VERIFY graphs of one ``tokens_per_req`` t: static inputs for ``max_bs * t`` tokens (every
    one's logits wanted) and one graph per batch size, in the owner's memory pool."""

    def __init__(self, owner: CudaGraphRunner, tokens_per_req: int, batch_sizes: Sequence[int],
                 trees: bool = False) -> None:
        self.owner = owner
        self.tokens_per_req = t = tokens_per_req
        # A padding row attends over its own t tokens after a prefix of fill - 1 keys.
        self.seq_len_fill_value = owner.seq_len_fill_value + t - 1
        self.batch_sizes = list(batch_sizes)  # all captured: decode pruning leaves them
        self.max_bs = max_bs = self.batch_sizes[-1]
        device = owner.device
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_bs * t, dtype=torch.int64, device=device)
            self.positions = torch.zeros(max_bs * t, dtype=torch.int64, device=device)
            self.out_cache_loc = torch.zeros(max_bs * t, dtype=torch.int64, device=device)
            self.logits_indices = torch.arange(max_bs * t, dtype=torch.int64, device=device)
            self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=device)
            self.seq_lens = torch.full((max_bs,), self.seq_len_fill_value, dtype=torch.int64, device=device)
            self.prefix_lens = self.seq_lens - t
            self.extend_lens = torch.full((max_bs,), t, dtype=torch.int64, device=device)
            self.extend_starts = torch.arange(max_bs, dtype=torch.int64, device=device) * t
            # A tree verify step's mask, uint8 [max_bs, t, t]; padding rows keep a valid one (each node sees itself).
            self.tree_mask = torch.ones(t, t, device=device).tril().to(torch.uint8).repeat(max_bs, 1, 1) if trees \
                else None
        self.seq_lens_cpu = torch.full((max_bs,), self.seq_len_fill_value, dtype=torch.int64)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def capture(self, bs: int, stream: torch.cuda.Stream) -> None:
        owner, n = self.owner, bs * self.tokens_per_req
        forward_batch = self._static_forward_batch(bs)
        owner.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, n, self.req_pool_indices[:bs], self.seq_lens[:bs], ForwardMode.TARGET_VERIFY, **self._tree_mask(bs))

        def run() -> torch.Tensor:
            return owner.model(forward_batch.input_ids, forward_batch.positions, forward_batch)

        self.graphs[bs], self.outputs[bs] = owner.record(run, stream)

    def _static_forward_batch(self, bs: int) -> ForwardBatch:
        t, n = self.tokens_per_req, bs * self.tokens_per_req
        fill = self.seq_len_fill_value
        context = self.owner.context
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
            input_ids=self.input_ids[:n], positions=self.positions[:n],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=self.seq_lens_cpu[:bs], out_cache_loc=self.out_cache_loc[:n], seq_lens_sum=bs * fill,
            logits_indices=self.logits_indices[:n],
            req_to_token_pool=context.req_to_token_pool, kv_cache=context.kv_cache,
            attn_backend=self.owner.attn_backend,
            extend_seq_lens=self.extend_lens[:bs], extend_prefix_lens=self.prefix_lens[:bs],
            extend_start_loc=self.extend_starts[:bs], extend_seq_lens_cpu=[t] * bs,
            extend_prefix_lens_cpu=[fill - t] * bs, tokens_per_req=t,
            tree_mask=self.tree_mask[:bs] if self.tree_mask is not None else None,
        )

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        t = self.tokens_per_req
        sizes = self.batch_sizes
        raw_bs = forward_batch.batch_size
        bs = sizes[bisect.bisect_left(sizes, raw_bs)]
        raw_n, n, fill = raw_bs * t, bs * t, self.seq_len_fill_value
        seq_lens_cpu = _copy_inputs(self, forward_batch, raw_bs, bs, t, fill)
        if self.tree_mask is not None:
            self.tree_mask[:raw_bs].copy_(forward_batch.tree_mask)
        torch.sub(self.seq_lens[:bs], t, out=self.prefix_lens[:bs])
        self.owner.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs], forward_batch.seq_lens_sum + (bs - raw_bs) * fill,
            ForwardMode.TARGET_VERIFY, seq_lens_cpu=seq_lens_cpu, num_tokens=n, **self._tree_mask(bs))
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_n]

    def _tree_mask(self, bs: int) -> dict[str, torch.Tensor]:
        """The keyword a tree-masking backend's capture and replay hooks get: the static mask of ``bs`` rows."""
        return {} if self.tree_mask is None else {"tree_mask": self.tree_mask[:bs]}

    def release(self) -> None:
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()


def _copy_inputs(static: CudaGraphRunner | _VerifyGraphs, forward_batch: ForwardBatch, raw_bs: int, bs: int,
                 tokens_per_req: int, fill: int) -> torch.Tensor:
    """Copy a batch of ``raw_bs`` requests into the static inputs of the ``bs`` graph; returns its host lengths.
    Padding rows write their K/V to padding slot 0 and attend over ``fill``-length sequences."""
    raw_n, n = raw_bs * tokens_per_req, bs * tokens_per_req
    if bs > raw_bs:
        static.seq_lens[raw_bs:bs].fill_(fill)
        static.out_cache_loc[raw_n:n].zero_()
        static.req_pool_indices[raw_bs:bs].zero_()
        static.input_ids[raw_n:n].zero_()
        static.positions[raw_n:n].zero_()
    # One multi-tensor copy: a synchronous decode step waits for the host to get here, and five separate
    # copies cost ~45 µs of it on an H100 host.
    torch._foreach_copy_(
        [static.input_ids[:raw_n], static.positions[:raw_n], static.req_pool_indices[:raw_bs],
         static.seq_lens[:raw_bs], static.out_cache_loc[:raw_n]],
        [forward_batch.input_ids, forward_batch.positions, forward_batch.req_pool_indices,
         forward_batch.seq_lens, forward_batch.out_cache_loc])
    seq_lens_cpu = static.seq_lens_cpu[:bs]
    if bs == raw_bs:  # no padding rows: no slicing and no fill of an empty tail (host operators on the critical path)
        seq_lens_cpu.copy_(forward_batch.seq_lens_cpu)
    else:
        seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        seq_lens_cpu[raw_bs:].fill_(fill)
    return seq_lens_cpu
