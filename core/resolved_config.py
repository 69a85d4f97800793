"""The resolved config: the user's ServerConfig with every ``auto`` replaced, once, by its value here.

The user's config is never written to. Once the model is loaded, :func:`resolve_config` reads what the
choices depend on — the device and its memory, the model's shape and traits, whether the run is an
offline batch or a server, the tensor-parallel size — and returns a frozen :class:`ResolvedConfig` whose
types carry no ``"auto"`` (``scheduler.max_running_requests`` is an ``int``). The scheduler, the model
runner, the graph runners and ``/get_server_info`` read that object. The sizing rules themselves are the
pure functions of :mod:`treadle.core.auto_size`.

One choice is made later, where it is made by trying: ``attention.backend: auto`` builds the registered
backends in priority order until one accepts the model (that needs the KV pool sized here), and the
runner records the one chosen with :meth:`ResolvedConfig.with_attention_backend`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from pydantic import ConfigDict

from treadle.core.auto_size import (
    GPU_LATENCY_CHUNK_SIZE,
    GPU_PREFILL_HOLD_STEPS,
    available_cpus,
    request_table_bytes,
    resolve_batch_sizes,
    resolve_chunked_prefill_size,
    resolve_cuda_only,
    resolve_http_workers,
    resolve_piecewise_max_tokens,
    resolve_speculative_max_batch_size,
)
from treadle.core.embedding.checkpoint import CheckpointEmbedding, EmbeddingSettings, resolve_embedding
from treadle.core.config import (
    AttentionConfig,
    CacheConfig,
    GrammarConfig,
    HttpServerConfig,
    LoraConfig,
    ModelConfig,
    MultimodalConfig,
    ParallelConfig,
    ReasoningConfig,
    RuntimeConfig,
    SchedulerConfig,
    ServerConfig,
    SpeculativeConfig,
    ToolsConfig,
)

logger = logging.getLogger(__name__)

# Without a GPU there is no device memory to size from: cap the default KV pool.
CPU_DEFAULT_KV_BYTES = 2 * 1024**3
CPU_DEFAULT_MAX_TOKENS = 65536
# A GPU budget that leaves the KV pool fewer tokens than this is refused as too small to serve.
MIN_GPU_KV_TOKENS = 64

_FROZEN = ConfigDict(extra="forbid", frozen=True)


class ResolvedModelConfig(ModelConfig):
    model_config = _FROZEN
    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "float16", "bfloat16"]
    context_length: int
    task: Literal["generate", "embed"] = "generate"
    normalize_embeddings: bool = True
    matryoshka: bool = False


class ResolvedCacheConfig(CacheConfig):
    model_config = _FROZEN
    max_total_tokens: int
    kv_dtype: str  # the storage dtype's name: the model dtype's for "auto"


class ResolvedSchedulerConfig(SchedulerConfig):
    model_config = _FROZEN
    max_running_requests: int
    chunked_prefill_size: int | None
    enable_mixed_chunk: bool
    prefill_hold_steps: int
    latency_chunk_size: int


class ResolvedRuntimeConfig(RuntimeConfig):
    model_config = _FROZEN
    cuda_graph_max_bs: int
    piecewise_cuda_graph_max_tokens: int


class ResolvedAttentionConfig(AttentionConfig):
    model_config = _FROZEN


class ResolvedLoraConfig(LoraConfig):
    model_config = _FROZEN
    enabled: bool = False  # whether adapters are served (any lora key set); off: nothing of LoRA is built
    max_rank: int = 16
    backend: str = "torch"  # the lora_backends plugin built (for "auto", the one chosen)


class _FrozenServer(HttpServerConfig):
    model_config = _FROZEN
    workers: int


class _FrozenParallel(ParallelConfig):
    model_config = _FROZEN


class _FrozenTools(ToolsConfig):
    model_config = _FROZEN


class _FrozenReasoning(ReasoningConfig):
    model_config = _FROZEN


class _FrozenGrammar(GrammarConfig):
    model_config = _FROZEN


class ResolvedSpeculativeConfig(SpeculativeConfig):
    model_config = _FROZEN
    max_batch_size: int
class _FrozenMultimodal(MultimodalConfig):
    model_config = _FROZEN
    local_media_folders: tuple[str, ...]


class ResolvedConfig(ServerConfig):
    """A ServerConfig whose ``auto`` values are resolved, frozen (assigning to it raises)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: ResolvedModelConfig
    cache: ResolvedCacheConfig
    scheduler: ResolvedSchedulerConfig
    attention: ResolvedAttentionConfig
    runtime: ResolvedRuntimeConfig
    server: _FrozenServer
    parallel: _FrozenParallel
    tools: _FrozenTools
    reasoning: _FrozenReasoning
    grammar: _FrozenGrammar
    speculative: ResolvedSpeculativeConfig
    lora: ResolvedLoraConfig
    multimodal: _FrozenMultimodal
    plugins: tuple[str, ...]

    def with_attention_backend(self, name: str) -> "ResolvedConfig":
        """This config with ``attention.backend`` set to the backend that was built (for ``auto``)."""
        return self.model_copy(update={"attention": self.attention.model_copy(update={"backend": name})})


