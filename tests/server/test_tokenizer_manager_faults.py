"""The tokenizer manager's output-routing task dying is a fault: every waiting request fails and the
server is told to shut down (no handler hangs on a stream that will never get another event)."""

from __future__ import annotations

import asyncio
import shutil

import zmq

from treadle.core.config import ServerConfig
from treadle.core.request import SamplingParams
from treadle.server.ipc import IpcAddresses, TokenizedGenerateReq
from treadle.server.metrics import ServerMetrics
from treadle.server.tokenizer_manager import TokenizerManager


def test_a_dead_routing_task_fails_waiting_requests_and_reports_the_fault() -> None:
    addresses = IpcAddresses.new()
    model_info = {"context_len": 64, "vocab_size": 32, "max_running_requests": 4, "max_total_tokens": 256}

    async def run() -> tuple[list[str], str]:
        manager = TokenizerManager(ServerConfig(), model_info, None, addresses, ServerMetrics())
        faults: list[str] = []
        manager.start(faults.append)
        stream = manager.submit([TokenizedGenerateReq("r1", [1, 2, 3], SamplingParams(max_new_tokens=2))])
        context = zmq.Context()
        garbage = context.socket(zmq.PUSH)
        garbage.connect(addresses.tokenizer_input)
        garbage.send(b"not a pickle")  # what a corrupted or foreign message looks like
        event = await asyncio.wait_for(stream.next_event(), 5)
        garbage.close(linger=0)
        context.term()
        manager.close()
        return faults, event.error.message

    try:
        faults, error = asyncio.run(run())
    finally:
        shutil.rmtree(addresses.folder, ignore_errors=True)
    assert len(faults) == 1 and "the tokenizer manager stopped routing outputs" in faults[0]
    assert error == faults[0]
