"""A test-only speculative worker: it wraps a ModelWorker and drafts from an oracle (shared by the CPU and GPU
multi-token scheduling tests; imported by name, see conftest.py).

For each request of a TARGET_VERIFY batch it proposes the next ``t - 1`` tokens of the request's continuation in a
plain run (``references``: prompt -> output ids), made deliberately wrong at one position chosen by a seeded
random generator, so a step accepts anywhere from 0 to all of its drafts. Whatever it proposes, the target keeps
only the drafts it would have produced itself: outputs must equal the plain run's.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.execution.overlap import LaunchedStep
from treadle.core.execution.worker import Worker
from treadle.core.scheduling.schedule_batch import ScheduleBatch


class OracleSpeculator(Worker):
    """Verifies ``k`` oracle drafts per request a decode step (``decode_tokens_per_req`` = k + 1).

    ``wrong``: where the first wrong draft goes: ``"random"`` (uniformly among the ``t - 1`` drafts, or none),
    ``"never"`` (every draft right: each step accepts all it can) or ``"always"`` (the first is wrong: none kept).
    """

    def __init__(self, inner: Worker, k: int, references: dict[tuple[int, ...], list[int]],
                 wrong: str = "random", seed: int = 0) -> None:
        self.inner = inner
        self.info, self.config = inner.info, inner.config
        self.k = k
        self.references = references
        self.wrong = wrong
        self.rng = random.Random(seed)
        self.batches: list[tuple[str, int, int]] = []  # (mode, requests, tokens per request) of every forward
        self.verify_steps: list[LaunchedStep] = []

    @property
    def decode_tokens_per_req(self) -> int:
        return self.k + 1

    def launch_forward(self, batch: ScheduleBatch, draft_ids: torch.Tensor | None = None) -> LaunchedStep:
        entries = batch.entries
        verify = batch.forward_mode is ForwardMode.TARGET_VERIFY
        if verify:
            assert draft_ids is None, "the scheduler hands a verify batch over without drafts"
            draft_ids = self.drafts(batch).to(self.info.device)
        self.batches.append((batch.forward_mode.name, len(entries), entries[0].extend_len if verify else 1))
        step = self.inner.launch_forward(batch, draft_ids)
        if verify:
            self.verify_steps.append(step)
        return step

    def launch_sampling(self, step: LaunchedStep, vocab_mask: torch.Tensor | None = None,
                        prompt_logprob_entries: Sequence[int] = ()) -> None:
        self.inner.launch_sampling(step, vocab_mask, prompt_logprob_entries)

    def drafts(self, batch: ScheduleBatch) -> torch.Tensor:
        """``[bs, t - 1]``: for each entry the oracle's tokens at positions ``kv_start + 1 ..``, one made wrong."""
        per_req = batch.entries[0].extend_len
        rows = []
        for entry in batch.entries:
            req = entry.req
            sequence = req.origin_input_ids + self.references[tuple(req.origin_input_ids)]
            row = [sequence[p] if p < len(sequence) else 3 for p in range(entry.kv_start + 1, entry.kv_start + per_req)]
            first_wrong = {"random": self.rng.randint(0, per_req - 1), "never": per_req - 1, "always": 0}[self.wrong]
            if first_wrong < len(row):
                row[first_wrong] = (row[first_wrong] + 1) % self.info.vocab_size
            rows.append(row)
        return torch.tensor(rows, dtype=torch.int64)

    def accepted_counts(self) -> list[int]:
        """How many drafts each row of every verify step kept (its results are on the host once settled)."""
        return [count for step in self.verify_steps for count in step.results.wait()["accepted"].tolist()]

    def verified_rows(self) -> list[tuple[tuple[int, ...], int, int, int]]:
        """(prompt, kv_start, tokens, drafts kept) of every row of every verify step."""
        rows = []
        for step in self.verify_steps:
            accepted = step.results.wait()["accepted"].tolist()
            rows.extend((tuple(entry.req.origin_input_ids), entry.kv_start, entry.extend_len, count)
                        for entry, count in zip(step.batch.entries, accepted))
        return rows
