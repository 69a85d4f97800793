"""Decode steps of several tokens per request on CUDA: the oracle speculator (tests/oracle_speculator.py) over a
ModelWorker that captured verify graphs for t = 2..k + 1 makes the scheduler build TARGET_VERIFY batches, which
replay those graphs, and the greedy tokens are the plain run's (float32, triton, overlap on and off, the token and
the paged allocator); every KV slot comes back. tests/core/test_multi_token_steps.py is the same on the CPU, eagerly.

Where the two runs part, it must be at a near-tie of the plain run (its top two log-probs within 2e-3): a verify
step runs the extend attention kernels, which sum in another order than the decode kernel (float32 logits agree
within 2e-3, tests/gpu/test_verify_graphs_gpu.py).
"""

from __future__ import annotations

import pytest
import torch

from graph_replays import ReplayCounter
from oracle_speculator import OracleSpeculator
from treadle import Engine, SamplingParams
from treadle.testing.engine import assert_kv_accounted

pytestmark = pytest.mark.gpu

K = 4
NEAR_TIE = 2e-3


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 200, (count,), generator=generator).tolist()
    shared = torch.randint(10, 8000, (40,), generator=generator).tolist()
    prompts = [torch.randint(10, 8000, (n,), generator=generator).tolist() for n in lengths]
    return [shared + p if i % 3 == 0 else p for i, p in enumerate(prompts)]  # some share a 40-token prefix


def _first_difference(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_verify_steps_replay_graphs_and_give_the_plain_tokens(real_shape_llama_dir, engine_config, page_size,
                                                              overlap):
    from treadle.core.execution.worker import ModelWorker
    from treadle.core.scheduling.scheduler import Scheduler

    config = engine_config(real_shape_llama_dir, "triton", "float32", page_size=page_size)
    config["scheduler"].update(disable_overlap=not overlap, chunked_prefill_size=128)
    prompts = _prompts(12, seed=5)
    params = [SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
    engine = Engine(config)
    worker = None
    try:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
        assert_kv_accounted(engine)
        registry = engine.scheduler.registry
        engine.scheduler.worker.release_graphs()
        target = ModelWorker(engine.config, registry, offline=True, verify_tokens_per_req=range(2, K + 2))
        worker = OracleSpeculator(target, K, {tuple(p): o.token_ids for p, o in zip(prompts, plain)}, seed=1)
        replays = {t: ReplayCounter(target.cuda_graphs.verify[t]) for t in range(2, K + 2)}
        engine.scheduler = Scheduler(engine.config, registry, worker=worker)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
    finally:
        if worker is not None:
            worker.inner.release_graphs()
        engine.shutdown()
    verify_steps = [t for mode, _, t in worker.batches if mode == "TARGET_VERIFY"]
    assert verify_steps and sum(r.count for r in replays.values()) == len(verify_steps)
    assert set(worker.accepted_counts()) == set(range(K + 1))
    for i, (got, want) in enumerate(zip(outputs, plain)):
        part = _first_difference(got.token_ids, want.token_ids)
        if part is None:
            continue
        (first, top1), (second, top2) = want.output_top_logprobs[part][:2]
        assert top1 - top2 <= NEAR_TIE and got.token_ids[part] in (first, second), (
            f"request {i} parted from the plain run at token {part}, not at a near-tie ({top1} vs {top2})")
    assert sum(o.token_ids == p.token_ids for o, p in zip(outputs, plain)) >= 10
