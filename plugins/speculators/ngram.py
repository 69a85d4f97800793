"""The ``ngram`` speculator: prompt lookup. Drafts are the tokens that followed the latest earlier occurrence of
the request's own last ``n`` tokens (``ngram_max`` down to ``ngram_min``: the longest match wins) in its prompt
and output. No weights; all host work, a few dictionary look-ups per request and step.

Each request keeps an index ``n -> {n tokens: the position after their latest occurrence}``, updated with the
tokens appended since the last step, so a step costs what is new, not the whole sequence.

With ``speculative.topk`` > 1 it drafts trees: up to ``topk`` continuations (the latest occurrence of each suffix
length, longest first, then earlier occurrences: the index keeps ``topk`` positions per n-gram) become branches of
one tree, merged where they agree, grown breadth-first across the branches until it holds ``num_tokens`` drafts.
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
    from collections.abc import Iterable

    from treadle.core.execution.worker import ModelWorker
    from treadle.core.registry import Registry
    from treadle.core.request import Req
    from treadle.core.resolved_config import ResolvedConfig
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


class NgramSpeculator(Speculator):
    """Prompt-lookup drafts (module docstring) for up to ``num_draft_tokens`` positions per request."""

    def __init__(self, num_draft_tokens: int, ngram_min: int, ngram_max: int, device: torch.device,
                 topk: int = 1) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"ngram_min {ngram_min} and ngram_max {ngram_max}: need 1 <= ngram_min <= ngram_max")
        self.num_draft_tokens = num_draft_tokens
        self.topk = topk  # the most branches of a draft tree; 1: chains
        self.sizes = range(ngram_max, ngram_min - 1, -1)  # longest first
        self.device = device
        self.recent = RecentTokens()
        self._indexes: dict[str, _Index] = {}
        # A chain look-up max_drafts made, by id(req): (req, len(req.output_ids), row, drafts); propose reuses it
        # for the same request in the same state instead of looking up again on the verify critical path.
        self._found: dict[int, tuple["Req", int, RowTokens, list[int]]] = {}

    def max_drafts(self, reqs: list["Req"]) -> int:
        """The longest continuation any request has: 0 when none of them repeats itself (the step then decodes
        one token each instead of verifying guesses)."""
        unread, most = self.recent.unread(), 0
        self._found.clear()
        for req in reqs:
            row = RecentTokens.row(req, req.kv_len + 1, unread)
            if self.topk > 1:
                found = draft_tree(self._lookup_all(req, row, self.num_draft_tokens), self.num_draft_tokens)[0]
            else:
                found = self._lookup(req, row, self.num_draft_tokens)
                self._found[id(req)] = (req, len(req.output_ids), row, found)
            most = max(most, len(found))
            if most == self.num_draft_tokens:
                break
        return most

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        if self.topk > 1:
            trees = [self._tree(entry.req, row, num_drafts)
                     for entry, row in zip(batch.entries, self.recent.rows(batch))]
            tokens, parents = zip(*trees) if trees else ((), ())
            ids, parent_ids = to_device_packed([np.asarray(tokens, dtype=np.int64).reshape(-1, num_drafts),
                                                np.asarray(parents, dtype=np.int64).reshape(-1, num_drafts)],
                                               self.device)
            return Drafts(ids, parents=parent_ids)
        rows = [self._drafts(entry.req, row, num_drafts) for entry, row in zip(batch.entries, self.recent.rows(batch))]
        self._found.clear()
        return Drafts(to_device_packed([rows], self.device)[0])  # through the pinned ring: no allocation a step

    def after_target_forward(self, step: LaunchedStep) -> None:
        self.recent.step_launched(step)

    def request_released(self, req: "Req") -> None:
        self._indexes.pop(req.rid, None)

    def _drafts(self, req: "Req", row: RowTokens, num_drafts: int) -> list[int]:
        """``num_drafts`` proposals: the look-up's continuation, padded with its last token (or the sequence's)."""
        found = self._found.get(id(req))
        if found is not None and found[0] is req and found[1] == len(req.output_ids) and found[2] == row:
            drafts = found[3][:num_drafts]  # a look-up's continuation is the same, cut, for fewer drafts
        else:
            drafts = self._lookup(req, row, num_drafts)
        if not drafts:
            tokens = self._indexes[req.rid].tokens
            drafts = [row.unread[-1] if row.unread else tokens[-1]]
        return drafts + [drafts[-1]] * (num_drafts - len(drafts))

    def _tree(self, req: "Req", row: RowTokens, num_drafts: int) -> tuple[list[int], list[int]]:
        """A tree of ``num_drafts`` drafts ``(tokens, parents)`` from the row's continuations, padded by a chain
        repeating the first branch's last token (or the sequence's, without a match)."""
        branches = self._lookup_all(req, row, num_drafts)
        tokens, parents = draft_tree(branches, num_drafts)
        if len(tokens) < num_drafts:
            last = len(branches[0]) - 1 if branches else -1
            node = _branch_end(tokens, parents, branches[0]) if branches else -1
            token = branches[0][last] if branches else (row.unread[-1] if row.unread
                                                         else self._indexes[req.rid].tokens[-1])
            while len(tokens) < num_drafts:
                tokens.append(token)
                parents.append(node)
                node = len(tokens) - 1
        return tokens, parents

    def _lookup(self, req: "Req", row: RowTokens, num_drafts: int) -> list[int]:
        """Up to ``num_drafts`` tokens that followed the latest earlier occurrence of the row's suffix (empty: no
        match, or it ends before the row's unseen tokens)."""
        found = self._lookup_all(req, row, num_drafts, limit=1)
        return found[0] if found else []

    def _lookup_all(self, req: "Req", row: RowTokens, num_drafts: int, limit: int | None = None) -> list[list[int]]:
        """Up to ``limit`` (default ``topk``) continuations of the row's suffix, each of up to ``num_drafts`` tokens,
        from different earlier occurrences: the longest suffix's latest first (empty ones left out)."""
        index = self._indexes.get(req.rid)
        if index is None:
            index = self._indexes[req.rid] = _Index(self.sizes, self.topk)
        tokens = index.update(req)
        tail = row.unread
        continuations = []
        for found in index.lookup_all(tokens, tail, limit or self.topk):
            start = found + row.missing  # the continuation's first tokens stand for the row's unseen ones
            drafts = tokens[start:start + num_drafts]
            if len(drafts) < num_drafts and tail:
                skip = max(0, start - len(tokens))
                drafts += tail[skip:skip + num_drafts - len(drafts)]
            if drafts:
                continuations.append(drafts)
        return continuations


