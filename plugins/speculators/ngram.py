"""The ``ngram`` speculator: prompt lookup. Drafts are the tokens that followed the latest earlier occurrence of
the request's own last ``n`` tokens (``ngram_max`` down to ``ngram_min``: the longest match wins) in its prompt
and output. No weights; all host work, a few dictionary look-ups per request and step.

Each request keeps an index ``n -> {n tokens: the position after their latest occurrence}``, updated with the
tokens appended since the last step, so a step costs what is new, not the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from treadle.core.execution.overlap import LaunchedStep, to_device
from treadle.core.hookspecs import hookimpl
from treadle.core.speculative.history import RecentTokens, RowTokens
from treadle.core.speculative.speculator import Drafts, Speculator

if TYPE_CHECKING:
    from treadle.core.execution.worker import ModelWorker
    from treadle.core.registry import Registry
    from treadle.core.request import Req
    from treadle.core.resolved_config import ResolvedConfig
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


class NgramSpeculator(Speculator):
    """Prompt-lookup drafts (module docstring) for up to ``num_draft_tokens`` positions per request."""

    def __init__(self, num_draft_tokens: int, ngram_min: int, ngram_max: int, device: torch.device) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min {ngram_min} and ngram_max {ngram_max}: need 1 <= ngram_min <= ngram_max")
        self.num_draft_tokens = num_draft_tokens
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self.device = device
        self.recent = RecentTokens()
        self._indexes: dict[str, _Index] = {}

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        rows = [self._drafts(entry.req, row, num_drafts) for entry, row in zip(batch.entries, self.recent.rows(batch))]
        return Drafts(to_device(torch.tensor(rows, dtype=torch.int64), self.device))

    def after_target_forward(self, step: LaunchedStep) -> None:
        self.recent.step_launched(step)

    def request_released(self, req: "Req") -> None:
        self._indexes.pop(req.rid, None)

    def _drafts(self, req: "Req", row: RowTokens, num_drafts: int) -> list[int]:
        index = self._indexes.get(req.rid)
        if index is None:
            index = self._indexes[req.rid] = _Index(self.sizes)
        tokens = index.update(req)
        tail = row.unread
        found = index.lookup(tokens, tail)
        if found is None:
            last = tail[-1] if tail else tokens[-1]
            return [last] * num_drafts
        start = found + row.missing  # the continuation's first tokens stand for the row's unseen ones
        drafts = tokens[start:start + num_drafts]
        if len(drafts) < num_drafts and tail:
            skip = max(0, start - len(tokens))
            drafts += tail[skip:skip + num_drafts - len(drafts)]
        if not drafts:
            drafts = [tail[-1] if tail else tokens[-1]]
        return drafts + [drafts[-1]] * (num_drafts - len(drafts))


@dataclass
class _Index:
    """One request's appended tokens and, per n-gram size, each n-gram's latest position (the index after it)."""

    sizes: range
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = -1
    latest: dict[int, dict[tuple[int, ...], int]] = field(default_factory=dict)

    def update(self, req: "Req") -> list[int]:
        """Take in the tokens appended to ``req`` since the last call; returns the sequence so far."""
        prompt, output = req.origin_input_ids, req.output_ids
        old = len(self.tokens)
        if self.prompt_len != len(prompt) or old > len(prompt) + len(output):
            self.tokens, self.prompt_len, self.latest, old = [], len(prompt), {}, 0  # a different sequence
        if old < len(prompt):
            self.tokens.extend(prompt[old:])
            self.tokens.extend(output)
        else:
            self.tokens.extend(output[old - len(prompt):])
        self._index_from(old)
        return self.tokens

    def _index_from(self, old: int) -> None:
        tokens, length = self.tokens, len(self.tokens)
        for n in self.sizes:
            # n-grams starting at s whose next token exists: s + n < length; new ones start at old - n or later.
            first = max(0, old - n)
            if first + n >= length:
                continue
            keys = zip(*(tokens[first + i:length - n + i] for i in range(n)))
            self.latest.setdefault(n, {}).update(zip(keys, range(first + n, length)))

    def lookup(self, tokens: list[int], tail: list[int]) -> int | None:
        """Where the continuation of the latest earlier occurrence of the sequence's last n tokens (``tokens``
        then ``tail``) starts, for the longest n with one; None without a match."""
        total = len(tokens) + len(tail)
        for n in self.sizes:
            if n >= total:
                continue
            suffix = tuple(tail[-n:]) if len(tail) >= n else tuple(tokens[len(tokens) - (n - len(tail)):]) + tuple(tail)
            found = self.latest.get(n, {}).get(suffix)
            if found is not None:
                return found
        return None


def make_ngram_speculator(target: "ModelWorker", config: "ResolvedConfig", registry: "Registry") -> NgramSpeculator:
    spec = config.speculative
    return NgramSpeculator(spec.num_tokens, spec.ngram_min, spec.ngram_max, target.info.device)


@hookimpl
def treadle_register_speculators(register) -> None:
    register("ngram", make_ngram_speculator)
