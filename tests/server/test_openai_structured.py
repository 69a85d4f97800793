"""response_format, tools and tool_choice end to end: the embedded SmolLM2 behind the real openai client.

One server serves the module. Constrained requests run concurrently (the batch
makes them cheap on the CPU); every reply is checked with `jsonschema`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import signal

import httpx
import jsonschema
import openai
import pytest

from treadle.core.config import ServerConfig
from treadle.core.request import SamplingParams
from treadle.server.launch import ServerHandle, launch_server

MODEL = "smol"
needs_grammar = pytest.mark.skipif(
    "json_schema" not in {f.name for f in dataclasses.fields(SamplingParams)},
    reason="constrained decoding (the grammar_backends plugin kind) is not in this build")

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "description": "Add two integers",
    "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 100}, "b": {"type": "integer", "minimum": 0, "maximum": 100}},
        "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(smollm2_dir: str) -> ServerHandle:
    # think_tags is on for every test: replies without <think> must pass through it untouched.
    config = ServerConfig(model={"path": smollm2_dir, "served_model_name": MODEL}, reasoning={"parser": "think_tags"},
                          cache={"max_total_tokens": 16384}, server={"port": 0, "log_level": "warning"})
    handle = launch_server(config, timeout=300)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _gather(server: ServerHandle, requests: list[dict]) -> list:
    async def run() -> list:
        async with openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                                      timeout=600) as aclient:
            return await asyncio.gather(*(aclient.chat.completions.create(model=MODEL, **r) for r in requests))

    return asyncio.run(run())


def _streamed(client: openai.OpenAI, **request) -> tuple[dict, str | None]:
    """The message a stream adds up to (content, reasoning, tool calls by index) and its finish_reason."""
    content, reasoning, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **request):
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in calls and call.type == "function" and call.function.name
                calls[call.index] = {"id": call.id, "name": call.function.name,
                                     "arguments": call.function.arguments or ""}
            else:
                assert call.function.name is None
                calls[call.index]["arguments"] += call.function.arguments
        finish = choice.finish_reason or finish
    message = {"content": content, "tool_calls": [calls[i] for i in sorted(calls)]}
    if reasoning:
        message["reasoning_content"] = reasoning
    return message, finish


# ------------------------------------------------------------------ no grammar needed


def test_auto_without_a_call_is_plain_content_streamed_or_not(client: openai.OpenAI) -> None:
    request = dict(messages=ASK_WEATHER, tools=TOOLS, max_tokens=12, temperature=0)
    full = client.chat.completions.create(model=MODEL, **request)
    choice = full.choices[0]
    assert choice.message.tool_calls is None and choice.message.content
    assert choice.message.reasoning_content is None
    assert choice.finish_reason == "length"
    streamed, finish = _streamed(client, **request)
    assert streamed == {"content": choice.message.content, "tool_calls": []} and finish == "length"


def test_tools_change_the_prompt_through_the_fallback_rendering(client: openai.OpenAI) -> None:
    plain = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=1, temperature=0)
    with_tools = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, max_tokens=1,
                                                temperature=0)
    ignored = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="none",
                                             max_tokens=1, temperature=0)
    assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools are described
    assert ignored.usage.prompt_tokens == plain.usage.prompt_tokens


@pytest.mark.parametrize("fields, param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "send_email"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": 1}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_bad_tool_and_format_fields_are_openai_shaped_400s(client: openai.OpenAI, fields: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=4, **fields)
    error = info.value.body
    assert info.value.status_code == 400 and error["type"] == "invalid_request_error"
    assert error["param"] == param and error["message"]


def test_completions_check_response_format_too(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=4, extra_body={
            "response_format": {"type": "json_object"}, "regex": "a+"})
    assert info.value.body["param"] == "response_format"


def test_streaming_a_bad_request_is_a_400_before_any_event(server: ServerHandle) -> None:
    body = {"model": MODEL, "messages": ASK_WEATHER, "stream": True, "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "nope"}}}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "tool_choice"


# ------------------------------------------------------------------ constrained


@needs_grammar
def test_json_schema_suite_every_reply_validates(server: ServerHandle) -> None:
    from structured_schemas import SCHEMAS  # tests/structured_schemas.py, shared with the Engine tests

    assert len(SCHEMAS) >= 20
    requests = [dict(messages=[{"role": "user", "content": prompt + " Answer in JSON."}],
                     response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema,
                                                                            "strict": True}},
                     max_tokens=160, temperature=0)
                for name, prompt, schema in SCHEMAS]
    replies = _gather(server, requests)
    for (name, _, schema), reply in zip(SCHEMAS, replies):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", f"{name}: cut off: {choice.message.content!r}"
        jsonschema.validate(json.loads(choice.message.content), schema)


@needs_grammar
def test_regex_suite_fullmatches(server: ServerHandle) -> None:
    from structured_schemas import REGEXES

    requests = [dict(messages=[{"role": "user", "content": prompt}], max_tokens=40, temperature=0,
                     extra_body={"regex": pattern}) for _, prompt, pattern in REGEXES]
    for (name, _, pattern), reply in zip(REGEXES, _gather(server, requests)):
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and re.fullmatch(pattern, choice.message.content), (name, choice)


@needs_grammar
def test_json_object_reply_is_an_object(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, response_format={"type": "json_object"},
                                           max_tokens=60, temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


@needs_grammar
def test_required_always_yields_valid_calls(server: ServerHandle) -> None:
    prompts = ["What is the weather in Paris?", "Add 2 and 3.", "Hello!"]
    cases = [(p, parallel, 0.0) for p in prompts for parallel in (True, False)]
    cases += [("Is it raining in Tokyo, in fahrenheit?", True, 1.0), ("Add 40 and 2.", False, 1.0)]
    requests = [dict(messages=[{"role": "user", "content": p}], tools=TOOLS, tool_choice="required",
                     parallel_tool_calls=parallel, max_tokens=120, temperature=temperature, seed=1)
                for p, parallel, temperature in cases]
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    for request, reply in zip(requests, _gather(server, requests)):
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls", (request, choice)
        calls = choice.message.tool_calls
        assert 1 <= len(calls) <= (4 if request["parallel_tool_calls"] else 1)  # tools.max_forced_calls
        for call in calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
        assert choice.message.content is None


@needs_grammar
def test_named_function_is_called_and_streaming_agrees(client: openai.OpenAI) -> None:
    request = dict(messages=[{"role": "user", "content": "What is 7 plus 5?"}], tools=TOOLS,
                   tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=60, temperature=0)
    full = client.chat.completions.create(model=MODEL, **request)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "add"
    jsonschema.validate(json.loads(call.function.arguments), ADD["function"]["parameters"])
    streamed, finish = _streamed(client, **request)
    assert finish == "tool_calls" and streamed["content"] == ""
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [("add", call.function.arguments)]


@needs_grammar
def test_auto_parses_a_call_the_model_writes_in_the_parser_format(client: openai.OpenAI) -> None:
    # The regex makes SmolLM2 write a llama3_json call; the default parser must read it back, streamed or not.
    request = dict(messages=ASK_WEATHER, tools=TOOLS, max_tokens=40, temperature=0,
                   extra_body={"regex": r'\{"name": "get_weather", "parameters": \{"city": "[A-Z][a-z]{1,12}", '
                                        r'"unit": "(celsius|fahrenheit)"\}\}'})
    full = client.chat.completions.create(model=MODEL, **request)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    streamed, finish = _streamed(client, **request)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"]] == [("get_weather", call.function.arguments)]


@needs_grammar
def test_response_format_streaming_equals_non_streaming(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer", "minimum": 0, "maximum": 10**8}},
              "required": ["city", "population"], "additionalProperties": False}
    request = dict(messages=[{"role": "user", "content": "The largest city of France, as JSON."}], max_tokens=60,
                   temperature=0,
                   response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    full = client.chat.completions.create(model=MODEL, **request)
    streamed, finish = _streamed(client, **request)
    assert streamed["content"] == full.choices[0].message.content and finish == full.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(streamed["content"]), schema)


@needs_grammar
def test_completions_response_format_json_object(client: openai.OpenAI) -> None:
    reply = client.completions.create(model=MODEL, prompt="A JSON object describing a cat: ", max_tokens=60,
                                      temperature=0, extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(reply.choices[0].text), dict)


@needs_grammar
def test_completions_regex_extra_fullmatches(client: openai.OpenAI) -> None:
    pattern = r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d)"
    reply = client.completions.create(model=MODEL, prompt="Today's date is ", max_tokens=20, temperature=0,
                                      extra_body={"regex": pattern})
    assert reply.choices[0].finish_reason == "stop"
    assert re.fullmatch(pattern, reply.choices[0].text)


@needs_grammar
def test_reasoning_is_split_from_content_streamed_and_not(client: openai.OpenAI) -> None:
    # The regex makes SmolLM2 think in <think> tags; think_tags must move that text to reasoning_content.
    request = dict(messages=[{"role": "user", "content": "Is Paris in France? Think first."}], max_tokens=40,
                   temperature=0, extra_body={"regex": r"<think>[a-z][a-z ]{4,40}</think>(Yes|No)\."})
    full = client.chat.completions.create(model=MODEL, **request)
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "stop"
    assert re.fullmatch(r"[a-z][a-z ]{4,40}", message.reasoning_content) and message.content in ("Yes.", "No.")
    streamed, finish = _streamed(client, **request)
    assert finish == "stop"
    assert streamed == {"content": message.content, "reasoning_content": message.reasoning_content, "tool_calls": []}
