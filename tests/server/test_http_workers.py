"""Several HTTP workers, in-process: each request's outputs, errors and control answers go back to the worker that
sent it, and admission counts every worker's requests. (The four-worker server end to end is tests/server/test_http.py.)
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time

import pytest
import zmq

from treadle.core.auto_size import resolve_http_workers
from treadle.core.config import ServerConfig
from treadle.core.request import FinishReason, InvalidRequestError, ReqOutput, SamplingParams
from treadle.server.detokenizer import Detokenizer
from treadle.server.inflight import InflightCounts
from treadle.server.ipc import (
    BatchTokenIDOut,
    DetokenizerSockets,
    IpcAddresses,
    RegisterDecode,
    TokenizedGenerateReq,
    WorkerSockets,
    bind_pull,
)
from treadle.server.metrics import ServerMetrics
from treadle.server.scheduler_process import SchedulerLoop
from treadle.server.tokenizer_manager import RequestError, TokenizerManager


class EchoScheduler:
    """Finishes every request in one step with two tokens; refuses prompts that start with token 0."""

    def __init__(self) -> None:
        self.live_by_rid: dict = {}
        self.waiting: list = []
        self.new: list = []

    def add_request(self, req) -> None:
        if req.origin_input_ids[0] == 0:
            raise InvalidRequestError("token 0 is not welcome here", param="prompt")
        self.live_by_rid[req.rid] = req
        self.new.append(req)

    def has_work(self) -> bool:
        return bool(self.new)

    def step(self) -> list[ReqOutput]:
        done, self.new = self.new, []
        for req in done:
            del self.live_by_rid[req.rid]
        return [ReqOutput(req.rid, [7, 8], FinishReason.LENGTH, None, len(req.origin_input_ids), 2, 0) for req in done]

    def abort_request(self, rid: str) -> ReqOutput | None:
        req = self.live_by_rid.pop(rid, None)
        if req is None:
            return None
        self.new.remove(req)
        return ReqOutput(rid, [], FinishReason.ABORT, None, len(req.origin_input_ids), 0, 0)

    def kv_stats(self) -> dict:
        return {"running": 0, "waiting": len(self.new)}


class Backend:
    """The scheduler loop and the detokenizer of a server with ``workers`` HTTP workers, pumped by hand."""

    def __init__(self, addresses: IpcAddresses) -> None:
        self.scheduler = EchoScheduler()
        self.loop = SchedulerLoop(self.scheduler, addresses, os.getppid())
        self.context = zmq.Context()
        self.detokenizer_inbox = bind_pull(self.context, addresses.detokenizer_input)
        self.to_workers = WorkerSockets(self.context, addresses.worker_inputs)
        self.detokenizer = Detokenizer()

    def pump(self, step: bool = True) -> None:
        self.loop._drain_requests()
        if step and self.scheduler.has_work():
            self.loop._send_outputs(self.scheduler.step())
        while self.detokenizer_inbox.poll(0):
            for worker_id, reply in self.detokenizer.handle_routed(self.detokenizer_inbox.recv_pyobj()).items():
                self.to_workers.send(worker_id, reply)

    def close(self) -> None:
        self.loop.close()
        self.context.destroy(linger=0)


@pytest.fixture()
def addresses():
    addresses = IpcAddresses.new(http_workers=3)
    yield addresses
    shutil.rmtree(addresses.folder, ignore_errors=True)


def _managers(addresses: IpcAddresses, config: ServerConfig, info: dict) -> list[TokenizerManager]:
    path = InflightCounts.create(addresses.folder, 3)
    return [TokenizerManager(config, info, None, addresses, ServerMetrics(), worker_id=worker_id,
                             inflight=InflightCounts(path, worker_id)) for worker_id in range(3)]


async def _until(backend: Backend, awaitable, step: bool = True):
    task = asyncio.ensure_future(awaitable)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        backend.pump(step)
        done, _ = await asyncio.wait([task], timeout=0.01)
        if done:
            return task.result()
    task.cancel()
    raise AssertionError("no answer within 30 s")


def _req(rid: str, first_token: int = 1) -> TokenizedGenerateReq:
    return TokenizedGenerateReq(rid, [first_token, 2, 3], SamplingParams(max_new_tokens=2))


def test_outputs_errors_and_control_answers_reach_the_worker_that_sent_the_request(addresses) -> None:
    async def run() -> None:
        managers = _managers(addresses, ServerConfig(), {"context_len": 512, "vocab_size": 512})
        backend = Backend(addresses)
        try:
            for manager in managers:
                manager.start()
            streams = [manager.submit([_req(f"w{i}")]) for i, manager in enumerate(managers)]
            for i, stream in enumerate(streams):
                event = await _until(backend, stream.next_event())
                assert event.output.rid == f"w{i}" and event.output.new_token_ids == [7, 8]
                assert not managers[i].states
            refused = managers[2].submit([_req("bad", first_token=0)])
            assert (await _until(backend, refused.next_event())).error.param == "prompt"
            # A control request is answered to the worker that asked, and only there.
            assert await _until(backend, managers[1].control("stats")) == {"kv": {"running": 0, "waiting": 0}}
            assert not any(manager._control_waiters for manager in managers)
            # /abort_request through worker 0 reaches requests that workers 1 and 2 hold, and their own handlers
            # get the final 'abort' output.
            held = [managers[1].submit([_req("job-0")]), managers[2].submit([_req("job-1")])]
            deadline = time.monotonic() + 30  # two workers' sockets: either request may arrive first
            while len(backend.scheduler.live_by_rid) < 2 and time.monotonic() < deadline:
                backend.pump(step=False)
                await asyncio.sleep(0.01)
            answer = await _until(backend, managers[0].control("abort_request", args={"rid": "job"}), step=False)
            assert sorted(answer["aborted"]) == ["job-0", "job-1"]
            for stream in held:
                assert (await _until(backend, stream.next_event())).output.finished_reason == FinishReason.ABORT
        finally:
            for manager in managers:
                manager.close()
            backend.close()

    asyncio.run(run())


def test_admission_counts_the_requests_of_every_worker(addresses) -> None:
    config = ServerConfig(scheduler={"max_running_requests": 3}, server={"max_queued_requests": 0})
    info = {"context_len": 512, "vocab_size": 512, "max_running_requests": 3}

    async def run() -> None:
        managers = _managers(addresses, config, info)
        backend = Backend(addresses)
        try:
            for manager in managers:
                manager.start()
            first = managers[0].submit([_req("a"), _req("b")])
            second = managers[1].submit([_req("c")])
            assert managers[2].inflight_requests() == 3
            with pytest.raises(RequestError) as refused:
                managers[2].submit([_req("d")])
            assert refused.value.status_code == 503 and refused.value.code == "server_overloaded"
            for stream in (first, first, second):
                await _until(backend, stream.next_event())
            assert managers[2].inflight_requests() == 0  # the others' finished requests left the count
            managers[2].submit([_req("d")])
        finally:
            for manager in managers:
                manager.close()
            backend.close()

    asyncio.run(run())


@pytest.mark.parametrize("cpus, workers", [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (64, 8), (256, 8)])
def test_auto_workers_are_one_per_four_cpus_up_to_eight(cpus: int, workers: int) -> None:
    assert resolve_http_workers("auto", cpus) == workers
    assert resolve_http_workers(3, cpus) == 3


def test_several_detokenizers_each_get_the_tokens_of_their_workers_requests() -> None:
    addresses = IpcAddresses.new(http_workers=4, detokenizers=2)
    context = zmq.Context()
    try:
        inboxes = [bind_pull(context, address) for address in addresses.detokenizer_inputs]
        shards = DetokenizerSockets(context, addresses.detokenizer_inputs)
        for worker_id in range(4):
            shards.register(RegisterDecode(f"r{worker_id}", True, [], worker_id))
        shards.send_outputs([ReqOutput(f"r{w}", [5], FinishReason.LENGTH if w == 3 else None, None, 1, 1, 0)
                             for w in range(4)])
        received = [[message for message in _drain(inbox)] for inbox in inboxes]
        registered = [[m.rid for m in messages if isinstance(m, RegisterDecode)] for messages in received]
        outputs = [[o.rid for m in messages if isinstance(m, BatchTokenIDOut) for o in m.outputs]
                   for messages in received]
        assert registered == [["r0", "r2"], ["r1", "r3"]] and outputs == [["r0", "r2"], ["r1", "r3"]]
        assert sorted(shards.worker_of) == ["r0", "r1", "r2"]  # r3 finished
    finally:
        context.destroy(linger=0)
        shutil.rmtree(addresses.folder, ignore_errors=True)


def _drain(inbox) -> list:
    messages = []
    while inbox.poll(1000 if not messages else 50):
        messages.append(inbox.recv_pyobj())
    return messages
