"""What every server child process does first: logging, signals, dying with its parent."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys

LOG_FORMAT = "[treadle %(processName)s] %(asctime)s %(levelname)s %(name)s: %(message)s"
_PR_SET_PDEATHSIG = 1


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def configure_child_process(log_level: str) -> int:
    """Set up a child process; returns the parent's pid (the loop compares it to notice an orphaned child).

    Ctrl-C reaches the whole process group; only the parent acts on it and then
    stops the children with SIGTERM, which exits them cleanly.
    """
    configure_logging(log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if sys.platform.startswith("linux"):
        try:  # the kernel kills us if the parent dies, even by SIGKILL
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            pass
    return os.getppid()


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # The parent is stopping (or gone) and nothing here needs saving: skip the interpreter's
    # teardown of torch and friends, which takes seconds, so the whole server stops fast.
    logging.shutdown()
    os._exit(0)
