"""What every server child process does first: logging, signals, dying with its parent; the main process's stop
signals until uvicorn takes them over; the event loop."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Coroutine

LOG_FORMAT = "[treadle %(processName)s] %(asctime)s %(levelname)s %(name)s: %(message)s"
_PR_SET_PDEATHSIG = 1
_before_exit: list[Callable[[], None]] = []


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format=LOG_FORMAT, stream=sys.stderr, force=True)


def configure_child_process(log_level: str) -> int:
    """Set up a child process; returns the parent's pid (the loop compares it to notice an orphaned child).

    Ctrl-C reaches the whole process group; only the parent acts on it and then
    stops the children with SIGTERM, which exits them cleanly.
    """
    configure_logging(log_level)
    use_a_thread_lock_for_progress_bars()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    set_parent_death_signal(signal.SIGTERM)
    return os.getppid()


class StartupSignals:
    """The main process's SIGINT/SIGTERM handler until its DrainingServer takes them over: notes each signal
    (start-up stops when one came) and, once handed that server, passes them on to it, the noted ones first. So a
    signal that comes once start-up is done but before uvicorn runs (another HTTP worker may already answer
    ``/health`` then) drains, as one a moment later would."""

    def __init__(self) -> None:
        self.noted: list[int] = []
        self._server: Any = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self._server is None:
            self.noted.append(signum)
        else:
            self._server.handle_exit(signum, frame)

    def hand_to(self, server: Any) -> None:
        """Pass signals to ``server`` (a DrainingServer, whose loop runs) from now on, those noted so far first;
        None: only note them again (before that loop ends)."""
        self._server = server
        while server is not None and self.noted:
            server.handle_exit(self.noted.pop(0), None)


def set_parent_death_signal(sig: int) -> None:
    """Have the kernel send ``sig`` to this process when its parent dies, even by SIGKILL (Linux)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
        except (OSError, AttributeError):
            pass


def use_a_thread_lock_for_progress_bars() -> None:
    """tqdm's default lock is a named multiprocessing semaphore, which a process ended by a signal or ``os._exit``
    never unlinks (the resource tracker then warns of a leak at shutdown). A child's bars are its own: a thread
    lock serves."""
    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())


def before_exit_on_sigterm(cleanup: Callable[[], None]) -> None:
    """Run ``cleanup`` when SIGTERM ends this child (e.g. stop processes it started, remove files it made)."""
    _before_exit.append(cleanup)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    # The parent is stopping (or gone) and nothing here needs saving: skip the interpreter's
    # teardown of torch and friends, which takes seconds, so the whole server stops fast.
    for cleanup in reversed(_before_exit):
        try:
            cleanup()
        except Exception:  # the process is ending either way
            logging.getLogger(__name__).exception("cleanup before exit failed")
    logging.shutdown()
    os._exit(0)


def run_event_loop(main: Coroutine[Any, Any, Any], event_loop: str = "auto") -> Any:
    """Run ``main`` to completion on a new event loop (``server.event_loop``): uvloop's when asked, or with ``auto``
    when uvloop is installed; the standard library's otherwise. uvloop's loop and transports are C, so an HTTP
    worker spends less CPU on every streamed event."""
    uvloop = _uvloop() if event_loop != "asyncio" else None
    if uvloop is None:
        check_event_loop(event_loop)
        return asyncio.run(main)
    if hasattr(uvloop, "run"):
        return uvloop.run(main)
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())  # uvloop before 0.18
    return asyncio.run(main)


def check_event_loop(event_loop: str) -> None:
    """Raise ConfigError when ``server.event_loop`` asks for uvloop and it is not installed."""
    if event_loop == "uvloop" and _uvloop() is None:
        from treadle.core.config import ConfigError

        raise ConfigError("server.event_loop is uvloop but uvloop is not installed; `pip install uvloop`, or set "
                          "server.event_loop to auto or asyncio")


def _uvloop() -> Any:
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop
