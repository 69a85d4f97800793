"""Tool-call and reasoning parsers: formats, streaming deltas, defaults by model family, registry rules."""

from __future__ import annotations

import json

import jsonschema
import pytest

from treadle.core.config import ConfigError, load_config, validate_plugin_choices
from treadle.text.forced_tools import ForcedCallFormat, forced_call_schema
from treadle.core.hookspecs import hookimpl
from treadle.core.registry import PluginError, build_registry
from treadle.text.tool_parser import ToolCall, ToolParser, default_tool_parser
from treadle.testing import check_reasoning_parser, check_tool_parser


@pytest.fixture(scope="module")
def registry():
    return build_registry()


@pytest.mark.parametrize("name", ["llama3_json", "mistral", "hermes"])
def test_builtin_tool_parsers_conform(registry, name):
    check_tool_parser(registry.get("tool_parsers", name))


def test_forced_call_format_conforms():
    check_tool_parser(ForcedCallFormat)


def test_think_tags_conforms(registry):
    check_reasoning_parser(registry.get("reasoning_parsers", "think_tags"))


def test_conformance_check_catches_a_parser_that_loses_arguments():
    class Lossy(ToolParser):
        def snapshot(self, text, final):
            snap = ForcedCallFormat().snapshot(text, final)
            if snap is not None:
                for call in snap.calls:
                    call.arguments = call.arguments[:1]
            return snap

        def render_calls(self, calls):
            return ForcedCallFormat().render_calls(calls)

        def tools_prompt(self, tools):
            return str(tools)

    with pytest.raises(AssertionError, match="Lossy"):
        check_tool_parser(Lossy)


def test_llama3_json_reads_python_tag_and_semicolon_separated_calls(registry):
    parser = registry.get("tool_parsers", "llama3_json")()
    parsed = parser.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}')
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("a", {"x": 1}), ("b", {})]
    assert parser.parse('{"answer": 42}').calls == []  # JSON that is not a call stays content
    assert parser.parse('{"answer": 42}').content == '{"answer": 42}'
    assert parser.parse('{"name": "a", "parameters": {"x": 1').calls == []  # cut off


def test_mistral_keeps_content_before_the_marker(registry):
    parser = registry.get("tool_parsers", "mistral")()
    parsed = parser.parse('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]')
    assert parsed.content == "Let me check. "
    assert [(c.name, c.arguments) for c in parsed.calls] == [("get_weather", '{"city": "Paris"}')]


def test_mistral_call_ids_suit_its_chat_template(registry):
    parser = registry.get("tool_parsers", "mistral")()
    [call] = parser.parse('[TOOL_CALLS] [{"name": "f", "arguments": {}}]').calls
    assert len(call.id) == 9 and call.id.isalnum()
    _, [header] = parser.streamer().feed('[TOOL_CALLS] [{"name": "f"')
    assert len(header.id) == 9 and header.id.isalnum()
    [forced] = ForcedCallFormat(ids_from=parser).parse('{"name": "f", "arguments": {}}').calls
    assert len(forced.id) == 9


def test_hermes_reads_several_blocks_between_content(registry):
    parser = registry.get("tool_parsers", "hermes")()
    text = ('Checking both.\n<tool_call>\n{"name": "a", "arguments": {"q": "</tool_call>"}}\n</tool_call>\n'
            '<tool_call>{"arguments": {}, "name": "b"}</tool_call>')
    parsed = parser.parse(text)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == [("a", {"q": "</tool_call>"}), ("b", {})]
    assert parsed.content == "Checking both.\n\n"
    assert parser.parse("<tool_call>{not json}</tool_call>").calls == []


def test_streaming_deltas_follow_the_openai_order(registry):
    streamer = registry.get("tool_parsers", "hermes")().streamer()
    text = 'Hi <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    outputs = [streamer.feed(text[i:i + 4]) for i in range(0, len(text), 4)] + [streamer.finish()]
    content = "".join(c for c, _ in outputs)
    deltas = [d for _, ds in outputs for d in ds]
    assert content == "Hi "
    assert deltas[0].id.startswith("call_") and deltas[0].name == "get_weather" and deltas[0].index == 0
    assert all(d.id is None and d.name is None for d in deltas[1:])
    assert len(deltas) > 2  # the arguments arrive in several fragments
    assert deltas[0].arguments + "".join(d.arguments for d in deltas[1:]) == '{"city": "Paris"}'
    assert deltas[1].to_openai() == {"index": 0, "function": {"arguments": deltas[1].arguments}}
    assert deltas[0].to_openai()["type"] == "function"


