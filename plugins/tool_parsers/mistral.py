"""``mistral``: Mistral tool calls, ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

Text before the ``[TOOL_CALLS]`` marker is content.
"""

from __future__ import annotations

import json
import secrets
import string
from typing import Any

from treadle.core.hookspecs import hookimpl
from treadle.text.tool_parser import Snapshot, ToolCall, ToolParser, describe_tools, held_suffix, scan_call_list

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    """Content, then ``[TOOL_CALLS]`` and a JSON array of call objects (a lone object is accepted too)."""

    model_families = ("mistral", "mixtral")
    needs_special_tokens = True  # [TOOL_CALLS] is a control token

    def snapshot(self, text: str, final: bool) -> Snapshot | None:
        at = text.find(MARKER)
        if at < 0:
            keep = len(text) if final else len(text) - held_suffix(text, MARKER)
            return Snapshot(text[:keep])
        content = text[:at]
        body = text[at + len(MARKER):]
        start = at + len(MARKER) + len(body) - len(body.lstrip())
        if start == len(text):
            return None if final else Snapshot(content)
        if text[start] == "[":
            calls, end, ok = scan_call_list(text, start + 1, ",", "]", ("arguments", "parameters"))
            closed = end is not None and not text[end:].strip()
        else:
            calls, _, ok = scan_call_list(text, start, ",", None, ("arguments", "parameters"))
            closed = ok and len(calls) == 1 and calls[0].complete
        if final and (not ok or not closed or not calls):
            return None
        return Snapshot(content, calls if ok else [])

    def new_call_id(self) -> str:
        # Mistral's chat templates accept only 9 alphanumeric characters as a tool call id.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))

    def render_calls(self, calls: list[ToolCall]) -> str:
        objects = ", ".join(f'{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}' for c in calls)
        return f"{MARKER} [{objects}]"

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call the functions below. To call them, reply with "
            f'{MARKER} [{{"name": <function name>, "arguments": <object of argument values>}}, ...]. '
            "Otherwise answer normally.\n\n" + describe_tools(tools)
        )


@hookimpl
def treadle_register_tool_parsers(register) -> None:
    register("mistral", MistralToolParser)
