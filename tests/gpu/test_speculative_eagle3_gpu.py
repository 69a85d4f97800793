"""The ``eagle3`` speculator on CUDA: a tiny random EAGLE-3 head (hub layout) over a target of Llama-3.1-8B attention
shapes whose CUDA graphs record the three hidden states the head reads. Greedy tokens are the plain run's (where
they part, only at a near-tie of the plain run: verify steps sum in another order than decode steps), both overlap
modes, with the target's decode, verify and prefill graphs replaying; the conformance kit's no-sync check passes;
every KV slot comes back. Overlapped verify (speculative.overlap): the head drafts on the device
(eagle3_overlap.py), its catch-up and decode steps replaying their graphs, with a head whose drafts are the plain
run's most frequent tokens (so that some are kept). tests/plugins/test_eagle3_speculator.py is the same on the CPU,
eagerly, and checks the proposals against a plain-torch EAGLE-3."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graph_replays import ReplayCounter
from near_tie import assert_plain_or_near_tie
from treadle import Engine, SamplingParams
from treadle.testing.eagle3_heads import make_eagle3_head
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.speculator_plugins import OverlappedVerifySteps

pytestmark = pytest.mark.gpu

K = 4
NEAR_TIE = 2e-3


@pytest.fixture(scope="module")
def eagle_dir(real_shape_llama_dir, tmp_path_factory) -> str:
    config = json.loads((Path(real_shape_llama_dir) / "config.json").read_text())
    return make_eagle3_head(tmp_path_factory.mktemp("eagle3-real-shape"), config, 2048, aux_layer_ids=[0, 1, 2],
                            scale=0.02)


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, 200, (count,), generator=generator).tolist()
    return [torch.randint(10, 8000, (n,), generator=generator).tolist() for n in lengths]


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_eagle3_through_cuda_graphs_gives_the_plain_tokens(real_shape_llama_dir, engine_config, eagle_dir, overlap):
    prompts = _prompts(12, seed=4)
    params = [SamplingParams(max_new_tokens=16 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
    config = engine_config(real_shape_llama_dir, "triton", "float32")
    config["scheduler"]["disable_overlap"] = not overlap
    with Engine(config) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    config["plugins"] = ["treadle.plugins.speculators.eagle3"]
    config["speculative"] = {"method": "eagle3", "num_tokens": K, "draft_model_path": eagle_dir, "max_batch_size": 16}
    with Engine(config) as engine:
        target = engine.scheduler.worker.target
        assert target.cuda_graphs is not None and target.cuda_graphs.verify
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
        assert not engine.scheduler.worker.speculator.states
    assert all(o.spec_verify_steps > 0 for o in outputs)
    assert_plain_or_near_tie(outputs, plain, min_equal=10, near_tie=NEAR_TIE)


def test_the_conformance_kit_passes_eagle3_and_draft_on_cuda(real_shape_llama_dir, engine_config, eagle_dir):
    from treadle.plugins.speculators.draft import build_draft_speculator
    from treadle.plugins.speculators.eagle3 import build_eagle3_speculator
    from treadle.testing import check_speculator

    config = engine_config(real_shape_llama_dir, "triton", "float32")  # float32: the kit wants the plain tokens
    for factory, path in ((build_eagle3_speculator, eagle_dir), (build_draft_speculator, real_shape_llama_dir)):
        check_speculator(factory, model_dir=real_shape_llama_dir,
                         overrides={"model": config["model"], "attention": config["attention"],
                                    "runtime": config["runtime"], "speculative": {"draft_model_path": path}})


def _record_drafts(speculator) -> list:
    """``(prompt, batch entry, drafts row)`` of every proposal, host path's and device's (an entry's ``kv_start``, the
    last token's position, is exact once the run is over)."""
    recorded = []
    propose, propose_on_device = speculator.propose, speculator.propose_on_device

    def record(batch, drafts):
        recorded.extend((tuple(e.req.origin_input_ids), e, drafts.token_ids[i]) for i, e in enumerate(batch.entries))
        return drafts

    speculator.propose = lambda batch, n: record(batch, propose(batch, n))
    speculator.propose_on_device = lambda batch, n, positions, rows: record(
        batch, propose_on_device(batch, n, positions, rows))
    return recorded


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_overlapped_eagle3_drafts_on_the_device(real_shape_llama_dir, engine_config, tmp_path, graphs):
    """Eagerly too: the Triton kernels read the catch-up's and decode steps' device tensors as they are laid out.
    The drafts proposed on the device are those the host path proposes at the same positions (but at near-ties)."""
    config = engine_config(real_shape_llama_dir, "triton", "float32", graphs=graphs)
    generator = torch.Generator().manual_seed(5)
    # Four requests: 4 x (k + 1) = 20 tokens a step, the Triton decode kernel's verify route (overlappable).
    prompts = [torch.randint(10, 8000, (int(n),), generator=generator).tolist() for n in (7, 30, 61, 90)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in (33, 12, 27, 40)]
    with Engine(config) as engine:
        plain = engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True, top_logprobs_num=2)
    frequent = torch.cat([torch.tensor(o.token_ids) for o in plain]).bincount().topk(4).indices.tolist()
    target_config = json.loads((Path(real_shape_llama_dir) / "config.json").read_text())
    head = make_eagle3_head(tmp_path, target_config, 2048, aux_layer_ids=[0, 1, 2], scale=0.02,
                            draft_targets=frequent)
    config["plugins"] = ["treadle.plugins.speculators.eagle3"]
    config["speculative"] = {"method": "eagle3", "num_tokens": K, "draft_model_path": head, "max_batch_size": 16,
                             "overlap": False}
    with Engine(config) as engine:
        host_drafts = _record_drafts(engine.scheduler.worker.speculator)
        engine.generate(input_ids=prompts, sampling_params=params)
    config["speculative"]["overlap"] = True
    with Engine(config) as engine:
        device_drafts = _record_drafts(engine.scheduler.worker.speculator)
        worker = engine.scheduler.worker
        head_graphs = worker.speculator.graphs
        assert worker.overlap_verify and (head_graphs is not None and bool(head_graphs.runner.verify)) == graphs
        catch_ups = [ReplayCounter(g) for g in head_graphs.runner.verify.values()] if graphs else []
        decodes = ReplayCounter(head_graphs.runner if graphs else None)
        steps = OverlappedVerifySteps()
        engine.scheduler.add_observer(steps)
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
        assert not worker.speculator.states
    assert steps.overlapped >= steps.verify // 2 > 0, (steps.overlapped, steps.verify)
    if graphs:
        assert sum(c.count for c in catch_ups) >= steps.overlapped and decodes.count > 0
    print("tokens per verify step", sum(len(o.token_ids) for o in outputs) / sum(o.spec_verify_steps for o in outputs))
    assert_plain_or_near_tie(outputs, plain, min_equal=len(plain) - 1, near_tie=NEAR_TIE)
    by_host = {(prompt, entry.kv_start, len(row)): row.tolist() for prompt, entry, row in host_drafts}
    compared = [by_host[key] == row.tolist() for prompt, entry, row in device_drafts
                if (key := (prompt, entry.kv_start, len(row))) in by_host]
    assert len(compared) > 10 and sum(compared) >= 0.9 * len(compared), (sum(compared), len(compared))
