"""CudaGraphRunner's batch-size ladder, and that the CPU never builds one."""

from __future__ import annotations

import pytest
import torch

from treadle.core.cuda_graph import capture_batch_sizes


@pytest.mark.parametrize(
    ("max_bs", "expected"),
    [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (32, [1, 2, 4, 8, 16, 24, 32]), (20, [1, 2, 4, 8, 16, 20])],
)
def test_capture_sizes_cover_every_batch_up_to_the_maximum(max_bs: int, expected: list[int]) -> None:
    assert capture_batch_sizes(max_bs) == expected


def test_a_zero_maximum_is_refused() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_cpu_runner_has_no_graph_runner(tiny_llama_dir) -> None:
    from treadle.core.config import load_config
    from treadle.core.model_runner import ModelRunner
    from treadle.core.registry import build_registry

    config = load_config(overrides={"model.path": tiny_llama_dir, "model.device": "cpu",
                                    "cache.max_total_tokens": 256}, use_env=False)
    runner = ModelRunner(config, build_registry())
    assert runner.cuda_graph_runner is None


def test_large_maxima_use_coarser_buckets() -> None:
    assert capture_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]



def test_every_built_in_model_splits_for_piecewise_prefill_graphs() -> None:
    """Prefill graphs capture ``forward_hidden`` and run ``compute_logits`` eagerly; a model without them
    prefills eagerly, so every built-in family must have both."""
    from treadle.core.registry import build_registry

    registry = build_registry()
    names = registry.table()["models"]
    assert "LlamaForCausalLM" in names and "Qwen3MoeForCausalLM" in names
    for name in names:
        model_class = registry.get("models", name)
        assert callable(getattr(model_class, "forward_hidden", None)), name
        assert callable(getattr(model_class, "compute_logits", None)), name


def test_release_graphs_frees_both_runners_and_later_forwards_run_eagerly():
    from types import SimpleNamespace

    from treadle.core.model_runner import ModelRunner

    released = []
    runner = SimpleNamespace(device=torch.device("cpu"),
                             cuda_graph_runner=SimpleNamespace(release=lambda: released.append("decode")),
                             piecewise_graph_runner=SimpleNamespace(release=lambda: released.append("prefill")))
    ModelRunner.release_graphs(runner)  # type: ignore[arg-type]
    assert released == ["decode", "prefill"]
    assert runner.cuda_graph_runner is None and runner.piecewise_graph_runner is None
