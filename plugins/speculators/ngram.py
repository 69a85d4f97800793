"""The ``ngram`` speculator: prompt lookup. Drafts are the tokens that followed the latest earlier occurrence of
the request's own last ``n`` tokens (``ngram_max`` down to ``ngram_min``: the longest match wins) in its prompt
and output. No weights; all host work, a few dictionary look-ups per request and step.

Each request keeps an index ``n -> {n tokens: the position after their latest occurrence}``, updated with the
tokens appended since the last step, so a step costs what is new, not the whole sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from treadle.core.execution.overlap import LaunchedStep, to_device_packed
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

    def max_drafts(self, reqs: list["Req"]) -> int:
        """The longest continuation any request has: 0 when none of them repeats itself (the step then decodes
        one token each instead of verifying guesses)."""
        unread, most = self.recent.unread(), 0
        for req in reqs:
            found = self._lookup(req, RecentTokens.row(req, req.kv_len + 1, unread), self.num_draft_tokens)
            most = max(most, len(found))
            if most == self.num_draft_tokens:
                break
        return most

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        rows = [self._drafts(entry.req, row, num_drafts) for entry, row in zip(batch.entries, self.recent.rows(batch))]
        return Drafts(to_device_packed([rows], self.device)[0])  # through the pinned ring: no allocation a step

    def after_target_forward(self, step: LaunchedStep) -> None:
        self.recent.step_launched(step)

    def request_released(self, req: "Req") -> None:
        self._indexes.pop(req.rid, None)

    def _drafts(self, req: "Req", row: RowTokens, num_drafts: int) -> list[int]:
        """``num_drafts`` proposals: the look-up's continuation, padded with its last token (or the sequence's)."""
        drafts = self._lookup(req, row, num_drafts)
        if not drafts:
            tokens = self._indexes[req.rid].tokens
            drafts = [row.unread[-1] if row.unread else tokens[-1]]
        return drafts + [drafts[-1]] * (num_drafts - len(drafts))

    def _lookup(self, req: "Req", row: RowTokens, num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` tokens that followed the latest earlier occurrence of the row's suffix (empty: no
        match, or it ends before the row's unseen tokens)."""
        index = self._indexes.get(req.rid)
        if index is None:
            index = self._indexes[req.rid] = _Index(self.sizes)
        tokens = index.update(req)
        tail = row.unread
        found = index.lookup(tokens, tail)
        if found is None:
            return []
        start = found + row.missing  # the continuation's first tokens stand for the row's unseen ones
        drafts = tokens[start:start + num_drafts]
        if len(drafts) < num_drafts and tail:
            skip = max(0, start - len(tokens))
            drafts += tail[skip:skip + num_drafts - len(drafts)]
        return drafts


@dataclass
class _Index:
    """One request's appended tokens and, per n-gram size, each n-gram's latest position (the index after it),
    keyed by a 64-bit polynomial hash of the n-gram (a collision only costs a wrong draft, which is verified)."""

    sizes: range
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = -1
    latest: dict[int, dict[int, int]] = field(default_factory=dict)

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
            count = length - n - first
            if count <= 0:
                continue
            latest = self.latest.setdefault(n, {})
            if count < _BULK:  # a step's few new tokens
                for start in range(first, length - n):
                    latest[_hash(tokens[start:start + n])] = start + n
                continue
            # A prompt: the same hash for every n-gram at once (uint64 arithmetic wraps like the mask).
            window = np.asarray(tokens[first:length - 1], dtype=np.uint64)
            hashes = np.zeros(count, dtype=np.uint64)
            for i in range(n):
                hashes = hashes * np.uint64(_MULT) + window[i:i + count]
            latest.update(zip(hashes.tolist(), range(first + n, length)))

    def lookup(self, tokens: list[int], tail: list[int]) -> int | None:
        """Where the continuation of the latest earlier occurrence of the sequence's last n tokens (``tokens``
        then ``tail``) starts, for the longest n with one; None without a match."""
        total = len(tokens) + len(tail)
        for n in self.sizes:
            if n >= total:
                continue
            suffix = tail[-n:] if len(tail) >= n else tokens[len(tokens) - (n - len(tail)):] + tail
            found = self.latest.get(n, {}).get(_hash(suffix))
            if found is not None:
                return found
        return None


_MULT = 0x100000001B3
_MASK = (1 << 64) - 1
_BULK = 64  # from this many new n-grams on, hashed with numpy


def _hash(ngram: list[int]) -> int:
    value = 0
    for token in ngram:
        value = (value * _MULT + token) & _MASK
    return value


def make_ngram_speculator(target: "ModelWorker", config: "ResolvedConfig", registry: "Registry") -> NgramSpeculator:
    spec = config.speculative
    return NgramSpeculator(spec.num_tokens, spec.ngram_min, spec.ngram_max, target.info.device)


@hookimpl
def treadle_register_speculators(register) -> None:
    register("ngram", make_ngram_speculator)
