"""``check_tool_parser`` / ``check_reasoning_parser``: do parser plugins read back what their format writes?"""

from __future__ import annotations

import json
from typing import Any, Callable

from treadle.text.reasoning_parser import ReasoningParser
from treadle.text.tool_parser import ToolCall, ToolParser

# Arguments chosen to trip naive scanners: braces and quotes inside strings, nesting, unicode, numbers.
_CALL_SETS: list[list[ToolCall]] = [
    [ToolCall("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    [ToolCall("noop", "{}")],
    [ToolCall("open", '{"path": "C:\\\\dir\\\\", "quote": "say \\"hi\\"", "empty": ""}')],
    [ToolCall("search", '{"query": "a } tricky \\" {string", "filters": {"tags": ["x", "y"], "limit": 5}}'),
     ToolCall("add", '{"a": -1.5e3, "b": true, "c": null, "d": "caf\\u00e9 東京"}')],
]
_PLAIN_TEXTS = ["The capital of France is Paris.", "", "Use braces } like { this"]
_TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def check_tool_parser(factory: Callable[[], ToolParser]) -> None:
    """Assert that ``factory()`` builds a conforming :class:`ToolParser`.

    - ``parse(render_calls(calls))`` gives back the same names and argument values, and no content;
    - streaming that text — split into single characters, into pairs, and in one piece — gives
      deltas in the OpenAI order (a header with id and name first, then argument fragments)
      whose concatenation equals the parsed calls' arguments exactly;
    - plain text without calls is all content, streamed or not;
    - ``tools_prompt(tools)`` mentions every tool's name.

    Raises AssertionError naming the broken rule.
    """
    name = getattr(factory, "__name__", repr(factory))
    parser = factory()
    _expect(isinstance(parser, ToolParser), f"{name}() built a {type(parser).__name__}, not a ToolParser")
    for calls in _CALL_SETS:
        text = parser.render_calls(calls)
        parsed = parser.parse(text)
        _expect([c.name for c in parsed.calls] == [c.name for c in calls],
                f"{name}: parse(render_calls(...)) found calls {[c.name for c in parsed.calls]} in {text!r}, "
                f"expected {[c.name for c in calls]}")
        for got, want in zip(parsed.calls, calls):
            _expect(_loads(got.arguments) == json.loads(want.arguments),
                    f"{name}: arguments {got.arguments!r} parsed from {text!r} differ from {want.arguments!r}")
        _expect(not parsed.content.strip(), f"{name}: parsing {text!r} left content {parsed.content!r}")
        for size in (1, 2, len(text)):
            content, streamed = _stream(parser, text, size)
            _expect(streamed == [(c.name, c.arguments) for c in parsed.calls],
                    f"{name}: streaming {text!r} in pieces of {size} gave calls {streamed}, "
                    f"but parse gave {[(c.name, c.arguments) for c in parsed.calls]}")
            _expect(content == parsed.content,
                    f"{name}: streaming {text!r} in pieces of {size} gave content {content!r}, "
                    f"parse {parsed.content!r}")
    for text in _PLAIN_TEXTS:
        parsed = parser.parse(text)
        _expect(parsed.calls == [] and parsed.content == text,
                f"{name}: plain text {text!r} parsed as content {parsed.content!r} with {len(parsed.calls)} calls")
        content, streamed = _stream(parser, text, 1)
        _expect(content == text and streamed == [],
                f"{name}: streaming plain text {text!r} gave content {content!r} and calls {streamed}")
    prompt = parser.tools_prompt(_TOOLS)
    _expect("get_weather" in prompt, f"{name}: tools_prompt does not mention the tool 'get_weather': {prompt!r}")


def _stream(parser: ToolParser, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    streamer = parser.streamer()
    content = ""
    calls: list[list[str]] = []
    pieces = [text[i:i + size] for i in range(0, len(text), size)] if text else []
    outputs = [streamer.feed(piece) for piece in pieces] + [streamer.finish()]
    for text_delta, deltas in outputs:
        content += text_delta
        for delta in deltas:
            if delta.id is not None:
                _expect(delta.index == len(calls) and delta.name,
                        f"streamer: header for call {delta.index} out of order or without a name ({delta})")
                calls.append([delta.name, delta.arguments])
            else:
                _expect(delta.index < len(calls), f"streamer: arguments for call {delta.index} before its header")
                calls[delta.index][1] += delta.arguments
    return content, [(n, a) for n, a in calls]


_REASONING_CASES = [
    # (prompt, completion, reasoning, content)
    ("", "<think>Paris is in France.</think>The capital is Paris.", "Paris is in France.", "The capital is Paris."),
    ("", "<think>\nstep 1 < step 2\n</think>\n\nAnswer: 4", "step 1 < step 2\n", "Answer: 4"),
    ("<|im_start|>assistant\n<think>\n", "opened by the template</think>done", "opened by the template", "done"),
    ("", "No reasoning here.", "", "No reasoning here."),
    ("", "<think>cut off while thinking", "cut off while thinking", ""),
]


def check_reasoning_parser(factory: Callable[[], ReasoningParser],
                           cases: list[tuple[str, str, str, str]] | None = None) -> None:
    """Assert that ``factory()`` builds a :class:`ReasoningParser` that splits the cases right.

    ``cases`` are (prompt, completion, reasoning, content); the default ones are in the
    ``<think>...</think>`` format. Each completion is parsed whole and streamed in
    pieces of 1, 2 and 3 characters; all must give the expected split.
    """
    name = getattr(factory, "__name__", repr(factory))
    parser = factory()
    _expect(isinstance(parser, ReasoningParser), f"{name}() built a {type(parser).__name__}, not a ReasoningParser")
    for prompt, text, reasoning, content in cases or _REASONING_CASES:
        got = parser.parse(text, prompt)
        _expect(got == (reasoning, content),
                f"{name}: parse({text!r}) after prompt {prompt[-20:]!r} gave {got}, expected {(reasoning, content)}")
        for size in (1, 2, 3):
            streamer = parser.streamer(prompt)
            parts = [streamer.feed(text[i:i + size]) for i in range(0, len(text), size)] + [streamer.finish()]
            streamed = ("".join(r for r, _ in parts), "".join(c for _, c in parts))
            _expect(streamed == (reasoning, content),
                    f"{name}: streaming {text!r} in pieces of {size} gave {streamed}, expected {(reasoning, content)}")


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return AssertionError  # a sentinel no expected value equals


def _expect(ok: Any, message: str) -> None:
    if not ok:
        raise AssertionError(message)
