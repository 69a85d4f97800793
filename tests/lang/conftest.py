"""Shared real backends for the treadle.lang tests: one Engine and one server for this package.

(The package-scoped fixtures need tests/lang/__init__.py; without it pytest
keeps them, and the model, alive for the whole session.) The server (a child
process) starts loading as soon as the package's first test runs, if any
selected test needs it, so its model load overlaps the Engine's.
Both run torch on one thread: on a small shared CPU, OpenMP threads spinning
against other processes make a 135M-parameter model an order of magnitude slower.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from treadle.core.config import ServerConfig
from treadle.core.loading.default_model import default_model
from treadle.lang import EngineBackend, RuntimeEndpoint

ENDPOINT_FIXTURE = "endpoint_backend"


def _config(port: int = 30000) -> ServerConfig:
    return ServerConfig(
        model={"path": default_model()},
        cache={"max_total_tokens": 8192},
        server={"port": port, "log_level": "warning"},
    )


@pytest.fixture(scope="package")
def _server_future(request: pytest.FixtureRequest):
    from treadle.server.launch import launch_server

    pool = ThreadPoolExecutor(max_workers=1)
    future: Future = pool.submit(launch_server, _config(port=0), env={"OMP_NUM_THREADS": "1"})
    yield future
    pool.shutdown(wait=True)
    if future.exception() is None:
        future.result().shutdown()


@pytest.fixture(scope="package", autouse=True)
def _start_server_early(request: pytest.FixtureRequest) -> None:
    # Begin the server's model load at once, so it overlaps the Engine's.
    if any(ENDPOINT_FIXTURE in item.fixturenames for item in request.session.items):
        request.getfixturevalue("_server_future")


@pytest.fixture(scope="package")
def engine():
    import torch

    from treadle.core.engine import Engine

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    engine = Engine(_config())
    yield engine
    engine.shutdown()
    torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def engine_backend(engine) -> EngineBackend:
    return EngineBackend(engine)


@pytest.fixture(scope="package")
def endpoint_backend(_server_future: Future):
    backend = RuntimeEndpoint(_server_future.result().base_url)
    yield backend
    backend.shutdown()
