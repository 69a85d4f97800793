"""Speculative decoding from the config on CUDA (``speculative.method``): the speculative worker's target captured
verify graphs for t = 2..k + 1 up to ``speculative.max_batch_size`` requests, verify steps replay them, and greedy
tokens are the plain run's (ngram and the oracle; float32, triton and flashinfer_triton, token and paged
allocators); the oracle keeps k + 1 tokens a step; rejection sampling (random drafts with their distributions)
runs without a device sync inside propose; oracle trees (topk 2, flashinfer_triton included) replay verify graphs that take a
tree mask (one request: every step); every
KV slot comes back. The draft tree kernels (kernels/draft_trees.py) give the torch layout and kept path on CUDA.

Where a run parts from the plain one, it must be at a near-tie (as tests/gpu/test_multi_token_gpu.py explains).
"""

from __future__ import annotations

import pytest
import torch

from graph_replays import ReplayCounter
from near_tie import NEAR_TIE, assert_greedy_under, assert_plain_or_near_tie
from treadle import Engine, SamplingParams
from treadle.testing import check_speculator
from treadle.testing.engine import assert_kv_accounted

pytestmark = pytest.mark.gpu

K = 4
PLUGINS = ["treadle.plugins.speculators.ngram", "treadle.testing.speculator_plugins"]


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    phrase = torch.randint(10, 8000, (12,), generator=generator).tolist()
    # Each ends in a phrase said three times: the n-gram look-up has a continuation to propose from the start.
    return [torch.randint(10, 8000, (int(n),), generator=generator).tolist() + phrase * 3
            for n in torch.randint(3, 100, (count,), generator=generator)]


@pytest.mark.parametrize("backend, page_size", [("triton", 1), ("triton", 16), ("flashinfer_triton", 16)])
@pytest.mark.parametrize("method", ["ngram", "oracle", "oracle_tree"])
def test_speculative_worker_replays_verify_graphs_with_the_plain_tokens(real_shape_llama_dir, engine_config, method,
                                                                        backend, page_size):
    if backend.startswith("flashinfer"):
        pytest.importorskip("flashinfer")  # trees too: a packed custom mask (tests/gpu/test_flashinfer_trees_gpu.py)
    dtype = "bfloat16" if backend.startswith("flashinfer") else "float32"  # flashinfer has no float32 KV cache
    config = {**engine_config(real_shape_llama_dir, backend, dtype, page_size=page_size), "plugins": PLUGINS}
    prompts = _prompts(12, seed=3)
    params = [SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(12)]
    plain_engine = Engine(config)
    try:
        plain = plain_engine.generate(input_ids=prompts, sampling_params=params, return_logprob=True,
                                      top_logprobs_num=2)
        outputs = _verify_graph_run(config, method, prompts, params, plain)
        if dtype == "bfloat16":  # rounding may swap near-tied tokens: each token greedy under the plain engine
            assert_greedy_under(plain_engine, prompts, outputs)  # (tests/gpu/test_flashinfer_trees_gpu.py: why)
            assert any(o.token_ids == p.token_ids for o, p in zip(outputs, plain))
        else:
            assert_plain_or_near_tie(outputs, plain, min_equal=len(plain) - 2, near_tie=NEAR_TIE)
    finally:
        plain_engine.shutdown()


def _verify_graph_run(config, method, prompts, params, plain):
    trees = method == "oracle_tree"  # topk 2: the right draft second among two children, two kept a step
    engine = Engine({**config, "speculative": {"method": method, "num_tokens": K, "max_batch_size": 16,
                                               "topk": 2 if trees else 1}})
    try:
        worker = engine.scheduler.worker
        graphs = worker.target.cuda_graphs
        assert sorted(graphs.verify) == list(range(2, K + 2)) and graphs.verify_trees == trees
        replays = {t: ReplayCounter(graphs.verify[t]) for t in graphs.verify}
        if method != "ngram":
            worker.speculator.references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
    finally:
        engine.shutdown()
    assert sum(r.count for r in replays.values()) > 0
    if method != "ngram":  # every draft right until a near-tie parts the runs
        kept = 1.8 if trees else 3
        assert sum(o.completion_tokens for o in outputs) > kept * sum(o.spec_verify_steps for o in outputs)
    return outputs


