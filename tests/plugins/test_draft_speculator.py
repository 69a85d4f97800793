"""The ``draft`` speculator's proposals, driven by hand-built verify batches: the drafts are the draft model's own
greedy continuation of each request's sequence, whether the tokens it has not seen are on the host or only on the
device (overlap scheduling appends a verify step's tokens after the next batch is built), after any number of
accepted drafts; sampling requests get distributions; every draft KV slot comes back."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.execution.worker import ModelWorker
from treadle.core.request import Req
from treadle.core.scheduling.observers import StepObserver
from treadle.core.scheduling.schedule_batch import BatchEntry, ScheduleBatch
from treadle.plugins.speculators.draft import DraftModelSpeculator, check_same_vocabulary
from treadle.plugins.speculators.draft_memory import draft_kv_tokens, draft_server_config
from treadle.testing.engine import assert_kv_accounted

PROMPTS = [[5, 17, 42, 8, 99, 3, 250, 11, 7], [300, 301, 9, 4]]
GREEDY = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def target_engine(tiny_llama_dir):
    engine = Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 512}})
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory) -> str:
    from treadle.testing.models import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama-draft"), seed=7, num_hidden_layers=1)


def greedy_tokens(model_dir: str, prompts: list[list[int]], count: int) -> list[list[int]]:
    with Engine({"model": {"path": model_dir}, "cache": {"max_total_tokens": 512}}) as engine:
        params = SamplingParams(max_new_tokens=count, temperature=0.0, ignore_eos=True)
        return [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]


def speculator(engine: Engine, draft_dir: str, k: int) -> DraftModelSpeculator:
    target = engine.scheduler.worker
    config = draft_server_config(engine.resolved_config, target.info, draft_dir, draft_kv_tokens(target.info, k))
    return DraftModelSpeculator(target, ModelWorker(config, engine.scheduler.registry), k)


class Sequence:
    """A request as the scheduler would hand it over: ``known`` tokens on the host, ``last`` at position ``at``
    (on the device only when the host has not appended it yet)."""

    def __init__(self, prompt: list[int], row: int, params: SamplingParams = GREEDY) -> None:
        self.req = Req(rid=f"r{row}", origin_input_ids=list(prompt), sampling_params=params)
        self.req.req_pool_idx = row

    def at(self, full: list[int], last: int, on_host: int, worker: ModelWorker, tokens: int) -> BatchEntry:
        prompt_len = len(self.req.origin_input_ids)
        self.req.output_ids = full[prompt_len:on_host]
        worker.next_input_ids.ids[self.req.req_pool_idx] = full[last]
        return BatchEntry(self.req, kv_start=last, extend_len=tokens, new_slots=torch.empty(0, dtype=torch.int64),
                          write_from=last, input_on_device=True)


def verify_batch(*entries: BatchEntry) -> ScheduleBatch:
    return ScheduleBatch(ForwardMode.TARGET_VERIFY, list(entries))


@pytest.mark.parametrize("draft", ["same", "other"])
def test_drafts_follow_the_draft_models_greedy_path(target_engine, tiny_llama_dir, other_draft_dir, draft):
    draft_dir = tiny_llama_dir if draft == "same" else other_draft_dir
    k = 3
    spec = speculator(target_engine, draft_dir, k)
    worker = target_engine.scheduler.worker
    # Each request's full sequence: the draft model's own greedy path, so every proposal should be a slice of it.
    paths = [p + out for p, out in zip(PROMPTS, greedy_tokens(draft_dir, PROMPTS, 20))]
    seqs = [Sequence(p, row) for row, p in enumerate(PROMPTS)]
    last = [len(p) for p in PROMPTS]  # the first sampled token, not yet on the host
    on_host = list(last)
    # Accepted drafts per step for each request: none, some, all (both drafts and the bonus unseen by the host).
    for step, accepted in enumerate([(0, 1), (1, 3), (3, 0), (2, 2)]):
        entries = [seq.at(path, p, h, worker, k + 1) for seq, path, p, h in zip(seqs, paths, last, on_host)]
        drafts = spec.propose(verify_batch(*entries), k)
        assert drafts.probs is None
        expected = [path[p + 1:p + 1 + k] for path, p in zip(paths, last)]
        assert drafts.token_ids.tolist() == expected, f"step {step}"
        # The host appends this step's tokens only after the next batch is built: it knows up to `last` then.
        on_host = [p + 1 for p in last]
        last = [p + a + 1 for p, a in zip(last, accepted)]
    for seq in seqs:
        spec.request_released(seq.req)
    info = spec.draft.info
    assert info.allocator.free_slots == info.allocator.total_slots
    assert info.req_to_token_pool.free_count == info.req_to_token_pool.size


def test_a_plain_step_between_verify_steps_settles_the_proposal(target_engine, tiny_llama_dir):
    k = 2
    spec = speculator(target_engine, tiny_llama_dir, k)
    worker = target_engine.scheduler.worker
    path = PROMPTS[0] + greedy_tokens(tiny_llama_dir, PROMPTS[:1], 16)[0]
    seq = Sequence(PROMPTS[0], 3)
    p = len(PROMPTS[0])
    assert spec.propose(verify_batch(seq.at(path, p, p, worker, k + 1)), k).token_ids.tolist() == [path[p + 1:p + 3]]
    # One draft kept, then a plain decode step (t = 1) of the token after it; the host has caught up.
    decode = seq.at(path, p + 2, p + 2, worker, 1)
    spec.after_target_forward(type("Step", (), {"batch": ScheduleBatch(ForwardMode.DECODE, [decode])})())
    assert spec.memory.sequences["r3"].seen == p + 2
    entry = seq.at(path, p + 3, p + 3, worker, k + 1)
    assert spec.propose(verify_batch(entry), k).token_ids.tolist() == [path[p + 4:p + 6]]
    spec.request_released(seq.req)
    assert spec.draft.info.allocator.free_slots == spec.draft.info.allocator.total_slots


def test_sampling_requests_get_their_distributions(target_engine, tiny_llama_dir):
    k = 2
    spec = speculator(target_engine, tiny_llama_dir, k)
    worker = target_engine.scheduler.worker
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=5, ignore_eos=True)
    seqs = [Sequence(PROMPTS[0], 0, params), Sequence(PROMPTS[1], 1)]
    entries = [seq.at(p + [11], len(p), len(p), worker, k + 1) for seq, p in zip(seqs, PROMPTS)]
    drafts = spec.propose(verify_batch(*entries), k)
    probs = drafts.probs
    assert probs is not None and tuple(probs.shape) == (2, k, worker.info.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, k))
    assert int((probs[0] > 0).sum(-1).max()) <= 5  # top-k 5
    assert probs[0].gather(1, drafts.token_ids[0].unsqueeze(1)).min() > 0  # each draft was possible
    assert torch.equal(probs[1].argmax(-1), drafts.token_ids[1]) and torch.all(probs[1].max(-1).values == 1)
    for seq in seqs:
        spec.request_released(seq.req)


def test_a_draft_of_another_vocabulary_is_refused(target_engine, tmp_path):
    from treadle.testing.models import make_tiny_llama

    target = target_engine.scheduler.worker
    wide = make_tiny_llama(tmp_path / "wide", vocab_size=target.info.vocab_size + 64)
    config = draft_server_config(target_engine.resolved_config, target.info, wide, 64)
    draft = ModelWorker(config, target_engine.scheduler.registry)
    with pytest.raises(ValueError, match="does not share the target's tokenizer"):
        check_same_vocabulary(target.info, draft.info)


# ---------------------------------------------------------------------- through the Engine and the scheduler

ENGINE_PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6],
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],
    [300, 301, 9],
    [400, 7, 7, 7, 9, 10, 11, 12, 13],
]
BUDGETS = (21, 6, 17, 30)
ENGINE_GREEDY = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in BUDGETS]
DRAFT_PLUGIN = "treadle.plugins.speculators.draft"  # until the installed package lists it as an entry point


def engine_config(model_dir: str, draft_dir: str | None = None, k: int = 3, overlap: bool = True,
                  kv_tokens: int = 2048, **scheduler) -> dict:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": kv_tokens}, "plugins": [DRAFT_PLUGIN],
              "scheduler": {"disable_overlap": not overlap, **scheduler}}
    if draft_dir is not None:
        config["speculative"] = {"method": "draft", "num_tokens": k, "draft_model_path": draft_dir,
                                 "max_batch_size": 8}
    return config


@pytest.fixture(scope="module")
def plain_outputs(tiny_llama_dir):
    with Engine(engine_config(tiny_llama_dir)) as engine:
        return engine.generate(input_ids=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)


class VerifySteps(StepObserver):
    """(tokens per request, drafts kept) of every row of every verify step."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, int]] = []

    def results_arrived(self, step) -> None:
        if step.forward_batch.forward_mode.is_verify():
            tokens = step.forward_batch.tokens_per_req
            self.rows.extend((tokens, kept) for kept in step.results.wait()["accepted"].tolist())