@dataclass(frozen=True)
class RuntimeFacts:
    """What the ``auto`` choices depend on, read off the loaded model, the device and the kind of run."""

    device: Literal["cpu", "cuda"]
    dtype: Literal["float32", "float16", "bfloat16"]
    context_length: int  # the model's max_position_embeddings (``model.context_length`` overrides it)
    kv_bytes_per_token: int  # one token's K and V over every layer, this rank's share
    kv_dtype: str
    device_total_bytes: int = 0  # 0 on the CPU
    device_free_bytes: int = 0  # after the weights are loaded
    tp_size: int = 1
    offline: bool = False  # an Engine batch (no stream waits on a step) rather than a server
    prefers_mixed_chunks: bool = False
    launch_bound_prefill: bool = False
    lora_max_rank: int = 0  # the adapters' slot rank (lora.max_rank resolved); 0: LoRA is off
    lora_backend: str = ""  # the lora_backends plugin chosen
    embedding: EmbeddingSettings | None = None  # model.task and its settings (None: the config's, no checkpoint)
    cpu_count: int = field(default_factory=available_cpus)  # sizes server.workers

    @property
    def on_cuda(self) -> bool:
        return self.device == "cuda"


def resolve_config(config: ServerConfig, facts: RuntimeFacts,
                   agree_min: Callable[[int], int] = lambda value: value) -> ResolvedConfig:
    """Every ``auto`` of ``config`` resolved for ``facts``; ``config`` itself is left as it is.

    ``agree_min`` makes the ranks of a tensor-parallel group agree on the KV pool size (the smallest one
    wins, since every rank must make the same scheduling decisions); the identity by default.
    """
    on_cuda = facts.on_cuda
    sched = config.scheduler
    context_length = config.model.context_length or facts.context_length
    kv_tokens, sizes = _kv_pool_and_batch_sizes(config, facts, context_length, agree_min)
    chunked_prefill_size = resolve_chunked_prefill_size(sched.chunked_prefill_size, on_cuda=on_cuda,
                                                        offline=facts.offline)
    # An offline batch has no stream waiting on each step: its last prompts prefill in one chunk rather than a
    # latency chunk a step, each step later than the one before.
    latency_chunk_size = 0 if facts.offline and sched.latency_chunk_size == "auto" else resolve_cuda_only(
        sched.latency_chunk_size, on_cuda=on_cuda, cuda_value=GPU_LATENCY_CHUNK_SIZE)
    piecewise = resolve_piecewise_max_tokens(
        config.runtime.piecewise_cuda_graph_max_tokens, on_cuda=on_cuda, chunked_prefill_size=chunked_prefill_size,
        tp_size=facts.tp_size, mixed_decode_rows=sizes.max_running_requests if sizes.enable_mixed_chunk else 0,
        latency_chunk_size=latency_chunk_size, launch_bound_prefill=facts.launch_bound_prefill)
    values = config.model_dump()
    values["model"].update(device=facts.device, dtype=facts.dtype, context_length=context_length)
    embedding = facts.embedding or resolve_embedding(config.model, CheckpointEmbedding())
    values["model"].update(task=embedding.task, pooling=embedding.pooling,
                           normalize_embeddings=embedding.normalize, matryoshka=embedding.matryoshka)
    values["cache"].update(max_total_tokens=kv_tokens, kv_dtype=facts.kv_dtype)
    values["scheduler"].update(
        max_running_requests=sizes.max_running_requests, chunked_prefill_size=chunked_prefill_size,
        enable_mixed_chunk=sizes.enable_mixed_chunk, latency_chunk_size=latency_chunk_size,
        prefill_hold_steps=resolve_cuda_only(sched.prefill_hold_steps, on_cuda=on_cuda,
                                             cuda_value=GPU_PREFILL_HOLD_STEPS))
    values["lora"].update(enabled=facts.lora_max_rank > 0, max_rank=facts.lora_max_rank or 16,
                          backend=facts.lora_backend or "torch")
    values["server"].update(workers=resolve_http_workers(config.server.workers, facts.cpu_count))
    values["runtime"].update(cuda_graph_max_bs=sizes.cuda_graph_max_bs, piecewise_cuda_graph_max_tokens=piecewise)
    values["speculative"].update(
        max_batch_size=resolve_speculative_max_batch_size(config.speculative.max_batch_size, on_cuda=on_cuda))
    return ResolvedConfig.model_validate(values)


