"""Requests as the scheduler sees them (:class:`Req`); their sampling parameters, outputs and finish reasons
(:mod:`treadle.core.request_io`, torch-free) are re-exported here."""

from __future__ import annotations

import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any

import torch

from treadle.core.request_io import FinishReason, ReqOutput, SamplingParams
from treadle.core.validation import InvalidRequestError

__all__ = ["FinishReason", "InvalidRequestError", "Req", "ReqOutput", "SamplingParams", "next_arrival"]


_arrivals = itertools.count(1)


def next_arrival() -> int:
    """The next value of ``Req.arrival``: increasing in the order requests are queued."""
    return next(_arrivals)


@dataclass(eq=False)
class Req:
    """One generation request and everything the scheduler tracks for it.

    Token layout: ``origin_input_ids + output_ids`` is the sequence; the KV of
    the first ``kv_len`` of those tokens is computed and lives at ``kv_slots``
    (a CPU int64 tensor). ``prefix_len`` of them are shared with the radix
    cache (locked via ``last_node``).
    """

    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: only output logprobs; k: input logprobs from position k
    top_logprobs_num: int = 0
    # An embedding request (model.task: embed): its prompt is pooled into one vector and nothing is sampled.
    wants_embedding: bool = False
    arrival: int = field(default_factory=next_arrival)  # stamped again by Scheduler.add_request
    lora_name: str | None = None  # the LoRA adapter to run under (None: the base model)

    output_ids: list[int] = field(default_factory=list)
    finished_reason: str | None = None
    finished_detail: str | None = None  # the matched stop string or token, or an error message
    error: str | None = None

    # Memory state owned by the scheduler (and ``kv_slots``, a property over _kv_head + _kv_tail).
    req_pool_idx: int | None = None
    prefix_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0  # tokens served from the radix cache on first admission
    # The adapter's registration (the radix cache's namespace for this request's prefixes; None: base model),
    # set when the scheduler accepts the request, and the device slot it holds while admitted (-1: none).
    lora_uid: int | None = None
    lora_slot: int = -1
    # Tokens sampled on the device but not yet appended to output_ids (overlap scheduling reads
    # each step's tokens one step late); the sequence is really ``seq_len + pending_tokens`` long.
    # A verify step in flight counts one until its accepted drafts are counted (docs/scheduling.md).
    pending_tokens: int = 0

    # Sampling state.
    sample_seed: int = 0
    grammar: Any = None  # the GrammarMatcher of a constrained request (core.grammar)

    # Log-probabilities (filled when return_logprob).
    input_token_logprobs: list[float | None] = field(default_factory=list)
    output_token_logprobs: list[float] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    # Embedding state: positions before hidden_states_from may come from the radix cache; ``pooled`` holds the
    # pooling's parts of the chunks computed so far (host float32), ``embedding`` the finished vector.
    # Images and video frames of a vision-language request (core/multimodal/inputs.py), None for text.
    multimodal: Any = None
    hidden_states_from: int = 0
    pooled: Any = None
    embedding: list[float] | None = None

    # Bookkeeping.
    retractions: int = 0
    input_logprobs_sent: bool = False
    # Verify steps (speculative decoding) that gave the request tokens: completion tokens / this is its
    # acceptance length when every decode step verified.
    spec_verify_steps: int = 0

    def __post_init__(self) -> None:
        self._kv_head: torch.Tensor = torch.empty(0, dtype=torch.int64)
        # Slots appended by decode steps, kept as ints until kv_slots is read: a tensor op per request
        # per step would cost more host time than the rest of building a decode batch.
        self._kv_tail: list[int] = []
        seed = self.sampling_params.seed
        self.sample_seed = seed if seed is not None else (uuid.uuid4().int & 0x7FFFFFFF)
        # (token ids, biases) of the request's logit_bias as CPU tensors, built once: the sampler concatenates
        # a step's rows from them instead of walking every entry of every request again each step.
        bias = self.sampling_params.logit_bias
        self.logit_bias_table: tuple[torch.Tensor, torch.Tensor] | None = (
            torch.tensor(list(bias), dtype=torch.int64), torch.tensor(list(bias.values()), dtype=torch.float32)
        ) if bias else None

    @staticmethod
    def new_rid() -> str:
        return uuid.uuid4().hex

    @property
    def all_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    def token_at(self, position: int) -> int:
        """The sequence's token at ``position`` (without building ``all_ids``)."""
        prompt_len = len(self.origin_input_ids)
        return self.origin_input_ids[position] if position < prompt_len else self.output_ids[position - prompt_len]

    @property
    def seq_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def kv_slots(self) -> torch.Tensor:
        """The KV slots of the sequence's first ``kv_len`` tokens (CPU int64)."""
        if self._kv_tail:
            self._kv_head = torch.cat([self._kv_head, torch.tensor(self._kv_tail, dtype=torch.int64)])
            self._kv_tail = []
        return self._kv_head

    @kv_slots.setter
    def kv_slots(self, slots: torch.Tensor) -> None:
        self._kv_head, self._kv_tail = slots, []

    def append_kv_slot(self, slot: int) -> None:
        """One more token's KV slot (a decode step's)."""
        self._kv_tail.append(slot)

    def extend_kv_slots(self, slots: list[int]) -> None:
        """More tokens' KV slots, in order (a verify step's)."""
        self._kv_tail.extend(slots)

    def truncate_kv(self, length: int) -> list[int]:
        """Keep the KV slots of the first ``length`` tokens; return the slots past them (a verify step's rejected
        positions, the KV of tokens never read), cheaply when they are all recent decode slots."""
        head = int(self._kv_head.numel())
        if length >= head:
            cut = length - head
            dropped = self._kv_tail[cut:]
            del self._kv_tail[cut:]
            return dropped
        slots = self.kv_slots
        self.kv_slots = slots[:length]
        return slots[length:].tolist()

    def cut_kv(self, start: int, end: int) -> list[int]:
        """Take the KV slots of positions ``[start, end)`` out, the later ones moving down; return them."""
        head = int(self._kv_head.numel())
        if start >= head:
            dropped = self._kv_tail[start - head:end - head]
            del self._kv_tail[start - head:end - head]
            return dropped
        slots = self.kv_slots
        self.kv_slots = torch.cat([slots[:start], slots[end:]])
        return slots[start:end].tolist()

    @property
    def last_kv_slot(self) -> int:
        """The slot of the last computed token, or -1 when there is none."""
        if self._kv_tail:
            return self._kv_tail[-1]
        return int(self._kv_head[-1]) if self._kv_head.numel() else -1

    @property
    def kv_len(self) -> int:
        return int(self._kv_head.numel()) + len(self._kv_tail)

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    def finish(self, reason: str, detail: str | None = None) -> None:
        if self.finished_reason is None:
            self.finished_reason = reason
            self.finished_detail = detail