def test_streamer_max_calls_drops_later_calls(registry):
    streamer = registry.get("tool_parsers", "llama3_json")().streamer()
    streamer.max_calls = 1
    _, deltas = streamer.feed('{"name": "a", "parameters": {}}; {"name": "b", "parameters": {}}')
    assert {d.index for d in deltas} == {0} and streamer.calls_made == 1


@pytest.mark.parametrize("architecture, parser", [
    ("LlamaForCausalLM", "llama3_json"), ("MistralForCausalLM", "mistral"), ("MixtralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "hermes"), ("Qwen3MoeForCausalLM", "hermes"), ("GPT2LMHeadModel", "llama3_json"),
    (None, "llama3_json"),
])
def test_default_parser_follows_the_model_family(registry, architecture, parser):
    assert default_tool_parser(registry, architecture) == parser


def test_forced_schema_accepts_exactly_calls_of_the_given_tools():
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}},
        {"type": "function", "function": {"name": "ping"}}]
    one = forced_call_schema(tools, None, parallel=False)
    jsonschema.validate({"name": "add", "arguments": {"a": 1}}, one)
    jsonschema.validate({"name": "ping", "arguments": {}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {}}, one)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "other", "arguments": {}}, one)
    named = forced_call_schema(tools, "ping", parallel=True)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "add", "arguments": {"a": 1}}, named)
    many = forced_call_schema(tools, None, parallel=True)
    jsonschema.validate([{"name": "ping", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}], many)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], many)
    with pytest.raises(jsonschema.ValidationError):  # tools.max_forced_calls bounds the array
        jsonschema.validate([{"name": "ping", "arguments": {}}] * 5, many)
    parsed = ForcedCallFormat().parse('[{"name": "ping", "arguments": {}}, {"name": "add", "arguments": {"a": 2}}]')
    assert [c.name for c in parsed.calls] == ["ping", "add"]


def test_duplicate_and_unknown_tool_parser_names_are_errors(registry):
    class Clash:
        __name__ = "clashing-parsers"

        @hookimpl
        def treadle_register_tool_parsers(self, register):
            register("hermes", object)

    with pytest.raises(PluginError, match=r"duplicate tool parser 'hermes': registered by both"):
        build_registry(extra_plugins=[Clash()])
    with pytest.raises(PluginError,
                       match=r"unknown reasoning parser 'thinking'; available: think_tags \(from treadle\)"):
        registry.get("reasoning_parsers", "thinking")


def test_config_names_of_parsers_are_checked(registry):
    validate_plugin_choices(load_config(overrides={"tools.parser": "none", "reasoning.parser": "think_tags"},
                                        use_env=False), registry)
    with pytest.raises(ConfigError, match=r"tools.parser: unknown tool parser 'qwen'; available: hermes"):
        validate_plugin_choices(load_config(overrides={"tools.parser": "qwen"}, use_env=False), registry)
    with pytest.raises(ConfigError, match=r"reasoning.parser: unknown reasoning parser"):
        validate_plugin_choices(load_config(overrides={"reasoning.parser": "r1"}, use_env=False), registry)


def test_tool_call_to_openai_shape():
    call = ToolCall("f", '{"x": 1}')
    assert call.to_openai() == {"id": call.id, "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}


def test_conformance_check_catches_a_reasoning_parser_that_ignores_the_prompt(registry):
    from treadle.text.reasoning_parser import ReasoningParser

    think_tags = registry.get("reasoning_parsers", "think_tags")()

    class PromptBlind(ReasoningParser):
        def streamer(self, prompt):
            return think_tags.streamer("")  # misses blocks the template opened

    with pytest.raises(AssertionError, match="PromptBlind: parse"):
        check_reasoning_parser(PromptBlind)
