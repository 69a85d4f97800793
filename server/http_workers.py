"""The HTTP workers: ``server.workers`` processes that each run uvicorn + FastAPI + a TokenizerManager on one port.

Worker 0 is the main process (:mod:`treadle.server.launch`), which also supervises every other process; workers
1 .. N-1 are processes it starts while the model loads and hands the model's description and tokenizer once it
has loaded. Each worker listens on a socket of its own, all bound to the server's port with ``SO_REUSEPORT`` by
the main process before the model loads (so a busy port fails at once): the kernel spreads new connections over
the listening workers by their address hash, so one worker's backlog never takes every connection of a burst.

Each worker's requests carry its id; the scheduler, the data-parallel controller and the detokenizer send
everything about a request back to that worker's inbox (:mod:`treadle.server.ipc`). Every worker counts its own
requests into prometheus-client's multiprocess folder (one ``/metrics`` scrape sums them) and its in-flight
requests into the shared counts that admission reads (:mod:`treadle.server.inflight`).

Signals from the main process: SIGTERM drains (new requests get 503, running ones get
``server.shutdown_timeout`` to finish, then the worker exits 0); SIGUSR1 stops at once (every waiting handler
gets a 503), which the main process sends when another process died, and the kernel sends if the main process
itself dies.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import socket
import tempfile
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from treadle.core.config import ServerConfig
from treadle.server.front_profile import start_profile
from treadle.server.inflight import InflightCounts
from treadle.server.ipc import IpcAddresses
from treadle.server.process_utils import configure_logging, run_event_loop, set_parent_death_signal

logger = logging.getLogger("treadle.server")

# prometheus-client reads this when each metric is made: set before any worker makes one.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# After the drain, how long uvicorn waits for responses still being written.
RESPONSE_FLUSH_TIMEOUT_S = 5
STOP_NOW_REASON = "the server is stopping: one of its processes exited"


@dataclass(frozen=True)
class FrontendLayout:
    """What the HTTP workers share: how many there are, the in-flight counts file and the metrics folder
    (both None with one worker)."""

    workers: int
    inflight_path: str | None = None
    metrics_dir: str | None = None

    @classmethod
    def create(cls, workers: int, ipc_folder: str) -> "FrontendLayout":
        """The layout for ``workers`` workers; with more than one, sets ``PROMETHEUS_MULTIPROC_DIR`` in this
        process's environment (which the workers started after inherit)."""
        if workers == 1:
            os.environ.pop(MULTIPROC_ENV, None)  # one process: plain in-memory metrics, as the server owns them
            return cls(1)
        metrics_dir = tempfile.mkdtemp(prefix="treadle-metrics-")
        os.environ[MULTIPROC_ENV] = metrics_dir
        return cls(workers, InflightCounts.create(ipc_folder, workers), metrics_dir)

    def remove(self) -> None:
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)
            if os.environ.get(MULTIPROC_ENV) == self.metrics_dir:
                del os.environ[MULTIPROC_ENV]


def build_http_server(config: ServerConfig, addresses: IpcAddresses, model_info: dict[str, Any], tokenizer: Any,
                      layout: FrontendLayout, worker_id: int, server_info: dict[str, Any]) -> Any:
    """Worker ``worker_id``'s TokenizerManager, app and (draining) uvicorn server, in the running loop."""
    import uvicorn

    from treadle.core.loading.gc_freeze import freeze_startup_objects
    from treadle.server.app import build_app
    from treadle.server.draining import DrainingServer
    from treadle.server.metrics import ServerMetrics
    from treadle.server.tokenizer_manager import TokenizerManager

    inflight = InflightCounts(layout.inflight_path, worker_id) if layout.inflight_path else None
    manager = TokenizerManager(config, model_info, tokenizer, addresses, ServerMetrics(layout.metrics_dir),
                               worker_id=worker_id, inflight=inflight)
    app = build_app(manager, server_info)
    freeze_startup_objects()  # full collections would walk the tokenizer, FastAPI and torch modules mid-stream
    uv_config = uvicorn.Config(app, log_level=config.server.log_level,
                               timeout_graceful_shutdown=RESPONSE_FLUSH_TIMEOUT_S,
                               access_log=config.server.log_level == "debug")
    return DrainingServer(uv_config, manager, asyncio.get_running_loop(), signals_only_drain=worker_id > 0)


def run_http_worker(worker_id: int, config: ServerConfig, addresses: IpcAddresses, layout: FrontendLayout,
                    listen_socket: socket.socket, inbox: Connection, outbox: Connection) -> None:
    """Process entry point of HTTP worker ``worker_id`` (1 .. N-1): wait for the model, serve until told to stop.

    ``inbox`` brings ``(model_info, tokenizer, server_info)`` once the model has loaded (EOF: the server stopped
    first); ``outbox`` says ``"serving"`` once uvicorn listens.
    """
    configure_logging(config.server.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the main process acts on it
    set_parent_death_signal(signal.SIGUSR1)
    try:
        model_info, tokenizer, server_info = inbox.recv()
    except EOFError:
        return
    write_profile = start_profile(f"http-worker-{worker_id}")
    status = run_event_loop(_serve(worker_id, config, addresses, layout, listen_socket, outbox,
                                   model_info, tokenizer, server_info), config.server.event_loop)
    if write_profile is not None:
        write_profile()
    # Nothing is left to save: skip the interpreter's teardown of torch and friends (seconds, under load), so the
    # main process, which waits for its workers before it stops the scheduler, stops fast.
    logging.shutdown()
    os._exit(status)


async def _serve(worker_id: int, config: ServerConfig, addresses: IpcAddresses, layout: FrontendLayout,
                 listen_socket: socket.socket, outbox: Connection, model_info: dict[str, Any], tokenizer: Any,
                 server_info: dict[str, Any]) -> int:
    loop = asyncio.get_running_loop()
    server = build_http_server(config, addresses, model_info, tokenizer, layout, worker_id, server_info)
    manager = server.manager
    crashed: list[str] = []

    def on_fatal(reason: str) -> None:  # this worker's output routing died
        crashed.append(reason)
        server.stop_now(reason, False)

    loop.add_signal_handler(signal.SIGUSR1, server.stop_now, STOP_NOW_REASON, False)
    manager.start(on_fatal)
    reporter = loop.create_task(_report_serving(server, outbox))
    try:
        await server.serve(sockets=[listen_socket])
    finally:
        reporter.cancel()
        manager.close()
    return 1 if crashed else 0


async def _report_serving(server: Any, outbox: Connection) -> None:
    while not server.started:
        await asyncio.sleep(0.02)
    outbox.send("serving")
    outbox.close()
