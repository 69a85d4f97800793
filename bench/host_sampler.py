"""HostSampler: where the host's main thread is, every few milliseconds, to explain a stalled step.

A daemon thread reads the main thread's Python stack (``sys._current_frames``) every ``interval_s`` and keeps
a timestamp and a few frames per sample. Afterwards :meth:`hot_frames` counts the frames sampled in a time
window, leaving out samples where the thread was waiting for the device (those are not host work). A gap
between two samples longer than the interval means the main thread held the GIL in one C call meanwhile (the
sampler could not run): the sample after the gap shows that call, weighted by the gap.

It costs the main thread a GIL hand-off per sample, so it is on only with ``treadle bench offline --step-trace``.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import Counter
from types import FrameType


class HostSampler:
    """Samples the main thread's Python stack on a daemon thread between :meth:`start` and :meth:`stop`."""

    def __init__(self, interval_s: float = 0.002, depth: int = 4) -> None:
        self.interval_s = interval_s
        self.depth = depth
        self.samples: list[tuple[float, float, tuple[str, ...]]] = []  # (time, ms since the last sample, frames)
        self._main_id = threading.main_thread().ident
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="host-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._main_id)
            now = time.perf_counter()
            if frame is not None:
                self.samples.append((now, (now - last) * 1e3, _frames(frame, self.depth)))
            last = now

    def hot_frames(self, start: float, end: float, top: int = 4) -> list[tuple[str, float]]:
        """The stacks (innermost frame first, joined by " < ") sampled in ``[start, end)`` (``time.perf_counter``
        seconds), by ms of host work, waits for the device left out."""
        counts: Counter[str] = Counter()
        for when, gap_ms, frames in self.samples:
            if start <= when < end and not _waiting(frames):
                counts[" < ".join(frames)] += gap_ms
        return [(where, round(ms, 1)) for where, ms in counts.most_common(top)]


def _waiting(frames: tuple[str, ...]) -> bool:
    """The host was waiting for the device (a step's tokens, or a synchronize), not working."""
    return any(f.endswith("(synchronize)") or (f.startswith("overlap.py:") and f.endswith("(wait)")) for f in frames)


def _frames(frame: FrameType | None, depth: int) -> tuple[str, ...]:
    names = []
    while frame is not None and len(names) < depth:
        code = frame.f_code
        names.append(f"{code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}({code.co_name})")
        frame = frame.f_back
    return tuple(names)
