"""The peer-to-peer all-reduce on 2 GPUs (and 4 where the machine has them): NCCL's sums, bitwise repeatable, in
CUDA graphs, and inside a tp=2 Engine.

Needs two GPUs with peer access (e.g. nvidia-h100-x2); skipped elsewhere. Run with
``bash tests/gpu/multi_gpu.sh setup ar_tests``. Every check prints what it saw; a rank that hangs fails the check
after its timeout with every rank's state instead of hanging the run.
"""

from __future__ import annotations

import pytest
import torch

from treadle import Engine
from treadle.testing.all_reduce import check_custom_all_reduce
from treadle.testing.engine import assert_kv_accounted

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]


@pytest.mark.parametrize("world", [2, 4])
def test_peer_all_reduce_matches_nccl_eager_and_in_cuda_graphs(world):
    """1 KiB..8 MiB, bf16/fp16/fp32, one-shot and two-shot: within rounding of NCCL's sum, bitwise repeatable,
    the same on every rank, in CUDA graphs with new inputs copied in, no wait given up."""
    if torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} GPUs")
    reports = check_custom_all_reduce(world_size=world, timeout_s=400)
    for report in reports:
        print(f"rank {report['rank']}: {report['all_reduce']}; {report['cases']} cases, bitwise equal to NCCL in "
              f"{report['exact_cases']}, waits given up {report['errors']}")
        assert report["cases"] == 3 * 6 * 2


def test_auto_picks_the_peer_all_reduce_on_gpus_with_peer_access():
    reports = check_custom_all_reduce(world_size=2, mode="auto", dtypes=("bfloat16",), sizes=(8 * 1024,),
                                      graphs=False, timeout_s=200)
    assert all(r["all_reduce"].startswith("peer-to-peer") for r in reports), reports


def _generate(model_dir: str, engine_config, tp_size: int, custom: bool) -> list[list[int]]:
    config = engine_config(model_dir, "triton", "float32", graphs=True)
    config["parallel"] = {"tp_size": tp_size, "custom_all_reduce": custom}
    prompts = [list(range(10 + n, 10 + 2 * n)) for n in (5, 37, 130)]
    with Engine(config) as engine:
        if tp_size > 1:
            print(f"tp={tp_size} custom_all_reduce={custom}: {engine.model_info.get('all_reduce')}")
            assert engine.model_info["all_reduce"].startswith("peer-to-peer" if custom else "nccl")
        outputs = engine.generate(input_ids=prompts, sampling_params=[
            {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}] * len(prompts))
        assert_kv_accounted(engine)
    return [out.token_ids for out in outputs]


def test_tp2_engine_with_the_peer_all_reduce_generates_what_tp1_does(real_shape_llama_dir, engine_config):
    """float32, triton, decode CUDA graphs capturing the peer all-reduce (prefill messages above 8 MiB go to NCCL)."""
    want = _generate(real_shape_llama_dir, engine_config, 1, False)
    assert _generate(real_shape_llama_dir, engine_config, 2, True) == want
