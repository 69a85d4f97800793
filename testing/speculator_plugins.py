"""Speculators for tests and benchmarks (plugin module ``treadle.testing.speculator_plugins``; list it under
``plugins:``):

- ``oracle``: proposes each request's continuation from a plain run (``speculator.references``: prompt ids ->
  output ids, set after the engine is built), so every draft is right while the run repeats the plain one: the
  machinery measured with acceptance k + 1 (``bench/speculative.py``).
- ``oracle_tree``: the oracle's continuation as a draft tree (``speculative.topk`` children per depth, at least
  2): at every depth the wrong children first, then the right one, which the next depth continues, so a step keeps
  ``num_tokens // topk`` drafts; with ``breaks`` set, every child goes wrong at a depth drawn from a seeded
  generator, so steps keep anywhere from none to all of the right path.
- ``random_drafts``: drafts sampled on the device from a fixed random distribution ``q`` per position, returned
  with ``q`` (``Drafts.probs``), so verify steps go through rejection sampling.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch

from treadle.core.execution.overlap import to_device, to_device_packed
from treadle.core.hookspecs import hookimpl
from treadle.core.scheduling.observers import StepObserver
from treadle.core.speculative.speculator import Drafts, Speculator

if TYPE_CHECKING:
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


class OracleSpeculator(Speculator):
    """Drafts the reference continuation of each request (token 0 past its end or for an unknown prompt).

    On the device too (``propose_on_device``, overlapped verify steps): each running request's prompt and
    reference continuation are copied once into a device table row (its request-table row), from which the drafts
    after each request's device position are gathered."""

    proposes_on_device = True

    def __init__(self, num_draft_tokens: int, device: torch.device, table_rows: int = 0) -> None:
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        self.references = {}
        # Set: each step's draft at this index (and so every one after it) is wrong, so a step keeps that many
        # drafts and gives the KV of the rest back (a benchmark's partly accepted steps).
        self.wrong_at: int | None = None
        self.table_rows = table_rows  # request-table rows (the device table's)
        self._table: torch.Tensor | None = None  # [rows, longest sequence + drafts + 2]: prompt, reference, zeros
        self._offsets: dict[int, torch.Tensor] = {}

    @property
    def references(self) -> dict[tuple[int, ...], list[int]]:
        """Prompt ids -> the continuation to draft (assign a new dict to change them)."""
        return self._references

    @references.setter
    def references(self, references: dict[tuple[int, ...], list[int]]) -> None:
        self._references = references
        self._width: int | None = None  # the longest prompt + reference, + 2; found again on the next device proposal
        self._row_owner: dict[int, str] = {}  # table row -> the request whose sequence it holds (all written again)

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        return Drafts(to_device_packed([self.continuations(batch, num_drafts)], self.device)[0])

    def propose_on_device(self, batch: "ScheduleBatch", num_drafts: int, positions: torch.Tensor,
                          req_pool_indices: torch.Tensor) -> Drafts:
        table = self._table_with(batch, num_drafts)
        if num_drafts not in self._offsets:
            self._offsets[num_drafts] = torch.arange(1, num_drafts + 1, device=self.device)
        width = table.shape[1]
        columns = (positions.unsqueeze(1) + self._offsets[num_drafts]).clamp_(max=width - 1)
        drafts = table.view(-1)[req_pool_indices.unsqueeze(1) * width + columns]
        if self.wrong_at is not None and self.wrong_at < num_drafts:
            right = drafts[:, self.wrong_at]
            drafts[:, self.wrong_at] = torch.where(right > 0, right - 1, torch.ones_like(right))
        return Drafts(drafts)

    def _table_with(self, batch: "ScheduleBatch", num_drafts: int) -> torch.Tensor:
        """The device table, holding every entry's sequence in its request-table row (copied the first time)."""
        if self._width is None:  # the longest sequence, found again only when the references change
            self._width = max((len(p) + len(o) for p, o in self.references.items()), default=0) + 2
        width = self._width + num_drafts
        rows = max(self.table_rows, 1 + max(e.req.req_pool_idx for e in batch.entries))
        if self._table is None or self._table.shape[1] < width or self._table.shape[0] < rows:
            self._table = torch.zeros((rows, width), dtype=torch.int64, device=self.device)
            self._row_owner.clear()
        for entry in batch.entries:
            req, row = entry.req, entry.req.req_pool_idx
            if self._row_owner.get(row) == req.rid:
                continue
            prompt = req.origin_input_ids
            sequence = (prompt + self.references.get(tuple(prompt), []))[:self._table.shape[1]]
            self._table[row].zero_()
            self._table[row, :len(sequence)] = to_device(torch.tensor(sequence, dtype=torch.int64), self.device)
            self._row_owner[row] = req.rid
        return self._table

    def continuations(self, batch: "ScheduleBatch", num_drafts: int) -> list[list[int]]:
        """Each entry's next ``num_drafts`` reference tokens, on the host."""
        rows = []
        for entry in batch.entries:
            prompt = entry.req.origin_input_ids
            output = self.references.get(tuple(prompt), [])
            start = entry.kv_start + 1 - len(prompt)  # the first draft's index in the output
            row = output[start:start + num_drafts]
            row = row + [0] * (num_drafts - len(row))
            if self.wrong_at is not None and self.wrong_at < num_drafts:
                token = row[self.wrong_at]
                row[self.wrong_at] = token - 1 if token > 0 else 1  # in the vocabulary, never the target's token
            rows.append(row)
        return rows


