"""The ``draft`` speculator on CUDA with graphs on: a draft model equal to the target (Llama-3.1-8B attention shapes,
few layers) drafts through its own decode CUDA graphs, the target verifies through its verify graphs, nearly every
draft is kept, greedy tokens are the plain run's (where they part, only at a near-tie of the plain run: the draft's
and the verify step's kernels sum in other orders), and both KV pools are full again afterwards.
tests/plugins/test_draft_speculator.py is the same on the CPU, eagerly."""

from __future__ import annotations

import pytest
import torch

from graph_replays import ReplayCounter
from treadle import Engine, SamplingParams
from treadle.testing.engine import assert_kv_accounted

pytestmark = pytest.mark.gpu

K = 4
NEAR_TIE = 2e-3


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 200, (count,), generator=generator).tolist()
    return [torch.randint(10, 8000, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("backend,dtype", [("triton", "float32"), ("flashinfer_triton", "bfloat16")])
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_draft_equal_to_the_target_through_cuda_graphs(real_shape_llama_dir, engine_config, backend, dtype,
                                                         overlap):
    prompts = _prompts(12, seed=3)
    params = [SamplingParams(max_new_tokens=16 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
    config = engine_config(real_shape_llama_dir, backend, dtype)
    config["scheduler"]["disable_overlap"] = not overlap
    with Engine(config) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    config["plugins"] = ["treadle.plugins.speculators.draft"]
    config["speculative"] = {"method": "draft", "num_tokens": K, "draft_model_path": real_shape_llama_dir,
                             "max_batch_size": 16}
    with Engine(config) as engine:
        speculator = engine.scheduler.worker.speculator
        replays = ReplayCounter(speculator.draft.cuda_graphs)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
        draft = speculator.draft.info
        assert draft.allocator.free_slots == draft.allocator.total_slots
    assert replays.count > 0, "the draft's decode steps replay its CUDA graphs"
    tokens = sum(len(o.token_ids) for o in outputs)
    steps = sum(o.spec_verify_steps for o in outputs)
    assert tokens / steps >= 0.8 * (K + 1), f"acceptance length {tokens / steps:.2f} of at most {K + 1}"
    for i, (got, want) in enumerate(zip(outputs, plain)):
        part = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if part is None:
            assert len(got.token_ids) == len(want.token_ids)
            continue
        if dtype == "float32":
            (first, top1), (second, top2) = want.output_top_logprobs[part][:2]
            assert top1 - top2 <= NEAR_TIE and got.token_ids[part] in (first, second), (
                f"request {i} parted from the plain run at token {part}, not at a near-tie ({top1} vs {top2})")
    if dtype == "float32":
        assert sum(o.token_ids == p.token_ids for o, p in zip(outputs, plain)) >= 10


def test_draft_trees_through_cuda_graphs(real_shape_llama_dir, engine_config):
    """speculative.topk 2: the draft grows trees through its decode graphs (two scratch rows per request), the target
    verifies them through its tree verify graphs; greedy tokens are the plain run's (or part at a near-tie), and both
    pools are full again but for the trees' scratch rows and slots."""
    prompts = _prompts(12, seed=4)
    params = [SamplingParams(max_new_tokens=16 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
    config = engine_config(real_shape_llama_dir, "triton", "float32")
    with Engine(config) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    config["plugins"] = ["treadle.plugins.speculators.draft"]
    config["speculative"] = {"method": "draft", "num_tokens": 6, "topk": 2, "draft_model_path": real_shape_llama_dir,
                             "max_batch_size": 16}
    with Engine(config) as engine:
        speculator = engine.scheduler.worker.speculator
        target_graphs = engine.scheduler.worker.target.cuda_graphs
        assert target_graphs.verify_trees
        draft_replays = ReplayCounter(speculator.draft.cuda_graphs)
        verify_replays = [ReplayCounter(graphs) for graphs in target_graphs.verify.values()]
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
        draft, scratch = speculator.draft.info, speculator.trees
        assert draft.allocator.free_slots + scratch.slots.numel() == draft.allocator.total_slots
    assert draft_replays.count > 0 and sum(r.count for r in verify_replays) > 0
    # The draft's argmax after the last token is always a node, and right (the draft is the target): 2 tokens a step.
    assert sum(len(o.token_ids) for o in outputs) > 1.8 * sum(o.spec_verify_steps for o in outputs)
    for i, (got, want) in enumerate(zip(outputs, plain)):
        part = next((j for j, (a, b) in enumerate(zip(got.token_ids, want.token_ids)) if a != b), None)
        if part is not None:
            (first, top1), (second, top2) = want.output_top_logprobs[part][:2]
            assert top1 - top2 <= NEAR_TIE and got.token_ids[part] in (first, second), (
                f"request {i} parted from the plain run at token {part}, not at a near-tie ({top1} vs {top2})")
    assert sum(o.token_ids == p.token_ids for o, p in zip(outputs, plain)) >= 10
