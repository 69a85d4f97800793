"""End-to-end engine behaviour on tiny random models: HF parity under every memory configuration."""

from __future__ import annotations

import pytest
import torch

from treadle import Engine, SamplingParams
from treadle.core.request import InvalidRequestError

from treadle.testing.engine import assert_kv_accounted

PROMPTS = [
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6],
    [5, 17, 42, 8, 99, 3, 250, 11, 200, 12],  # shares a 8-token prefix with the first
    [300, 301, 9],
    [5, 17, 42, 8, 99, 3, 250, 11, 7, 64, 31, 2, 150, 77, 45, 18, 6, 120, 121, 122, 123, 124],
]
NEW_TOKENS = 12


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    outputs = []
    with torch.no_grad():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def llama_reference(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, NEW_TOKENS)


@pytest.fixture(scope="module")
def mistral_reference(tiny_mistral_dir):
    return hf_greedy(tiny_mistral_dir, PROMPTS, NEW_TOKENS)


def make_engine(model_dir: str, **sections) -> Engine:
    config = {"model": {"path": model_dir}, "cache": {"max_total_tokens": 2048}}
    for section, values in sections.items():
        config.setdefault(section, {}).update(values)
    return Engine(config)


GREEDY = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)

MEMORY_CONFIGS = {
    "token": {},
    "paged4": {"cache": {"kv_allocator": "paged", "page_size": 4}},
    "no-radix": {"cache": {"disable_radix_cache": True}},
    "chunked": {"scheduler": {"chunked_prefill_size": 5}},
    "paged-chunked-mixed": {"cache": {"kv_allocator": "paged", "page_size": 4},
                            "scheduler": {"chunked_prefill_size": 6, "enable_mixed_chunk": True}},
}


@pytest.mark.parametrize("memory", list(MEMORY_CONFIGS))
def test_llama_greedy_matches_hf_cold_and_warm(tiny_llama_dir, llama_reference, memory):
    engine = make_engine(tiny_llama_dir, **MEMORY_CONFIGS[memory])
    cold = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in cold] == llama_reference
    warm = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in warm] == llama_reference
    if memory != "no-radix":
        assert sum(o.cached_tokens for o in warm) > 0
    assert_kv_accounted(engine)


@pytest.mark.parametrize("memory", ["token", "paged4"])
def test_mistral_sliding_window_matches_hf(tiny_mistral_dir, mistral_reference, memory):
    engine = make_engine(tiny_mistral_dir, **MEMORY_CONFIGS[memory])
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == mistral_reference
    assert_kv_accounted(engine)


