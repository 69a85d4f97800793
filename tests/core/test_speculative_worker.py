"""The speculative worker with test speculators (treadle.testing.speculator_plugins): an oracle whose drafts are
all right keeps k + 1 tokens a step until the end; random drafts with known distributions go through rejection
sampling (greedy outputs unchanged, seeded sampled outputs reproducible); a speculator's malformed drafts are an
error naming it; the conformance kit passes the built-ins and fails a broken speculator."""

from __future__ import annotations

import math

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.speculative.speculator import Drafts, Speculator
from treadle.testing import check_speculator
from treadle.testing.engine import assert_kv_accounted

PLUGINS = ["treadle.testing.speculator_plugins", "treadle.plugins.speculators.ngram"]
PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11], [300, 301, 9], [60, 61, 62, 63, 60, 61]]
BUDGETS = (21, 9, 16)


def engine(model_dir: str, method: str | None, num_tokens: int = 4, **sections) -> Engine:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}, "plugins": PLUGINS, **sections}
    if method is not None:
        config["speculative"] = {"method": method, "num_tokens": num_tokens, "max_batch_size": 16}
    return Engine(config)


def greedy(budgets=BUDGETS) -> list[SamplingParams]:
    return [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]


@pytest.fixture(scope="module")
def plain(tiny_llama_dir):
    return engine(tiny_llama_dir, None).generate(input_ids=PROMPTS, sampling_params=greedy())


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_an_oracle_draft_keeps_k_plus_one_tokens_a_step(tiny_llama_dir, plain, overlap):
    k = 4
    oracle = engine(tiny_llama_dir, "oracle", k, scheduler={"disable_overlap": not overlap})
    oracle.scheduler.worker.speculator.references = {tuple(p): o.token_ids for p, o in zip(PROMPTS, plain)}
    outputs = oracle.generate(input_ids=PROMPTS, sampling_params=greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    # The prefill gives the first token; every verify step then k + 1 (the last one what the budget leaves).
    assert [o.spec_verify_steps for o in outputs] == [math.ceil((n - 1) / (k + 1)) for n in BUDGETS]
    assert_kv_accounted(oracle)


def test_random_drafts_with_distributions_leave_greedy_output_unchanged(tiny_llama_dir, plain):
    spec = engine(tiny_llama_dir, "random_drafts", 3)
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=greedy())
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert all(o.spec_verify_steps > 0 for o in outputs)
    assert_kv_accounted(spec)


def test_seeded_sampling_through_rejection_sampling_is_reproducible(tiny_llama_dir):
    params = [SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, seed=7 + n, ignore_eos=True)
              for n in BUDGETS]
    runs = []
    for _ in range(2):
        spec = engine(tiny_llama_dir, "random_drafts", 3)
        runs.append([o.token_ids for o in spec.generate(input_ids=PROMPTS, sampling_params=params)])
        assert_kv_accounted(spec)
    assert runs[0] == runs[1] and [len(ids) for ids in runs[0]] == list(BUDGETS)


def test_seeded_sampling_with_ngram_drafts_gives_the_plain_runs_tokens(tiny_llama_dir):
    """Drafts without distributions: the target keeps a draft exactly when its own seeded sample equals it, so a
    seeded request samples what plain decoding samples."""
    params = [SamplingParams(max_new_tokens=n, temperature=0.7, top_p=0.9, seed=3 + n, ignore_eos=True)
              for n in BUDGETS]
    expected = [o.token_ids for o in engine(tiny_llama_dir, None).generate(input_ids=PROMPTS, sampling_params=params)]
    spec = engine(tiny_llama_dir, "ngram", 3)
    outputs = spec.generate(input_ids=PROMPTS, sampling_params=params)
    assert [o.token_ids for o in outputs] == expected
    assert_kv_accounted(spec)


class _WrongShape(Speculator):
    num_draft_tokens = 3

    def __init__(self, target, config, registry) -> None:
        self.device = target.info.device

    def propose(self, batch, num_drafts: int) -> Drafts:
        return Drafts(torch.zeros(len(batch.entries), num_drafts + 1, dtype=torch.int64, device=self.device))


def test_malformed_drafts_are_an_error_naming_the_speculator(tiny_llama_dir):
    from treadle.core.speculative.worker import SpeculativeWorker

    base = engine(tiny_llama_dir, "ngram", 3)
    worker = base.scheduler.worker
    assert isinstance(worker, SpeculativeWorker)
    worker.speculator = _WrongShape(worker.target, worker.config, None)
    with pytest.raises(ValueError, match=r"speculator _WrongShape proposed drafts of shape \(3, 4\).* needs \(3, 3\)"):
        base.generate(input_ids=PROMPTS, sampling_params=greedy())


@pytest.mark.parametrize("name", ["ngram", "oracle", "random_drafts"])
def test_the_conformance_kit_passes_the_test_and_built_in_speculators(tiny_llama_dir, name):
    from treadle.core.registry import build_registry

    check_speculator(build_registry(PLUGINS).get("speculators", name), model_dir=tiny_llama_dir,
                     overrides={"plugins": PLUGINS})


def test_the_conformance_kit_fails_a_broken_speculator(tiny_llama_dir):
    with pytest.raises(AssertionError, match=r"token_ids must be int64 \[3, 3\], got torch.int64 \[3, 4\]"):
        check_speculator(_WrongShape, model_dir=tiny_llama_dir)


def test_verify_graphs_stop_at_the_speculative_batch_size(tiny_llama_dir):
    """Past ``speculative.max_batch_size`` running requests a step verifies no drafts: the target captures verify
    graphs no larger (a default server captured them up to ``cuda_graph_max_bs``, 1280-token FlashInfer plans)."""
    with engine(tiny_llama_dir, "ngram") as spec_engine:
        assert spec_engine.scheduler.worker.target.verify_max_bs == 16
