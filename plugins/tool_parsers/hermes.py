"""``hermes``: Hermes / Qwen-style tool calls, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

Each call is its own block; text outside the blocks is content.
"""

from __future__ import annotations

import json
from typing import Any

from treadle.core.hookspecs import hookimpl
from treadle.text.tool_parser import (
    Snapshot,
    ToolCall,
    ToolParser,
    call_from_scan,
    could_start,
    describe_tools,
    held_suffix,
    scan_object,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    """Content with ``<tool_call>`` blocks, one JSON call object in each."""

    model_families = ("qwen",)

    def snapshot(self, text: str, final: bool) -> Snapshot | None:
        content: list[str] = []
        calls = []
        i = 0
        while True:
            at = text.find(START, i)
            if at < 0:
                tail = text[i:]
                content.append(tail if final else tail[: len(tail) - held_suffix(tail, START)])
                break
            content.append(text[i:at])
            j = _skip_ws(text, at + len(START))
            if j == len(text):
                if final:
                    return None
                break
            scan = scan_object(text, j)
            call = call_from_scan(text, scan)
            if call is None:
                if final:
                    return None
                break
            calls.append(call)
            if scan.end is None:
                if final:
                    return None
                break
            k = _skip_ws(text, scan.end)
            if text.startswith(END, k):
                i = k + len(END)
            elif k == len(text) or could_start(text[k:], END):
                break  # the block is not closed yet (or the model stopped without closing it)
            else:
                if final:
                    return None
                break
        return Snapshot("".join(content), calls)

    def render_calls(self, calls: list[ToolCall]) -> str:
        return "\n".join(f'{START}\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}\n{END}'
                         for c in calls)

    def tools_prompt(self, tools: list[dict[str, Any]]) -> str:
        return (
            "You can call the functions below. For each call, reply with a block\n"
            f'{START}\n{{"name": <function name>, "arguments": <object of argument values>}}\n{END}\n'
            "Otherwise answer normally.\n\n<tools>\n" + describe_tools(tools) + "\n</tools>"
        )


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


@hookimpl
def treadle_register_tool_parsers(register) -> None:
    register("hermes", HermesToolParser)