FAMILIES = {
    "qwen2-sliding-layer1": ("make_tiny_qwen2", {"use_sliding_window": True, "sliding_window": 6, "max_window_layers": 1}),
    "qwen3": ("make_tiny_qwen3", {}),
    "mixtral": ("make_tiny_mixtral", {}),
    "qwen3-moe": ("make_tiny_qwen3_moe", {}),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    """A tiny checkpoint of each newer family and HF's greedy outputs for PROMPTS."""
    from treadle.testing import models

    make, overrides = FAMILIES[request.param]
    path = getattr(models, make)(tmp_path_factory.mktemp(request.param), **overrides)
    return path, hf_greedy(path, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("memory", list(MEMORY_CONFIGS))
def test_family_greedy_matches_hf_cold_and_warm(family_model, memory):
    model_dir, reference = family_model
    engine = make_engine(model_dir, **MEMORY_CONFIGS[memory])
    for _ in ("cold", "warm"):
        outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)
        assert [o.token_ids for o in outputs] == reference
    assert_kv_accounted(engine)


def hf_input_logprobs(model_dir: str, ids: list[int], start: int) -> list[float]:
    """HF transformers' log-prob of each prompt token from position ``start`` on, given the ones before it."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        log_probs = torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)
    return [log_probs[p - 1, ids[p]].item() for p in range(max(start, 1), len(ids))]


@pytest.mark.parametrize("allocator", [{}, {"kv_allocator": "paged", "page_size": 4}])
@pytest.mark.parametrize("chunk", [None, 4])
def test_retraction_under_a_tiny_pool_completes_every_request(tiny_llama_dir, llama_reference, allocator, chunk):
    """Also with prompt log-probs: a request retracted before its first output computes them once more, and
    reports them once (with 4-token chunks and pages of 4 they were reported again after each retraction)."""
    engine = make_engine(tiny_llama_dir, cache={"max_total_tokens": 48, **allocator},
                         scheduler={"new_token_ratio": 0.0, "chunked_prefill_size": chunk})
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, logprob_start_len=0)
    assert [o.token_ids for o in outputs] == llama_reference
    assert engine.kv_stats()["retractions"] > 0
    for out, ids in zip(outputs, PROMPTS):
        assert out.input_token_logprobs[0] is None  # the first token has no context
        assert out.input_token_logprobs[1:] == pytest.approx(hf_input_logprobs(tiny_llama_dir, ids, 0), abs=1e-4)
    assert_kv_accounted(engine)


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    params = SamplingParams(max_new_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    batched = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert alone.token_ids == batched[0].token_ids
    other = engine.generate(input_ids=PROMPTS[0], sampling_params={**vars(params), "seed": 99})
    assert other.token_ids != alone.token_ids
    assert_kv_accounted(engine)


def test_penalties_and_min_p_change_the_distribution_but_stay_valid(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    base = engine.generate(input_ids=PROMPTS[2], sampling_params=GREEDY)
    penalized = engine.generate(
        input_ids=PROMPTS[2],
        sampling_params=SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True,
                                       repetition_penalty=1.9, frequency_penalty=2.0, presence_penalty=2.0),
    )
    assert penalized.token_ids != base.token_ids
    # A strong frequency penalty keeps greedy decoding from repeating a token 3+ times in a row.
    ids = penalized.token_ids
    assert not any(ids[i] == ids[i + 1] == ids[i + 2] for i in range(len(ids) - 2))
    sampled = engine.generate(input_ids=PROMPTS[2], sampling_params=SamplingParams(
        max_new_tokens=8, temperature=0.7, min_p=0.2, seed=3, ignore_eos=True))
    assert len(sampled.token_ids) == 8
    assert_kv_accounted(engine)


def test_logit_bias_bans_and_forces_tokens_batched_with_unbiased_requests(tiny_llama_dir, llama_reference):
    engine = make_engine(tiny_llama_dir)
    banned = llama_reference[0][0]
    params = [{**vars(GREEDY), "logit_bias": {str(banned): -100}}, GREEDY,
              {**vars(GREEDY), "logit_bias": {7: 100}}, GREEDY]
    outs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    assert banned not in outs[0].token_ids and outs[0].token_ids != llama_reference[0]
    assert outs[2].token_ids == [7] * NEW_TOKENS
    assert [outs[1].token_ids, outs[3].token_ids] == [llama_reference[1], llama_reference[3]]
    vocab = engine.scheduler.worker.info.vocab_size
    with pytest.raises(InvalidRequestError, match=f"logit_bias names token {vocab}"):
        engine.generate(input_ids=PROMPTS[0], sampling_params={**vars(GREEDY), "logit_bias": {vocab: 1}})
    assert_kv_accounted(engine)


def test_stop_token_ids_and_max_new_tokens(tiny_llama_dir, llama_reference):
    engine = make_engine(tiny_llama_dir)
    target = llama_reference[0][4]
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, stop_token_ids=[target]))
    first = llama_reference[0].index(target)
    assert out.token_ids == llama_reference[0][: first + 1]
    assert out.finish_reason == "stop" and out.matched_stop == target
    short = engine.generate(input_ids=PROMPTS[0], sampling_params={"max_new_tokens": 3, "temperature": 0})
    assert short.finish_reason in ("length", "stop") and len(short.token_ids) <= 3
    assert_kv_accounted(engine)


@pytest.mark.parametrize("start, chunk", [(5, None), (14, 4)], ids=["warm-cache", "after-first-chunks"])
def test_input_logprobs_match_a_direct_forward(tiny_llama_dir, start, chunk):
    """Also when the first wanted position lies chunks into the prompt (those chunks report none)."""
    engine = make_engine(tiny_llama_dir, scheduler={"chunked_prefill_size": chunk})
    ids = PROMPTS[0]
    if chunk is None:
        engine.generate(input_ids=ids, sampling_params=GREEDY)  # warm the radix cache: logprobs must stay exact
    out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                          logprob_start_len=start)
    assert out.token_ids == [] and out.finish_reason == "length"
    assert out.input_token_logprobs == pytest.approx(hf_input_logprobs(tiny_llama_dir, ids, start), abs=1e-4)
    assert_kv_accounted(engine)


def test_top_logprobs_beyond_the_vocabulary_fail_clearly(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir)
    vocab = engine.scheduler.worker.info.vocab_size
    with pytest.raises(InvalidRequestError, match=f"top_logprobs_num must be in \\[0, {vocab}\\]"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, return_logprob=True, top_logprobs_num=vocab + 1)
    assert_kv_accounted(engine)  # nothing was left queued
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY, return_logprob=True, top_logprobs_num=vocab)
    assert out.token_ids == engine.generate(input_ids=PROMPTS[0], sampling_params=GREEDY).token_ids
    assert len(out.output_top_logprobs[0]) == vocab


def test_prompt_longer_than_the_pool_fails_clearly(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, cache={"max_total_tokens": 16})
    with pytest.raises(InvalidRequestError, match="KV cache holds only 16"):
        engine.generate(input_ids=list(range(1, 40)), sampling_params=GREEDY)
    with pytest.raises(InvalidRequestError, match="context length"):
        make_engine(tiny_llama_dir, model={"context_length": 32}).generate(
            input_ids=list(range(1, 40)), sampling_params=GREEDY)
    assert_kv_accounted(engine)


def test_abort_frees_everything(tiny_llama_dir):
    from treadle.core.request import Req

    engine = make_engine(tiny_llama_dir)
    scheduler = engine.scheduler
    reqs = [Req(rid=f"r{i}", origin_input_ids=p, sampling_params=SamplingParams(max_new_tokens=50, ignore_eos=True))
            for i, p in enumerate(PROMPTS)]
    for req in reqs:
        scheduler.add_request(req)
    for _ in range(3):
        scheduler.step()
    for req in reqs:
        final = scheduler.abort_request(req.rid)
        assert final is None or final.finished_reason == "abort"
    assert not scheduler.has_work()
    assert_kv_accounted(engine)


def test_a_large_batch_is_fed_as_requests_finish_and_checked_before_any_step(tiny_llama_dir, llama_reference):
    from treadle.core.engine import QUEUED_PER_RUNNING_REQUEST

    engine = make_engine(tiny_llama_dir, scheduler={"max_running_requests": 2})
    scheduler, held, steps = engine.scheduler, [], [0]
    step = scheduler.step

    def counting_step():
        held.append(len(scheduler.live_by_rid))
        steps[0] += 1
        return step()

    scheduler.step = counting_step
    prompts = PROMPTS * 6  # 24 prompts, more than the scheduler holds at once
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    assert [o.token_ids for o in outputs] == llama_reference * 6
    assert max(held) == QUEUED_PER_RUNNING_REQUEST * 2
    assert_kv_accounted(engine)
    # A prompt that can never run fails the whole call before anything is computed or queued.
    steps[0] = 0
    with pytest.raises(InvalidRequestError, match="token ids must be in"):
        engine.generate(input_ids=prompts + [[1, 10**6]], sampling_params=GREEDY)
    assert steps[0] == 0
    assert_kv_accounted(engine)


def test_a_request_id_is_taken_while_its_request_lives_and_free_again_after(tiny_llama_dir):
    from treadle.core.request import Req

    engine = make_engine(tiny_llama_dir)
    scheduler = engine.scheduler
    make = lambda: Req(rid="same", origin_input_ids=PROMPTS[0], sampling_params=GREEDY)  # noqa: E731
    first = make()
    scheduler.add_request(first)
    with pytest.raises(InvalidRequestError, match="request id 'same' is already in use"):
        scheduler.add_request(make())
    while scheduler.has_work():
        scheduler.step()
    assert first.finished and scheduler.abort_request("same") is None  # finished: nothing to abort
    second = make()
    scheduler.add_request(second)  # the id is free again
    assert scheduler.abort_request("same").finished_reason == "abort"
    assert scheduler.abort_request("same") is None and scheduler.abort_request("never") is None
    scheduler.add_request(make())
    while scheduler.has_work():
        scheduler.step()
    assert_kv_accounted(engine)  # also: no request left in live_by_rid


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "random", "dfs-weight", "lof", "priority", "shortest-prompt-first"])
def test_every_policy_serves_the_same_greedy_outputs(tiny_llama_dir, llama_reference, policy):
    engine = make_engine(tiny_llama_dir, scheduler={"policy": policy, "max_running_requests": 2})
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, priority=[0, 3, 1, 2])
    assert [o.token_ids for o in outputs] == llama_reference
    assert_kv_accounted(engine)


def _queued_and_steps(engine: Engine) -> tuple[list[int], list[int]]:
    """Record the prompt lengths in the order requests reach the scheduler, and count its steps."""
    scheduler, queued, steps = engine.scheduler, [], [0]
    add, step = scheduler.add_request, scheduler.step

    def recording_add(req):
        queued.append(len(req.origin_input_ids))
        add(req)

    def counting_step():
        steps[0] += 1
        return step()

    scheduler.add_request, scheduler.step = recording_add, counting_step
    return queued, steps


@pytest.mark.parametrize("batch_order", ["longest_output_first", "submission"])
def test_a_batch_is_queued_longest_output_first_and_answered_in_order(tiny_llama_dir, llama_reference, batch_order):
    engine = make_engine(tiny_llama_dir, scheduler={"batch_order": batch_order})
    queued, _ = _queued_and_steps(engine)
    budgets = [3, NEW_TOKENS, 7, NEW_TOKENS]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in budgets]
    outputs = engine.generate(input_ids=PROMPTS, sampling_params=params)
    expected = [1, 3, 2, 0] if batch_order == "longest_output_first" else [0, 1, 2, 3]  # a stable sort
    assert queued == [len(PROMPTS[i]) for i in expected]
    assert [o.token_ids for o in outputs] == [ref[:n] for ref, n in zip(llama_reference, budgets)]
    assert_kv_accounted(engine)


def test_longest_output_first_ends_a_batch_with_uneven_budgets_in_fewer_steps(tiny_llama_dir):
    # Six short requests submitted before two long ones: in submission order the long ones start last and
    # decode alone at the end; queued first, they run while the short ones come and go beside them.
    prompts = [[10 + i, 20 + i, 30 + i] for i in range(8)]
    params = [SamplingParams(max_new_tokens=n, temperature=0.0, ignore_eos=True) for n in [4] * 6 + [24] * 2]
    steps, outputs = {}, {}
    for batch_order in ("submission", "longest_output_first"):
        engine = make_engine(tiny_llama_dir, scheduler={"batch_order": batch_order, "max_running_requests": 4})
        _, counted = _queued_and_steps(engine)
        outputs[batch_order] = [o.token_ids for o in engine.generate(input_ids=prompts, sampling_params=params)]
        steps[batch_order] = counted[0]
        assert_kv_accounted(engine)
    assert outputs["longest_output_first"] == outputs["submission"]
    assert steps["longest_output_first"] < steps["submission"], steps


@pytest.mark.parametrize("memory", ["token", "paged4"])
def test_a_cold_batch_sharing_a_prefix_computes_it_once(tiny_llama_dir, memory):
    system = list(range(10, 74))  # 64 shared tokens
    prompts = [system + [200 + i, 300 + i, 400 + i] for i in range(4)]
    engine = make_engine(tiny_llama_dir, **MEMORY_CONFIGS[memory])
    outputs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
    # The first request computes the prefix; the other three wait one step and reuse it.
    assert [o.cached_tokens for o in outputs] == [0, 64, 64, 64]
    assert [o.token_ids for o in outputs] == hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)
    assert_kv_accounted(engine)


def test_a_sequence_that_outgrows_the_pool_finishes_with_length(tiny_llama_dir, llama_reference):
    engine = make_engine(tiny_llama_dir, cache={"max_total_tokens": 20})
    out = engine.generate(input_ids=PROMPTS[0], sampling_params=SamplingParams(
        max_new_tokens=40, temperature=0, ignore_eos=True))
    # 17 prompt tokens + the tokens whose KV fits in 20 slots; the request ends instead of hanging.
    assert out.finish_reason == "length"
    assert 1 <= len(out.token_ids) <= 4
    assert out.token_ids == llama_reference[0][: len(out.token_ids)]
    assert_kv_accounted(engine)


def test_startup_objects_are_frozen_out_of_garbage_collection_until_shutdown(tiny_llama_dir):
    import gc

    gc.unfreeze()
    engine = make_engine(tiny_llama_dir)
    try:
        # The modules, model and tokenizer: full collections would walk them all every few hundred steps.
        assert gc.get_freeze_count() > 10_000
        assert engine.generate(input_ids=PROMPTS[:1], sampling_params=GREEDY)[0].token_ids
    finally:
        engine.shutdown()
    assert gc.get_freeze_count() == 0  # a dropped engine can be collected again
