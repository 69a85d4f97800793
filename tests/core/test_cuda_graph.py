"""CudaGraphRunner's batch-size ladder, how a batch fills its static inputs, and that the CPU never builds one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from treadle.core.execution.cuda_graph import _copy_inputs, capture_batch_sizes, faster_sizes


@pytest.mark.parametrize(
    ("max_bs", "expected"),
    [(1, [1]), (3, [1, 2, 3]), (8, [1, 2, 4, 8]), (32, [1, 2, 4, 8, 16, 24, 32]), (20, [1, 2, 4, 8, 16, 20])],
)
def test_capture_sizes_cover_every_batch_up_to_the_maximum(max_bs: int, expected: list[int]) -> None:
    assert capture_batch_sizes(max_bs) == expected


def test_a_zero_maximum_is_refused() -> None:
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        capture_batch_sizes(0)


def test_a_cpu_worker_captures_no_graphs(tiny_llama_dir) -> None:
    from treadle.core.config import load_config
    from treadle.core.execution.worker import ModelWorker
    from treadle.core.registry import build_registry

    config = load_config(overrides={"model.path": tiny_llama_dir, "model.device": "cpu",
                                    "cache.max_total_tokens": 256}, use_env=False)
    worker = ModelWorker(config, build_registry(), verify_tokens_per_req=[3])
    assert worker.cuda_graphs is None and worker.piecewise_graphs is None
    assert not worker.runner.uses_decode_graphs and worker.runner.piecewise_graph_tokens == 0


def test_large_maxima_use_coarser_buckets() -> None:
    assert capture_batch_sizes(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]


def test_pruning_drops_sizes_slower_than_a_larger_one() -> None:
    # Shaped like an 8B Llama's graphs on an H100, where cuBLAS ran 448 rows far slower than 480, and 416 and 288
    # a little slower than the size above (the server logged 288, 416 and 448 as dropped).
    seconds = {256: 7.1, 288: 8.3, 320: 7.7, 352: 8.9, 384: 8.6, 416: 10.2, 448: 14.1, 480: 9.9, 512: 9.8}
    # 480 is within 2% of 512 and stays; 448 and 416 are slower than 480, 352 than 384, 288 than 320.
    assert faster_sizes(seconds) == [256, 320, 384, 480, 512]
    # Within the tolerance nothing goes: small sizes replay in nearly the same time.
    assert faster_sizes({1: 7.20, 2: 7.25, 4: 7.22, 8: 7.30}) == [1, 2, 4, 8]
    assert faster_sizes({1: 7.30, 2: 7.25}, tolerance=0.0) == [2]
    # The largest size always stays, and a ladder that only grows keeps every size.
    assert faster_sizes({64: 3.0}) == [64]
    assert faster_sizes({8: 1.0, 16: 2.0, 32: 3.0}) == [8, 16, 32]



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

    from treadle.core.execution.worker import ModelWorker

    released, eager = [], []
    worker = SimpleNamespace(runner=SimpleNamespace(device=torch.device("cpu"),
                                                    forward=lambda batch: eager.append(batch) or "logits"),
                             cuda_graphs=SimpleNamespace(release=lambda: released.append("decode")),
                             piecewise_graphs=SimpleNamespace(release=lambda: released.append("prefill")))
    ModelWorker.release_graphs(worker)  # type: ignore[arg-type]
    assert released == ["decode", "prefill"]
    assert worker.cuda_graphs is None and worker.piecewise_graphs is None
    assert ModelWorker.forward(worker, "batch") == "logits" and eager == ["batch"]  # type: ignore[arg-type]


@pytest.mark.parametrize("raw_bs", [2, 3])  # padded to the 3-row graph, and exactly its size
def test_static_inputs_take_the_batch_then_padding(raw_bs: int) -> None:
    t, fill = 2, 7  # a verify graph of 2 tokens per request
    static = SimpleNamespace(**{name: torch.full((3 * t,), -1) for name in ("input_ids", "positions", "out_cache_loc")},
                             req_pool_indices=torch.full((3,), -1), seq_lens=torch.full((3,), -1),
                             seq_lens_cpu=torch.full((3,), -1))
    tokens = torch.arange(1, raw_bs * t + 1)
    batch = SimpleNamespace(input_ids=tokens, positions=tokens + 10, out_cache_loc=tokens + 20,
                            req_pool_indices=torch.arange(raw_bs) + 1, seq_lens=torch.arange(raw_bs) + 30,
                            seq_lens_cpu=torch.arange(raw_bs) + 30)
    seq_lens_cpu = _copy_inputs(static, batch, raw_bs, 3, t, fill)
    padding = 3 - raw_bs
    assert seq_lens_cpu.tolist() == static.seq_lens.tolist() == list(range(30, 30 + raw_bs)) + [fill] * padding
    assert static.input_ids.tolist() == tokens.tolist() + [0] * (padding * t)
    assert static.out_cache_loc.tolist() == (tokens + 20).tolist() + [0] * (padding * t)
    assert static.req_pool_indices.tolist() == list(range(1, raw_bs + 1)) + [0] * padding
