"""Tensor parallelism on 2 GPUs (NCCL, CUDA graphs capturing the all-reduce): tp=2 generates what tp=1 does.

Needs a machine with at least two GPUs (e.g. nvidia-h200-x2); skipped elsewhere. Run with
``bash tests/gpu/multi_gpu.sh setup tp_tests``.

- float32 (triton): identical greedy tokens for every prompt; row-parallel layers only reorder
  float32 sums, far below these random weights' logit gaps.
- bfloat16 (triton, flashinfer): the partial sums are rounded to bf16 before the all-reduce,
  unlike one big matmul, so a near tie may flip late in a sequence; the first tokens of every
  prompt must agree, and the overall agreement is printed.
"""

from __future__ import annotations

import pytest
import torch

from treadle import Engine
from treadle.testing.engine import assert_kv_accounted

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

NEW_TOKENS = 24
FIRST_TOKENS_BF16 = 4
CASES = [("triton", "float32"), ("triton", "bfloat16"), ("flashinfer", "bfloat16")]


def _prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(10, 8000, (n,), generator=generator).tolist() for n in (5, 37, 130, 300, 700)]


def _generate(config: dict, tp_size: int) -> list[list[int]]:
    config = {**config, "parallel": {"tp_size": tp_size}}
    with Engine(config) as engine:
        runner = engine.scheduler.runner
        assert runner.cuda_graph_runner is not None, "CUDA graphs must be on (they capture the NCCL all-reduce)"
        outputs = engine.generate(input_ids=_prompts(), sampling_params={
            "max_new_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True})
        assert_kv_accounted(engine)
        return [out.token_ids for out in outputs]


@pytest.mark.parametrize(("backend", "dtype"), CASES)
def test_tp2_matches_tp1_with_cuda_graphs(real_shape_llama_dir, engine_config, backend, dtype):
    config = engine_config(real_shape_llama_dir, backend, dtype, graphs=True)
    expected = _generate(config, 1)
    got = _generate(config, 2)
    same = sum(a == b for want, have in zip(expected, got) for a, b in zip(want, have))
    print(f"{backend} {dtype}: tp=2 agrees with tp=1 on {same}/{NEW_TOKENS * len(expected)} tokens")
    if dtype == "float32":
        assert got == expected
    else:
        assert [ids[:FIRST_TOKENS_BF16] for ids in got] == [ids[:FIRST_TOKENS_BF16] for ids in expected]


PIECEWISE_CASES = [("triton", "float32"), ("flashinfer", "bfloat16")]
# Different lengths, so that with two running at a time the waiting prompts trickle in beside a decode.
PIECEWISE_NEW_TOKENS = (NEW_TOKENS, 8, 16, 12, 20)


def _generate_piecewise(config: dict, tp_size: int) -> tuple[list[list[int]], int, int]:
    """Greedy tokens with prefill CUDA graphs (their pieces capture the row-parallel all-reduces) and latency
    chunks (prompt pieces mixed into decode steps), the extend batches that replayed the pieces, and the mixed
    steps."""
    from batch_log import record_batches
    from graph_replays import ReplayCounter

    from treadle.core.forward_batch import ForwardMode

    config = {**config, "parallel": {"tp_size": tp_size},
              "runtime": {**config["runtime"], "piecewise_cuda_graph_max_tokens": 1024},
              "scheduler": {**config["scheduler"], "max_running_requests": 2, "latency_chunk_size": 64}}
    with Engine(config) as engine:
        runner = engine.scheduler.runner
        assert runner.piecewise_graph_runner is not None
        replays = ReplayCounter(runner.piecewise_graph_runner)
        modes = record_batches(engine, lambda batch: batch.forward_mode)
        outputs = engine.generate(input_ids=_prompts(), sampling_params=[
            {"max_new_tokens": n, "temperature": 0.0, "ignore_eos": True} for n in PIECEWISE_NEW_TOKENS])
        assert_kv_accounted(engine)
        return [out.token_ids for out in outputs], replays.count, modes.count(ForwardMode.MIXED)


@pytest.mark.parametrize(("backend", "dtype"), PIECEWISE_CASES)
def test_tp2_piecewise_prefill_graphs_and_latency_chunks_match_tp1(real_shape_llama_dir, engine_config, backend,
                                                                   dtype):
    config = engine_config(real_shape_llama_dir, backend, dtype, graphs=True)
    expected, _, _ = _generate_piecewise(config, 1)
    got, replays, mixed = _generate_piecewise(config, 2)
    same = sum(a == b for want, have in zip(expected, got) for a, b in zip(want, have))
    print(f"{backend} {dtype} piecewise: tp=2 agrees with tp=1 on {same}/{sum(PIECEWISE_NEW_TOKENS)} tokens; "
          f"{replays} piecewise replays, {mixed} mixed steps at tp=2")
    assert replays >= 2 and mixed >= 1
    if dtype == "float32":
        assert got == expected
    else:
        assert [ids[:FIRST_TOKENS_BF16] for ids in got] == [ids[:FIRST_TOKENS_BF16] for ids in expected]
