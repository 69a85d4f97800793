"""A scheduler step's outputs by field, the form in which they cross the server's process boundaries.

A step makes one :class:`~treadle.core.request.ReqOutput` per running request (hundreds at saturation). Pickled one
by one, each costs ~2 us to write and ~5 us to read (a class reference and a dict of 14 fields per object); as a
few lists, a step's outputs cost ~0.2 us each both ways. The fields every output has go in one list each; the
finish reasons only for the outputs that finished; the rarer fields (log-probs, verify lengths, embeddings) only
for the outputs that carry any of them.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, fields
from typing import Any, Iterator, Sequence

from treadle.core.request_io import ReqOutput

_COMMON = ("rid", "new_token_ids", "finished_reason", "finished_detail", "prompt_tokens", "completion_tokens",
           "cached_tokens", "spec_verify_steps")
# Every other ReqOutput field, and its default (an output carries only the ones it sets otherwise).
RARE_FIELDS = tuple(f.name for f in fields(ReqOutput) if f.name not in _COMMON)
_DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
             for f in fields(ReqOutput) if f.name in RARE_FIELDS}


@dataclass
class OutputColumns:
    """Outputs by field: entry ``i`` of each list is output ``i``'s; ``finished`` and ``rare`` are keyed by ``i``.

    ``text_deltas`` is None on the way to the detokenizer and the text of each output on the way back.
    """

    rids: list[str]
    token_ids: list[list[int]]
    prompt_tokens: list[int]
    completion_tokens: list[int]
    cached_tokens: list[int]
    spec_verify_steps: list[int]
    finished: dict[int, tuple[str, str | None]]  # i -> (finished_reason, finished_detail)
    rare: dict[int, dict[str, Any]]  # i -> the RARE_FIELDS that output sets
    text_deltas: list[str] | None = None

    @classmethod
    def of(cls, outputs: Sequence[ReqOutput], text_deltas: list[str] | None = None) -> "OutputColumns":
        finished: dict[int, tuple[str, str | None]] = {}
        rare: dict[int, dict[str, Any]] = {}
        verify_steps = []
        for i, out in enumerate(outputs):
            if out.finished_reason is not None:
                finished[i] = (out.finished_reason, out.finished_detail)
            if (out.new_output_logprobs or out.input_token_logprobs is not None or out.new_verify_lengths
                    or out.embedding is not None or out.new_output_top_logprobs or out.input_top_logprobs is not None):
                values = {name: getattr(out, name) for name in RARE_FIELDS}
                rare[i] = {name: value for name, value in values.items() if value != _DEFAULTS[name]}
            verify_steps.append(out.spec_verify_steps)
        return cls([out.rid for out in outputs], [out.new_token_ids for out in outputs],
                   [out.prompt_tokens for out in outputs], [out.completion_tokens for out in outputs],
                   [out.cached_tokens for out in outputs], verify_steps, finished, rare, text_deltas)

    def __len__(self) -> int:
        return len(self.rids)

    def rows(self, row_type: type = ReqOutput) -> list[Any]:
        """One ``row_type`` (ReqOutput, or StrOutput with the text) per output."""
        texts = self.text_deltas
        rows = []
        for i, (rid, ids, prompt, completion, cached, verify) in enumerate(zip(
                self.rids, self.token_ids, self.prompt_tokens, self.completion_tokens, self.cached_tokens,
                self.spec_verify_steps)):
            reason, detail = self.finished.get(i, (None, None))
            row = row_type(rid, ids, reason, detail, prompt, completion, cached, spec_verify_steps=verify,
                           **self.rare.get(i, {}))
            if texts is not None:
                row.text_delta = texts[i]
            rows.append(row)
        return rows

    def select(self, indices: Sequence[int], text_deltas: list[str] | None = None) -> "OutputColumns":
        """The outputs at ``indices`` (with ``text_deltas``, one per index, when given)."""
        if len(indices) == len(self.rids):  # all of them, in order
            return OutputColumns(self.rids, self.token_ids, self.prompt_tokens, self.completion_tokens,
                                 self.cached_tokens, self.spec_verify_steps, self.finished, self.rare,
                                 text_deltas if text_deltas is not None else self.text_deltas)
        position = {index: new for new, index in enumerate(indices)}
        texts = self.text_deltas
        return OutputColumns(
            [self.rids[i] for i in indices], [self.token_ids[i] for i in indices],
            [self.prompt_tokens[i] for i in indices], [self.completion_tokens[i] for i in indices],
            [self.cached_tokens[i] for i in indices], [self.spec_verify_steps[i] for i in indices],
            {position[i]: value for i, value in self.finished.items() if i in position},
            {position[i]: value for i, value in self.rare.items() if i in position},
            text_deltas if text_deltas is not None else (None if texts is None else [texts[i] for i in indices]))

    def finished_rids(self) -> Iterator[str]:
        return (self.rids[i] for i in self.finished)
