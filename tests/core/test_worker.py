"""The model worker between the scheduler and the model runner: the scheduler runs every step through its two
calls, reads the model and memory facts from ``worker.info``, and takes any Worker (the seam a speculative
decoder plugs into)."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.config import load_config
from treadle.core.execution.worker import ModelWorker, Worker, WorkerInfo, accepted_draft_counts
from treadle.core.registry import build_registry
from treadle.core.scheduling.scheduler import Scheduler
from treadle.testing.engine import assert_kv_accounted

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 12, 40, 7], [3, 3, 8], [100, 101, 102, 103, 104, 105, 106, 107, 108]]


def _config(model_dir: str):
    return load_config(overrides={"model.path": model_dir, "model.device": "cpu", "cache.max_total_tokens": 512},
                       use_env=False)


class CountingWorker(Worker):
    """A worker that wraps another, as a speculative one wraps its target: it only counts the calls."""

    def __init__(self, inner: Worker) -> None:
        self.inner = inner
        self.info, self.config = inner.info, inner.config
        self.forwards = self.samplings = 0

    def launch_forward(self, batch, draft_ids=None):
        self.forwards += 1
        return self.inner.launch_forward(batch, draft_ids)

    def launch_sampling(self, step, vocab_mask=None, prompt_logprob_entries=()):
        self.samplings += 1
        self.inner.launch_sampling(step, vocab_mask, prompt_logprob_entries)


def test_the_scheduler_runs_every_step_through_the_worker_it_is_given(tiny_llama_dir) -> None:
    config = _config(tiny_llama_dir)
    registry = build_registry()
    reference = Engine(_config(tiny_llama_dir)).generate(input_ids=PROMPTS, sampling_params=GREEDY)
    worker = CountingWorker(ModelWorker(config, registry))
    engine = Engine(config, registry)
    engine.scheduler = Scheduler(config, registry, worker=worker)
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    assert [o.token_ids for o in outputs] == [o.token_ids for o in reference]
    assert worker.forwards == worker.samplings >= GREEDY.max_new_tokens
    # Prompt log-probs are computed by the worker for the entries the scheduler names: one per prompt token.
    assert [len(o.input_token_logprobs) for o in outputs] == [len(p) for p in PROMPTS]
    assert_kv_accounted(engine)


def test_the_scheduler_reads_model_and_memory_facts_from_worker_info(tiny_llama_dir) -> None:
    scheduler = Engine(_config(tiny_llama_dir)).scheduler
    info, runner = scheduler.worker.info, scheduler.worker.runner
    assert isinstance(info, WorkerInfo)
    assert (info.vocab_size, info.context_len, info.page_size, info.max_total_tokens) == (
        runner.vocab_size, runner.context_len, runner.page_size, runner.max_total_tokens)
    assert scheduler.allocator is info.allocator is runner.allocator
    assert scheduler.req_to_token_pool is info.req_to_token_pool is runner.req_to_token_pool
    assert scheduler.context_len == info.context_len
    with pytest.warns(DeprecationWarning, match="scheduler.worker.info"):
        assert scheduler.runner is runner  # kept for a release: benchmarks and plugins read it
    with pytest.raises(AttributeError):
        info.vocab_size = 1  # frozen


def test_accepted_drafts_are_the_leading_ones_the_target_agrees_with() -> None:
    drafts = torch.tensor([[4, 5, 6], [4, 9, 6], [7, 5, 6], [4, 5, 6]])
    target = torch.tensor([[4, 5, 6, 1], [4, 5, 6, 1], [4, 5, 6, 1], [4, 5, 0, 1]])
    assert accepted_draft_counts(drafts, target).tolist() == [3, 1, 0, 2]
