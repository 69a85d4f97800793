"""The memory-sized defaults: running-request limit, CUDA-graph sizes and mixed chunks from memory numbers."""

from __future__ import annotations

import pytest

from treadle.core.auto_size import (
    CPU_MAX_RUNNING_REQUESTS,
    GPU_LATENCY_CHUNK_SIZE,
    GPU_PREFILL_HOLD_STEPS,
    OFFLINE_GPU_CHUNKED_PREFILL_SIZE,
    SERVER_CHUNKED_PREFILL_SIZE,
    GiB,
    auto_max_running_requests,
    graph_batch_sizes,
    piecewise_token_sizes,
    request_table_bytes,
    resolve_batch_sizes,
    resolve_chunked_prefill_size,
    resolve_cuda_only,
    resolve_piecewise_max_tokens,
)
from treadle.core.config import ConfigError, load_config

H100 = 80 * GiB


def test_the_running_limit_follows_the_kv_pool_up_to_the_gpu_cap() -> None:
    # Llama-3.1-8B on an H100: ~400k KV tokens -> the large-GPU cap.
    assert auto_max_running_requests(400_000, H100) == 512
    # A small pool: 256 tokens per request, rounded down to a multiple of 8.
    assert auto_max_running_requests(20_000, H100) == 72
    assert auto_max_running_requests(1_000, H100) == 3
    assert auto_max_running_requests(100, H100) == 1
    # Smaller GPUs get smaller caps whatever the pool.
    assert auto_max_running_requests(10**7, 24 * GiB) == 128
    assert auto_max_running_requests(10**7, 40 * GiB) == 256


def test_a_pool_without_tokens_is_refused() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        auto_max_running_requests(0, H100)


def test_cuda_resolves_auto_from_memory_and_graphs_cover_every_running_batch() -> None:
    sizes = resolve_batch_sizes("auto", "auto", "auto", on_cuda=True, kv_tokens=400_000, gpu_memory_bytes=H100)
    assert (sizes.max_running_requests, sizes.cuda_graph_max_bs) == (512, 512)
    assert graph_batch_sizes(sizes.cuda_graph_max_bs)[-1] == sizes.max_running_requests


def test_explicit_values_win_and_graphs_never_exceed_the_running_limit() -> None:
    sizes = resolve_batch_sizes(100, "auto", True, on_cuda=True, kv_tokens=400_000, gpu_memory_bytes=H100)
    assert (sizes.max_running_requests, sizes.cuda_graph_max_bs, sizes.enable_mixed_chunk) == (100, 100, True)
    sizes = resolve_batch_sizes("auto", 48, False, on_cuda=True, kv_tokens=400_000, gpu_memory_bytes=H100)
    assert (sizes.max_running_requests, sizes.cuda_graph_max_bs, sizes.enable_mixed_chunk) == (512, 48, False)
    assert resolve_batch_sizes(16, 64, "auto", on_cuda=True, kv_tokens=10**6).cuda_graph_max_bs == 16


def test_a_model_that_prefers_mixed_chunks_gets_them_on_cuda_unless_they_are_set() -> None:
    """A mixture of experts, whose decode steps read the weights a prefill chunk reads, mixes on CUDA only."""
    assert not resolve_batch_sizes(16, 16, "auto", on_cuda=True, kv_tokens=10**6).enable_mixed_chunk
    assert resolve_batch_sizes(16, 16, "auto", on_cuda=True, kv_tokens=10**6, prefers_mixed_chunks=True
                               ).enable_mixed_chunk
    assert not resolve_batch_sizes(16, 16, "auto", on_cuda=False, kv_tokens=10**6, prefers_mixed_chunks=True
                                   ).enable_mixed_chunk
    assert not resolve_batch_sizes(16, 16, False, on_cuda=True, kv_tokens=10**6, prefers_mixed_chunks=True
                                   ).enable_mixed_chunk


def test_cpu_keeps_the_fixed_defaults() -> None:
    sizes = resolve_batch_sizes("auto", "auto", "auto", on_cuda=False, kv_tokens=10**6)
    assert sizes.max_running_requests == CPU_MAX_RUNNING_REQUESTS == 64
    assert sizes.cuda_graph_max_bs == 32
    assert sizes.enable_mixed_chunk is False


def test_graph_buckets_step_by_8_then_16_then_32() -> None:
    sizes = graph_batch_sizes(512)
    assert sizes[:12] == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80]
    assert {b - a for a, b in zip(sizes, sizes[1:]) if a >= 256} == {32}
    assert sizes[-1] == 512 and len(sizes) == 31
    assert graph_batch_sizes(300)[-3:] == [256, 288, 300]
    # A batch pads to the next bucket: fewer than 8 rows of padding to 64, 16 to 256, 32 beyond.
    for bs in range(1, 513):
        padding = next(s for s in sizes if s >= bs) - bs
        assert padding < (8 if bs <= 64 else 16 if bs <= 256 else 32)


