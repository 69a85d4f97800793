"""Draft trees (``speculative.topk`` > 1): the target verifies every node of each request's tree in one forward under a
tree mask and keeps the longest path it would have produced itself, whichever child that path goes through; greedy
output equals plain decoding's token for token (under a sliding window too), seeded sampled output too, and the
sampled tokens have the target's distribution (chi-square); the kept path's K/V is moved into place and every KV slot
comes back. (Each node's logits against HF's, and the decode step after the K/V moved, for torch_native and triton's
interpreted kernels: tests/core/test_verify_step.py.) A backend that cannot mask trees is refused (methods that draft
chains: tests/core/test_speculative_config.py)."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.execution.sampler import Sampler, SamplingBatch
from treadle.core.request import Req
from treadle.core.speculative.tree import TreeLayout, kept_path, verify_tree
from treadle.core.speculative.worker import check_tree_backend
from treadle.testing.engine import assert_kv_accounted

from chi_square import chi_square_passes

PLUGINS = ["treadle.testing.speculator_plugins"]
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11], [300, 301, 9], [60, 61, 62, 63, 60, 61]]
BUDGETS = (21, 9, 16)


def greedy(budgets=BUDGETS) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]


def engine(model_dir: str, method: str | None, backend: str = "torch_native", **sections) -> Engine:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}, "plugins": PLUGINS,
              "attention": {"backend": backend}, **sections}
    if method is not None:
        config["speculative"] = {"method": method, "num_tokens": 4, "topk": 2, "max_batch_size": 16,
                                 **config.get("speculative", {})}
    return Engine(config)


def oracle_tree(model_dir: str, plain, breaks: bool, backend: str = "torch_native", **sections) -> Engine:
    spec = engine(model_dir, "oracle_tree", backend, **sections)
    speculator = spec.scheduler.worker.speculator
    speculator.references = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    speculator.breaks = breaks
    return spec


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-tree-draft"), seed=7, num_hidden_layers=1)


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return engine(tiny_llama_dir, None).generate(input_ids=PROMPTS, sampling_params=greedy())


def test_the_kept_path_runs_through_whichever_child_matches():
    # Root -> drafts 0 and 1; 0 -> 2; 1 -> 3 -> 4. The target says 11 after the root, 13 after draft 1, 99 after 3.
    layout = TreeLayout.of(torch.tensor([[-1, -1, 0, 1, 3]]))
    assert layout.depth.tolist() == [[0, 1, 1, 2, 2, 3]]
    assert layout.ancestors[0, 5].tolist() == [True, False, True, False, True, True]
    path, accepted = kept_path(layout, torch.tensor([[10, 11, 12, 13, 14]]), torch.tensor([[11, 0, 13, 0, 99, 7]]))
    assert accepted.tolist() == [2] and path.tolist() == [[0, 2, 4, 4, 4, 4]]


def test_an_oracle_tree_keeps_its_second_children(tiny_llama_dir, plain):
    """Every right draft sits second among its siblings; each step keeps the two of them and the target's token."""
    spec = oracle_tree(tiny_llama_dir, plain, breaks=False)
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert [o.spec_verify_steps for o in outputs] == [-(-(n - 1) // 3) for n in BUDGETS]
    assert_kv_accounted(spec)


@pytest.mark.parametrize("memory", ["sync", "paged4"])
def test_broken_trees_give_the_plain_greedy_tokens(tiny_llama_dir, plain, memory):
    sections = ({"scheduler": {"disable_overlap": True}} if memory == "sync"
                else {"cache": {"max_total_tokens": 2048, "kv_allocator": "paged", "page_size": 4}})
    spec = oracle_tree(tiny_llama_dir, plain, breaks=True, **sections)
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert_kv_accounted(spec)


def test_trees_under_a_sliding_window_give_the_plain_greedy_tokens(tiny_mistral_dir):
    """A window of 8 keys: a node counts it from its depth's position, not its place in the step (topk 3)."""
    prompts = [[5, 17, 42, 8, 99, 3, 250, 11, 7, 7, 9, 12], [300, 301, 9]]
    params = greedy((21, 9))
    plain = engine(tiny_mistral_dir, None).generate(input_ids=prompts, sampling_params=params)
    spec = engine(tiny_mistral_dir, "oracle_tree", speculative={"topk": 3})
    speculator = spec.scheduler.worker.speculator
    speculator.references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
    speculator.breaks = True
    assert [o.token_ids for o in spec.generate(input_ids=prompts, sampling_params=params)] == \
        [o.token_ids for o in plain]
    assert_kv_accounted(spec)


def test_draft_model_trees_give_the_plain_greedy_and_seeded_tokens(tiny_llama_dir, other_draft_dir, plain):
    seeded = [SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, seed=3 + n, ignore_eos=True)
              for n in BUDGETS]
    expected = engine(tiny_llama_dir, None).generate(input_ids=PROMPTS, sampling_params=seeded, return_logprob=True)
    spec = engine(tiny_llama_dir, "draft", speculative={"draft_model_path": other_draft_dir, "topk": 3})
    assert [o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=greedy())] == \
        [o.token_ids for o in plain]
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=seeded, return_logprob=True)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got.output_token_logprobs, want.output_token_logprobs, atol=1e-5, rtol=0)
    assert all(o.spec_verify_steps > 0 for o in outputs)
    assert_kv_accounted(spec)
    # The draft's pool: all free but the trees' scratch rows and slots, held while the speculator lives.
    speculator = spec.scheduler.worker.speculator
    info, scratch = speculator.draft.info, speculator.trees
    assert info.allocator.free_slots + scratch.slots.numel() == info.allocator.total_slots
    assert info.req_to_token_pool.free_count + scratch.rows.numel() == info.req_to_token_pool.size


