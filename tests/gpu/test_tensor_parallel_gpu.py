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
