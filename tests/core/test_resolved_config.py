"""resolve_config: every ``auto`` resolved once into a frozen config; the user's config is never written to."""

from __future__ import annotations

import pydantic
import pytest

from treadle.core.auto_size import (
    GPU_LATENCY_CHUNK_SIZE,
    GPU_PIECEWISE_GRAPH_MAX_TOKENS,
    GPU_PREFILL_HOLD_STEPS,
    OFFLINE_GPU_CHUNKED_PREFILL_SIZE,
    SERVER_CHUNKED_PREFILL_SIZE,
    request_table_bytes,
)
from treadle.core.config import load_config
from treadle.core.resolved_config import (
    CPU_DEFAULT_MAX_TOKENS,
    ResolvedConfig,
    RuntimeFacts,
    describe_resolution,
    resolve_config,
)

GiB = 1024**3
KV_BYTES_PER_TOKEN = 128 * 1024  # an 8B model's K and V over 32 layers in bf16


def h100(**changes) -> RuntimeFacts:
    values = dict(device="cuda", dtype="bfloat16", context_length=8192, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                  kv_dtype="bfloat16", device_total_bytes=80 * GiB, device_free_bytes=64 * GiB)
    return RuntimeFacts(**{**values, **changes})


def cpu(**changes) -> RuntimeFacts:
    values = dict(device="cpu", dtype="float32", context_length=2048, kv_bytes_per_token=4096, kv_dtype="float32")
    return RuntimeFacts(**{**values, **changes})


def test_a_server_on_a_gpu_gets_its_pool_and_sizes_from_the_memory_left() -> None:
    config = load_config(use_env=False)
    resolved = resolve_config(config, h100())
    budget = 80 * GiB * config.cache.mem_fraction - 16 * GiB
    running = resolved.scheduler.max_running_requests
    expected_pool = int((budget - request_table_bytes(running, 8192, 1)) // KV_BYTES_PER_TOKEN)
    assert resolved.cache.max_total_tokens == expected_pool
    assert running == 512 and resolved.runtime.cuda_graph_max_bs == running
    assert resolved.scheduler.chunked_prefill_size == SERVER_CHUNKED_PREFILL_SIZE
    assert resolved.scheduler.latency_chunk_size == GPU_LATENCY_CHUNK_SIZE
    assert resolved.scheduler.prefill_hold_steps == GPU_PREFILL_HOLD_STEPS
    assert resolved.runtime.piecewise_cuda_graph_max_tokens == GPU_PIECEWISE_GRAPH_MAX_TOKENS
    assert resolved.model.context_length == 8192 and resolved.model.device == "cuda"


def test_an_offline_batch_takes_larger_chunks_and_no_latency_chunks() -> None:
    resolved = resolve_config(load_config(use_env=False), h100(offline=True))
    assert resolved.scheduler.chunked_prefill_size == OFFLINE_GPU_CHUNKED_PREFILL_SIZE
    assert resolved.scheduler.latency_chunk_size == 0
    on_cpu = resolve_config(load_config(use_env=False), cpu(offline=True))
    assert on_cpu.scheduler.chunked_prefill_size == SERVER_CHUNKED_PREFILL_SIZE


def test_explicit_values_win_and_the_users_config_is_left_as_it_was() -> None:
    config = load_config(overrides={"scheduler.max_running_requests": 48, "scheduler.latency_chunk_size": 0,
                                    "scheduler.chunked_prefill_size": 512, "cache.max_total_tokens": 10_000,
                                    "model.context_length": 1024}, use_env=False)
    before = config.model_dump()
    resolved = resolve_config(config, h100(offline=True))
    assert config.model_dump() == before
    assert resolved.scheduler.max_running_requests == 48 and resolved.runtime.cuda_graph_max_bs == 48
    assert resolved.scheduler.latency_chunk_size == 0 and resolved.scheduler.chunked_prefill_size == 512
    assert resolved.cache.max_total_tokens == 10_000 and resolved.model.context_length == 1024
    assert config.scheduler.max_running_requests == 48 and config.runtime.cuda_graph_max_bs == "auto"


def test_the_cpu_pool_is_capped_and_rounded_to_whole_pages() -> None:
    resolved = resolve_config(load_config(use_env=False), cpu())
    assert resolved.cache.max_total_tokens == CPU_DEFAULT_MAX_TOKENS
    paged = load_config(overrides={"cache.kv_allocator": "paged", "cache.page_size": 16,
                                   "cache.max_total_tokens": 1000}, use_env=False)
    assert resolve_config(paged, cpu()).cache.max_total_tokens == 992


def test_tensor_parallel_ranks_agree_on_the_smallest_pool() -> None:
    resolved = resolve_config(load_config(use_env=False), h100(), agree_min=lambda tokens: min(tokens, 4096))
    assert resolved.cache.max_total_tokens == 4096
    assert resolved.scheduler.max_running_requests == 16  # sized from the agreed pool


def test_too_little_gpu_memory_is_refused_with_what_to_change() -> None:
    with pytest.raises(RuntimeError, match="lower scheduler.max_running_requests"):
        resolve_config(load_config(use_env=False), h100(device_free_bytes=12 * GiB))


def test_the_resolved_config_is_frozen_typed_and_reported() -> None:
    config = load_config(use_env=False)
    resolved = resolve_config(config, cpu())
    assert isinstance(resolved, ResolvedConfig)
    assert isinstance(resolved.scheduler.max_running_requests, int)
    for section in ("model", "cache", "scheduler", "runtime", "server", "parallel", "grammar"):
        with pytest.raises(pydantic.ValidationError, match="frozen"):
            setattr(getattr(resolved, section), next(iter(type(getattr(resolved, section)).model_fields)), None)
    chosen = resolved.with_attention_backend("torch_native")
    assert chosen.attention.backend == "torch_native" and resolved.attention.backend == "auto"
    line = describe_resolution(config, chosen)
    assert "scheduler.max_running_requests 64 (auto)" in line and "attention.backend torch_native (auto)" in line
    assert chosen.model_dump(mode="json")["scheduler"]["max_running_requests"] == 64


def test_http_workers_are_sized_from_the_cpus_unless_set() -> None:
    assert resolve_config(load_config(use_env=False), cpu(cpu_count=16)).server.workers == 4
    assert resolve_config(load_config(use_env=False), cpu(cpu_count=2)).server.workers == 1
    two = load_config(overrides={"server.workers": 2}, use_env=False)
    assert resolve_config(two, cpu(cpu_count=64)).server.workers == 2
    assert "server.workers 4 (auto)" in describe_resolution(load_config(use_env=False),
                                                            resolve_config(load_config(use_env=False),
                                                                           cpu(cpu_count=16)))
