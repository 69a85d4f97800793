"""Start and stop the server: ``serve(config)`` (blocking) and ``launch_server(config)`` (a handle, for tests).

``serve`` binds the port first (so a busy port fails before the model loads),
starts the scheduler and detokenizer processes (and, with ``server.workers`` > 1,
the other HTTP workers: :mod:`treadle.server.http_workers`), waits for the model,
then runs uvicorn in this process, which is HTTP worker 0. The first
SIGINT/SIGTERM drains, in every worker: new requests get 503, running ones get
``server.shutdown_timeout`` seconds to finish, the rest are aborted, then the
workers, uvicorn and the children stop and the process exits 0. A second signal
stops at once. A child that dies on its own (an HTTP worker too, or the
output-routing task of this process) takes the server down with an error log
line and exit status 1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Callable

from treadle.core.auto_size import available_cpus, resolve_http_workers
from treadle.core.config import ConfigError, ServerConfig, load_config
from treadle.server.front_profile import start_profile
from treadle.server.http_workers import FrontendLayout, build_http_server, run_http_worker
from treadle.server.ipc import IpcAddresses
from treadle.server.process_utils import StartupSignals, check_event_loop, configure_logging, run_event_loop

logger = logging.getLogger("treadle.server")

_CHILD_STOP_TIMEOUT_S = 10.0
# Beyond server.shutdown_timeout, how long the other HTTP workers get to finish draining.
_WORKER_DRAIN_MARGIN_S = 15.0
# The config with its secrets travels to a launch_server child in this variable, not on its command line.
CONFIG_ENV = "TREADLE_LAUNCH_CONFIG_JSON"


class ServerStartupError(RuntimeError):
    """The server could not start (port in use, model failed to load, a child died)."""


def serve(config: ServerConfig, scheduler_target: Callable[..., None] | None = None) -> None:
    """Run the server until SIGINT/SIGTERM; raises SystemExit(1) if a child process crashes.

    ``scheduler_target`` replaces the scheduler process's entry point (a picklable function taking
    ``run_scheduler_process``'s arguments): bench/front_end.py serves a stand-in scheduler through it.

    On a node other than node 0 (``parallel.node_rank > 0``) it runs only this node's scheduler ranks (no HTTP)
    until rank 0 stops them, or with ``parallel.dp_size > 1`` this node's replicas until node 0's controller does.
    """
    configure_logging(config.server.log_level)
    if config.parallel.node_rank > 0:
        _serve_node_ranks(config)
        return
    try:  # an unreadable key file or a missing event loop fails now, before the model loads
        config.server.resolved_api_key()
        config.server.resolved_admin_api_key()
        check_event_loop(config.server.event_loop)
    except ConfigError as exc:
        raise ServerStartupError(str(exc)) from None
    stop_signals = StartupSignals()
    workers = resolve_http_workers(config.server.workers, available_cpus())  # as the resolved config has it
    listen_sockets = _bind_all(config.server.host, config.server.port, workers)
    # While the model loads a signal just stops the start; from _run_http on, the DrainingServer handles them.
    previous = {sig: signal.signal(sig, stop_signals) for sig in (signal.SIGINT, signal.SIGTERM)}
    addresses = IpcAddresses.new(workers, min(config.server.detokenizers, workers))
    layout = FrontendLayout.create(workers, addresses.folder)  # before any metric is made, here or in a worker
    children = _Children(config, addresses, layout, listen_sockets[1:], scheduler_target)
    exit_code = 0
    try:
        ready = children.start(should_stop=lambda: bool(stop_signals.noted), while_waiting=_preload_http_stack)
        if ready is None:
            logger.info("stopped before the model finished loading")
            return
        model_info, tokenizer = ready
        write_profile = start_profile("http-worker-0")
        exit_code = run_event_loop(_run_http(config, addresses, layout, model_info, tokenizer, listen_sockets[0],
                                             children, stop_signals), config.server.event_loop)
        if write_profile is not None:
            write_profile()
    finally:
        children.stop()
        for sock in listen_sockets:
            sock.close()
        shutil.rmtree(addresses.folder, ignore_errors=True)
        layout.remove()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        logger.info("server stopped")
    if exit_code:
        raise SystemExit(exit_code)


async def _run_http(config: ServerConfig, addresses: IpcAddresses, layout: FrontendLayout,
                    model_info: dict[str, Any], tokenizer: Any, listen_socket: socket.socket,
                    children: "_Children", stop_signals: StartupSignals) -> int:
    server = build_http_server(config, addresses, model_info, tokenizer, layout, 0, {"pids": children.pids()})
    manager = server.manager
    server.on_drain = children.drain_http_workers
    server.on_stop_now = children.stop_http_workers_now
    loop = asyncio.get_running_loop()
    crashed: list[str] = []

    def on_fatal(reason: str) -> None:
        if server.should_exit:
            return
        crashed.append(reason)
        server.stop_now(reason, force=False)

    def on_child_exit(name: str, code: int | None) -> None:
        if name.startswith(_HTTP_WORKER) and manager.draining and code == 0:
            return  # that worker has drained
        if server.should_exit:
            if not name.startswith(_HTTP_WORKER):
                children.stop_http_workers_now()  # workers still draining: their requests will not finish
            return
        reason = f"the {name} process exited unexpectedly (exit code {code}); shutting the server down"
        logger.error(reason)
        on_fatal(reason)

    manager.start(on_fatal)
    children.watch(loop, on_child_exit)
    stop_signals.hand_to(server)  # a signal since start-up ended drains now (uvicorn's handlers come later)
    host, port = listen_socket.getsockname()[:2]
    logger.info("treadle serves %s at http://%s:%d with %d HTTP worker%s", manager.served_model_name, host, port,
                layout.workers, "s" if layout.workers > 1 else "")
    try:
        await server.serve(sockets=[listen_socket])
        await children.wait_http_workers(config.server.shutdown_timeout + _WORKER_DRAIN_MARGIN_S)
    finally:
        stop_signals.hand_to(None)
        children.unwatch(asyncio.get_running_loop())
        manager.close()
    return 1 if crashed else 0


_HTTP_WORKER = "http-worker-"


def _detokenizer_name(shard: int) -> str:
    return f"detokenizer-{shard}" if shard else "detokenizer"


def _run_scheduler_process(config: ServerConfig, addresses: IpcAddresses, ready: Connection) -> None:
    from treadle.server.scheduler_process import run_scheduler_process  # here: the main process never loads torch

    run_scheduler_process(config, addresses, ready)


class _Children:
    """The scheduler and detokenizer processes, and HTTP workers 1 .. N-1."""

    def __init__(self, config: ServerConfig, addresses: IpcAddresses, layout: FrontendLayout,
                 worker_sockets: list[socket.socket], scheduler_target: Callable[..., None] | None = None) -> None:
        from treadle.server.detokenizer import run_detokenizer_process
        from treadle.server.dp_controller import run_dp_controller_process

        self.context = mp.get_context("spawn")  # CUDA and threads do not survive fork
        self.ready_recv, ready_send = self.context.Pipe(duplex=False)
        self._child_ends: list[Connection] = []
        # With data parallelism the "scheduler" is the controller in front of the replicas.
        if scheduler_target is None:
            scheduler_target = run_dp_controller_process if config.parallel.dp_size > 1 else _run_scheduler_process
        self.processes = {
            "scheduler": self.context.Process(
                target=scheduler_target, args=(config, addresses, ready_send), name="scheduler"),
            **{_detokenizer_name(shard): self.context.Process(
                target=run_detokenizer_process, args=(addresses, config.server.log_level, shard),
                name=_detokenizer_name(shard)) for shard in range(len(addresses.detokenizer_inputs))},
        }
        # Each other HTTP worker: its process, the pipe that hands it the model, the one that says it serves.
        self.http_workers: dict[str, tuple[Any, Connection, Connection]] = {}
        for worker_id, sock in enumerate(worker_sockets, start=1):
            model_recv, model_send = self.context.Pipe(duplex=False)
            serving_recv, serving_send = self.context.Pipe(duplex=False)
            name = f"{_HTTP_WORKER}{worker_id}"
            self.processes[name] = self.context.Process(
                target=run_http_worker, name=name,
                args=(worker_id, config, addresses, layout, sock, model_recv, serving_send))
            self.http_workers[name] = (self.processes[name], model_send, serving_recv)
            self._child_ends.extend([model_recv, serving_send])
        self._ready_send = ready_send
        self._stopping = False

    def pids(self) -> dict[str, int | None]:
        return {name: p.pid for name, p in self.processes.items()}

    def start(self, should_stop: Any, while_waiting: Any = None) -> tuple[dict[str, Any], Any] | None:
        """Start them all; wait until the scheduler has loaded the model and every HTTP worker serves. None if a
        stop signal came first."""
        for process in self.processes.values():
            process.start()
        self._ready_send.close()
        for end in self._child_ends:
            end.close()
        if while_waiting is not None:
            while_waiting()
        scheduler = self.processes["scheduler"]
        while not self.ready_recv.poll(0.2):
            if should_stop():
                return None
            self._check_alive()
        try:
            message = self.ready_recv.recv()
        except EOFError:
            scheduler.join(timeout=5)  # its pipe closed as it exited; reap it so its exit code is known
            raise ServerStartupError(
                f"the scheduler process exited during startup (exit code {scheduler.exitcode})") from None
        if message[0] != "ready":
            raise ServerStartupError(f"the scheduler failed to start: {message[1]}")
        if not self._start_http_workers(message[1], message[2], should_stop):
            return None
        return message[1], message[2]

    def _start_http_workers(self, model_info: dict[str, Any], tokenizer: Any, should_stop: Any) -> bool:
        """Hand every other HTTP worker the model; wait until each serves. False if a stop signal came first."""
        server_info = {"pids": {"server": os.getpid(), **self.pids()}}
        for _, model_send, _ in self.http_workers.values():
            try:
                model_send.send((model_info, tokenizer, server_info))
            except OSError:  # that worker is gone
                time.sleep(0.5)
                self._check_alive()
                raise
        for name, (process, _, serving_recv) in self.http_workers.items():
            while not serving_recv.poll(0.2):
                if should_stop():
                    return False
                self._check_alive()
            try:
                serving_recv.recv()
            except EOFError:
                process.join(timeout=5)
                raise ServerStartupError(f"the {name} process exited during startup (exit code "
                                         f"{process.exitcode}); see its log above") from None
        return True

    def _check_alive(self) -> None:
        for name, process in self.processes.items():
            if not process.is_alive():
                raise ServerStartupError(f"the {name} process exited during startup (exit code "
                                         f"{process.exitcode}); see its log above")

    def drain_http_workers(self) -> None:
        """SIGTERM to the other HTTP workers: they drain as this process does."""
        self._signal_http_workers(signal.SIGTERM)

    def stop_http_workers_now(self) -> None:
        """SIGUSR1 to the other HTTP workers: they fail their requests with 503 and exit."""
        self._signal_http_workers(signal.SIGUSR1)

    def _signal_http_workers(self, sig: int) -> None:
        for process, _, _ in self.http_workers.values():
            if process.is_alive():
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    async def wait_http_workers(self, timeout: float) -> None:
        """Wait (up to ``timeout`` s) for the other HTTP workers to exit, as they do once drained."""
        deadline = time.monotonic() + timeout
        while any(p.is_alive() for p, _, _ in self.http_workers.values()) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    def watch(self, loop: asyncio.AbstractEventLoop, on_exit: Any) -> None:
        for name, process in self.processes.items():
            loop.add_reader(process.sentinel, self._exited, loop, name, process, on_exit)

    def _exited(self, loop: asyncio.AbstractEventLoop, name: str, process: Any, on_exit: Any) -> None:
        loop.remove_reader(process.sentinel)
        process.join(timeout=1)
        if not self._stopping:
            on_exit(name, process.exitcode)

    def unwatch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._stopping = True
        for process in self.processes.values():
            if process.sentinel is not None:
                try:
                    loop.remove_reader(process.sentinel)
                except (ValueError, OSError):
                    pass

    def stop(self) -> None:
        """SIGTERM them all, wait, SIGKILL what is left."""
        self._stopping = True
        for _, model_send, serving_recv in self.http_workers.values():
            model_send.close()  # a worker still waiting for the model sees EOF and exits
            serving_recv.close()
        for process in self.processes.values():
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + _CHILD_STOP_TIMEOUT_S
        for name, process in self.processes.items():
            if process.pid is None:
                continue
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                logger.warning("the %s process did not stop within %.0f s; killing it", name, _CHILD_STOP_TIMEOUT_S)
                process.kill()
                process.join(timeout=5)
        self.ready_recv.close()


def _serve_node_ranks(config: ServerConfig) -> None:
    from treadle.server.dp_nodes import DpNodeError, serve_dp_node

    # SIGTERM/SIGINT here stop the ranks or replicas (they die with this process); node 0 then fails.
    previous = {sig: signal.signal(sig, _raise_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        if config.parallel.dp_size > 1:
            status = serve_dp_node(config)  # this process only relays: it never imports torch
        else:
            from treadle.core.distributed.tensor_parallel import run_node_ranks

            status = run_node_ranks(config)
    except DpNodeError as exc:
        raise ServerStartupError(str(exc)) from None
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if status:
        raise SystemExit(status)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(0)


def _preload_http_stack() -> None:
    """Import what the HTTP side needs (and what unpickling the tokenizer needs) while the model loads."""
    import transformers  # noqa: F401
    import uvicorn  # noqa: F401

    import treadle.server.app  # noqa: F401
    import treadle.server.openai_routes  # noqa: F401


def _bind_all(host: str, port: int, count: int) -> list[socket.socket]:
    """``count`` sockets bound to ``host:port`` (port 0: a free port), with SO_REUSEPORT when several: one for each
    HTTP worker, the kernel spreading connections over those that listen."""
    probe = _bind(host, port)  # fails if anything listens there, a server of several workers included
    if count == 1:
        return [probe]
    port = probe.getsockname()[1]
    probe.close()
    sockets: list[socket.socket] = []
    try:
        while len(sockets) < count:
            sockets.append(_bind(host, port, reuse_port=True))
    except BaseException:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _bind(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    # proto must say TCP: asyncio turns Nagle's algorithm off (TCP_NODELAY) only on accepted sockets whose
    # proto is IPPROTO_TCP, and with Nagle on, every streamed chunk after a response's headers on a kept-alive
    # connection waits for the client's delayed ACK (~40 ms on Linux).
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ServerStartupError(f"cannot listen on {host}:{port}: {exc.strerror}; "
                                 "set server.port to a free port (or stop what is using it)") from None
    sock.set_inheritable(False)
    return sock


# ---------------------------------------------------------------- a server in a subprocess (tests, scripts)


@dataclass
class ServerHandle:
    """A server running in a child process (from :func:`launch_server`)."""

    process: subprocess.Popen
    base_url: str
    port: int
    api_key: str | None
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def shutdown(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send ``sig`` and wait for the server to exit; returns its exit status."""
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                raise RuntimeError(f"the server did not exit within {timeout:.0f} s of signal {sig}:\n{self.log()[-3000:]}")
        return self.process.returncode

    def __enter__(self) -> "ServerHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def launch_server(config: ServerConfig, timeout: float = 300.0, env: dict[str, str] | None = None) -> ServerHandle:
    """Start ``serve(config)`` in a subprocess (port 0 → a free port) and wait until /health answers."""
    if config.server.port == 0:
        config = config.model_copy(deep=True)
        config.server.port = _free_port(config.server.host)
    log_file = tempfile.NamedTemporaryFile(prefix="treadle-server-", suffix=".log", delete=False)
    # Through the environment, not argv: other users can read a command line, not an environment.
    process = subprocess.Popen(
        [sys.executable, "-m", "treadle.server.launch", "--config-env"],
        stdout=log_file, stderr=subprocess.STDOUT,
        env={**os.environ, **(env or {}), CONFIG_ENV: json.dumps(_config_with_secrets(config))},
    )
    log_file.close()
    host = config.server.host
    handle = ServerHandle(process, f"http://{host}:{config.server.port}", config.server.port,
                          config.server.resolved_api_key(), Path(log_file.name))
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ServerStartupError(f"the server exited with status {process.returncode} during startup:\n"
                                     f"{handle.log()[-5000:]}")
        try:
            with urllib.request.urlopen(f"{handle.base_url}/health", timeout=2) as response:
                if response.status == 200:
                    return handle
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.2)
    handle.shutdown(signal.SIGKILL)
    raise ServerStartupError(f"the server did not become healthy within {timeout:.0f} s:\n{handle.log()[-5000:]}")


def _config_with_secrets(config: ServerConfig) -> dict[str, Any]:
    values = config.model_dump(mode="json")
    for name in ("api_key", "admin_api_key"):
        secret = getattr(config.server, name)
        values["server"][name] = secret.get_secret_value() if secret is not None else None
    return values


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    """``python -m treadle.server.launch [--config FILE] [--set key=value ...]``."""
    parser = argparse.ArgumentParser(prog="treadle serve", description="Start the treadle HTTP server.")
    parser.add_argument("--config", help="YAML config file")
    parser.add_argument("--config-env", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. --set server.port=8000 (repeatable)")
    args = parser.parse_args(argv)
    if args.config_env:
        config = ServerConfig(**json.loads(os.environ.pop(CONFIG_ENV)))
    else:
        config = load_config(args.config, overrides=args.set)
    try:
        serve(config)
    except ServerStartupError as exc:
        logger.error("%s", exc)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
