"""Fixtures for the GPU tests: a small model with Llama-3.1-8B's attention shapes, saved once per session."""

from __future__ import annotations

import pytest

# 128-dim heads, 4 query heads per KV head and llama3 rotary scaling, as in Llama-3.1-8B; few, narrow layers.
REAL_SHAPE_LLAMA = dict(
    hidden_size=2048, intermediate_size=4096, num_hidden_layers=4, num_attention_heads=16,
    num_key_value_heads=4, head_dim=128, vocab_size=8192, max_position_embeddings=4096, rope_theta=500000.0,
    rope_scaling={"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 1024, "rope_type": "llama3"},
    rms_norm_eps=1e-5,
)

@pytest.fixture(scope="session")
def real_shape_llama_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("real-shape-llama"), seed=0, **REAL_SHAPE_LLAMA)


@pytest.fixture(scope="session")
def engine_config():
    """``engine_config(model_dir, backend, dtype, graphs=True, page_size=1)`` -> an Engine config dict."""
    return _engine_config


def _engine_config(model_dir: str, backend: str, dtype: str, *, graphs: bool = True, page_size: int = 1) -> dict:
    return {
        "model": {"path": model_dir, "dtype": dtype, "device": "cuda", "context_length": 2048},
        "attention": {"backend": backend},
        "cache": {"kv_allocator": "token" if page_size == 1 else "paged", "page_size": page_size,
                  "max_total_tokens": 16384},
        "scheduler": {"max_running_requests": 16},
        "runtime": {"disable_cuda_graph": not graphs, "cuda_graph_max_bs": 16},
    }
