"""Startup failures fail fast (a crashed child is in test_shutdown.py)."""

from __future__ import annotations

import socket

import pytest

from treadle.server.launch import ServerStartupError, serve


def test_a_busy_port_fails_before_loading_the_model(make_config) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        config = make_config("/nonexistent-model")
        config.server.port = busy.getsockname()[1]
        with pytest.raises(ServerStartupError, match="cannot listen on 127.0.0.1"):
            serve(config)


def test_an_unreadable_api_key_file_fails_before_loading_the_model(make_config, tmp_path) -> None:
    config = make_config("/nonexistent-model", api_key_file=str(tmp_path / "missing"))
    with pytest.raises(ServerStartupError, match="server.api_key_file: cannot read"):
        serve(config)