def _kv_pool_and_batch_sizes(config: ServerConfig, facts: RuntimeFacts, context_length: int,
                             agree_min: Callable[[int], int]) -> tuple[int, Any]:
    """The KV pool size in tokens, and the batch sizes resolved for it.

    On CUDA the pool gets ``cache.mem_fraction`` of the device's memory less what is in use after loading
    and less the per-request tables, which grow with the running limit, which grows with the pool: the limit
    is sized from the whole budget, then the pool gets what the tables leave.
    """
    sched = config.scheduler
    page_size = config.cache.page_size
    per_token = facts.kv_bytes_per_token

    def batch_sizes(kv_tokens: int) -> Any:
        return resolve_batch_sizes(sched.max_running_requests, config.runtime.cuda_graph_max_bs,
                                   sched.enable_mixed_chunk, on_cuda=facts.on_cuda, kv_tokens=kv_tokens,
                                   gpu_memory_bytes=facts.device_total_bytes,
                                   prefers_mixed_chunks=facts.prefers_mixed_chunks)

    requested = config.cache.max_total_tokens
    if requested is None and facts.on_cuda:
        total, free = facts.device_total_bytes, facts.device_free_bytes
        budget = total * config.cache.mem_fraction - (total - free)
        sizes = batch_sizes(max(int(budget // per_token), 1))
        budget -= request_table_bytes(sizes.max_running_requests, context_length, page_size)
        if budget <= per_token * MIN_GPU_KV_TOKENS:
            raise RuntimeError(
                f"not enough GPU memory for the KV cache: cache.mem_fraction={config.cache.mem_fraction} "
                f"of {total / 2**30:.1f} GiB leaves {budget / 2**30:.2f} GiB after the weights and "
                f"{sizes.max_running_requests} request rows; lower scheduler.max_running_requests or "
                "model.context_length, or raise cache.mem_fraction")
        requested = int(budget // per_token)
    elif requested is None:
        requested = min(int(CPU_DEFAULT_KV_BYTES * config.cache.mem_fraction // per_token), CPU_DEFAULT_MAX_TOKENS)
    requested = agree_min(requested)
    size = requested - requested % page_size
    if size < page_size:
        raise ValueError(f"cache.max_total_tokens={requested} is smaller than one page ({page_size})")
    return size, batch_sizes(size)


# The keys whose "auto" (or null default) the resolution replaces, as (section, key).
RESOLVED_KEYS = (
    ("model", "task"), ("model", "device"), ("model", "dtype"), ("model", "context_length"), ("cache", "max_total_tokens"),
    ("cache", "kv_dtype"), ("scheduler", "max_running_requests"), ("scheduler", "chunked_prefill_size"),
    ("scheduler", "enable_mixed_chunk"), ("scheduler", "latency_chunk_size"), ("scheduler", "prefill_hold_steps"),
    ("runtime", "cuda_graph_max_bs"), ("runtime", "piecewise_cuda_graph_max_tokens"), ("attention", "backend"),
    ("speculative", "max_batch_size"),
    ("server", "workers"),
)


def describe_resolution(config: ServerConfig, resolved: ResolvedConfig) -> str:
    """One line listing every resolved key's value, ``(auto)`` after those the user left to treadle."""
    parts = []
    for section, key in RESOLVED_KEYS:
        asked = getattr(getattr(config, section), key)
        value = getattr(getattr(resolved, section), key)
        parts.append(f"{section}.{key} {value}{' (auto)' if asked in ('auto', None) and asked != value else ''}")
    return ", ".join(parts)
