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
:mod:`treadle.core.execution.piecewise_graph`). All graphs share one memory pool, captured largest
first so the smaller ones reuse its blocks.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING

import torch

from treadle.core.auto_size import graph_batch_sizes
from treadle.core.execution.batch_context import StaticBatchContext, model_context_layout, using_batch_context
from treadle.core.execution.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from treadle.core.execution.model_runner import ModelRunner

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

    ``can_run(forward_batch)`` says whether a batch can replay; ``replay(forward_batch)``
    copies its inputs into the static buffers (device-to-device, no host sync), lets
    the attention backend update its metadata, replays, and returns the logits
    rows of the real requests. The returned tensor is a view into the graph's
    output and is overwritten by the next replay.
    """

    def __init__(self, model_runner: "ModelRunner") -> None:
        self.model_runner = model_runner
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.device = model_runner.device
        requested = model_runner.config.runtime.cuda_graph_max_bs
        # Decode never holds more requests than the scheduler runs at once.
        max_bs = min(requested, model_runner.max_running_requests)
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.max_bs = self.batch_sizes[-1]
        self.seq_len_fill_value = int(self.attn_backend.get_cuda_graph_seq_len_fill_value())

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

        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.seconds_per_replay: dict[int, float] = {}  # per captured size, when pruned
        self.outputs: dict[int, torch.Tensor] = {}
        self.memory_pool = None
        self.attn_backend.init_cuda_graph_state(max_bs, max_bs)
        self.capture()

    # ------------------------------------------------------------------ capture

    def capture(self) -> None:
        """Capture one decode graph per batch size, largest first, sharing one memory pool."""
        from tqdm.auto import tqdm

        stream = torch.cuda.Stream(device=self.device)
        sizes = sorted(self.batch_sizes, reverse=True)
        with torch.inference_mode(), torch.cuda.device(self.device):
            for bs in tqdm(sizes, desc="capturing CUDA graphs", unit="graph", leave=False):
                self.graphs[bs], self.outputs[bs] = self._capture_one(bs, stream)
        torch.cuda.synchronize(self.device)
        if self.model_runner.config.runtime.cuda_graph_prune and len(sizes) > 1:
            self._prune()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.batch_sizes)

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
        runner = self.model_runner
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
            req_to_token_pool=runner.req_to_token_pool,
            kv_cache=runner.kv_cache,
            attn_backend=self.attn_backend,
        )

    # ------------------------------------------------------------------- replay

    def release(self) -> None:
        """Free every captured graph (the runner cannot replay afterwards)."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()

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
        if padding:
            # Padding rows write their K/V to padding slot 0 and attend over fill-length sequences.
            self.seq_lens[raw_bs:bs].fill_(self.seq_len_fill_value)
            self.out_cache_loc[raw_bs:bs].zero_()
            self.req_pool_indices[raw_bs:bs].zero_()
            self.input_ids[raw_bs:bs].zero_()
            self.positions[raw_bs:bs].zero_()
        # One multi-tensor copy: a synchronous decode step waits for the host to get here, and five separate
        # copies cost ~45 µs of it on an H100 host. The logits rows of a decode batch are every row in order
        # (can_run), which the static arange already holds.
        torch._foreach_copy_(
            [self.input_ids[:raw_bs], self.positions[:raw_bs], self.req_pool_indices[:raw_bs],
             self.seq_lens[:raw_bs], self.out_cache_loc[:raw_bs]],
            [forward_batch.input_ids, forward_batch.positions, forward_batch.req_pool_indices,
             forward_batch.seq_lens, forward_batch.out_cache_loc])

        seq_lens_cpu = self.seq_lens_cpu[:bs]
        seq_lens_cpu[:raw_bs].copy_(forward_batch.seq_lens_cpu)
        seq_lens_cpu[raw_bs:].fill_(self.seq_len_fill_value)
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
