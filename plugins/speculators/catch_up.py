"""The catch-up step of a drafter: the tokens a draft's KV has not seen yet, and where each one is read.

Overlap scheduling appends a step's tokens to the host's request one step late, so the tokens a drafter must catch
up on are not all on the host when it proposes: the request's last sampled token is in the target's next-input
buffer (on the device), and the drafts the target just accepted are in the drafter's buffer of its last proposal.
:class:`CatchUp` collects the host's tokens in one list and where the others are read, so that the step's input
ids are built on the device with two gathers and no wait.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

from treadle.core.execution.overlap import to_device

if TYPE_CHECKING:
    from treadle.core.request import Req


class ProposalState(Protocol):
    """What a catch-up reads of a request's last proposal: its drafts sit in row ``row`` of the drafter's buffer of
    last drafts, ``proposed`` of them, for the positions after ``drafts_at`` (-1: none)."""

    row: int
    drafts_at: int
    proposed: int


class CatchUp:
    """One extend step of a drafter over several requests (``rows``: each one's index in the verify batch)."""

    def __init__(self) -> None:
        self.rows: list[int] = []
        self.table_rows: list[int] = []  # each one's row of the request table the step reads (``state.row``)
        self.extend_lens: list[int] = []
        self.prefix_lens: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []
        self.host_ids: list[int] = []  # 0 where the token is read on the device
        self.from_target: list[tuple[int, int]] = []  # (token index, target request-table row)
        self.from_drafts: list[tuple[int, int, int]] = []  # (token index, buffer row, column)

    def add(self, index: int, req: "Req", first: int, last: int, slots: list[int], state: ProposalState,
            shift: int = 0) -> bool:
        """Add ``req``'s tokens at positions ``[first, last]`` (``last``: its last sampled token), computed at KV
        positions ``[first - shift, last - shift]`` in ``slots``. False, adding nothing, when a token is nowhere
        to be read."""
        on_host = req.seq_len
        ids: list[int] = []
        target: list[tuple[int, int]] = []
        drafts: list[tuple[int, int, int]] = []
        for q in range(first, last + 1):
            if q < on_host:
                ids.append(req.token_at(q))
                continue
            ids.append(0)
            if q == last:
                target.append((q - first, req.req_pool_idx))
            elif state.drafts_at >= 0 and 0 <= q - state.drafts_at - 1 < state.proposed:
                drafts.append((q - first, state.row, q - state.drafts_at - 1))
            else:
                return False
        offset = len(self.host_ids)
        self.rows.append(index)
        self.table_rows.append(state.row)
        self.host_ids.extend(ids)
        self.from_target.extend((offset + k, row) for k, row in target)
        self.from_drafts.extend((offset + k, row, column) for k, row, column in drafts)
        self.extend_lens.append(last + 1 - first)
        self.prefix_lens.append(first - shift)
        self.positions.extend(range(first - shift, last + 1 - shift))
        self.slots.extend(slots)
        return True

    def device_input_ids(self, device: torch.device, target_ids: torch.Tensor,
                         last_drafts: torch.Tensor) -> torch.Tensor:
        """The step's token ids on the device: the host's, then the device-only ones copied in."""
        ids = to_device(torch.tensor(self.host_ids, dtype=torch.int64), device)
        if self.from_target:
            at, rows = zip(*self.from_target)
            ids.index_copy_(0, index_tensor(at, device), target_ids.index_select(0, index_tensor(rows, device)))
        if self.from_drafts:
            at, rows, columns = zip(*self.from_drafts)
            flat = [row * last_drafts.shape[1] + column for row, column in zip(rows, columns)]
            ids.index_copy_(0, index_tensor(at, device), last_drafts.view(-1).index_select(0, index_tensor(flat, device)))
        return ids


def index_tensor(values: Any, device: torch.device) -> torch.Tensor:
    return to_device(torch.tensor(list(values), dtype=torch.int64), device)
