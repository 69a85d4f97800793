"""core.validation: one check of a request's ids and sampling parameters against the limits, for every entry point."""

from __future__ import annotations

import re

import pytest

from treadle import Engine, SamplingParams
from treadle.core.request import InvalidRequestError
from treadle.core.validation import REQUEST_LIMITS_KEY, RequestLimits, check_request, check_sampling_params
from treadle.testing.engine import assert_kv_accounted

LIMITS = RequestLimits(context_len=32, vocab_size=100, kv_slots=24, max_request_tokens=28)
OPENAI_NAMES = {"prompt": "messages", "input_ids": "messages", "max_new_tokens": "max_tokens",
                "top_logprobs_num": "top_logprobs"}


def refusal(ids, params=None, limits=LIMITS, **options) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        check_request(ids, params or SamplingParams(max_new_tokens=4), limits, **options)
    return info.value


@pytest.mark.parametrize("ids, params, options, param, code, words", [
    ([], None, {}, "prompt", None, "the prompt is empty"),
    ([5] * 32, None, {}, "prompt", "context_length_exceeded", "the prompt is too long: it has 32 tokens"),
    ([5] * 24, None, {}, "prompt", None, "the KV cache holds only 24"),
    ([5, 100], None, {}, "input_ids", None, r"token ids must be in \[0, 100\)"),
    ([5, -1], None, {}, "input_ids", None, r"token ids must be in \[0, 100\)"),
    ([5] * 10, SamplingParams(max_new_tokens=23), {"output_must_fit": True}, "max_new_tokens",
     "context_length_exceeded", "lower max_new_tokens to at most 22"),
    ([5] * 10, SamplingParams(max_new_tokens=19), {}, "max_new_tokens", None, "server.max_request_tokens = 28"),
    ([5], SamplingParams(logit_bias={100: 1}, max_new_tokens=4), {}, "logit_bias", None, "logit_bias names token 100"),
    ([5], None, {"top_logprobs_num": 101}, "top_logprobs_num", None, r"must be in \[0, 100\] \(the vocabulary"),
    ([5], None, {"top_logprobs_num": -1}, "top_logprobs_num", None, "got -1"),
    ([5], SamplingParams(temperature=-1, max_new_tokens=4), {}, "temperature", None, "temperature must be >= 0, got -1"),
    ([5], SamplingParams(logit_bias={7: 101}, max_new_tokens=4), {}, "logit_bias.7", None, r"\[-100, 100\], got 101"),
    ([5], SamplingParams(regex="a", ebnf='root ::= "a"', max_new_tokens=4), {}, "ebnf", None, "at most one"),
    ([5], SamplingParams(json_schema="[1]", max_new_tokens=4), {}, "json_schema", None, "must be a JSON object"),
])
def test_each_limit_names_its_field_and_says_what_would_be_right(ids, params, options, param, code, words):
    error = refusal(ids, params, **options)
    assert (error.param, error.code) == (param, code)
    assert re.search(words, str(error)), str(error)


def test_a_request_within_every_limit_passes():
    check_request([5] * 10, SamplingParams(max_new_tokens=18), LIMITS, top_logprobs_num=100, output_must_fit=True)
    # Without output_must_fit a budget past the context is the scheduler's to shorten, not an error.
    check_request([5] * 10, SamplingParams(max_new_tokens=18), RequestLimits(context_len=12))


def test_the_callers_field_names_are_used_in_param_and_message():
    error = refusal([5] * 10, SamplingParams(max_new_tokens=23), output_must_fit=True, names=OPENAI_NAMES)
    assert error.param == "max_tokens" and "lower max_tokens to at most 22" in str(error)
    assert refusal([5] * 40, names=OPENAI_NAMES).param == "messages"
    assert refusal([5, 100], names=OPENAI_NAMES).param == "messages"
    top = refusal([5], top_logprobs_num=101, names=OPENAI_NAMES)
    assert top.param == "top_logprobs" and str(top).startswith("top_logprobs must be in")
    with pytest.raises(InvalidRequestError, match="max_tokens must be >= 0, got -1") as info:
        check_sampling_params(SamplingParams(max_new_tokens=-1), OPENAI_NAMES)
    assert info.value.param == "max_tokens"


def test_a_limit_the_caller_does_not_know_is_not_checked():
    unknown = RequestLimits()
    check_request([10**6] * 5000, SamplingParams(max_new_tokens=10**6, logit_bias={10**6: 1}), unknown,
                  top_logprobs_num=10**6, output_must_fit=True)
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        check_request([], SamplingParams(), unknown)


def test_limits_travel_in_model_info():
    info = {"context_len": 32, REQUEST_LIMITS_KEY: LIMITS.as_dict()}
    assert RequestLimits.from_model_info(info) == LIMITS
    assert RequestLimits.from_model_info({"context_len": 32}) == RequestLimits()


def test_the_scheduler_checks_with_its_model_and_pool(tiny_llama_dir):
    engine = Engine({"model": {"path": tiny_llama_dir}, "cache": {"max_total_tokens": 64},
                     "server": {"max_request_tokens": 40}})
    limits = engine.scheduler.request_limits
    assert limits == RequestLimits(context_len=engine.scheduler.context_len, vocab_size=512, kv_slots=64,
                                   max_request_tokens=40)
    assert engine.scheduler.request_limits is limits  # built once
    with pytest.raises(InvalidRequestError, match=r"plus max_new_tokens \(32\) exceeds server.max_request_tokens"):
        engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 32})
    with pytest.raises(InvalidRequestError, match="KV cache holds only 64"):
        engine.generate(input_ids=[5] * 70, sampling_params={"max_new_tokens": 1})
    out = engine.generate(input_ids=[5] * 10, sampling_params={"max_new_tokens": 30, "temperature": 0})
    assert out.prompt_tokens == 10 and out.completion_tokens <= 30
    assert_kv_accounted(engine)
