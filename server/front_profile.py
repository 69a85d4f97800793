"""A diagnostic: where the HTTP front's CPU time goes under a real load.

With ``TREADLE_FRONT_PROFILE`` set to a folder, every HTTP worker and every detokenizer runs under
:mod:`cProfile` and writes ``<folder>/<process>.prof`` (``http-worker-0.prof``, ``detokenizer-0.prof``, ...) when
the server stops (SIGTERM). Read one with ``python -m pstats <file>`` (``sort tottime``, ``stats 30``). The
profiler slows Python code by up to ~2x, so compare shares of time, not the throughput of a profiled run.
"""

from __future__ import annotations

import cProfile
import os
from typing import Callable

PROFILE_ENV = "TREADLE_FRONT_PROFILE"


def start_profile(process: str) -> Callable[[], None] | None:
    """Start profiling this process when asked; returns the function that stops and writes it (None: not asked)."""
    folder = os.environ.get(PROFILE_ENV)
    if not folder:
        return None
    profiler = cProfile.Profile()
    profiler.enable()

    def write() -> None:
        profiler.disable()
        os.makedirs(folder, exist_ok=True)
        profiler.dump_stats(os.path.join(folder, f"{process}.prof"))

    return write
