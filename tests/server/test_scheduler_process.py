"""The scheduler loop's request plumbing, in-process with a stand-in scheduler; the step-trace diagnostic."""

from __future__ import annotations

import asyncio
import os
import shutil

from treadle.core.config import ServerConfig
from treadle.core.request import InvalidRequestError, ReqOutput, SamplingParams
from treadle.server.ipc import IpcAddresses, TokenizedGenerateReq
from treadle.server.metrics import ServerMetrics
from treadle.server.scheduler_process import SchedulerLoop
from treadle.server.tokenizer_manager import TokenizerManager


class RefusingScheduler:
    """Rejects every request the way the real Scheduler rejects one that can never fit."""

    def add_request(self, req) -> None:
        raise InvalidRequestError("the KV cache holds only 16 tokens", param="prompt")

    def has_work(self) -> bool:
        return False

    def abort_request(self, rid: str) -> ReqOutput | None:
        return None


def test_add_request_failure_comes_back_to_that_request_as_a_400() -> None:
    addresses = IpcAddresses.new()

    async def run():
        manager = TokenizerManager(ServerConfig(), {"context_len": 512, "vocab_size": 512}, None, addresses,
                                   ServerMetrics())
        manager.start()
        loop = SchedulerLoop(RefusingScheduler(), addresses, os.getppid())
        try:
            stream = manager.submit([TokenizedGenerateReq("r1", [1, 2, 3], SamplingParams(max_new_tokens=4))])
            for _ in range(100):
                loop._drain_requests()
                try:
                    return await asyncio.wait_for(stream.next_event(), 0.05)
                except asyncio.TimeoutError:
                    continue
        finally:
            loop.close()
            manager.close()

    try:
        event = asyncio.run(run())
    finally:
        shutil.rmtree(addresses.folder, ignore_errors=True)
    assert event is not None and event.error is not None
    assert event.error.status_code == 400
    assert event.error.param == "prompt" and "KV cache" in event.error.message


def test_the_step_trace_diagnostic_observes_the_scheduler_and_writes_its_split_when_stopped(
        tiny_llama_dir, tmp_path, monkeypatch) -> None:
    """TREADLE_STEP_TRACE: the scheduler process registers the runtime's step timer (no bench code) and writes the
    per-step-kind split on SIGTERM, then runs the handler that was there before."""
    import json
    import signal

    from treadle import Engine
    from treadle.server.scheduler_process import STEP_TRACE_ENV, _install_step_trace

    path = tmp_path / "steps.json"
    monkeypatch.setenv(STEP_TRACE_ENV, str(path))
    engine = Engine({"model": {"path": tiny_llama_dir, "device": "cpu"}})
    before = signal.getsignal(signal.SIGTERM)
    chained: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: chained.append(signum))
    try:
        _install_step_trace(engine.scheduler)
        engine.generate(input_ids=[[5, 6, 7], [8, 9]],
                        sampling_params=SamplingParams(max_new_tokens=4, ignore_eos=True))
        signal.getsignal(signal.SIGTERM)(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, before)
    dumped = json.loads(path.read_text())
    assert dumped["steps"] >= 4 and dumped["per_step_kind"]["EXTEND"]["steps"] == 1
    assert dumped["per_step_kind"]["DECODE"]["steps"] >= 3 and dumped["per_step_kind"]["DECODE"]["forward_mean_ms"] > 0
    assert chained == [signal.SIGTERM]
