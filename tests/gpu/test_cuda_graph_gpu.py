"""CUDA-graph decode gives the same greedy tokens as eager decode, and really replays graphs."""

from __future__ import annotations

import pytest
import torch

from graph_replays import ReplayCounter

from treadle import Engine, SamplingParams

pytestmark = pytest.mark.gpu

NEW_TOKENS = 24


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 200, (count,), generator=generator).tolist()
    return [torch.randint(10, 8000, (n,), generator=generator).tolist() for n in lengths]


def _generate(config: dict, prompts: list[list[int]]) -> tuple[list[list[int]], int]:
    engine = Engine(config)
    replays = ReplayCounter(engine.scheduler.worker.cuda_graphs)
    try:
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        return [o.token_ids for o in outputs], replays.count
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    ("backend", "dtype", "page_size"),
    [("triton", "float32", 1), ("triton", "bfloat16", 16), ("flashinfer", "bfloat16", 1),
     ("flashinfer", "bfloat16", 16), ("flashinfer_triton", "bfloat16", 1)],
)
@pytest.mark.parametrize("count", [3, 8])  # 3 pads to the graph of 4; 8 is captured exactly
def test_graphs_on_and_off_give_identical_tokens(real_shape_llama_dir, engine_config, backend, dtype, page_size,
                                                 count, monkeypatch) -> None:
    if backend.startswith("flashinfer"):
        pytest.importorskip("flashinfer")
    if backend == "flashinfer_triton":  # 3 requests decode through triton, 8 through flashinfer
        from treadle.plugins.attention.hybrid import FlashInferTritonAttnBackend

        monkeypatch.setattr(FlashInferTritonAttnBackend, "small_decode_batch", 4)
    prompts = _prompts(count, seed=count)
    eager, eager_replays = _generate(engine_config(real_shape_llama_dir, backend, dtype, graphs=False,
                                                   page_size=page_size), prompts)
    graphed, replays = _generate(engine_config(real_shape_llama_dir, backend, dtype, graphs=True,
                                               page_size=page_size), prompts)
    assert eager_replays == 0
    assert replays >= NEW_TOKENS - 1, f"only {replays} decode steps replayed a CUDA graph"
    assert graphed == eager


def test_batches_larger_than_the_graphs_run_eagerly(real_shape_llama_dir, engine_config) -> None:
    config = engine_config(real_shape_llama_dir, "triton", "bfloat16")
    config["runtime"]["cuda_graph_max_bs"] = 4
    prompts = _prompts(6, seed=1)
    graphed, replays = _generate(config, prompts)
    assert replays == 0  # six requests, all finishing together: every decode step is too big for the graphs
    eager, _ = _generate(engine_config(real_shape_llama_dir, "triton", "bfloat16", graphs=False), prompts)
    assert graphed == eager


def test_pruned_sizes_are_timed_and_a_dropped_size_pads_up(real_shape_llama_dir, engine_config, monkeypatch) -> None:
    import treadle.core.execution.cuda_graph as cuda_graph
    from treadle.bench.offline_treadle import decode_graphs

    engine = Engine(engine_config(real_shape_llama_dir, "triton", "bfloat16"))
    try:
        runner = engine.scheduler.worker.cuda_graphs
        ladder = cuda_graph.capture_batch_sizes(16)
        assert sorted(runner.seconds_per_replay) == ladder and all(s > 0 for s in runner.seconds_per_replay.values())
        assert runner.batch_sizes == cuda_graph.faster_sizes(runner.seconds_per_replay)
        assert sorted(runner.graphs) == runner.batch_sizes and runner.batch_sizes[-1] == 16
        recorded = decode_graphs(engine)  # what `treadle bench offline` writes into its JSON
        assert recorded["decode_graph_batch_sizes"] == runner.batch_sizes
        assert sorted(recorded["decode_graph_ms_per_replay"]) == ladder
    finally:
        engine.shutdown()
    # Keep only 8 and 16: three requests replay the graph of 8 (not 4) and decode the same tokens as eager.
    monkeypatch.setattr(cuda_graph, "faster_sizes", lambda seconds: [8, 16])
    engine = Engine(engine_config(real_shape_llama_dir, "triton", "bfloat16"))
    try:
        runner = engine.scheduler.worker.cuda_graphs
        assert runner.batch_sizes == [8, 16] and sorted(runner.graphs) == [8, 16]
        replays = ReplayCounter(runner)
        prompts = _prompts(3, seed=3)
        params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        graphed = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        engine.shutdown()
    eager, _ = _generate(engine_config(real_shape_llama_dir, "triton", "bfloat16", graphs=False), prompts)
    assert replays.count >= NEW_TOKENS - 1
    assert graphed == eager
