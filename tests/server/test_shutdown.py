"""Graceful shutdown and faults: each test starts its own server and ends with no process left.

- SIGTERM drains: the streaming request in flight completes, new requests get 503, exit 0.
- Past ``server.shutdown_timeout`` the rest is aborted; a second SIGINT stops at once.
- A SIGTERM at once after start-up (another HTTP worker answered /health before the main process serves) drains too.
- Any process SIGKILLed (the scheduler, standing for every child the main process watches, the detokenizer
  included; the main process with the tokenizer manager; or another HTTP worker) takes the whole server down
  within 5 s, with no orphan and the port free.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time
from typing import Iterator

import httpx
import pytest

from treadle.server.launch import ServerHandle, launch_server

# Long enough (~3 s on a CPU) that a busy machine cannot finish it before the signal is handled.
OUTPUT_TOKENS = 1500
LONG_STREAM = {"text": "drain me", "stream": True,
               "sampling_params": {"max_new_tokens": OUTPUT_TOKENS, "ignore_eos": True}}


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from treadle.testing.models import make_tiny_llama
    from treadle.testing.tokenizer import make_tiny_tokenizer

    path = tmp_path_factory.mktemp("tiny-llama-4k")
    make_tiny_llama(path, max_position_embeddings=4096)
    make_tiny_tokenizer(path)
    return str(path)


def _start(model_dir: str, make_config, **server: object) -> tuple[ServerHandle, dict[str, int]]:
    handle = launch_server(make_config(model_dir, **server), timeout=180)
    pids = httpx.get(f"{handle.base_url}/get_server_info", timeout=30).json()["pids"]
    return handle, pids


@contextlib.contextmanager
def _streaming(model_dir: str, make_config, **server: object
               ) -> Iterator[tuple[ServerHandle, dict[str, int], "_Stream"]]:
    """A server with one long stream under way (its first event arrived); SIGKILLed at the end if still up."""
    handle, pids = _start(model_dir, make_config, **server)
    try:
        stream = _Stream(handle.base_url)
        stream.start()
        assert stream.first.wait(30)
        yield handle, pids, stream
    finally:
        handle.shutdown(signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting to be reaped is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pids: list[int], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in pids if _alive(pid)], "processes left behind"


def _port_free(port: int, timeout: float = 5.0) -> None:
    """The port refuses connections within ``timeout`` (a killed process's threads close it a moment late)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=5).close()
        except ConnectionRefusedError:
            return
        assert time.monotonic() < deadline, f"port {port} still accepts connections"
        time.sleep(0.05)


class _Stream(threading.Thread):
    """Reads one streaming /generate in the background, as a client reading lines would; ``first`` is set at
    the first line. Keeps every line as it came, so a test can check the stream is whole (``events``)."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.first = threading.Event()
        self.lines: list[str] = []
        self.error: httpx.HTTPError | None = None

    def run(self) -> None:
        try:
            with httpx.stream("POST", f"{self.base_url}/generate", json=LONG_STREAM, timeout=60) as response:
                for line in response.iter_lines():
                    if line:
                        self.lines.append(line)
                        self.first.set()
        except httpx.HTTPError as exc:  # e.g. the connection closed mid-body
            self.error = exc

    @property
    def done(self) -> bool:
        return self.lines[-1:] == ["data: [DONE]"]

    def events(self) -> list[dict]:
        """The events before ``[DONE]``; fails unless every line is one whole ``data:`` JSON event."""
        assert self.error is None, repr(self.error)
        assert self.done, f"the stream ended without data: [DONE]; last line {self.lines[-1:]!r:.200}"
        cut = [line for line in self.lines[:-1] if not _is_json_event(line)]
        assert not cut, f"{len(cut)} lines are not whole data: JSON events, the first: {cut[0]!r:.200}"
        return [json.loads(line[6:]) for line in self.lines[:-1]]


def _is_json_event(line: str) -> bool:
    try:
        return line.startswith("data: ") and isinstance(json.loads(line[6:]), dict)
    except ValueError:
        return False


def test_sigterm_drains_running_requests_and_refuses_new_ones(long_context_model: str, make_config) -> None:
    with _streaming(long_context_model, make_config) as (handle, pids, stream):
        handle.process.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        refused = httpx.post(f"{handle.base_url}/generate", json={"text": "late"}, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"], (refused.text, handle.log()[-3000:])
        assert refused.json()["error"]["code"] == "server_shutting_down"
        stream.join(30)
        events = stream.events()
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "length", handle.log()[-3000:]
        assert len(events[-1]["output_ids"]) == OUTPUT_TOKENS
        assert handle.process.wait(30) == 0, handle.log()[-3000:]
        _wait_gone(list(pids.values()), 5)
        _port_free(handle.port)
        assert_nothing_alarming(handle)


def assert_nothing_alarming(handle: ServerHandle) -> None:
    """A clean stop's log: no leaked-semaphore warning (multiprocessing's resource tracker prints it as it ends,
    just after the server), no traceback, no process said to have died."""
    time.sleep(1)
    log = handle.log()
    for alarm in ("resource_tracker", "leaked", "Traceback", "unexpectedly"):
        assert alarm not in log, log[-3000:]


def test_requests_outliving_the_shutdown_timeout_are_aborted(long_context_model: str, make_config) -> None:
    with _streaming(long_context_model, make_config, shutdown_timeout=0.1) as (handle, pids, stream):
        handle.process.send_signal(signal.SIGTERM)
        stream.join(30)
        assert stream.events()[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert handle.process.wait(30) == 0
        _wait_gone(list(pids.values()), 5)


def test_a_second_sigint_stops_at_once(long_context_model: str, make_config) -> None:
    with _streaming(long_context_model, make_config, shutdown_timeout=60) as (handle, pids, _):
        handle.process.send_signal(signal.SIGINT)
        time.sleep(0.1)
        started = time.monotonic()
        handle.process.send_signal(signal.SIGINT)
        handle.process.wait(30)
        assert time.monotonic() - started < 10, handle.log()[-3000:]
        _wait_gone(list(pids.values()), 5)
        _port_free(handle.port)


def test_sigterm_as_soon_as_another_worker_answers_health_still_stops(long_context_model: str, make_config) -> None:
    # /health can be answered by HTTP worker 1 while the main process is still building its own server: a signal
    # then must drain all the same (it used to be only noted, and the server ran on).
    handle = launch_server(make_config(long_context_model, workers=2, shutdown_timeout=5), timeout=180)
    try:
        pid = handle.process.pid
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(child) for child in f.read().split()]
        assert handle.shutdown(signal.SIGTERM, timeout=20) == 0, handle.log()[-3000:]  # at once: the window is short
        _wait_gone(children, 5)
    finally:
        handle.shutdown(signal.SIGKILL)


# One victim per way a death is noticed: a child of the main process (the scheduler; the detokenizer is watched and
# handled by the same code, launch._Children.watch -> on_child_exit), the main process itself (every child sees its
# parent go), and another HTTP worker (a child the main process drains with, handled apart).
@pytest.mark.parametrize("victim", ["scheduler", "server", "http-worker-1"])
def test_a_killed_process_takes_everything_down_within_5_s(long_context_model: str, make_config, victim: str) -> None:
    # The last one: a server of two HTTP workers whose second worker process dies.
    handle, pids = _start(long_context_model, make_config, workers=2 if victim.startswith("http-worker") else 1)
    try:
        started = time.monotonic()
        os.kill(pids[victim], signal.SIGKILL)
        _wait_gone(list(pids.values()), 5)
        assert time.monotonic() - started < 5
        if victim != "server":
            assert handle.process.wait(5) != 0
            assert f"the {victim} process exited unexpectedly" in handle.log()
        _port_free(handle.port)
    finally:
        handle.shutdown(signal.SIGKILL)
