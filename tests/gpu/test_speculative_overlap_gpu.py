"""Overlapped verify on CUDA (speculative.overlap): with the test oracle proposing on the device, each verify step is
queued before the previous one's results are read, replays its captured verify graph, and greedy tokens are the
plain run's (float32, triton, real Llama shapes), with every draft kept and with two of four kept a step (the rest's
KV given back one step late); every KV slot comes back. Where a run parts from the plain one, it must be at a
near-tie (as tests/gpu/test_multi_token_gpu.py explains)."""

from __future__ import annotations

import pytest
import torch

from graph_replays import ReplayCounter
from near_tie import NEAR_TIE, assert_plain_or_near_tie
from treadle import Engine, SamplingParams
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.speculator_plugins import OverlappedVerifySteps

pytestmark = pytest.mark.gpu

K = 4
PLUGINS = ["treadle.testing.speculator_plugins"]


@pytest.mark.parametrize("wrong_at", [None, 2], ids=["all-kept", "two-kept"])
def test_overlapped_verify_replays_graphs_with_the_plain_tokens(real_shape_llama_dir, engine_config, wrong_at):
    config = {**engine_config(real_shape_llama_dir, "triton", "float32"), "plugins": PLUGINS}
    generator = torch.Generator().manual_seed(5)
    # Four requests: 4 x (k + 1) = 20 tokens a step, the Triton decode kernel's verify route (overlappable).
    prompts = [torch.randint(10, 8000, (int(n),), generator=generator).tolist() for n in (7, 30, 61, 90)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (33, 12, 27, 40)]
    plain = _plain_run(config, prompts, params)
    engine = Engine({**config, "speculative": {"method": "oracle", "num_tokens": K, "max_batch_size": 16,
                                               "overlap": True}})
    try:
        worker = engine.scheduler.worker
        assert worker.overlap_verify
        replays = {t: ReplayCounter(worker.target.cuda_graphs.verify[t]) for t in worker.target.cuda_graphs.verify}
        worker.speculator.references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
        worker.speculator.wrong_at = wrong_at
        steps = OverlappedVerifySteps()
        engine.scheduler.add_observer(steps)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
    finally:
        engine.shutdown()
    assert steps.overlapped >= steps.verify // 2 > 0, (steps.overlapped, steps.verify)
    assert sum(r.count for r in replays.values()) >= steps.verify
    assert_plain_or_near_tie(outputs, plain, min_equal=len(plain) - 1, near_tie=NEAR_TIE)


def _plain_run(config: dict, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    """Plain decode's outputs, with the top two log-probs a near-tie is judged by."""
    engine = Engine(config)
    try:
        return engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    finally:
        engine.shutdown()
