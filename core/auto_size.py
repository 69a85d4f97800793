"""Memory-sized defaults: the running-request limit, the CUDA-graph batch sizes and mixed chunks.

``scheduler.max_running_requests``, ``runtime.cuda_graph_max_bs`` and
``scheduler.enable_mixed_chunk`` default to ``auto``. On the CPU that keeps
the old fixed values. On CUDA the running limit is sized from the KV pool
(every running request needs KV slots; a decode batch only amortizes the
weight reads when it is large) and capped by the GPU's memory class, and
CUDA graphs cover every decode batch that can occur. Explicit values win.
The functions here are pure (numbers in, numbers out) so they are tested on
the CPU; ModelRunner feeds them the measured memory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1024**3
CPU_MAX_RUNNING_REQUESTS = 64
CPU_CUDA_GRAPH_MAX_BS = 32
# The pool must hold at least this many tokens per running request on average
# (a prompt of a few hundred tokens plus its output) for the limit to be usable.
TOKENS_PER_RUNNING_REQUEST = 256
# Past these batch sizes a decode step is bound by KV reads, not weights, and the
# host's per-request work grows: larger limits stop paying (measured on an H100).
_GPU_RUNNING_CAPS = ((24 * GiB, 128), (48 * GiB, 256))
_LARGE_GPU_RUNNING_CAP = 512
# Mixed prefill+decode batches on CUDA: see docs/lab/benchmarks-history.md for the A/B (dense 8B shapes: 0.96-0.99x).
# A model may prefer them (``prefers_mixed_chunks``: Qwen3-30B-A3B, 1.17x).
MIXED_CHUNK_ON_CUDA = False
# While a trickle of requests arrives (fewer decoding than this, and at most one chunk of prompts waiting),
# each step carries at most this many prompt tokens mixed into the decode batch: on an H100 a step of a few
# hundred rows costs little more than a decode step (it is bound by reading the weights), so a new prompt
# no longer stalls the streams for a prefill step of its own. Measured at 4 req/s on 8B shapes
# (docs/lab/benchmarks-history.md): 256 / 384 / 512 gave TTFT p50 34.7 / 29.5 / 29.7 ms and ITL p99 11.1 / 13.2 / 12.7 ms;
# off 28.3 / 19.4 ms.
GPU_LATENCY_CHUNK_SIZE = 512
# Prompt tokens per prefill step (``scheduler.chunked_prefill_size: auto``). Through the server a prefill step
# stalls every running stream for its whole length, so chunks stay at 2048. An offline Engine batch has no
# stream to stall, and on an H100 a larger step costs less per token (the issue-10 workload, four pairs in three
# calls: 4096 ran 1.00-1.03x the out tok/s of 2048, +1.2% on average, prefill GPU time -3.5 to -5%;
# docs/lab/benchmarks-history.md).
SERVER_CHUNKED_PREFILL_SIZE = 2048
OFFLINE_GPU_CHUNKED_PREFILL_SIZE = 4096
# Decode steps a small prefill may wait for more requests while the decode batch is large (docs/scheduling.md).
GPU_PREFILL_HOLD_STEPS = 8
# Prefill batches up to this many tokens replay piecewise CUDA graphs: below it an eager prefill is bound by
# the host launching ~450 kernels (measured on an H100: 300 tokens take ~9 ms of GPU time, ~15 ms to launch).
GPU_PIECEWISE_GRAPH_MAX_TOKENS = 1024
# Device memory per running request outside the KV pool: a req_to_token row (int32 per
# position) and an attention backend's per-graph page-index row of the same size.
REQUEST_TABLE_COPIES = 2


@dataclass(frozen=True)
class BatchSizes:
    """The resolved sizes of one ModelRunner."""

    max_running_requests: int
    cuda_graph_max_bs: int
    enable_mixed_chunk: bool


def gpu_running_cap(gpu_memory_bytes: int) -> int:
    """Most running requests worth having on a GPU of this much memory."""
    for limit, cap in _GPU_RUNNING_CAPS:
        if gpu_memory_bytes <= limit:
            return cap
    return _LARGE_GPU_RUNNING_CAP


def auto_max_running_requests(kv_tokens: int, gpu_memory_bytes: int) -> int:
    """Running-request limit for a KV pool of ``kv_tokens`` slots on a GPU of ``gpu_memory_bytes``.

    ``kv_tokens // TOKENS_PER_RUNNING_REQUEST``, at most the GPU's cap, at least 1,
    rounded down to a multiple of 8 from 8 up (a CUDA-graph bucket).
    """
    if kv_tokens < 1:
        raise ValueError(f"the KV pool must hold at least one token, got {kv_tokens}")
    size = min(kv_tokens // TOKENS_PER_RUNNING_REQUEST, gpu_running_cap(gpu_memory_bytes))
    size = max(size, 1)
    return size - size % 8 if size >= 8 else size


def request_table_bytes(max_running_requests: int, context_len: int, page_size: int) -> int:
    """Device bytes that grow with the running limit: ``REQUEST_TABLE_COPIES`` int32 rows per request."""
    return REQUEST_TABLE_COPIES * (max_running_requests + 1) * (context_len + page_size) * 4


def resolve_batch_sizes(
    max_running_requests: int | str,
    cuda_graph_max_bs: int | str,
    enable_mixed_chunk: bool | str,
    *,
    on_cuda: bool,
    kv_tokens: int,
    gpu_memory_bytes: int = 0,
    prefers_mixed_chunks: bool = False,
) -> BatchSizes:
    """Replace each ``"auto"`` by its value for this device; explicit values are kept.

    The graph limit never exceeds the running limit (a decode batch is at most
    every running request), so an ``auto`` graph limit covers every decode batch.
    Mixed chunks are on on CUDA for a model that ``prefers_mixed_chunks`` (its decode
    step reads the weights a prefill chunk reads: a mixture of experts).
    """
    if max_running_requests == "auto":
        running = auto_max_running_requests(kv_tokens, gpu_memory_bytes) if on_cuda else CPU_MAX_RUNNING_REQUESTS
    else:
        running = int(max_running_requests)
    if cuda_graph_max_bs == "auto":
        graph_bs = running if on_cuda else min(CPU_CUDA_GRAPH_MAX_BS, running)
    else:
        graph_bs = int(cuda_graph_max_bs)
    if enable_mixed_chunk == "auto":
        mixed = (MIXED_CHUNK_ON_CUDA or prefers_mixed_chunks) if on_cuda else False
    else:
        mixed = bool(enable_mixed_chunk)
    return BatchSizes(running, min(graph_bs, running), mixed)


# server.workers: auto — one HTTP process per this many CPUs (the scheduler, the detokenizer and the clients of a
# benchmark on the same machine need the rest), at most HTTP_WORKERS_MAX.
CPUS_PER_HTTP_WORKER = 4
HTTP_WORKERS_MAX = 8


def resolve_http_workers(value: int | str, cpu_count: int) -> int:
    """``server.workers``: ``auto`` is ``cpu_count // CPUS_PER_HTTP_WORKER`` within 1..``HTTP_WORKERS_MAX``."""
    if value == "auto":
        return max(1, min(HTTP_WORKERS_MAX, cpu_count // CPUS_PER_HTTP_WORKER))
    return int(value)


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask: a container's or taskset's share, not the host's)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_cuda_only(value: int | str, *, on_cuda: bool, cuda_value: int) -> int:
    """A setting that is ``auto`` or a number, where ``auto`` means ``cuda_value`` on CUDA and 0 (off) on the CPU:
    ``scheduler.prefill_hold_steps`` (``GPU_PREFILL_HOLD_STEPS``; every GPU forward reads all the weights however
    few tokens it holds, a CPU step costs per token) and ``scheduler.latency_chunk_size``
    (``GPU_LATENCY_CHUNK_SIZE``; for the same reason a few hundred prompt tokens ride nearly free in a GPU
    decode step)."""
    if value == "auto":
        return cuda_value if on_cuda else 0
    return int(value)


# speculative.max_batch_size "auto": a decode step of more running requests verifies no drafts. A GPU step reads
# every weight once whatever its tokens, so verifying k + 1 tokens of up to 32 requests costs little more than a
# one-token step of them; a CPU step costs per token, so there speculation pays only for a few requests at a time.
GPU_SPECULATIVE_MAX_BATCH_SIZE = 32
CPU_SPECULATIVE_MAX_BATCH_SIZE = 4


def resolve_speculative_max_batch_size(value: int | str, *, on_cuda: bool) -> int:
    """``speculative.max_batch_size``: ``auto`` is ``GPU_SPECULATIVE_MAX_BATCH_SIZE`` on CUDA and
    ``CPU_SPECULATIVE_MAX_BATCH_SIZE`` on the CPU."""
    if value == "auto":
        return GPU_SPECULATIVE_MAX_BATCH_SIZE if on_cuda else CPU_SPECULATIVE_MAX_BATCH_SIZE
    return int(value)


def resolve_chunked_prefill_size(value: int | str | None, *, on_cuda: bool, offline: bool) -> int | None:
    """``scheduler.chunked_prefill_size``: ``auto`` is ``OFFLINE_GPU_CHUNKED_PREFILL_SIZE`` for an offline
    Engine on CUDA and ``SERVER_CHUNKED_PREFILL_SIZE`` otherwise; a number or None (no chunking) is kept."""
    if value != "auto":
        return value if value is None else int(value)
    return OFFLINE_GPU_CHUNKED_PREFILL_SIZE if on_cuda and offline else SERVER_CHUNKED_PREFILL_SIZE


def graph_batch_sizes(max_bs: int) -> list[int]:
    """The decode batch sizes to capture up to ``max_bs``: 1, 2, 4, 8, then every 8 to 64,
    every 16 to 256, every 32 beyond, and ``max_bs`` itself. A batch pads to the next one."""
    if max_bs < 1:
        raise ValueError(f"cuda_graph_max_bs must be at least 1, got {max_bs}")
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(80, 257, 16)) + list(range(288, max_bs, 32))
    return sorted({bs for bs in sizes if bs < max_bs} | {max_bs})


def resolve_piecewise_max_tokens(piecewise_max_tokens: int | str, *, on_cuda: bool,
                                 chunked_prefill_size: int | None, tp_size: int = 1,
                                 mixed_decode_rows: int = 0, latency_chunk_size: int = 0,
                                 launch_bound_prefill: bool = False) -> int:
    """``runtime.piecewise_cuda_graph_max_tokens`` for this device: ``auto`` is
    ``GPU_PIECEWISE_GRAPH_MAX_TOKENS`` on one GPU (no larger than the largest extend step: one prefill chunk
    plus ``mixed_decode_rows``, the decode rows a mixed step carries beside it, or a latency chunk with
    fewer decode rows than its size beside it), and 0 (off) on the CPU and under tensor parallelism (not
    measured there yet; a token count turns them on, docs/parallel.md).

    A model whose prefill is bound by the host's launches even at a whole chunk (``launch_bound_prefill``: many
    kernels per layer and little arithmetic per token, as a mixture of experts with small experts) has graphs
    up to its largest extend step."""
    if piecewise_max_tokens != "auto":
        return int(piecewise_max_tokens)
    if not on_cuda or tp_size > 1:
        return 0
    if chunked_prefill_size is None:
        return GPU_PIECEWISE_GRAPH_MAX_TOKENS
    largest = largest_extend_tokens(chunked_prefill_size, mixed_decode_rows, latency_chunk_size)
    return largest if launch_bound_prefill else min(GPU_PIECEWISE_GRAPH_MAX_TOKENS, largest)


def largest_extend_tokens(chunk_tokens: int, mixed_decode_rows: int, latency_chunk_size: int) -> int:
    """The most tokens an extend step holds: a full chunk of prompts and the decode rows a mixed step carries beside
    it, or a latency chunk beside fewer decode rows than its size."""
    return max(chunk_tokens + mixed_decode_rows, 2 * latency_chunk_size - 1)


def piecewise_token_sizes(max_tokens: int) -> list[int]:
    """The extend batch sizes (tokens) to capture up to ``max_tokens``: 8, 16, 32, 48, 64, 96, 128, then every
    64 to 512, every 128 to 1024, every 256 beyond, and ``max_tokens`` itself. A batch pads to the next one."""
    if max_tokens < 1:
        raise ValueError(f"piecewise_cuda_graph_max_tokens must be at least 1, got {max_tokens}")
    sizes = [8, 16, 32, 48, 64, 96] + list(range(128, 513, 64)) + list(range(640, 1025, 128)) \
        + list(range(1280, max_tokens, 256))
    return sorted({n for n in sizes if n < max_tokens} | {max_tokens})
