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


def test_accepted_connections_turn_nagle_off() -> None:
    """With Nagle's algorithm on, each streamed chunk after a response's headers on a kept-alive connection
    waits for the client's delayed ACK (~40 ms on Linux): asyncio turns it off only on sockets accepted from a
    listener whose proto is TCP, so the server's listener must say so."""
    import asyncio

    from treadle.server.launch import _bind

    async def accepted_nodelay() -> int:
        listener = _bind("127.0.0.1", 0)
        listener.listen()
        seen: asyncio.Future = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname()[:2])
        try:
            return await asyncio.wait_for(seen, 5)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1
