"""cache.kv_dtype: fp8_e4m3 — FP8 KV storage with per-layer scales, and the backend that refuses it."""

from __future__ import annotations

import pytest
import torch

from treadle.core.config import load_config
from treadle.core.memory.pools import KVCache
from treadle.core.execution.model_runner import ModelRunner
from treadle.core.registry import build_registry
from treadle.testing.models import make_tiny_llama

FP8 = torch.float8_e4m3fn


def test_fp8_cache_stores_scaled_saturated_values_and_takes_half_the_bytes():
    cache = KVCache(4, 1, num_layers=2, num_kv_heads=1, head_dim=4, dtype=FP8, device="cpu")
    assert cache.is_fp8 and cache.k_buffers[0].dtype == FP8
    cache.k_scales[1], cache.v_scales[1] = 2.0, 0.5
    k = torch.tensor([[1.0, -3.0, 1000.0, 0.0]])
    v = torch.tensor([[1.0, -3.0, 96.0, -1000.0]])
    cache.set_kv_buffer(1, torch.tensor([2]), k, v)
    assert cache.get_key_buffer(1)[2, 0].float().tolist() == [0.5, -1.5, 448.0, 0.0]  # k / 2, saturated
    assert cache.get_value_buffer(1)[2, 0].float().tolist() == [2.0, -6.0, 192.0, -448.0]  # v / 0.5
    assert cache.get_key_buffer(0).float().abs().sum() == 0  # other layers untouched
    assert KVCache.bytes_per_token(2, 1, 4, FP8) * 2 == KVCache.bytes_per_token(2, 1, 4, torch.bfloat16)


def test_torch_native_refuses_an_fp8_cache_and_names_the_backends_that_read_it(tmp_path):
    model = make_tiny_llama(tmp_path / "llama")
    overrides = {"model.path": model, "model.device": "cpu", "cache.kv_dtype": "fp8_e4m3", "cache.max_total_tokens": 256}
    registry = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
                               "treadle.plugins.kv_allocators.token"], load_entry_points=False)
    message = "torch_native attention does not read FP8 KV caches; use .*triton or flashinfer"
    with pytest.raises(ValueError, match=message):
        ModelRunner(load_config(overrides={**overrides, "attention.backend": "torch_native"}, use_env=False), registry)
    # attention.backend auto (the default) finds no other backend on the CPU and passes the reason on.
    with pytest.raises(RuntimeError, match="auto found no backend for this model on cpu: torch_native: " + message):
        ModelRunner(load_config(overrides=overrides, use_env=False), registry)


def test_checkpoint_kv_scales_reach_an_fp8_cache_and_are_ignored_by_a_16_bit_one(tmp_path, monkeypatch):
    from treadle.testing.models import make_tiny_fp8_llama

    model = make_tiny_fp8_llama(tmp_path / "fp8kv", kv_scales=(0.5, 0.25))
    registry = build_registry(["treadle.plugins.models.llama", "treadle.plugins.attention.torch_native",
                               "treadle.plugins.attention.triton.backend", "treadle.plugins.kv_allocators.token"],
                              load_entry_points=False)
    base = {"model.path": model, "model.device": "cpu", "cache.max_total_tokens": 256}
    plain = ModelRunner(load_config(overrides=base, use_env=False), registry)  # no "unexpected tensors"
    assert plain.kv_cache.dtype == torch.float32 and plain.kv_cache.k_scales == [1.0, 1.0]
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # builds the triton backend on the CPU; no kernel runs here
    fp8 = ModelRunner(load_config(overrides={**base, "cache.kv_dtype": "fp8_e4m3", "attention.backend": "triton"},
                                  use_env=False), registry)
    assert fp8.kv_cache.is_fp8
    assert fp8.kv_cache.k_scales == [0.5, 0.5] and fp8.kv_cache.v_scales == [0.25, 0.25]
