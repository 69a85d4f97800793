"""A draft model's memory: one request-table row and a list of KV slots per request it drafts for.

The draft keeps no prefix cache: a request's draft KV is computed from its first token and lives until the
request leaves the running batch (``DraftMemory.release``). Slots are only ever added (a position keeps its
slot while the request lives), so a rejected draft's slot is simply overwritten by the next step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from treadle.core.execution.overlap import to_device

if TYPE_CHECKING:
    from treadle.core.execution.worker import WorkerInfo
    from treadle.core.request import Req


@dataclass
class DraftSequence:
    """One request as the draft model knows it.

    ``slots[q]`` is the draft KV slot of position ``q``; positions ``[0, seen)`` hold the K/V of the request's
    real tokens. A proposal made at position ``proposed_at`` (the request's last sampled token) wrote the K/V
    of its first ``proposed - 1`` drafts after it; until the target has verified them (``settle``) they count
    as seen. ``drafts_at`` is where the drafts kept in the speculator's device buffer were proposed.
    """

    row: int
    slots: list[int] = field(default_factory=list)
    seen: int = 0
    proposed_at: int = -1
    proposed: int = 0
    drafts_at: int = -1

    def settle(self, kv_start: int) -> None:
        """The request's last sampled token is now at ``kv_start``: a proposal made before it was verified,
        keeping ``kv_start - proposed_at - 1`` drafts, whose K/V stays valid (up to the drafts the draft model
        itself computed K/V for)."""
        if 0 <= self.proposed_at < kv_start:
            accepted = kv_start - self.proposed_at - 1
            self.seen = min(self.seen, self.proposed_at + 1 + min(accepted, self.proposed - 1))
            self.proposed_at = -1


class DraftMemory:
    """The draft model's request-table rows and KV slots, per request (keyed by request id)."""

    def __init__(self, info: "WorkerInfo") -> None:
        self.allocator = info.allocator
        self.req_to_token_pool = info.req_to_token_pool
        self.sequences: dict[str, DraftSequence] = {}

    def sequence(self, req: "Req") -> DraftSequence | None:
        """``req``'s draft state, created (with a request-table row) on first use; None when no row is free."""
        seq = self.sequences.get(req.rid)
        if seq is None:
            row = self.req_to_token_pool.alloc()
            if row is None:
                return None
            seq = self.sequences[req.rid] = DraftSequence(row)
        return seq

    def reserve(self, seqs: list[DraftSequence | None], lengths: list[int]) -> list[bool]:
        """Give each sequence a slot for every position below ``lengths[i]``; False for a sequence that got none
        (the pool is short: it sits this step out) or is None. New slots go into the request table in one
        scatter."""
        short = [(i, seq, length - len(seq.slots)) for i, (seq, length) in enumerate(zip(seqs, lengths))
                 if seq is not None and length > len(seq.slots)]
        ok = [seq is not None for seq in seqs]
        if not short:
            return ok
        slots = self._alloc(short)
        if slots is None:  # short of memory: one at a time, as far as it goes
            for i, seq, count in short:
                got = self._alloc([(i, seq, count)])
                if got is None:
                    ok[i] = False
                else:
                    self._append(got, [(i, seq, count)])
            return ok
        self._append(slots, short)
        return ok

    def release(self, req: "Req") -> None:
        """Free ``req``'s row and slots (it finished, was aborted or retracted)."""
        seq = self.sequences.pop(req.rid, None)
        if seq is None:
            return
        if seq.slots:
            self.allocator.free(torch.tensor(seq.slots, dtype=torch.int64))
        self.req_to_token_pool.free(seq.row)

    def _alloc(self, short: list[tuple[int, DraftSequence, int]]) -> torch.Tensor | None:
        paged = self.allocator.page_size > 1
        return self.allocator.alloc_extend(
            [len(seq.slots) for _, seq, _ in short], [count for _, _, count in short],
            [seq.slots[-1] if paged and seq.slots else -1 for _, seq, _ in short])

    def _append(self, slots: torch.Tensor, short: list[tuple[int, DraftSequence, int]]) -> None:
        rows, cols = [], []
        for _, seq, count in short:
            rows.extend([seq.row] * count)
            cols.extend(range(len(seq.slots), len(seq.slots) + count))
        new = slots.tolist()
        start = 0
        for _, seq, count in short:
            seq.slots.extend(new[start:start + count])
            start += count
        table = self.req_to_token_pool.req_to_token
        device = table.device
        table[to_device(torch.tensor(rows, dtype=torch.int64), device),
              to_device(torch.tensor(cols, dtype=torch.int64), device)] = to_device(slots.to(table.dtype), device)
