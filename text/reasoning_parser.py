"""Reasoning in model text: the ``reasoning_parsers`` plugin interface.

A reasoning parser splits a completion into ``reasoning_content`` and ``content``
(e.g. ``<think>...</think>`` then the answer). It is written once, as a streamer
fed text deltas; parsing a whole completion feeds it in one piece, so streamed
and non-streamed results agree by construction.
"""

from __future__ import annotations

from abc import ABC, abstractmethod


class ReasoningStreamer(ABC):
    """Splits one completion's text deltas into (reasoning delta, content delta) pairs."""

    @abstractmethod
    def feed(self, delta: str) -> tuple[str, str]:
        """The reasoning and content that ``delta`` (with what came before) makes certain."""

    @abstractmethod
    def finish(self) -> tuple[str, str]:
        """Whatever was held back, once the completion ended."""


class ReasoningParser(ABC):
    """Reads one reasoning format. ``streamer(prompt)`` starts a completion of the rendered ``prompt``.

    The prompt matters because some chat templates open the reasoning block
    themselves (the completion then starts inside it, without an opening tag).
    """

    @abstractmethod
    def streamer(self, prompt: str) -> ReasoningStreamer:
        """A fresh streamer for one completion of ``prompt``."""

    def parse(self, text: str, prompt: str = "") -> tuple[str, str]:
        """(reasoning_content, content) of a whole completion."""
        streamer = self.streamer(prompt)
        r1, c1 = streamer.feed(text)
        r2, c2 = streamer.finish()
        return r1 + r2, c1 + c2