def record_catch_ups(speculator: DraftModelSpeculator) -> list[int]:
    """The tokens per request of every catch-up step a proposal runs (test instrumentation)."""
    lengths: list[int] = []
    extend_batch = speculator._extend_batch

    def recording(inputs, seqs, input_ids):
        if speculator.proposing:
            lengths.extend(inputs.extend_lens)
        return extend_batch(inputs, seqs, input_ids)

    speculator._extend_batch = recording
    speculator.proposing = False
    propose = speculator.propose

    def flagged(batch, num_drafts):
        speculator.proposing = True
        try:
            return propose(batch, num_drafts)
        finally:
            speculator.proposing = False

    speculator.propose = flagged
    return lengths


def assert_draft_pool_full(engine: Engine) -> None:
    draft = engine.scheduler.worker.speculator.draft.info
    assert draft.allocator.free_slots == draft.allocator.total_slots
    assert draft.req_to_token_pool.free_count == draft.req_to_token_pool.size


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_draft_equal_to_the_target_keeps_every_draft(tiny_llama_dir, plain_outputs, overlap):
    k = 3
    with Engine(engine_config(tiny_llama_dir, tiny_llama_dir, k, overlap)) as engine:
        verify_steps = VerifySteps()
        engine.scheduler.add_observer(verify_steps)
        catch_ups = record_catch_ups(engine.scheduler.worker.speculator)
        outputs = engine.generate(input_ids=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        # Prompts are prefilled in the draft beside the target's prefill: a proposal catches up on the last token,
        # or the last draft and the target's token after it when every draft was kept.
        assert catch_ups and max(catch_ups) == 2
        # Every verify step keeps every draft: k + 1 tokens a step, until the budgets run out.
        assert verify_steps.rows and all(kept == tokens - 1 for tokens, kept in verify_steps.rows)
        assert max(tokens for tokens, _ in verify_steps.rows) == k + 1
        assert sum(o.spec_verify_steps for o in outputs) >= sum(n - 1 for n in BUDGETS) // (k + 1)
        assert_kv_accounted(engine)
        assert_draft_pool_full(engine)


def test_another_draft_model_gives_the_plain_greedy_tokens(tiny_llama_dir, other_draft_dir, plain_outputs):
    with Engine(engine_config(tiny_llama_dir, other_draft_dir, 4)) as engine:
        outputs = engine.generate(input_ids=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert all(o.spec_verify_steps > 0 for o in outputs)
        assert_kv_accounted(engine)
        assert_draft_pool_full(engine)


def test_retraction_in_a_small_pool_keeps_the_tokens_and_frees_both_pools(tiny_llama_dir, plain_outputs):
    config = engine_config(tiny_llama_dir, tiny_llama_dir, 3, kv_tokens=48, new_token_ratio=0.0)
    with Engine(config) as engine:
        outputs = engine.generate(input_ids=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert engine.kv_stats()["retractions"] > 0
        assert_kv_accounted(engine)
        assert_draft_pool_full(engine)


def test_sampling_requests_run_with_sampled_drafts(tiny_llama_dir, other_draft_dir):
    params = [SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, ignore_eos=True, seed=i) for i in range(3)]
    with Engine(engine_config(tiny_llama_dir, other_draft_dir, 2)) as engine:
        outputs = engine.generate(input_ids=ENGINE_PROMPTS[:3], sampling_params=params)
        vocab = engine.scheduler.worker.info.vocab_size
        assert all(len(o.token_ids) == 12 and all(0 <= t < vocab for t in o.token_ids) for o in outputs)
        assert all(o.spec_verify_steps > 0 for o in outputs)
        assert_kv_accounted(engine)
        assert_draft_pool_full(engine)


def test_the_conformance_kit_passes_it(tiny_llama_dir, other_draft_dir):
    from treadle.plugins.speculators.draft import build_draft_speculator
    from treadle.testing import check_speculator

    check_speculator(build_draft_speculator, model_dir=tiny_llama_dir,
                     overrides={"speculative": {"draft_model_path": other_draft_dir}})


@pytest.mark.parametrize("memory", ["paged4", "chunked-mixed"])
def test_greedy_parity_with_pages_and_chunked_mixed_prefill(tiny_llama_dir, other_draft_dir, plain_outputs, memory):
    config = engine_config(tiny_llama_dir, other_draft_dir, 3)
    if memory == "paged4":
        config["cache"].update(kv_allocator="paged", page_size=4)
    else:
        config["scheduler"].update(chunked_prefill_size=6, enable_mixed_chunk=True)
    with Engine(config) as engine:
        outputs = engine.generate(input_ids=ENGINE_PROMPTS, sampling_params=ENGINE_GREEDY)
        assert [o.token_ids for o in outputs] == [o.token_ids for o in plain_outputs]
        assert_kv_accounted(engine)
        assert_draft_pool_full(engine)


@pytest.mark.parametrize("family", ["qwen3"])  # any family the loader knows: the draft is a ModelWorker
def test_other_families_draft_for_themselves(tmp_path, family):
    from treadle.testing import models

    target = getattr(models, f"make_tiny_{family}")(tmp_path / family)
    prompts, params = ENGINE_PROMPTS[:3], ENGINE_GREEDY[:3]
    with Engine(engine_config(target)) as engine:
        plain = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
    with Engine(engine_config(target, target, 3)) as engine:
        outputs = engine.generate(input_ids=prompts, sampling_params=params)
        assert [o.token_ids for o in outputs] == plain
        assert sum(len(o.token_ids) for o in outputs) / sum(o.spec_verify_steps for o in outputs) > 3.5
        assert_draft_pool_full(engine)