def test_tree_sampling_keeps_the_targets_distribution():
    """Root -> drafts 3 and 5, 5 -> 7: the first token has the root's distribution, the second the distribution of
    the node the first one went through."""
    vocab, requests = 12, 12000
    generator = torch.Generator().manual_seed(0)
    node_logits = torch.randn(4, vocab, generator=generator)
    node_logits[0, 3] += 1.0
    node_logits[0, 5] += 1.5  # the drafts are likely enough to be kept often
    reqs = []
    for i in range(requests):
        req = Req(rid=f"r{i}", origin_input_ids=[1, 2], sampling_params=SamplingParams(temperature=0.7, top_p=0.9))
        req.sample_seed = 1000 + i
        reqs.append(req)
    sampling = SamplingBatch.from_reqs(reqs, vocab, torch.device("cpu"), tokens_per_req=4)
    layout = TreeLayout.of(torch.tensor([[-1, -1, 1]]).expand(requests, 3))
    drafts = torch.tensor([[3, 5, 7]]).expand(requests, 3)
    verdict = verify_tree(Sampler(), node_logits.repeat(requests, 1), sampling, layout, drafts)
    p = torch.stack([target_distribution(row) for row in node_logits])
    first, second = verdict.token_ids[:, 0], verdict.token_ids[:, 1]
    assert chi_square_passes(first, p[0])
    assert chi_square_passes(second[first == 3], p[1])
    assert chi_square_passes(second[first == 5], p[2])
    assert torch.equal(verdict.accepted, (first == 3).long() + (first == 5).long() * (1 + (second == 7).long()))


def target_distribution(logits: torch.Tensor, temperature: float = 0.7, top_p: float = 0.9) -> torch.Tensor:
    probs = torch.softmax(logits / temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    keep = (ordered.cumsum(0) - ordered) <= top_p
    kept = torch.zeros_like(probs).scatter_(0, order, ordered * keep)
    return kept / kept.sum()


def test_a_backend_that_cannot_mask_trees_is_refused():
    from treadle.core.registry import build_registry

    class Flat:
        supports_tree_mask = False

    registry = build_registry()
    able = [name for name in registry.names("attention") if registry.get("attention", name).supports_tree_mask]
    assert {"torch_native", "triton", "flashinfer", "flashinfer_triton"} <= set(able)
    with pytest.raises(ValueError, match="attention backend 'flat'.*use attention.backend: .*flashinfer_triton"):
        check_tree_backend(Flat(), "flat", registry)
