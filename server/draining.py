"""Graceful shutdown: uvicorn, except that the first SIGINT/SIGTERM drains instead of closing the port.

Draining: new requests get 503 (``AdmissionMiddleware`` reads ``manager.draining``),
running ones get ``server.shutdown_timeout`` seconds to finish, what is left is
aborted (its clients get ``finish_reason: "abort"``), then uvicorn stops. A
second signal stops at once: every waiting handler gets a 503.

With several HTTP workers the main process's server passes each signal on
(``on_drain``, ``on_stop_now``): the other workers drain alongside it.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any, Callable

import uvicorn

logger = logging.getLogger("treadle.server")

# After aborting what outlived shutdown_timeout, how long the aborted requests get to answer.
_ABORT_FLUSH_TIMEOUT_S = 2.0


class DrainingServer(uvicorn.Server):
    """A uvicorn server that drains the TokenizerManager's requests on the first stop signal."""

    def __init__(self, config: uvicorn.Config, manager: Any, loop: asyncio.AbstractEventLoop,
                 on_drain: Callable[[], None] | None = None, on_stop_now: Callable[[], None] | None = None,
                 signals_only_drain: bool = False) -> None:
        super().__init__(config)
        self.manager = manager
        self.loop = loop
        self.drain_task: asyncio.Task | None = None
        self.on_drain = on_drain
        self.on_stop_now = on_stop_now
        # An HTTP worker other than the main process: a repeated signal (Ctrl-C reaches the whole process group,
        # then the main process passes SIGTERM on) still only drains; the main process says when to stop now.
        self.signals_only_drain = signals_only_drain

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Called as a signal handler on the loop's thread, between two bytecodes: hand the work to the loop.
        self.loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self.signals_only_drain and (self.should_exit or self.drain_task is not None):
            return
        if self.should_exit or self.drain_task is not None:
            logger.warning("%s again: stopping now, failing %d requests", name, len(self.manager.states))
            self.stop_now("the server is stopping")
            return
        if self.on_drain is not None:
            self.on_drain()
        self.drain_task = self.loop.create_task(self._drain(name))

    def stop_now(self, reason: str, force: bool = True) -> None:
        """Fail every waiting handler with a 503 and stop serving (and tell the other workers to); ``force``
        also skips the wait for responses still being written."""
        if self.on_stop_now is not None:
            self.on_stop_now()
        self.manager.fail_all(reason)
        self.should_exit = True
        self.force_exit = self.force_exit or force

    async def _drain(self, name: str) -> None:
        manager = self.manager
        timeout = manager.config.server.shutdown_timeout
        manager.draining = True
        how_to_stop = "" if self.signals_only_drain else " (send the signal again to stop at once)"
        logger.info("%s: draining; new requests get 503, %d running requests get up to %g s to finish%s",
                    name, len(manager.states), timeout, how_to_stop)
        await wait_until(lambda: not manager.states, timeout)
        if manager.states:
            logger.warning("aborting %d requests still running after server.shutdown_timeout = %g s",
                           len(manager.states), timeout)
            for rid in list(manager.states):
                manager.abort(rid, keep_waiting=True)
            await wait_until(lambda: not manager.states, _ABORT_FLUSH_TIMEOUT_S)
        self.should_exit = True


async def wait_until(condition: Callable[[], bool], timeout: float) -> None:
    """Poll ``condition`` until it holds or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
