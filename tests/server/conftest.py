"""Fixtures for server tests: a tiny Llama with a byte-level tokenizer and chat template."""

from __future__ import annotations

import pytest

from treadle.core.config import ServerConfig


@pytest.fixture(scope="session")
def tiny_model_dir(tiny_llama_text_dir: str) -> str:
    return tiny_llama_text_dir


def tiny_server_config(model_dir: str, **server: object) -> ServerConfig:
    """A small-footprint config on a free port; ``server`` sets HttpServerConfig fields."""
    return ServerConfig(
        model={"path": model_dir, "served_model_name": "tiny"},
        cache={"max_total_tokens": 8192},
        server={"port": 0, "log_level": "warning", **server},
    )


@pytest.fixture(scope="session")
def make_config():
    return tiny_server_config
