"""Draft trees verified through FlashInfer (``flashinfer`` and ``flashinfer_triton``: a packed custom mask,
kernels/tree_mask.py) on CUDA: the mask kernel writes the torch reference's bits; one tree verify step's attention
equals torch_native's over the same cache (with and without a sliding window); oracle trees that break at random
depths give the plain greedy tokens (bfloat16: each token greedy under the plain engine, scored teacher-forced) with page sizes 1 and 16,
verify graphs replayed, and eagerly; ngram and eagle3 trees likewise on flashinfer_triton; every KV slot comes back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from graph_replays import ReplayCounter
from near_tie import assert_greedy_under
from treadle import Engine, SamplingParams
from treadle.core.speculative.tree import TreeLayout
from treadle.kernels.tree_mask import pack_tree_mask, pack_tree_mask_reference, tree_mask_bytes
from treadle.testing.engine import assert_kv_accounted

pytestmark = pytest.mark.gpu
pytest.importorskip("flashinfer")

K = 4
PLUGINS = ["treadle.plugins.speculators.ngram", "treadle.plugins.speculators.eagle3",
           "treadle.testing.speculator_plugins"]


def _random_parents(bs: int, t: int, generator: torch.Generator) -> torch.Tensor:
    return torch.tensor([[int(torch.randint(-1, j, (1,), generator=generator)) for j in range(t - 1)]
                         for _ in range(bs)])


def _segments(packed: torch.Tensor, t: int, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    bits = ((packed.cpu()[:, None].to(torch.int32) >> torch.arange(8)) & 1).flatten()
    out, start = [], 0
    for length in seq_lens.tolist():
        out.append(bits[start * 8:start * 8 + t * length])
        start += t * length
    return out


def test_the_mask_kernel_writes_the_reference_bits_on_cuda():
    generator = torch.Generator().manual_seed(0)
    for t, bs, window in ((2, 1, None), (5, 7, None), (9, 33, 64), (17, 3, 5)):
        ancestors = TreeLayout.by_squaring(_random_parents(bs, t, generator)).ancestors
        seq_lens = torch.randint(t, 3000, (bs,), generator=generator)
        expected = pack_tree_mask_reference(ancestors, seq_lens, window)
        out = torch.zeros(tree_mask_bytes(t, seq_lens), dtype=torch.uint8, device="cuda")
        pack_tree_mask(ancestors.cuda().to(torch.uint8), seq_lens.cuda(), out, window)
        for got, want in zip(_segments(out, t, seq_lens), _segments(expected, t, seq_lens)):
            assert torch.equal(got, want), (t, bs, window)


@pytest.mark.parametrize("window", [None, 6])
def test_one_tree_verify_step_attends_as_torch_native_does(window):
    """FlashInfer's prefill wrapper planned with the packed mask against torch_native's masks, per request."""
    from treadle.plugins.attention.torch_native import _tree_mask

    import flashinfer

    generator = torch.Generator().manual_seed(1)
    bs, t, heads, kv_heads, dim, page = 4, 5, 8, 2, 128, 16
    seq_lens = torch.tensor([t, 37, 200, 64])
    ancestors = TreeLayout.by_squaring(_random_parents(bs, t, generator)).ancestors
    total_pages = int(((seq_lens + page - 1) // page).sum())
    k_cache = torch.randn(total_pages, page, kv_heads, dim, generator=generator).to("cuda", torch.bfloat16)
    v_cache = torch.randn(total_pages, page, kv_heads, dim, generator=generator).to("cuda", torch.bfloat16)
    q = torch.randn(bs * t, heads, dim, generator=generator).to("cuda", torch.bfloat16)
    pages = (seq_lens + page - 1) // page
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)]).to(torch.int32)
    last_page_len = (seq_lens - (pages - 1) * page).to(torch.int32)
    qo_indptr = (torch.arange(bs + 1) * t).to(torch.int32)
    packed = torch.empty(tree_mask_bytes(t, seq_lens), dtype=torch.uint8, device="cuda")
    pack_tree_mask(ancestors.cuda(), seq_lens.cuda(), packed, window)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(128 * 1024 * 1024, dtype=torch.uint8, device="cuda"), "NHD", backend="fa2")
    wrapper.plan(qo_indptr, kv_indptr, torch.arange(total_pages, dtype=torch.int32, device="cuda"), last_page_len,
                 heads, kv_heads, dim, page, causal=False, window_left=-1, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16, packed_custom_mask=packed)
    out = wrapper.run(q, (k_cache, v_cache)).float()
    for b in range(bs):
        length, first = int(seq_lens[b]), int(kv_indptr[b])
        keys = k_cache[first:first + int(pages[b])].flatten(0, 1)[:length].float().repeat_interleave(heads // kv_heads, 1)
        values = v_cache[first:first + int(pages[b])].flatten(0, 1)[:length].float().repeat_interleave(
            heads // kv_heads, 1)
        mask = _tree_mask(length - t, ancestors[b].cuda(), window)
        queries = q[b * t:(b + 1) * t].float()
        scores = torch.einsum("qhd,khd->hqk", queries, keys) / dim ** 0.5
        want = torch.einsum("hqk,khd->qhd", scores.masked_fill(~mask, float("-inf")).softmax(-1), values)
        torch.testing.assert_close(out[b * t:(b + 1) * t], want, atol=2e-2, rtol=2e-2)


def _prompts(count: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    phrase = torch.randint(10, 8000, (12,), generator=generator).tolist()
    return [torch.randint(10, 8000, (int(n),), generator=generator).tolist() + phrase * 3
            for n in torch.randint(3, 100, (count,), generator=generator)]


@pytest.mark.parametrize("backend, page_size, graphs", [("flashinfer", 1, True), ("flashinfer", 16, True),
                                                         ("flashinfer_triton", 16, True),
                                                         ("flashinfer_triton", 1, False)])
def test_oracle_trees_give_the_plain_greedy_tokens(real_shape_llama_dir, engine_config, backend, page_size, graphs):
    config = {**engine_config(real_shape_llama_dir, backend, "bfloat16", graphs=graphs, page_size=page_size),
              "plugins": PLUGINS}
    prompts = _prompts(10, seed=3)
    params = [SamplingParams(max_new_tokens=8 + 5 * i, temperature=0.0, ignore_eos=True) for i in range(10)]
    with Engine(config) as plain_engine:
        plain = plain_engine.generate(input_ids=prompts, sampling_params=params)
        outputs, graphs_runner, replays = _oracle_tree_run(config, prompts, params, plain, graphs)
        _assert_greedy(plain_engine, prompts, outputs, plain)
    if graphs:
        assert graphs_runner.verify_trees and sum(r.count for r in replays) > 0
    assert sum(o.spec_verify_steps for o in outputs) > 0


def _oracle_tree_run(config, prompts, params, plain, graphs):
    config = {**config, "speculative": {"method": "oracle_tree", "num_tokens": K, "topk": 2, "max_batch_size": 16}}
    with Engine(config) as engine:
        worker = engine.scheduler.worker
        graphs_runner = worker.target.cuda_graphs
        replays = [ReplayCounter(graphs_runner.verify[t]) for t in graphs_runner.verify] if graphs else []
        worker.speculator.references = {tuple(p): o.token_ids for p, o in zip(prompts, plain)}
        worker.speculator.breaks = True
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert_kv_accounted(engine)
    return outputs, graphs_runner, replays


def _assert_greedy(plain_engine, prompts, outputs, plain) -> None:
    """Each token greedy under the plain engine (bfloat16 rounding may swap near-tied tokens: a verify step's
    matmuls round otherwise than decode's), and most outputs equal to the plain run throughout."""
    assert_greedy_under(plain_engine, prompts, outputs)
    assert sum(o.token_ids == p.token_ids for o, p in zip(outputs, plain)) >= len(plain) // 2


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_ngram_and_eagle3_trees_on_flashinfer_triton(real_shape_llama_dir, engine_config, tmp_path, method):
    from treadle.testing.eagle3_heads import make_eagle3_head

    config = {**engine_config(real_shape_llama_dir, "flashinfer_triton", "bfloat16", page_size=16),
              "plugins": PLUGINS}
    prompts = _prompts(8, seed=6)
    params = [SamplingParams(max_new_tokens=12 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(8)]
    plain_engine = Engine(config)
    plain = plain_engine.generate(input_ids=prompts, sampling_params=params)
    spec = {"method": method, "num_tokens": K, "topk": 2, "max_batch_size": 16}
    if method == "eagle3":
        target = json.loads((Path(real_shape_llama_dir) / "config.json").read_text())
        spec["draft_model_path"] = make_eagle3_head(tmp_path / "head", target, 2048, aux_layer_ids=[0, 1, 2],
                                                    scale=0.02)
    config["speculative"] = spec
    try:
        with Engine(config) as engine:
            outputs = engine.generate(input_ids=prompts, sampling_params=params)
            assert_kv_accounted(engine)
            if method == "eagle3":
                assert engine.scheduler.worker.speculator.trees.graphs is not None
        assert sum(o.spec_verify_steps for o in outputs) > 0
        _assert_greedy(plain_engine, prompts, outputs, plain)
    finally:
        plain_engine.shutdown()
