"""Requests in flight per HTTP worker, shared between the workers so that admission limits hold across them.

With ``server.workers > 1`` each worker's TokenizerManager admits requests against
``max_inflight_requests`` (``scheduler.max_running_requests + server.max_queued_requests``) counting every
worker's requests, not only its own. The counts live in a small file in the server's private IPC folder that
every worker maps: worker ``i`` writes slot ``i`` (its own count, whenever it changes), and admission reads the
sum. One aligned 8-byte store per change and no lock: two workers admitting at the same instant may together
pass the limit by the requests they admit in that instant, never more.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

_SLOT_BYTES = 8


class InflightCounts:
    """Worker ``worker_id``'s view of the shared per-worker in-flight counts in the file at ``path``."""

    def __init__(self, path: str, worker_id: int) -> None:
        self.path = path
        self.worker_id = worker_id
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), 0)
        self._slots = memoryview(self._map).cast("q")
        if not 0 <= worker_id < len(self._slots):
            raise ValueError(f"worker {worker_id} has no slot in {path} ({len(self._slots)} workers)")

    @staticmethod
    def create(folder: str, workers: int) -> str:
        """Make the counts file for ``workers`` workers (all zero) in ``folder``; returns its path."""
        path = os.path.join(folder, "inflight-requests")
        with open(path, "wb") as file:
            file.write(bytes(_SLOT_BYTES * workers))
        return path

    def publish(self, count: int) -> None:
        """This worker now holds ``count`` requests."""
        self._slots[self.worker_id] = count

    def total(self) -> int:
        """Requests held by every worker."""
        return sum(self._slots)

    def close(self) -> None:
        self._slots.release()
        self._map.close()


class PublishedStates(dict):
    """A TokenizerManager's ``states`` (rid -> state) that publishes its size to the shared counts on every change."""

    def __init__(self, counts: InflightCounts) -> None:
        super().__init__()
        self.counts = counts

    def __setitem__(self, rid: str, state: Any) -> None:
        super().__setitem__(rid, state)
        self.counts.publish(len(self))

    def __delitem__(self, rid: str) -> None:
        super().__delitem__(rid)
        self.counts.publish(len(self))

    def pop(self, rid: str, *default: Any) -> Any:
        state = super().pop(rid, *default)
        self.counts.publish(len(self))
        return state

    def clear(self) -> None:
        super().clear()
        self.counts.publish(0)
