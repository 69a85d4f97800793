"""ScheduleBatch: the scheduler's view of one step (the model worker turns it into a device ForwardBatch:
core/execution/forward_inputs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from treadle.core.execution.forward_batch import ForwardMode
from treadle.core.execution.forward_inputs import token_owners
from treadle.core.execution.overlap import to_device_packed
from treadle.core.request import Req

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep

__all__ = ["BatchEntry", "ScheduleBatch", "token_owners"]


@dataclass
class BatchEntry:
    """One request's share of a step: compute tokens ``[kv_start, kv_start + extend_len)``."""

    req: Req
    kv_start: int
    extend_len: int
    new_slots: torch.Tensor  # host int64, extend_len slots
    write_from: int  # req_to_token positions rewritten from here (0 when the prefix is new to the row)
    logit_positions: range = field(default_factory=lambda: range(0))  # sequence positions needing logits
    completes_sequence: bool = True  # False for a middle chunk of a chunked prefill: nothing is sampled
    # Decode: the input token is the request's last sampled one, read from the device (it may not
    # have reached the host yet under overlap scheduling).
    input_on_device: bool = False


@dataclass
class ScheduleBatch:
    """The requests of one step and where each one's logits rows are."""

    forward_mode: ForwardMode
    entries: list[BatchEntry]
    # An overlapped verify batch (DecodeManager.overlapped_verify_batch): the verify step still in flight whose
    # acceptance places this one's tokens (on the device), and each entry's row in it. Until that step is read its
    # entries' ``kv_start`` are upper bounds (every draft kept); reading it sets them and clears ``follows``.
    follows: "LaunchedStep | None" = None
    follow_rows: list[int] | None = None

    @property
    def reqs(self) -> list[Req]:
        return [entry.req for entry in self.entries]

    def follows_every_row(self) -> bool:
        """Whether this overlapped batch's entries are the rows of the step it ``follows``, all of them in order:
        that step's per-row tensors then need no gather by ``follow_rows``."""
        return self.follow_rows == list(range(len(self.follows.batch.entries)))

    def last_logit_rows(self) -> list[int]:
        """Row (in the model's logits) of each request's last computed position."""
        rows, offset = [], 0
        for entry in self.entries:
            offset += len(entry.logit_positions)
            rows.append(offset - 1)
        return rows

    def write_req_to_token(self, req_to_token: torch.Tensor) -> None:
        """Record the slots of every (re)written position in the device table, in one scatter (its indices moved
        in one copy)."""
        entries = self.entries
        if all(e.write_from == e.kv_start for e in entries):  # decode and verify rows: the slots just allocated
            lengths = [e.extend_len for e in entries]
            starts = np.asarray([e.kv_start for e in entries], dtype=np.int64)
            rows = np.asarray([e.req.req_pool_idx for e in entries], dtype=np.int64)
            if all(n == lengths[0] for n in lengths):
                offset = np.arange(lengths[0], dtype=np.int64)
                rows, cols = np.repeat(rows, lengths[0]), (starts[:, None] + offset).reshape(-1)
            else:
                owner, offset = token_owners(lengths)
                rows, cols = rows[owner.numpy()], starts[owner.numpy()] + offset.numpy()
            slots = np.concatenate([e.new_slots.numpy() for e in entries])
        else:
            spans = [(e, e.kv_start + e.extend_len) for e in entries]
            owner, offset = token_owners([end - e.write_from for e, end in spans])
            rows = torch.tensor([e.req.req_pool_idx for e in entries], dtype=torch.int64)[owner]
            cols = torch.tensor([e.write_from for e in entries], dtype=torch.int64)[owner] + offset
            # Rows written from their first new token take the slots just allocated; reading req.kv_slots
            # would join each decode row's slot list into a tensor (~485 of them in a mixed step: ~7 ms).
            slots = torch.cat([e.new_slots if e.write_from == e.kv_start else e.req.kv_slots[e.write_from:end]
                               for e, end in spans])
        rows, cols, slots = to_device_packed([rows, cols, slots], req_to_token.device)
        req_to_token[rows, cols] = slots.to(req_to_token.dtype)
