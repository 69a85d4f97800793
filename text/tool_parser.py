"""Tool calls in model text: the ``tool_parsers`` plugin interface and the streaming diff every parser shares.

A tool parser knows one model family's call format (``{"name": ..., "parameters": ...}``,
``[TOOL_CALLS] [...]``, ``<tool_call>...</tool_call>``). It writes one function,
:meth:`ToolParser.snapshot`: what the text seen so far says — the plain content that is
certain, and the calls with their name (once complete) and the raw text of their
arguments so far. Non-streaming parsing is the final snapshot; streaming
(:class:`ToolCallStreamer`) diffs consecutive snapshots into OpenAI deltas, so the
two cannot disagree as long as snapshots only grow.

Calls forced by a grammar (``tool_choice`` ``required`` or a named function) use a
format of treadle's own, independent of the model family: see :mod:`treadle.text.forced_tools`.
"""

from __future__ import annotations

import json
import re
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class ToolCall:
    """A complete call: the function's name and its arguments as JSON text (OpenAI's ``arguments``)."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_call_id())

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class PartialCall:
    """A call as far as the text goes: ``name`` once its string is complete, the arguments' raw text so far."""

    name: str | None
    arguments: str = ""
    complete: bool = False


@dataclass
class Snapshot:
    """What a parser reads in the text so far: certain content and the calls begun."""

    content: str
    calls: list[PartialCall] = field(default_factory=list)


