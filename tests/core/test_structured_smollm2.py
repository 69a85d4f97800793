"""Structured output from the embedded SmolLM2 through the Engine: JSON that validates, regexes that match."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from treadle import Engine, SamplingParams
from treadle.testing.engine import assert_kv_accounted
from treadle.testing.tokenizer import chat_prompt_ids

from structured_schemas import REGEXES, SCHEMAS

# A spread of the shared suite (nested, arrays, enums, bounds, anyOf, optional, $ref); the OpenAI tests run all.
ENGINE_SCHEMAS = ["person", "enum_color", "bounded_number", "array_of_objects", "any_of", "optional_fields",
                  "defs_ref", "nullable"]


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    engine = Engine({"cache": {"max_total_tokens": 8192}})
    yield engine
    engine.shutdown()


def test_json_schema_outputs_parse_and_validate(engine):
    cases = [case for case in SCHEMAS if case[0] in ENGINE_SCHEMAS]
    outputs = engine.generate(
        input_ids=[chat_prompt_ids(engine.tokenizer, prompt + " Answer in JSON.") for _, prompt, _ in cases],
        sampling_params=[SamplingParams(max_new_tokens=80, temperature=0, json_schema=json.dumps(schema))
                         for _, _, schema in cases])
    for (name, _, schema), output in zip(cases, outputs):
        assert output.finish_reason == "stop", (name, output.text)
        jsonschema.validate(json.loads(output.text), schema)
    assert_kv_accounted(engine)


def test_regex_outputs_fullmatch(engine):
    outputs = engine.generate(
        input_ids=[chat_prompt_ids(engine.tokenizer, prompt) for _, prompt, _ in REGEXES],
        sampling_params=[SamplingParams(max_new_tokens=40, temperature=0, regex=pattern) for _, _, pattern in REGEXES])
    for (name, _, pattern), output in zip(REGEXES, outputs):
        assert output.finish_reason == "stop" and re.fullmatch(pattern, output.text), (name, output.text)


def test_the_constraint_changes_the_answer_and_spares_the_neighbour(engine):
    question = chat_prompt_ids(engine.tokenizer, "What is the capital of France? Answer in JSON.")
    greedy = SamplingParams(max_new_tokens=24, temperature=0)
    schema = {"type": "object", "properties": {"capital": {"type": "string"}}, "required": ["capital"]}
    free, constrained = engine.generate(input_ids=[question, question], sampling_params=[
        greedy, SamplingParams(max_new_tokens=24, temperature=0, json_schema=json.dumps(schema))])
    assert free.text == engine.generate(input_ids=question, sampling_params=greedy).text
    assert json.loads(constrained.text) == {"capital": "Paris"}
