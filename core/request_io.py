"""What a request carries across process boundaries: its :class:`SamplingParams` in, :class:`ReqOutput` and
:class:`FinishReason` out. Torch-free, so the HTTP workers and the detokenizer start without loading torch."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from treadle.core.validation import check_sampling_params, logit_bias_map

__all__ = ["FinishReason", "ReqOutput", "SamplingParams"]


@dataclass
class SamplingParams:
    """How to pick each next token and when to stop. ``temperature == 0`` is greedy."""

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True
    # Constrained decoding (at most one): the output must match a JSON schema, a regex or an EBNF grammar.
    # ``doc`` metadata is what the HTTP API's schema says of a field; ``accepts``, what its body may send
    # when that is more than the field holds (__post_init__ normalizes it).
    json_schema: str | None = field(default=None, metadata={
        "doc": "the output must be JSON matching this schema (a JSON object, or its JSON text)",
        "accepts": str | dict[str, Any] | None})
    regex: str | None = field(default=None, metadata={"doc": "the output must match this regular expression"})
    ebnf: str | None = field(default=None, metadata={"doc": "the output must match this EBNF grammar"})
    logit_bias: dict[int, float] | None = field(default=None, metadata={
        "doc": "token id -> bias in [-100, 100] added to its logit before sampling (as OpenAI's logit_bias: "
               "-100 bans a token, +100 all but forces it); keys may be strings of digits, as JSON carries them"})

    def __post_init__(self) -> None:
        if isinstance(self.json_schema, (dict, bool)):
            self.json_schema = json.dumps(self.json_schema)
        if self.logit_bias is not None:
            self.logit_bias = logit_bias_map(self.logit_bias)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])

    def verify(self) -> None:
        """Raise InvalidRequestError naming the first out-of-range field (:func:`core.validation.check_sampling_params`;
        a request's limits are checked by :func:`core.validation.check_request`)."""
        check_sampling_params(self)

    @property
    def is_constrained(self) -> bool:
        return self.json_schema is not None or self.regex is not None or self.ebnf is not None

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @classmethod
    def from_any(cls, value: "SamplingParams | dict[str, Any] | None") -> "SamplingParams":
        if value is None:
            return cls()
        if isinstance(value, SamplingParams):
            return value
        return cls(**value)


class FinishReason:
    """Why a request stopped, in the OpenAI vocabulary: 'stop', 'length' or 'abort'."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class ReqOutput:
    """What one scheduler step produced for one request (crosses the scheduler process boundary)."""

    rid: str
    new_token_ids: list[int]
    finished_reason: str | None
    finished_detail: str | None
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    new_output_logprobs: list[float] = field(default_factory=list)
    new_output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_token_logprobs: list[float | None] | None = None  # sent once, with the first output
    input_top_logprobs: list[list[tuple[int, float]] | None] | None = None
    spec_verify_steps: int = 0  # so far (speculative decoding; 0 without it)
    # The tokens each verify step of this output gave the request (accepted drafts + 1), for the acceptance
    # histogram; empty without speculation.
    new_verify_lengths: list[int] = field(default_factory=list)
    embedding: list[float] | None = None  # an embedding request's vector, with its finishing output
