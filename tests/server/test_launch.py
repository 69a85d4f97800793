"""Process supervision: a crashed child takes the server down; a busy port fails fast."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx
import pytest

from treadle.server.launch import ServerStartupError, launch_server, serve


def test_a_killed_scheduler_takes_the_server_down_with_a_clear_log_line(tiny_model_dir: str, make_config) -> None:
    handle = launch_server(make_config(tiny_model_dir), timeout=180)
    try:
        pids = httpx.get(f"{handle.base_url}/get_server_info", timeout=30).json()["pids"]
        os.kill(pids["scheduler"], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while handle.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert handle.process.returncode == 1
        assert "the scheduler process exited unexpectedly" in handle.log()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pids['detokenizer']}"):
            time.sleep(0.1)
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", handle.port), timeout=5).close()
    finally:
        handle.shutdown(signal.SIGKILL)


def test_a_busy_port_fails_before_loading_the_model(make_config) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = make_config("/nonexistent-model")
        config.server.port = busy.getsockname()[1]
        with pytest.raises(ServerStartupError, match="cannot listen on 127.0.0.1"):
            serve(config)
