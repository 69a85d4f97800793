"""``llama3_json``: Llama 3.x JSON tool calls, ``{"name": ..., "parameters": {...}}``.

The message is the call (optionally after ``<|python_tag|>``); several calls are
separated by ``;``. ``arguments`` is accepted in place of ``parameters``.
"""

from __future__ import annotations

import json
from typing import Any

from treadle.core.hookspecs import hookimpl
from treadle.text.tool_parser import Snapshot, ToolCall, ToolParser, could_start, describe_tools, scan_call_list

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    """Calls are the whole message: JSON objects with ``name`` and ``parameters``, ``;``-separated."""

    model_families = ("llama",)
    needs_special_tokens = True  # <|python_tag|> is a special token

    def snapshot(self, text: str, final: bool) -> Snapshot | None:
        stripped = text.lstrip()
        if not stripped or could_start(stripped, PYTHON_TAG):
            return Snapshot(text) if final else Snapshot("")
        start = len(text) - len(stripped)
        if stripped.startswith(PYTHON_TAG):
            start += len(PYTHON_TAG)
        elif not stripped.startswith("{"):
            return Snapshot(text)
        calls, _, ok = scan_call_list(text, start, ";", None, ("parameters", "arguments"))
        if final and (not ok or not calls or not all(c.complete for c in calls)):
            return None
        return Snapshot("", calls if ok else [])

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "; ".join(f'{{"name": {json.dumps(c.name)}, "parameters": {c.arguments}}}' for c in calls)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call these functions:\n" + describe_tools(tools) + "\n\nTo call one, reply with nothing but "
            'a JSON object {"name": <function name>, "parameters": <object of argument values>}; separate several '
            "calls with ';'. Otherwise answer normally."
        )


@hookimpl
def treadle_register_tool_parsers(register) -> None:
    register("llama3_json", Llama3JsonToolParser)
