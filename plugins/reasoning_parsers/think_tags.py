"""``think_tags``: ``<think>reasoning</think>answer`` (DeepSeek-R1, Qwen3, QwQ).

The completion starts in the reasoning block when it opens with ``<think>`` or when
the prompt already ends with ``<think>`` (templates that open the block for the
model). Whitespace right after either tag is dropped. A completion cut off inside
the block is all reasoning.
"""

from __future__ import annotations

from treadle.core.hookspecs import hookimpl
from treadle.text.reasoning_parser import ReasoningParser, ReasoningStreamer
from treadle.text.tool_parser import could_start, held_suffix

START, END = "<think>", "</think>"


class ThinkTagsStreamer(ReasoningStreamer):
    """States: ``start`` (is a ``<think>`` coming?), ``reasoning``, ``content``; ``*_ws`` drop leading whitespace."""

    def __init__(self, opened: bool) -> None:
        self.state = "reasoning_ws" if opened else "start"
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.buffer += delta
        reasoning, content = "", ""
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if not head or could_start(head, START):
                    break
                if head.startswith(START):
                    self.buffer = head[len(START):]
                    self.state = "reasoning_ws"
                else:
                    self.state = "content"
            elif self.state in ("reasoning_ws", "content_ws"):
                self.buffer = self.buffer.lstrip()
                if not self.buffer:
                    break
                self.state = self.state[:-3]
            elif self.state == "reasoning":
                at = self.buffer.find(END)
                if at >= 0:
                    reasoning += self.buffer[:at]
                    self.buffer = self.buffer[at + len(END):]
                    self.state = "content_ws"
                    continue
                keep = held_suffix(self.buffer, END)
                reasoning += self.buffer[: len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            else:
                content += self.buffer
                self.buffer = ""
                break
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self.buffer = self.buffer, ""
        if self.state.startswith("reasoning"):
            return rest, ""
        return "", rest


class ThinkTagsParser(ReasoningParser):
    """``<think>...</think>`` reasoning, the opening tag optional when the prompt opened it."""

    def streamer(self, prompt: str) -> ReasoningStreamer:
        return ThinkTagsStreamer(opened=prompt.rstrip().endswith(START))


@hookimpl
def treadle_register_reasoning_parsers(register) -> None:
    register("think_tags", ThinkTagsParser)