def test_prefill_graph_token_counts_step_by_64_then_128_then_256() -> None:
    sizes = piecewise_token_sizes(2048)
    assert sizes[:9] == [8, 16, 32, 48, 64, 96, 128, 192, 256]
    assert sizes[-5:] == [1024, 1280, 1536, 1792, 2048]
    assert piecewise_token_sizes(1024)[-5:] == [512, 640, 768, 896, 1024]
    assert piecewise_token_sizes(100) == [8, 16, 32, 48, 64, 96, 100]
    assert piecewise_token_sizes(5) == [5]
    # A prefill pads to the next size: by fewer than 16 tokens up to 64, 32 to 128, 64 to 512, 128 to 1024.
    for tokens in range(1, 2049):
        padding = next(s for s in sizes if s >= tokens) - tokens
        limit = next(step for top, step in ((64, 16), (128, 32), (512, 64), (1024, 128), (2048, 256)) if tokens <= top)
        assert padding < limit
    with pytest.raises(ValueError, match="piecewise_cuda_graph_max_tokens"):
        piecewise_token_sizes(0)


def test_prefill_graphs_are_on_for_cuda_only_and_never_exceed_a_chunk() -> None:
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=2048) == 1024
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=512) == 512
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=None) == 1024
    # A mixed step carries decode rows beside its chunk: 256 + up to 512 rows still replays.
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=256, mixed_decode_rows=512) == 768
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=512, mixed_decode_rows=64) == 576
    # A latency chunk rides beside fewer decode rows than its size.
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=128, latency_chunk_size=256) == 511
    assert resolve_piecewise_max_tokens("auto", on_cuda=False, chunked_prefill_size=2048) == 0
    # A model whose whole prefill chunks are launch-bound gets graphs up to its largest extend step.
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=4096, mixed_decode_rows=368,
                                        launch_bound_prefill=True) == 4464
    assert resolve_piecewise_max_tokens("auto", on_cuda=False, chunked_prefill_size=4096,
                                        launch_bound_prefill=True) == 0
    assert resolve_piecewise_max_tokens(2048, on_cuda=True, chunked_prefill_size=4096, launch_bound_prefill=True) == 2048
    assert resolve_piecewise_max_tokens(4096, on_cuda=True, chunked_prefill_size=2048) == 4096
    assert resolve_piecewise_max_tokens(0, on_cuda=True, chunked_prefill_size=2048) == 0
    assert resolve_piecewise_max_tokens("auto", on_cuda=True, chunked_prefill_size=2048, tp_size=2) == 0


def test_request_tables_scale_with_rows_and_context() -> None:
    assert request_table_bytes(511, 131072, 1) == 2 * 512 * 131073 * 4


def test_config_accepts_ints_or_auto() -> None:
    config = load_config(use_env=False)
    assert config.scheduler.max_running_requests == "auto"
    assert config.runtime.cuda_graph_max_bs == "auto"
    assert config.scheduler.enable_mixed_chunk == "auto"
    assert config.runtime.piecewise_cuda_graph_max_tokens == "auto"
    assert config.scheduler.chunked_prefill_size == "auto"
    assert load_config(overrides=["scheduler.chunked_prefill_size=null"], use_env=False).scheduler.chunked_prefill_size is None
    config = load_config(overrides=["scheduler.max_running_requests=8", "runtime.cuda_graph_max_bs=auto",
                                    "scheduler.enable_mixed_chunk=true"], use_env=False)
    assert (config.scheduler.max_running_requests, config.runtime.cuda_graph_max_bs) == (8, "auto")
    assert config.scheduler.enable_mixed_chunk is True
    for bad, key in [("scheduler.max_running_requests=0", "max_running_requests"),
                     ("runtime.cuda_graph_max_bs=lots", "cuda_graph_max_bs"),
                     ("scheduler.enable_mixed_chunk=maybe", "enable_mixed_chunk"),
                     ("runtime.piecewise_cuda_graph_max_tokens=-1", "piecewise_cuda_graph_max_tokens"),
                     ("scheduler.chunked_prefill_size=0", "chunked_prefill_size"),
                     ("scheduler.chunked_prefill_size=big", "chunked_prefill_size")]:
        with pytest.raises(ConfigError, match=key):
            load_config(overrides=[bad], use_env=False)


