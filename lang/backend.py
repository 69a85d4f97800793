"""What a program needs from a model: generate, stream, score a continuation, warm the prefix cache."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator

from treadle.lang.chat_template import ChatTemplate


@dataclass
class Completion:
    """One finished generation: its text and the server's accounting for it."""

    text: str
    output_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def meta_info(self) -> dict[str, Any]:
        return {
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


@dataclass
class Scored:
    """Log-probabilities of the tokens of ``input_ids`` from ``start`` on, given what precedes each."""

    input_ids: list[int]
    start: int
    token_logprobs: list[float]
    cached_tokens: int = 0


class Backend(ABC):
    """A model a program runs against: an in-process Engine or a treadle server.

    Programs send token ids (tokenized here, with :attr:`tokenizer`) so that both
    backends see exactly the same input and ``select`` can reason about token boundaries.
    """

    @property
    @abstractmethod
    def tokenizer(self) -> Any:
        """The HF tokenizer of the served model."""

    @abstractmethod
    def generate(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Completion:
        """Generate one continuation of ``input_ids``."""

    @abstractmethod
    def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any]) -> Iterator[str | Completion]:
        """Yield text deltas as they are produced, then the final :class:`Completion`."""

    @abstractmethod
    def score(self, sequences: list[list[int]], starts: list[int]) -> list[Scored]:
        """Log-probability of every token of ``sequences[i]`` from position ``starts[i]`` (>= 1) on."""

    def cache_prefix(self, input_ids: list[int]) -> None:
        """Prefill ``input_ids`` without generating, so later requests sharing it hit the radix cache."""
        self.generate(input_ids, {"max_new_tokens": 0})

    @cached_property
    def chat_template(self) -> ChatTemplate:
        return ChatTemplate.from_tokenizer(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; no second BOS when the chat template already wrote one."""
        bos = getattr(self.tokenizer, "bos_token", None)
        add_special_tokens = not (bos and text.startswith(bos))
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def shutdown(self) -> None:
        """Release what the backend holds (nothing by default)."""


def slice_scores(
    sequences: list[list[int]], starts: list[int], logprob_start_len: int, per_sequence: list[list[float | None]]
) -> list[Scored]:
    """Cut per-sequence input log-probs (reported from ``logprob_start_len``) down to each sequence's start."""
    results = []
    for ids, start, logprobs in zip(sequences, starts, per_sequence):
        wanted = len(ids) - start
        tail = list(logprobs[len(logprobs) - wanted :]) if wanted else []
        if len(logprobs) < wanted or any(lp is None or math.isnan(lp) for lp in tail):
            raise RuntimeError(
                f"the backend returned {len(logprobs)} input log-probs from position {logprob_start_len} "
                f"for a {len(ids)}-token sequence; expected real values for positions {start}..{len(ids) - 1}"
            )
        results.append(Scored(input_ids=ids, start=start, token_logprobs=tail))
    return results
