"""Graceful shutdown: uvicorn, except that the first SIGINT/SIGTERM drains instead of closing the port.

Draining: new requests get 503 (``AdmissionMiddleware`` reads ``manager.draining``),
running ones get ``server.shutdown_timeout`` seconds to finish, what is left is
aborted (its clients get ``finish_reason: "abort"``), then uvicorn stops. A
second signal stops at once: every waiting handler gets a 503.
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

    def __init__(self, config: uvicorn.Config, manager: Any, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(config)
        self.manager = manager
        self.loop = loop
        self.drain_task: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        # Called as a signal handler on the loop's thread, between two bytecodes: hand the work to the loop.
        self.loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        if self.should_exit or self.drain_task is not None:
            logger.warning("%s again: stopping now, failing %d requests", name, len(self.manager.states))
            self.manager.fail_all("the server is stopping")
            self.should_exit = True
            self.force_exit = True
            return
        self.drain_task = self.loop.create_task(self._drain(name))

    async def _drain(self, name: str) -> None:
        manager = self.manager
        timeout = manager.config.server.shutdown_timeout
        manager.draining = True
        logger.info("%s: draining; new requests get 503, %d running requests get up to %g s to finish "
                    "(send the signal again to stop at once)", name, len(manager.states), timeout)
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
