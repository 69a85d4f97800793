"""What a chat completion adds to plain generation: response_format, tools, tool_choice, reasoning.

:func:`plan_chat` checks those fields (bad ones are 400s), decides how the prompt
shows the tools and which constraint the grammar enforces; a :class:`ChoiceReader`
then turns each choice's text into ``reasoning_content``, ``content`` and
``tool_calls`` — streamed as OpenAI deltas, or whole.

Tool-call modes: ``auto`` reads free text with the configured parser (``tools.parser``);
``required`` and a named function are enforced by a JSON-schema grammar over
treadle's own call format (:mod:`treadle.text.forced_tools`), so any model makes a valid call.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from treadle.core.config import ServerConfig
from treadle.text.forced_tools import ForcedCallFormat, forced_call_schema
from treadle.text.reasoning_parser import ReasoningParser, ReasoningStreamer
from treadle.core.registry import Registry, build_registry
from treadle.text.tool_parser import ToolCall, ToolCallStreamer, ToolParser, default_tool_parser
from treadle.server.protocol import ChatCompletionRequest, ChatMessage, _SamplingFields
from treadle.server.tokenizer_manager import RequestError


# The plugin kinds an HTTP worker reads; its registry imports no other built-in plugin (they would bring torch).
CHAT_PLUGIN_KINDS = ("tool_parsers", "reasoning_parsers")


class ChatParsers:
    """The server's tool and reasoning parsers, picked once from the config and the model's architecture."""

    def __init__(self, config: ServerConfig, architecture: str | None, registry: Registry | None = None) -> None:
        registry = registry if registry is not None else build_registry(config.plugins, kinds=CHAT_PLUGIN_KINDS)
        name: str | None = config.tools.parser
        if name == "auto":
            name = default_tool_parser(registry, architecture)
        elif name == "none":
            name = None
        self.tool_parser_name = name
        self.max_forced_calls = config.tools.max_forced_calls
        self.tool_parser: ToolParser | None = registry.get("tool_parsers", name)() if name else None
        reasoning = config.reasoning.parser
        self.reasoning_parser: ReasoningParser | None = (
            registry.get("reasoning_parsers", reasoning)() if reasoning != "none" else None)


@dataclass
class ChatPlan:
    """How one chat request is prompted, constrained and read back."""

    tools: list[dict[str, Any]] = field(default_factory=list)
    call_format: ToolParser | None = None  # reads the calls: the configured parser (auto) or the forced format
    forced: bool = False
    max_calls: int | None = None
    history_format: ToolParser = field(default_factory=ForcedCallFormat)
    reasoning: ReasoningParser | None = None
    constraint: dict[str, str] = field(default_factory=dict)  # SamplingParams fields: json_schema / regex / ebnf

    @property
    def reads_calls(self) -> bool:
        return self.call_format is not None


def plan_chat(body: ChatCompletionRequest, parsers: ChatParsers) -> ChatPlan:
    """Check response_format/tools/tool_choice and decide prompt, constraint and parsing; RequestError on bad input."""
    plan = ChatPlan(reasoning=parsers.reasoning_parser, history_format=parsers.tool_parser or ForcedCallFormat(),
                    constraint=constraint_fields(body))

    tools = _check_tools(body)
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice != "none" and not tools:
        raise RequestError(f"tool_choice {_choice_label(choice)} needs `tools`; send the functions the model may call",
                           param="tool_choice")
    if choice == "none":
        return plan
    plan.tools = tools
    plan.max_calls = None if body.parallel_tool_calls else 1
    if choice == "auto":
        if parsers.tool_parser is None:
            raise RequestError(
                "`tools` with tool_choice 'auto' need a tool parser, but this server has tools.parser: none; "
                "start it with a tools.parser (see `treadle plugins`) or send tool_choice 'required' or a named "
                "function",
                param="tools")
        plan.call_format = parsers.tool_parser
        return plan
    name = None if choice == "required" else choice.function.name  # type: ignore[union-attr]
    names = [t["function"]["name"] for t in tools]
    if name is not None and name not in names:
        raise RequestError(f"tool_choice names the function '{name}', which is not in `tools` ({', '.join(names)})",
                           param="tool_choice")
    if plan.constraint:
        raise RequestError(f"tool_choice {_choice_label(choice)} constrains the output to a tool call; "
                           f"it cannot be combined with {', '.join(sorted(plan.constraint))}", param="tool_choice")
    parallel = body.parallel_tool_calls and name is None
    plan.constraint["json_schema"] = json.dumps(forced_call_schema(tools, name, parallel, parsers.max_forced_calls))
    plan.call_format = ForcedCallFormat(ids_from=parsers.tool_parser)
    plan.forced = True
    return plan


def _choice_label(choice: Any) -> str:
    return f"'{choice}'" if isinstance(choice, str) else f"naming '{choice.function.name}'"


def constraint_fields(body: _SamplingFields) -> dict[str, str]:
    """The SamplingParams constraint a request asks for (response_format, regex or ebnf); 400 for more than one."""
    constraint = {}
    if body.regex is not None:
        constraint["regex"] = body.regex
    if body.ebnf is not None:
        constraint["ebnf"] = body.ebnf
    schema = _response_format_schema(body)
    if schema is not None:
        constraint["json_schema"] = schema
    if len(constraint) > 1:
        raise RequestError(f"send at most one of response_format (json), regex and ebnf; got "
                           f"{', '.join(sorted(constraint))}", param="response_format")
    return constraint


def _response_format_schema(body: _SamplingFields) -> str | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return json.dumps({"type": "object"})
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise RequestError("response_format of type 'json_schema' needs `json_schema.schema`, the JSON schema the "
                           "reply must follow", param="response_format.json_schema.schema")
    schema = fmt.json_schema.schema_
    _check_schema(schema, "response_format.json_schema.schema")
    return json.dumps(schema)


def _check_schema(schema: Any, param: str) -> None:
    """A schema that is not a valid JSON schema is a 400 (checked with `jsonschema` when it is installed)."""
    try:
        from jsonschema import SchemaError, validators
    except ImportError:  # the grammar backend's compiler still rejects it
        return
    try:
        validators.validator_for(schema).check_schema(schema)
    except SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise RequestError(f"{param} is not a valid JSON schema: {exc.message}" + (f" (at {where})" if where else ""),
                           param=param) from None


def _check_tools(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    tools = []
    seen: set[str] = set()
    for i, tool in enumerate(body.tools or []):
        function = tool.function
        if function.name in seen:
            raise RequestError(f"two tools are named '{function.name}'; function names must be unique",
                               param=f"tools.{i}.function.name")
        seen.add(function.name)
        if function.parameters is not None:
            if function.parameters.get("type", "object") != "object":
                raise RequestError(f"tools.{i}.function.parameters must be a JSON schema of type 'object' "
                                   f"(the arguments object), got type {function.parameters.get('type')!r}",
                                   param=f"tools.{i}.function.parameters")
            _check_schema(function.parameters, f"tools.{i}.function.parameters")
        tools.append(tool.model_dump(exclude_none=True))
    return tools


# ---------------------------------------------------------------- prompt


def template_messages(messages: list[ChatMessage], plan: ChatPlan, knows_tools: bool,
                      image_placeholder: str = "", video_placeholder: str = "") -> list[dict[str, Any]]:
    """The conversation as the chat template takes it.

    Templates that know tools get ``tool_calls`` and ``tool`` messages as they are. For the
    others (fallback): earlier calls are written into the assistant's text in the parser's
    format, tool results become user messages, and the tools with the call format go into
    the system message.
    """
    out: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": m.role, "content": m.text(image_placeholder, video_placeholder)}
        if m.tool_calls:
            if knows_tools:
                message["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.function.name,
                                                                  "arguments": _arguments_value(c.function.arguments)}}
                    for c in m.tool_calls]
            else:
                calls = plan.history_format.render_calls(
                    [ToolCall(c.function.name, c.function.arguments) for c in m.tool_calls])
                message["content"] = f"{message['content']}\n{calls}" if message["content"] else calls
        if m.role == "tool":
            if knows_tools:
                if m.tool_call_id:
                    message["tool_call_id"] = m.tool_call_id
                if m.name:
                    message["name"] = m.name
            else:
                source = m.name or m.tool_call_id or "the tool call"
                message = {"role": "user", "content": f"Result of {source}:\n{message['content']}"}
        out.append(message)
    if plan.tools and not knows_tools:
        prompt = plan.call_format.tools_prompt(plan.tools) if plan.call_format else ""
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out


def _arguments_value(arguments: str) -> Any:
    # HF chat templates expect the arguments as an object; keep the text if it is not JSON.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


# ---------------------------------------------------------------- reading the reply


class ChoiceReader:
    """Reads one choice's text deltas into OpenAI delta fields: reasoning_content, content, tool_calls."""

    def __init__(self, plan: ChatPlan, prompt: str) -> None:
        self.plan = plan
        self.reasoning: ReasoningStreamer | None = plan.reasoning.streamer(prompt) if plan.reasoning else None
        self.calls: ToolCallStreamer | None = (
            ToolCallStreamer(plan.call_format, plan.max_calls) if plan.call_format else None)

    @property
    def calls_made(self) -> int:
        return self.calls.calls_made if self.calls else 0

    def feed(self, text: str) -> dict[str, Any]:
        reasoning, content = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._delta(reasoning, content, final=False)

    def finish(self) -> dict[str, Any]:
        reasoning, content = self.reasoning.finish() if self.reasoning else ("", "")
        return self._delta(reasoning, content, final=True)

    def _delta(self, reasoning: str, content: str, final: bool) -> dict[str, Any]:
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        calls = []
        if self.calls is not None:
            content, calls = self.calls.feed(content) if not final else _concat(self.calls.feed(content),
                                                                                 self.calls.finish())
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [c.to_openai() for c in calls]
        return delta


def _concat(a: tuple[str, list], b: tuple[str, list]) -> tuple[str, list]:
    return a[0] + b[0], a[1] + b[1]


def chat_message(plan: ChatPlan, prompt: str, text: str) -> dict[str, Any]:
    """The non-streaming ``message`` of a choice whose whole text is ``text``."""
    message: dict[str, Any] = {"role": "assistant"}
    content = text
    if plan.reasoning is not None:
        reasoning, content = plan.reasoning.parse(text, prompt)
        message["reasoning_content"] = reasoning or None
    calls = []
    if plan.call_format is not None:
        parsed = plan.call_format.parse(content)
        calls = parsed.calls[: plan.max_calls] if plan.max_calls is not None else parsed.calls
        if calls:
            content = parsed.content
    message["content"] = content if content or not calls else None
    if calls:
        message["tool_calls"] = [c.to_openai() for c in calls]
    return message
