"""Chunked prefill: a prompt's last chunk shares its step with new prompts, and a prompt part-way through its chunks
gives its KV back before a running request is cut short."""

from __future__ import annotations

import pytest

from batch_log import generate_logged

from treadle import Engine, SamplingParams
from treadle.core.request import Req
from treadle.core.scheduling.observers import StepObserver
from treadle.testing.engine import assert_kv_accounted

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _solo(model_dir: str, prompt: list[int], new_tokens: int) -> list[int]:
    engine = Engine({"model": {"path": model_dir}, "cache": {"max_total_tokens": 256}})
    return engine.generate(input_ids=prompt, sampling_params=SamplingParams(max_new_tokens=new_tokens, **GREEDY)
                           ).token_ids


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_prompts_last_chunk_shares_its_step_with_new_prompts(tiny_llama_dir, overlap) -> None:
    prompts = [[7 + i % 50 for i in range(20)], [3, 14, 15, 92, 65, 35], [27, 18, 28, 18, 28]]
    params = [SamplingParams(max_new_tokens=3, **GREEDY)] * 3
    scheduler = {"chunked_prefill_size": 16, "disable_overlap": not overlap}
    outputs, log, engine = generate_logged(tiny_llama_dir, scheduler, prompts, params, lambda batch: [
        (len(e.req.origin_input_ids), e.extend_len) for e in batch.entries if not e.input_on_device])
    prefills = [entries for entries in log if entries]
    # 16 of the 20-token prompt; then its last 4 tokens with both short prompts (15 tokens in one step), where
    # the last chunk used to run alone and the short prompts in a step of their own.
    assert prefills == [[(20, 16)], [(20, 4), (6, 6), (5, 5)]]
    assert [tokens for tokens, _ in outputs] == [_solo(tiny_llama_dir, p, 3) for p in prompts]
    assert_kv_accounted(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_out_of_kv_a_chunked_prompt_goes_back_to_the_queue_before_a_running_request_is_cut(tiny_llama_dir,
                                                                                             overlap) -> None:
    # 40 slots and no decode reserve: A (6 + 30 tokens) decodes while B's 30-token prompt arrives and is prefilled
    # 8 tokens at a time until the pool is full. A is the only running request, so before, A was ended with
    # "the KV cache is full" at ~18 tokens; now B (nothing sampled yet) is retracted and A runs to its length.
    engine = Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 40},
                     "scheduler": {"chunked_prefill_size": 8, "new_token_ratio": 0.0, "disable_overlap": not overlap}})
    scheduler = engine.scheduler
    retracted = []

    class RetractionLog(StepObserver):
        def request_retracted(self, req: Req) -> None:
            # Told after the retraction: the request waits again, at the front, holding no KV.
            assert scheduler.waiting[0] is req and req.kv_len == 0 and scheduler.chunked_req is not req
            # Nothing sampled yet: it was the chunked prompt (a running request is retracted only after the step
            # in flight was read, so it has sampled at least one token).
            retracted.append((req.rid, req.output_ids == []))

    scheduler.add_observer(RetractionLog())
    prompt_a, prompt_b = [11, 12, 13, 14, 15, 16], [(5 * i) % 97 + 3 for i in range(30)]
    produced: dict[str, list[int]] = {"a": [], "b": []}
    finished: dict[str, str] = {}
    scheduler.add_request(Req(rid="a", origin_input_ids=prompt_a,
                              sampling_params=SamplingParams(max_new_tokens=30, **GREEDY)))
    for step in range(400):
        if step == 12:
            scheduler.add_request(Req(rid="b", origin_input_ids=prompt_b,
                                      sampling_params=SamplingParams(max_new_tokens=2, **GREEDY)))
        for output in scheduler.step():
            produced[output.rid].extend(output.new_token_ids)
            if output.finished_reason is not None:
                finished[output.rid] = output.finished_reason
        if len(finished) == 2:
            break
    assert finished == {"a": "length", "b": "length"}
    assert ("b", True) in retracted and not any(rid == "a" for rid, _ in retracted), retracted
    assert produced["a"] == _solo(tiny_llama_dir, prompt_a, 30)
    assert produced["b"] == _solo(tiny_llama_dir, prompt_b, 2)
    assert_kv_accounted(engine)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_a_prefill_admits_up_to_the_running_limit(tiny_llama_dir, overlap) -> None:
    """8 prompts of 16 tokens, 4 to a 64-token chunk, a running limit of 8: the second step admits the other 4. The
    request rows (the limit plus one) are taken as each request is admitted, and they were once also counted against
    the requests admitted so far, so the second step admitted 3 and a third prefill step carried the last prompt."""
    prompts = [[3 + i] + [(7 * i + j) % 97 + 5 for j in range(15)] for i in range(8)]
    params = [SamplingParams(max_new_tokens=4, **GREEDY)] * 8
    scheduler = {"max_running_requests": 8, "chunked_prefill_size": 64, "enable_mixed_chunk": True,
                 "prefill_hold_steps": 0, "disable_overlap": not overlap}
    outputs, log, engine = generate_logged(tiny_llama_dir, scheduler, prompts, params, lambda batch: sum(
        e.extend_len for e in batch.entries if not e.input_on_device and e.kv_start < len(e.req.origin_input_ids)))
    prefill_tokens = [tokens for tokens in log if tokens]
    assert prefill_tokens == [64, 64]
    assert [tokens for tokens, _ in outputs] == [_solo(tiny_llama_dir, p, 4) for p in prompts]
    assert_kv_accounted(engine)
