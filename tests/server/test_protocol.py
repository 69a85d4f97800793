"""server.protocol: the HTTP bodies' sampling fields are core.request.SamplingParams's, defined once."""

from __future__ import annotations

import dataclasses

import pytest
from pydantic import ValidationError

from treadle.core.request import SamplingParams
from treadle.server.protocol import (
    OPENAI_RENAMED_FIELDS,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
)

CORE_FIELDS = {field.name: field.default for field in dataclasses.fields(SamplingParams)}
# A value other than the default for every field, as a JSON body carries it.
SENT = {"max_new_tokens": 7, "temperature": 0.5, "top_p": 0.9, "top_k": 20, "min_p": 0.1, "repetition_penalty": 1.1,
        "frequency_penalty": 0.3, "presence_penalty": -0.2, "stop": ["\n"], "stop_token_ids": [2, 3],
        "ignore_eos": True, "seed": 11, "skip_special_tokens": False, "json_schema": {"type": "object"},
        "regex": None, "ebnf": None, "logit_bias": {"5": -100}}


def test_the_native_sampling_params_are_the_core_fields_with_their_defaults():
    assert {name: field.default for name, field in NativeSamplingParams.model_fields.items()} == CORE_FIELDS
    assert set(SENT) == set(CORE_FIELDS), "SENT must give every field a value (a field was added)"
    body = GenerateRequest(text="x", sampling_params=SENT)
    assert SamplingParams(**body.sampling_params.model_dump()) == SamplingParams(**SENT)


def test_the_openai_bodies_take_every_core_field_but_the_two_openai_names_otherwise():
    for body_type in (ChatCompletionRequest, CompletionRequest):
        shared = set(CORE_FIELDS) - set(OPENAI_RENAMED_FIELDS)
        assert shared <= set(body_type.model_fields), body_type
        assert not set(OPENAI_RENAMED_FIELDS) & set(body_type.model_fields)


@pytest.mark.parametrize("budget, expected, max_name", [
    ({"max_tokens": 9}, 9, "max_tokens"),
    ({"max_completion_tokens": 8, "max_tokens": 9}, 8, "max_completion_tokens"),
    ({}, 16, "max_tokens"),
])
def test_an_openai_body_maps_onto_sampling_params_in_one_step(budget, expected, max_name):
    fields = {k: v for k, v in SENT.items() if k not in OPENAI_RENAMED_FIELDS}
    body = CompletionRequest(prompt="x", **{**fields, "regex": "a+", **budget})
    params = body.sampling_params(default_max_tokens=16)
    assert params == SamplingParams(**{**SENT, "json_schema": None, "regex": "a+", "max_new_tokens": expected})
    assert body.field_names("prompt")["max_new_tokens"] == max_name
    assert body.field_names("prompt")["top_logprobs_num"] == "logprobs"
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    assert chat.field_names("messages") == {"prompt": "messages", "input_ids": "messages",
                                            "top_logprobs_num": "top_logprobs", "max_new_tokens": "max_tokens"}


def test_body_types_stay_strict_where_a_lax_parse_would_guess():
    with pytest.raises(ValidationError, match="sampling_params.ignore_eos"):
        GenerateRequest(text="x", sampling_params={"ignore_eos": "yes"})
    with pytest.raises(ValidationError, match="sampling_params.temprature"):
        GenerateRequest(text="x", sampling_params={"temprature": 0})
    with pytest.raises(ValidationError) as info:
        CompletionRequest(prompt="x", logit_bias={"a": 1})
    assert info.value.errors()[0]["loc"] == ("logit_bias", "a", "[key]")