@dataclass
class ToolCallDelta:
    """One streamed piece of call ``index``: the header (id and name) first, then argument fragments."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = "function"
            out["function"] = {"name": self.name, "arguments": self.arguments}
        else:
            out["function"] = {"arguments": self.arguments}
        return out


@dataclass
class ParsedCalls:
    """The result of parsing a whole completion: leftover content and the calls."""

    content: str
    calls: list[ToolCall]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class ToolParser(ABC):
    """Reads (and writes) one model family's tool-call format.

    Subclasses set ``model_families`` (lower-case HF ``model_type``-like prefixes of the
    architecture name, e.g. ``("qwen",)`` for ``Qwen2ForCausalLM``) to be the default for those models,
    and implement :meth:`snapshot`, :meth:`render_calls` and :meth:`tools_prompt`.
    """

    model_families: ClassVar[tuple[str, ...]] = ()
    # Set when the format uses special tokens (e.g. ``[TOOL_CALLS]``) that detokenization would otherwise drop.
    needs_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def snapshot(self, text: str, final: bool) -> Snapshot | None:
        """Content and calls in ``text`` (the completion so far).

        With ``final=False`` the text may stop anywhere; hold back content that
        could still turn into a call (e.g. a partial start marker) and only
        report a call's name once its string is complete. Each snapshot must
        extend the previous one (content and arguments only grow). With
        ``final=True`` return None when the text holds malformed calls: the
        whole text is then plain content.
        """

    @abstractmethod
    def render_calls(self, calls: list[ToolCall]) -> str:
        """The text the model would write to make ``calls`` (the parser's format; round-trips via parse)."""

    @abstractmethod
    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        """System-prompt text that lists ``tools`` and shows the call format, for chat templates that know no tools."""

    def new_call_id(self) -> str:
        """The id of a call read from the model (``call_`` + 24 hex digits).

        Override it where the family's chat template checks ids it gets back in the history.
        """
        return new_call_id()

    def parse(self, text: str) -> ParsedCalls:
        """Calls in a whole completion; malformed calls leave everything as content."""
        snap = self.snapshot(text, final=True)
        if snap is None or any(c.name is None or not c.complete for c in snap.calls):
            return ParsedCalls(text, [])
        return ParsedCalls(snap.content, [ToolCall(c.name or "", c.arguments or "{}", self.new_call_id())
                                          for c in snap.calls])

    def streamer(self) -> "ToolCallStreamer":
        return ToolCallStreamer(self)


class ToolCallStreamer:
    """Turns text deltas into content deltas and OpenAI tool-call deltas by diffing snapshots."""

    def __init__(self, parser: ToolParser, max_calls: int | None = None) -> None:
        self.parser = parser
        self.max_calls = max_calls
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []
        self.sent_args: list[int] = []

    @property
    def calls_made(self) -> int:
        return len(self.ids)

    def feed(self, delta: str) -> tuple[str, list[ToolCallDelta]]:
        self.text += delta
        return self._diff(self.parser.snapshot(self.text, final=False))

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The rest, once the completion ended: malformed calls not yet streamed flush as content."""
        snap = self.parser.snapshot(self.text, final=True)
        if snap is None:
            # Nothing can be taken back; what was not streamed as a call goes out as content.
            return (self.text[self.sent_content:] if not self.ids else ""), []
        return self._diff(snap)

    def _diff(self, snap: Snapshot | None) -> tuple[str, list[ToolCallDelta]]:
        if snap is None:
            return "", []
        content = ""
        if len(snap.content) > self.sent_content:
            content = snap.content[self.sent_content:]
            self.sent_content = len(snap.content)
        deltas: list[ToolCallDelta] = []
        calls = snap.calls if self.max_calls is None else snap.calls[: self.max_calls]
        for index, call in enumerate(calls):
            if call.name is None:
                break  # later calls wait for this one's header so indices stay in order
            if index == len(self.ids):
                self.ids.append(self.parser.new_call_id())
                self.sent_args.append(len(call.arguments))
                deltas.append(ToolCallDelta(index, self.ids[index], call.name, call.arguments))
            elif len(call.arguments) > self.sent_args[index]:
                deltas.append(ToolCallDelta(index, arguments=call.arguments[self.sent_args[index]:]))
                self.sent_args[index] = len(call.arguments)
        return content, deltas


# ---------------------------------------------------------------- helpers for parsers


@dataclass
class ObjectScan:
    """A JSON object read from a position in a text that may stop early.

    ``fields`` maps each top-level key to the (start, end) of its raw value
    (``end`` None while the value is still open); ``end`` is the index after
    the closing brace, or None while the object is open. ``ok`` is False when
    the text cannot be the start of a JSON object.
    """

    fields: dict[str, tuple[int, int | None]]
    end: int | None
    ok: bool = True

    def value(self, text: str, key: str) -> Any:
        """The decoded value of a complete field, or None."""
        span = self.fields.get(key)
        if span is None or span[1] is None:
            return None
        try:
            return json.loads(text[span[0]:span[1]])
        except ValueError:
            return None

    def raw(self, text: str, key: str) -> tuple[str, bool] | None:
        """The raw text of a field's value so far and whether it is complete."""
        span = self.fields.get(key)
        if span is None:
            return None
        start, end = span
        return (text[start:end], True) if end is not None else (text[start:], False)


_WS = " \t\r\n"


def scan_object(text: str, pos: int) -> ObjectScan:
    """Scan the JSON object that starts at ``text[pos] == "{"`` (see :class:`ObjectScan`)."""
    fields: dict[str, tuple[int, int | None]] = {}
    n = len(text)
    if pos >= n or text[pos] != "{":
        return ObjectScan(fields, None, ok=False)
    i = pos + 1
    while True:
        i = _skip_ws(text, i)
        if i >= n:
            return ObjectScan(fields, None)
        if text[i] == "}" and not fields:
            return ObjectScan(fields, i + 1)
        if text[i] != '"':
            return ObjectScan(fields, None, ok=False)
        key_end = _string_end(text, i)
        if key_end is None:
            return ObjectScan(fields, None)
        try:
            key = json.loads(text[i:key_end])
        except ValueError:
            return ObjectScan(fields, None, ok=False)
        i = _skip_ws(text, key_end)
        if i >= n:
            return ObjectScan(fields, None)
        if text[i] != ":":
            return ObjectScan(fields, None, ok=False)
        i = _skip_ws(text, i + 1)
        if i >= n:
            return ObjectScan(fields, None)
        value_end = _value_end(text, i)
        if value_end is None:
            fields[key] = (i, None)
            return ObjectScan(fields, None)
        if value_end < 0:
            return ObjectScan(fields, None, ok=False)
        fields[key] = (i, value_end)
        i = _skip_ws(text, value_end)
        if i >= n:
            return ObjectScan(fields, None)
        if text[i] == "}":
            return ObjectScan(fields, i + 1)
        if text[i] != ",":
            return ObjectScan(fields, None, ok=False)
        i += 1


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


_BRACKET_OR_QUOTE = re.compile(r'["{}\[\]]')


def _string_end(text: str, i: int) -> int | None:
    """Index after the closing quote of the string opening at ``i``, or None if the text ends first."""
    j = i + 1
    while True:
        j = text.find('"', j)
        if j < 0:
            return None
        backslashes = 0
        while text[j - 1 - backslashes] == "\\":
            backslashes += 1
        if backslashes % 2 == 0:
            return j + 1
        j += 1


def _value_end(text: str, i: int) -> int | None:
    """Index after the JSON value at ``i``; None if the text ends inside it, -1 if it cannot be JSON."""
    c = text[i]
    if c == '"':
        return _string_end(text, i)
    if c in "{[":
        depth = 0
        j = i
        while True:
            found = _BRACKET_OR_QUOTE.search(text, j)
            if found is None:
                return None
            j = found.start()
            c = text[j]
            if c == '"':
                end = _string_end(text, j)
                if end is None:
                    return None
                j = end
                continue
            depth += 1 if c in "{[" else -1
            if depth == 0:
                return j + 1
            j += 1
    j = i
    while j < len(text) and text[j] not in _WS + ",}]":
        j += 1
    if j == len(text):
        return None  # a number or literal may still grow
    try:
        json.loads(text[i:j])
    except ValueError:
        return -1
    return j


def call_from_scan(text: str, scan: ObjectScan,
                   args_keys: tuple[str, ...] = ("arguments", "parameters")) -> PartialCall | None:
    """A call object ``{"name": ..., <args key>: {...}}`` as far as it goes; None when it is not one."""
    if not scan.ok:
        return None
    name = scan.value(text, "name")
    if "name" in scan.fields and scan.fields["name"][1] is not None and not isinstance(name, str):
        return None
    raw = next((scan.raw(text, key) for key in args_keys if key in scan.fields), None)
    arguments = raw[0] if raw is not None else ""
    complete = scan.end is not None
    if complete:
        if not isinstance(name, str):
            return None
        if raw is None:
            arguments = "{}"
        elif not isinstance(scan.value(text, next(k for k in args_keys if k in scan.fields)), dict):
            return None
    return PartialCall(name if isinstance(name, str) else None, arguments, complete)


def could_start(text: str, marker: str) -> bool:
    """True when ``text`` is a proper prefix of ``marker`` (so it may still become the marker)."""
    return len(text) < len(marker) and marker.startswith(text)


def held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker`` (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


def describe_tools(tools: list[dict[str, Any]]) -> str:
    """One line per tool — name, description, JSON schema of the arguments — for fallback prompts."""
    lines = []
    for tool in tools:
        function = tool.get("function", {})
        description = f": {function['description']}" if function.get("description") else ""
        parameters = json.dumps(function.get("parameters") or {"type": "object", "properties": {}}, ensure_ascii=False)
        lines.append(f"- {function.get('name')}{description} Arguments (JSON schema): {parameters}")
    return "\n".join(lines)


def scan_call_list(
    text: str, pos: int, separator: str = ",", closer: str | None = "]",
    args_keys: tuple[str, ...] = ("arguments", "parameters"),
) -> tuple[list[PartialCall], int | None, bool]:
    """Call objects from ``pos`` on, separated by ``separator`` and ended by ``closer``.

    Returns (calls so far, index after the closer or None while open, ok). Without a
    ``closer`` the list runs to the end of the text, and objects may also follow each
    other with only whitespace between them.
    """
    calls: list[PartialCall] = []
    n = len(text)
    i = _skip_ws(text, pos)
    while True:
        if i >= n:
            return calls, None, True
        if closer is not None and text[i] == closer and not calls:
            return calls, i + 1, True
        if text[i] != "{":
            return calls, None, False
        scan = scan_object(text, i)
        call = call_from_scan(text, scan, args_keys)
        if call is None:
            return calls, None, False
        calls.append(call)
        if scan.end is None:
            return calls, None, True
        i = _skip_ws(text, scan.end)
        if i >= n:
            return calls, None, True
        if text[i] == separator:
            i = _skip_ws(text, i + 1)
        elif closer is not None and text[i] == closer:
            return calls, i + 1, True
        elif closer is not None or text[i] != "{":
            return calls, None, False


DEFAULT_TOOL_PARSER = "llama3_json"  # for model families no registered parser claims


def model_family(architecture: str | None) -> str:
    """``"LlamaForCausalLM"`` → ``"llama"``, ``"Qwen2MoeForCausalLM"`` → ``"qwen2moe"``."""
    return (architecture or "").lower().split("for")[0]


def default_tool_parser(registry: Any, architecture: str | None) -> str | None:
    """The registered parser that claims the model's family, else :data:`DEFAULT_TOOL_PARSER` if registered."""
    family = model_family(architecture)
    names = registry.names("tool_parsers")
    for name in names:
        families = getattr(registry.get("tool_parsers", name), "model_families", ())
        if family and any(family.startswith(f) for f in families):
            return name
    return DEFAULT_TOOL_PARSER if DEFAULT_TOOL_PARSER in names else None