def test_the_cpu_runner_resolves_auto_into_a_frozen_config_and_logs_it(tiny_llama_dir, caplog) -> None:
    import logging

    import pydantic

    from treadle.core.execution.model_runner import ModelRunner
    from treadle.core.registry import build_registry

    config = load_config(overrides={"model.path": tiny_llama_dir, "model.device": "cpu",
                                    "cache.max_total_tokens": 256}, use_env=False)
    before = config.model_dump()
    with caplog.at_level(logging.INFO, logger="treadle.core.execution.model_runner"):
        runner = ModelRunner(config, build_registry())
    assert "max_running_requests 64 (auto)" in caplog.text
    assert "enable_mixed_chunk False (auto)" in caplog.text
    assert "piecewise_cuda_graph_max_tokens 0 (auto)" in caplog.text and "prefill CUDA graphs off" in caplog.text
    assert f"chunked_prefill_size {SERVER_CHUNKED_PREFILL_SIZE} (auto)" in caplog.text
    assert "cache.max_total_tokens 256," in caplog.text  # set by the user: no "(auto)"
    resolved = runner.config
    assert runner.piecewise_graph_runner is None and resolved.runtime.piecewise_cuda_graph_max_tokens == 0
    assert runner.max_running_requests == resolved.scheduler.max_running_requests == 64
    assert runner.req_to_token_pool.size == 65
    assert resolved.scheduler.enable_mixed_chunk is False
    assert resolved.scheduler.chunked_prefill_size == SERVER_CHUNKED_PREFILL_SIZE
    assert resolved.attention.backend == "torch_native"
    assert config.model_dump() == before  # the user's config is never written to
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        resolved.scheduler.max_running_requests = 8


def test_offline_batches_on_cuda_take_larger_prefill_chunks_than_the_server() -> None:
    assert SERVER_CHUNKED_PREFILL_SIZE < OFFLINE_GPU_CHUNKED_PREFILL_SIZE
    assert resolve_chunked_prefill_size("auto", on_cuda=True, offline=True) == OFFLINE_GPU_CHUNKED_PREFILL_SIZE
    assert resolve_chunked_prefill_size("auto", on_cuda=True, offline=False) == SERVER_CHUNKED_PREFILL_SIZE
    assert resolve_chunked_prefill_size("auto", on_cuda=False, offline=True) == SERVER_CHUNKED_PREFILL_SIZE
    assert resolve_chunked_prefill_size(1000, on_cuda=True, offline=True) == 1000
    assert resolve_chunked_prefill_size(None, on_cuda=True, offline=True) is None


@pytest.mark.parametrize(("key", "cuda_value"), [("prefill_hold_steps", GPU_PREFILL_HOLD_STEPS),
                                                 ("latency_chunk_size", GPU_LATENCY_CHUNK_SIZE)])
def test_cuda_only_settings_are_on_for_cuda_with_auto_and_explicit_values_win(key: str, cuda_value: int) -> None:
    assert resolve_cuda_only("auto", on_cuda=True, cuda_value=cuda_value) == cuda_value > 0
    assert resolve_cuda_only("auto", on_cuda=False, cuda_value=cuda_value) == 0
    assert resolve_cuda_only(3, on_cuda=False, cuda_value=cuda_value) == 3
    assert resolve_cuda_only(0, on_cuda=True, cuda_value=cuda_value) == 0
    with pytest.raises(ConfigError, match=key):
        load_config(overrides=[f"scheduler.{key}=-1"])


def test_the_runner_passes_the_models_hints_to_the_resolution(tiny_llama_dir, tmp_path, monkeypatch) -> None:
    """A model's ``prefers_mixed_chunks`` and ``launch_bound_prefill`` reach the ``auto`` resolution (which acts on
    them on CUDA only), and an Engine resolves for an offline batch: Qwen3-MoE declares both hints, Llama neither."""
    from treadle import Engine
    from treadle.core.execution import model_runner
    from treadle.testing.models import make_tiny_qwen3_moe

    seen = []
    resolve = model_runner.resolve_config

    def spy(config, facts, **kwargs):
        seen.append(facts)
        return resolve(config, facts, **kwargs)

    monkeypatch.setattr(model_runner, "resolve_config", spy)
    for path, hinted in ((make_tiny_qwen3_moe(tmp_path / "qwen3moe"), True), (tiny_llama_dir, False)):
        seen.clear()
        engine = Engine({"model": {"path": path}, "cache": {"max_total_tokens": 256}})
        engine.shutdown()
        assert len(seen) == 1
        assert seen[0].prefers_mixed_chunks is hinted and seen[0].launch_bound_prefill is hinted
        assert seen[0].offline is True
