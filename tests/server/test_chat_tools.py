"""The chat-completion planning of response_format / tools / tool_choice, without a server."""

from __future__ import annotations

import json

import pytest

from treadle.core.config import ServerConfig
from treadle.server.chat_tools import ChatParsers, ChoiceReader, chat_message, plan_chat, template_messages
from treadle.server.protocol import ChatCompletionRequest
from treadle.server.tokenizer_manager import RequestError

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
USER = [{"role": "user", "content": "Weather in Paris?"}]


def _parsers(**config) -> ChatParsers:
    return ChatParsers(ServerConfig(**config), "LlamaForCausalLM")


def _plan(parsers=None, **fields):
    return plan_chat(ChatCompletionRequest(messages=USER, **fields), parsers or _parsers())


def test_response_format_maps_to_a_json_schema_constraint():
    assert _plan().constraint == {}
    assert _plan(response_format={"type": "text"}).constraint == {}
    assert json.loads(_plan(response_format={"type": "json_object"}).constraint["json_schema"]) == {"type": "object"}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    plan = _plan(response_format={"type": "json_schema",
                                  "json_schema": {"name": "x", "schema": schema, "strict": True}})
    assert json.loads(plan.constraint["json_schema"]) == schema


@pytest.mark.parametrize("fields, param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_object"}, "regex": "a+"}, "response_format"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": 3}}}]},
     "tools.0.function.parameters"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
])
def test_bad_fields_are_400s_naming_the_param(fields, param):
    with pytest.raises(RequestError) as info:
        _plan(**fields)
    assert info.value.status_code == 400 and info.value.param == param


def test_auto_needs_a_parser_but_forced_calls_do_not():
    off = _parsers(tools={"parser": "none"})
    with pytest.raises(RequestError, match="tools.parser: none"):
        _plan(off, tools=[WEATHER])
    assert _plan(off, tools=[WEATHER], tool_choice="required").forced


def test_tool_choice_modes():
    assert _plan(tools=[WEATHER], tool_choice="none").call_format is None
    auto = _plan(tools=[WEATHER])
    assert not auto.forced and type(auto.call_format).__name__ == "Llama3JsonToolParser"
    assert "json_schema" not in auto.constraint
    required = _plan(tools=[WEATHER], tool_choice="required")
    assert json.loads(required.constraint["json_schema"])["type"] == "array"  # parallel calls allowed
    single = _plan(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    assert json.loads(single.constraint["json_schema"])["type"] == "object" and single.max_calls == 1
    named = _plan(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.constraint["json_schema"])["properties"]["name"]["enum"] == ["get_weather"]


def test_fallback_prompt_lists_tools_and_rewrites_history():
    plan = _plan(tools=[WEATHER])
    body = ChatCompletionRequest(messages=[
        {"role": "system", "content": "Be brief."}, *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}])
    fallback = template_messages(body.messages, plan, knows_tools=False)
    assert fallback[0]["role"] == "system" and fallback[0]["content"].startswith("Be brief.\n\n")
    assert "get_weather" in fallback[0]["content"]
    assert fallback[2]["content"] == '{"name": "get_weather", "parameters": {"city": "Paris"}}'
    assert fallback[3] == {"role": "user", "content": "Result of call_1:\n22 C"}
    native = template_messages(body.messages, plan, knows_tools=True)
    assert native[0]["content"] == "Be brief."
    assert native[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert native[3]["tool_call_id"] == "call_1"


def test_reader_splits_reasoning_content_and_calls_streamed_and_whole():
    parsers = ChatParsers(ServerConfig(reasoning={"parser": "think_tags"}), "Qwen2ForCausalLM")
    plan = plan_chat(ChatCompletionRequest(messages=USER, tools=[WEATHER]), parsers)
    text = ('<think>Need the weather.</think>Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
            "</tool_call>")
    message = chat_message(plan, "", text)
    assert message["reasoning_content"] == "Need the weather."
    assert message["content"] == "Sure. "
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    reader = ChoiceReader(plan, "")
    deltas = [reader.feed(text[i:i + 3]) for i in range(0, len(text), 3)] + [reader.finish()]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == message["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == message["content"]
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"].startswith("call_")
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Paris"}'
    assert reader.calls_made == 1


def test_templates_that_render_tools_get_them_and_others_get_the_fallback(tmp_path):
    from transformers import AutoTokenizer

    from treadle.server.tokenizer_manager import TokenizerManager
    from treadle.testing.tokenizer import CHAT_TEMPLATE, make_tiny_tokenizer

    make_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    manager = TokenizerManager.__new__(TokenizerManager)  # only the template side, no sockets
    manager.tokenizer, manager._template_knows_tools = tokenizer, None
    assert not manager.template_knows_tools()
    plan = _plan(tools=[WEATHER])
    body = ChatCompletionRequest(messages=USER)
    fallback = manager.render_chat(template_messages(body.messages, plan, knows_tools=False))
    assert "get_weather" in fallback and fallback.startswith("<s><|system|>You can call these functions")

    tokenizer.chat_template = "{% if tools %}<tools>{{ tools | tojson }}</tools>{% endif %}" + CHAT_TEMPLATE
    manager._template_knows_tools = None
    assert manager.template_knows_tools()
    native = manager.render_chat(template_messages(body.messages, plan, knows_tools=True), plan.tools)
    assert native.startswith('<tools>[{"type": "function", "function": {"name": "get_weather"')
    assert "You can call" not in native