def test_rejection_sampling_on_cuda_is_seeded_and_leaves_nothing_behind(real_shape_llama_dir, engine_config):
    config = {**engine_config(real_shape_llama_dir, "triton", "bfloat16"), "plugins": PLUGINS,
              "speculative": {"method": "random_drafts", "num_tokens": K, "max_batch_size": 16}}
    prompts = _prompts(8, seed=4)
    params = [SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, seed=i, ignore_eos=True) for i in range(8)]
    runs = []
    for _ in range(2):
        engine = Engine(config)
        try:
            runs.append([o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)])
            assert_kv_accounted(engine)
        finally:
            engine.shutdown()
    assert runs[0] == runs[1]


@pytest.mark.parametrize("name", ["ngram", "random_drafts"])
def test_the_conformance_kit_on_cuda(real_shape_llama_dir, engine_config, name):
    from treadle.core.registry import build_registry

    config = engine_config(real_shape_llama_dir, "triton", "float32")
    check_speculator(build_registry(PLUGINS).get("speculators", name), model_dir=real_shape_llama_dir,
                     overrides={key: config[key] for key in ("model", "attention", "runtime")} | {"plugins": PLUGINS})



def test_draft_tree_kernels_match_torch_on_cuda():
    from treadle.core.speculative.tree import TreeLayout, kept_path
    from treadle.kernels.draft_trees import kept_path as kernel_kept_path, tree_layout

    generator = torch.Generator().manual_seed(0)
    for t in (2, 5, 9, 17):
        parents = torch.tensor([[int(torch.randint(-1, j, (1,), generator=generator)) for j in range(t - 1)]
                                for _ in range(6)], device="cuda")
        layout = TreeLayout.by_squaring(parents)
        for got, want in zip(tree_layout(parents), (layout.parents, layout.ancestors, layout.depth)):
            assert torch.equal(got, want)
        drafts = torch.randint(0, 2, (6, t - 1), generator=generator).cuda()
        tokens = torch.randint(0, 2, (6, t), generator=generator).cuda()
        path, accepted = kept_path(layout, drafts, tokens)
        for got, want in zip(kernel_kept_path(layout.parents, layout.ancestors, layout.depth, drafts, tokens),
                             (path, accepted, tokens.gather(1, path))):
            assert torch.equal(got, want)


def test_one_request_replays_a_tree_verify_graph_every_step(real_shape_llama_dir, engine_config):
    config = {**engine_config(real_shape_llama_dir, "triton", "float32"), "plugins": PLUGINS}
    prompt = _prompts(1, seed=5)
    params = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    with Engine(config) as plain_engine:
        plain = plain_engine.generate(input_ids=prompt, sampling_params=params)
    config["speculative"] = {"method": "oracle_tree", "num_tokens": K, "topk": 2, "max_batch_size": 16}
    with Engine(config) as engine:
        graphs = engine.scheduler.worker.target.cuda_graphs
        replays = [ReplayCounter(graphs.verify[t]) for t in graphs.verify]
        engine.scheduler.worker.speculator.references = {tuple(prompt[0]): plain[0].token_ids}
        output = engine.generate(input_ids=prompt, sampling_params=params)[0]
        assert_kv_accounted(engine)
    # Every verify step that gave tokens replayed a graph (none fell back to an eager forward).
    assert sum(r.count for r in replays) >= output.spec_verify_steps > 0


def test_a_default_graph_size_captures_verify_graphs_only_to_the_speculative_batch_size(real_shape_llama_dir,
                                                                                       engine_config):
    """``cuda_graph_max_bs`` 256 with FlashInfer: verify graphs of 5 tokens up to bs 256 overflowed its workspace at
    start-up; they stop at the first captured size >= speculative.max_batch_size (32)."""
    config = engine_config(real_shape_llama_dir, "flashinfer_triton", "bfloat16", page_size=16)
    config["runtime"]["cuda_graph_max_bs"] = 256
    config["scheduler"]["max_running_requests"] = 256
    config["plugins"] = PLUGINS
    config["speculative"] = {"method": "ngram", "num_tokens": K, "max_batch_size": 32}
    with Engine(config) as engine:
        graphs = engine.scheduler.worker.target.cuda_graphs
        verify_sizes = next(iter(graphs.verify.values())).batch_sizes
        assert max(verify_sizes) == min(bs for bs in graphs.batch_sizes if bs >= 32) < max(graphs.batch_sizes)
        (output,) = engine.generate(input_ids=[[5, 6, 7, 5, 6, 7, 5, 6]],
                                    sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True))
        assert len(output.token_ids) == 8
