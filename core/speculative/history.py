"""What the host knows of a verify row's sequence when drafts are proposed, for speculators that draft from it.

Under overlap scheduling a request's newest tokens reach ``req.output_ids`` one step late: when a verify batch is
built, the previous verify step's results are already on the host (the scheduler read how far each request got)
but its tokens are appended only after the new forward is queued. :class:`RecentTokens` hands out those unread
tokens; a row may still end in tokens the host has not seen at all (its last token came from a prefill or a
one-token decode step still in flight), which :meth:`RecentTokens.sequence` counts as ``missing``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from treadle.core.execution.forward_batch import ForwardMode

if TYPE_CHECKING:
    from treadle.core.execution.overlap import LaunchedStep
    from treadle.core.request import Req
    from treadle.core.scheduling.schedule_batch import ScheduleBatch


@dataclass
class RowTokens:
    """One verify row's sequence as the host knows it: ``req.origin_input_ids + req.output_ids``, then ``unread``
    (sampled, not appended yet), then ``missing`` tokens it cannot see; the row's first token is the last one."""

    unread: list[int]
    missing: int


class RecentTokens:
    """Follows the target's forwards (``step_launched``) and, for a verify batch about to run, says what each
    row's sequence is (``rows``). Never waits for the device nor asks it: a step the scheduler has not read yet
    counts as unseen (the scheduler reads a verify step before building the next batch, so its tokens are there;
    the answer depends only on the scheduler's own steps, the same on every tensor-parallel rank)."""

    def __init__(self) -> None:
        self._last_verify: "LaunchedStep | None" = None

    def step_launched(self, step: "LaunchedStep") -> None:
        if step.batch.forward_mode is ForwardMode.TARGET_VERIFY:
            self._last_verify = step

    def rows(self, batch: "ScheduleBatch") -> list[RowTokens]:
        """Each entry's sequence up to its row's first token (at ``entry.kv_start``)."""
        unread = self.unread()
        return [self.row(entry.req, entry.kv_start + 1, unread) for entry in batch.entries]

    def forget(self) -> None:
        self._last_verify = None

    def unread(self) -> dict[int, list[int]]:
        """``id(req) -> tokens`` of the last verify step the scheduler read (empty when there is none); pass it to
        :meth:`row`."""
        step = self._last_verify
        if step is None or step.results is None or not step.results.waited:
            return {}
        host = step.results.wait()
        if "accepted" not in host:
            return {}
        next_ids, accepted = host["next_ids"].tolist(), host["accepted"].tolist()
        return {id(entry.req): ids[:count + 1] for entry, ids, count in zip(step.batch.entries, next_ids, accepted)}

    @staticmethod
    def row(req: "Req", length: int, unread: dict[int, list[int]]) -> RowTokens:
        """``req``'s sequence of ``length`` tokens (its last the newest sampled one) as the host knows it;
        ``unread``: from :meth:`unread`. Before a decode batch is built, ``length`` is ``req.kv_len + 1``."""
        unread = unread.get(id(req), ())
        known = len(req.origin_input_ids) + len(req.output_ids)
        if known + len(unread) <= length:
            return RowTokens(list(unread), length - known - len(unread))
        return RowTokens([], max(0, length - known))  # appended already (or the host is ahead: no guess)