class OracleTreeSpeculator(OracleSpeculator):
    """The reference continuation as a tree of ``topk`` children per depth, the right one last (module docstring)."""

    proposes_on_device = False  # trees are verified with the host between steps

    def __init__(self, num_draft_tokens: int, device: torch.device, vocab_size: int, topk: int = 2,
                 seed: int = 0) -> None:
        super().__init__(num_draft_tokens, device)
        self.vocab_size = vocab_size
        self.topk = max(2, topk)
        self.breaks = False
        self.rng = random.Random(seed)

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        right_rows = self.continuations(batch, num_drafts)
        tokens, parents = [], []
        for right in right_rows:
            broken_at = self.rng.randint(0, num_drafts) if self.breaks else num_drafts
            row_tokens, row_parents, parent = [], [], -1
            for depth in range(num_drafts):
                for child in range(self.topk):
                    if len(row_tokens) == num_drafts:
                        break
                    is_right = child == self.topk - 1 and depth < broken_at
                    row_tokens.append(right[depth] if is_right else (right[depth] + 1 + child) % self.vocab_size)
                    row_parents.append(parent)
                parent = len(row_tokens) - 1
            tokens.append(row_tokens)
            parents.append(row_parents)
        # Both in one host-to-device copy; nothing here waits for the device.
        tokens_and_parents = to_device(torch.tensor([tokens, parents], dtype=torch.int64), self.device)
        return Drafts(tokens_and_parents[0], parents=tokens_and_parents[1])


class RandomDraftSpeculator(Speculator):
    """Drafts drawn on the device from ``q`` (``[num_draft_tokens, vocab]``, fixed by ``seed``), with ``q``."""

    def __init__(self, num_draft_tokens: int, vocab_size: int, device: torch.device, seed: int = 0) -> None:
        self.num_draft_tokens = num_draft_tokens
        generator = torch.Generator().manual_seed(seed)
        self.q = torch.softmax(2.0 * torch.randn(num_draft_tokens, vocab_size, generator=generator), dim=-1).to(device)
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def propose(self, batch: "ScheduleBatch", num_drafts: int) -> Drafts:
        bs, q = len(batch.entries), self.q[:num_drafts]
        # Exponential race: argmax(q / E), E ~ Exp(1), samples from q on the device without a sync.
        noise = torch.empty((bs, *q.shape), device=q.device).exponential_(generator=self.generator)
        ids = (q.unsqueeze(0) / noise).argmax(dim=-1)
        return Drafts(ids, q.unsqueeze(0).expand(bs, num_drafts, q.shape[-1]))


class OverlappedVerifySteps(StepObserver):
    """Counts the verify batches launched (``verify``) and those queued before the verify step they follow was read
    (``overlapped``: ``ScheduleBatch.follows``, speculative.overlap); add it with ``scheduler.add_observer``."""

    def __init__(self) -> None:
        self.verify = self.overlapped = 0

    def forward_launching(self, batch) -> None:
        if batch.forward_mode.is_verify():
            self.verify += 1
            self.overlapped += batch.follows is not None


def make_oracle(target, config, registry) -> OracleSpeculator:
    return OracleSpeculator(config.speculative.num_tokens, target.info.device, target.info.req_to_token_pool.size)


def make_oracle_tree(target, config, registry) -> OracleTreeSpeculator:
    spec = config.speculative
    return OracleTreeSpeculator(spec.num_tokens, target.info.device, target.info.vocab_size, spec.topk)


def make_random_drafts(target, config, registry) -> RandomDraftSpeculator:
    return RandomDraftSpeculator(config.speculative.num_tokens, target.info.vocab_size, target.info.device)


@hookimpl
def treadle_register_speculators(register) -> None:
    register("oracle", make_oracle)
    register("oracle_tree", make_oracle_tree)
    register("random_drafts", make_random_drafts)