@dataclass
class _Index:
    """One request's appended tokens and, per n-gram size, each n-gram's latest position (the index after it),
    keyed by a 64-bit polynomial hash of the n-gram (a collision only costs a wrong draft, which is verified)."""

    sizes: range
    keep: int = 1  # positions kept per n-gram: the latest in ``latest``, up to ``keep - 1`` before it in ``earlier``
    tokens: list[int] = field(default_factory=list)
    prompt_len: int = -1
    latest: dict[int, dict[int, int]] = field(default_factory=dict)
    earlier: dict[int, dict[int, list[int]]] = field(default_factory=dict)

    def update(self, req: "Req") -> list[int]:
        """Take in the tokens appended to ``req`` since the last call; returns the sequence so far."""
        prompt, output = req.origin_input_ids, req.output_ids
        old = len(self.tokens)
        if self.prompt_len != len(prompt) or old > len(prompt) + len(output):
            self.tokens, self.prompt_len, self.latest, self.earlier, old = [], len(prompt), {}, {}, 0  # another one
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
            if count < _BULK:  # a step's few new tokens
                self._record(n, [(_hash(tokens[start:start + n]), start + n) for start in range(first, length - n)])
                continue
            # A prompt: the same hash for every n-gram at once (uint64 arithmetic wraps like the mask).
            window = np.asarray(tokens[first:length - 1], dtype=np.uint64)
            hashes = np.zeros(count, dtype=np.uint64)
            for i in range(n):
                hashes = hashes * np.uint64(_MULT) + window[i:i + count]
            self._record(n, zip(hashes.tolist(), range(first + n, length)))

    def _record(self, n: int, found: "Iterable[tuple[int, int]]") -> None:
        """Take in ``(hash, position after it)`` pairs of n-grams of size ``n``, in sequence order."""
        latest = self.latest.setdefault(n, {})
        if self.keep == 1:
            latest.update(found)
            return
        earlier = self.earlier.setdefault(n, {})
        for key, position in found:
            before = latest.get(key)
            if before is not None:
                positions = earlier.setdefault(key, [])
                positions.append(before)
                if len(positions) >= self.keep:
                    del positions[0]
            latest[key] = position

    def lookup_all(self, tokens: list[int], tail: list[int], limit: int) -> list[int]:
        """Where the continuations of earlier occurrences of the sequence's last n tokens (``tokens`` then
        ``tail``) start: the latest occurrence of each n, longest first, then earlier ones; up to ``limit``
        different positions (empty without a match)."""
        total = len(tokens) + len(tail)
        latest, earlier = [], []
        for n in self.sizes:
            if n >= total:
                continue
            suffix = tail[-n:] if len(tail) >= n else tokens[len(tokens) - (n - len(tail)):] + tail
            key = _hash(suffix)
            found = self.latest.get(n, {}).get(key)
            if found is not None:
                latest.append(found)
                if limit == 1:
                    break
                earlier.extend(reversed(self.earlier.get(n, {}).get(key, ())))
        return list(dict.fromkeys(latest + earlier))[:limit]


def draft_tree(branches: list[list[int]], num_drafts: int) -> tuple[list[int], list[int]]:
    """``(tokens, parents)`` of a tree of at most ``num_drafts`` nodes holding the ``branches`` (token sequences
    from the root) merged where they share a prefix, grown one depth at a time across all branches (so every
    branch gets its first tokens before any gets its deepest); ``parents[j]`` is node ``j``'s parent, -1 the root."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}
    at: list[int | None] = [-1] * len(branches)  # each branch's deepest node so far (None: no room left for it)
    for depth in range(max(map(len, branches), default=0)):
        for b, branch in enumerate(branches):
            parent = at[b]
            if depth >= len(branch) or parent is None:
                continue
            node = children.get((parent, branch[depth]))
            if node is None and len(tokens) < num_drafts:
                node = children[(parent, branch[depth])] = len(tokens)
                tokens.append(branch[depth])
                parents.append(parent)
            at[b] = node
    return tokens, parents


def _branch_end(tokens: list[int], parents: list[int], branch: list[int]) -> int:
    """The node where ``branch`` ends in the tree (its last token placed)."""
    node = -1
    for token in branch:
        node = next(j for j in range(len(tokens)) if parents[j] == node and tokens[j] == token)
    return node


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
    return NgramSpeculator(spec.num_tokens, spec.ngram_min, spec.ngram_max, target.info.device, spec.topk)


@hookimpl
def treadle_register_speculators(register) -> None:
    register("ngram", make_ngram_speculator)
