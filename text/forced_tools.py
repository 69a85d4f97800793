"""Calls forced by a grammar: ``tool_choice`` ``required`` or a named function.

Whatever the model family, a forced call is written as JSON that a JSON-schema
grammar enforces — ``{"name": ..., "arguments": {...}}``, or an array of those
when several calls may be made — so any model, even one never trained on tools,
emits a valid call. :class:`ForcedCallFormat` reads that JSON like any tool parser.
"""

from __future__ import annotations

import json
from typing import Any

from treadle.text.tool_parser import Snapshot, ToolCall, ToolParser, describe_tools, scan_call_list


def forced_call_schema(tools: list[dict[str, Any]], name: str | None, parallel: bool,
                       max_calls: int = 4) -> dict[str, Any]:
    """The JSON schema of the call(s): one of ``tools`` (or exactly ``name``); an array of 1 to ``max_calls``
    calls when ``parallel`` (the bound keeps a model that repeats itself from filling ``max_tokens``)."""
    chosen = [t for t in tools if name is None or t["function"]["name"] == name]
    options = [_call_schema(t["function"]) for t in chosen]
    one = options[0] if len(options) == 1 else {"anyOf": options}
    if parallel and name is None:
        return {"type": "array", "items": one, "minItems": 1, "maxItems": max_calls}
    return one


def _call_schema(function: dict[str, Any]) -> dict[str, Any]:
    parameters = function.get("parameters") or {"type": "object", "properties": {}}
    return {
        "type": "object",
        "properties": {"name": {"type": "string", "enum": [function["name"]]}, "arguments": parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


class ForcedCallFormat(ToolParser):
    """Reads the JSON that :func:`forced_call_schema` enforces (one call object, or an array of them).

    Call ids come from ``ids_from`` (the model family's parser) when given, so they suit its chat template.
    """

    def __init__(self, ids_from: ToolParser | None = None) -> None:
        self.ids_from = ids_from

    def new_call_id(self) -> str:
        return self.ids_from.new_call_id() if self.ids_from is not None else super().new_call_id()

    def snapshot(self, text: str, final: bool) -> Snapshot | None:
        start = len(text) - len(text.lstrip())
        if start == len(text):
            return None if final else Snapshot("")
        if text[start] == "[":
            calls, end, ok = scan_call_list(text, start + 1, ",", "]", ("arguments",))
        else:
            calls, end, ok = scan_call_list(text, start, ",", None, ("arguments",))
            end = len(text) if ok and calls and calls[-1].complete and len(calls) == 1 else None
        if not ok or (final and (end is None or text[end:].strip() or not calls)):
            return None
        return Snapshot("", calls)

    def render_calls(self, calls: list[ToolCall]) -> str:
        objects = [f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls]
        return objects[0] if len(objects) == 1 else "[" + ", ".join(objects) + "]"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You have access to these functions:\n" + describe_tools(tools) + "\n\n"
            'Call a function by answering with JSON only: {"name": <function name>, "arguments": <object of '
            "argument values>}."
        )
