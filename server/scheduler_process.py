"""The scheduler process: runs ``core.scheduler.Scheduler`` in a loop behind ZMQ.

Loop: take every message waiting (new requests, aborts, control requests),
run one ``step()`` when there is work, push the outputs to the detokenizer.
With overlap scheduling a step's outputs are those of the batch before it, pushed
while the device runs the new one (docs/scheduling.md).
With nothing to do it blocks on the socket instead of spinning.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import torch
import zmq

from treadle.core.config import ServerConfig
from treadle.core.scheduling.step_timer import StepTimer
from treadle.core.validation import REQUEST_LIMITS_KEY
from treadle.server.ipc import (
    RESOLVED_CONFIG_KEY,
    AbortReq,
    AddRequestFailed,
    ControlReply,
    ControlReq,
    DetokenizerInit,
    DetokenizerSockets,
    IpcAddresses,
    QueueTimes,
    RegisterDecode,
    ReplicaFinished,
    ShutdownReq,
    TokenizedGenerateReq,
    WorkerSockets,
    bind_pull,
)
from treadle.server.process_utils import before_exit_on_sigterm, configure_child_process

logger = logging.getLogger("treadle.scheduler_process")

_IDLE_POLL_MS = 500


def run_scheduler_process(config: ServerConfig, addresses: IpcAddresses, ready: Connection,
                          report_finished: bool = False) -> None:
    """Process entry point: build the Scheduler, report readiness on ``ready``, then serve until told to stop.

    ``report_finished`` (data-parallel replicas): also tell ``addresses.tokenizer_input`` (the controller)
    which requests finished each step.
    """
    parent_pid = configure_child_process(config.server.log_level)
    try:
        from treadle.core.distributed.tensor_parallel import start_scheduler

        # At parallel.tp_size > 1 this process is rank 0; it starts this node's other ranks.
        scheduler = start_scheduler(config, in_server=True)
    except BaseException as exc:
        if _caused_by_the_user(exc):  # the message says what to change; the main process prints it once
            ready.send(("error", str(exc)))
        else:
            logger.error("the scheduler failed to start:\n%s", traceback.format_exc())
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1)
    stop_ranks_at_signal = getattr(scheduler, "stop_without_goodbye", None)
    if stop_ranks_at_signal is not None:  # tensor parallel: SIGTERM may come mid-step, when no goodbye can be said
        before_exit_on_sigterm(stop_ranks_at_signal)
    tokenizer = getattr(scheduler, "tokenizer", None)
    loop = SchedulerLoop(scheduler, addresses, parent_pid, report_finished)
    _install_step_trace(scheduler)
    loop.detokenizers.send_to_all(DetokenizerInit(tokenizer))
    ready.send(("ready", server_model_info(scheduler), tokenizer))
    ready.close()
    try:
        loop.run()
    except Exception:
        logger.error("the scheduler crashed:\n%s", traceback.format_exc())
        raise SystemExit(1)
    finally:
        loop.close()
        stop_ranks = getattr(scheduler, "shutdown", None)
        if stop_ranks is not None:
            stop_ranks()


# A diagnostic: with this set to a file path, the scheduler times every step's host phases and GPU span
# (core/scheduling/step_timer.py's StepTimer) and writes the split per step kind there when the server stops.
STEP_TRACE_ENV = "TREADLE_STEP_TRACE"


def _install_step_trace(scheduler: Any) -> None:
    path = os.environ.get(STEP_TRACE_ENV)
    if not path:
        return
    timer = StepTimer(torch.device(scheduler.model_info["device"]))
    scheduler.add_observer(timer)
    on_sigterm = signal.getsignal(signal.SIGTERM)

    def dump_then_stop(signum: int, frame: Any) -> None:  # the server stops its children with SIGTERM
        scheduler.remove_observer(timer)
        timer.dump(path)
        if callable(on_sigterm):
            on_sigterm(signum, frame)

    signal.signal(signal.SIGTERM, dump_then_stop)


def server_model_info(scheduler: Any) -> dict[str, Any]:
    """``model_info`` plus the pool sizes the HTTP side sizes its admission control from."""
    return {
        **scheduler.model_info,
        "max_total_tokens": int(scheduler.allocator.total_slots),
        "max_running_requests": scheduler.config.scheduler.max_running_requests,
        REQUEST_LIMITS_KEY: scheduler.request_limits.as_dict(),  # the HTTP process checks requests against them
        # The resolved config: every "auto" replaced by what the model runner chose.
        RESOLVED_CONFIG_KEY: scheduler.config.model_dump(mode="json"),
    }


def _caused_by_the_user(exc: BaseException) -> bool:
    """A start-up error that the config causes (a model path, a layout, a plugin): no traceback helps there."""
    from treadle.core.config import ConfigError
    from treadle.core.loading.default_model import DefaultModelError
    from treadle.core.loading.hub import HubError
    from treadle.core.loading.model_loader import ModelLoadError
    from treadle.core.loading.quantization import QuantizationError
    from treadle.core.registry import PluginError
    from treadle.core.distributed.tensor_parallel import TensorParallelError

    return isinstance(exc, (ConfigError, DefaultModelError, HubError, ModelLoadError, PluginError,
                            QuantizationError, TensorParallelError))


class SchedulerLoop:
    """Feeds a Scheduler from the request socket and pushes its outputs to the detokenizer."""

    def __init__(self, scheduler: Any, addresses: IpcAddresses, parent_pid: int,
                 report_finished: bool = False) -> None:
        self.scheduler = scheduler
        self.report_finished = report_finished
        self.parent_pid = parent_pid
        self.context = zmq.Context()
        self.requests = bind_pull(self.context, addresses.scheduler_input)
        self.detokenizers = DetokenizerSockets(self.context, addresses.detokenizer_inputs)
        self.replies = WorkerSockets(self.context, addresses.worker_inputs)
        self.running = True
        self.arrivals: dict[str, float] = {}  # rid -> arrival time, until the request is admitted
        self.pending_unloads: list[ControlReq] = []  # adapter unloads waiting for the adapter's requests
        # rid -> (arrival time, HTTP worker), until the request is admitted
        self.arrivals: dict[str, tuple[float, int]] = {}

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        while self.running:
            busy = self.scheduler.has_work()
            if poller.poll(0 if busy else _IDLE_POLL_MS):
                self._drain_requests()
            if not busy and os.getppid() != self.parent_pid:
                logger.error("the server process is gone; the scheduler exits")
                return
            if self.running and self.scheduler.has_work():
                started = time.monotonic()
                outputs = self.scheduler.step()
                if outputs:
                    self._send_outputs(outputs)
                if self.arrivals:
                    self._report_queue_times(started)
            if self.pending_unloads:
                self._retry_unloads()

    def _report_queue_times(self, step_started: float) -> None:
        """Requests that left the waiting queue in the last step: their queue time goes to /metrics."""
        waiting = {req.rid for req in self.scheduler.waiting}
        admitted = [rid for rid in self.arrivals if rid not in waiting]
        by_worker: dict[int, list[float]] = {}
        for rid in admitted:
            arrived, worker_id = self.arrivals.pop(rid)
            by_worker.setdefault(worker_id, []).append(max(0.0, step_started - arrived))
        for worker_id, seconds in by_worker.items():
            self.replies.send(worker_id, QueueTimes(seconds, worker_id))

    def close(self) -> None:
        self.context.destroy(linger=0)

    def _send_outputs(self, outputs: list[Any]) -> None:
        self.detokenizers.send_outputs(outputs)
        if self.report_finished:
            finished = [output.rid for output in outputs if output.finished_reason is not None]
            if finished:
                self.replies.send(0, ReplicaFinished(finished))

    def _drain_requests(self) -> None:
        while True:
            try:
                message = self.requests.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(message)

    def _handle(self, message: Any) -> None:
        if isinstance(message, TokenizedGenerateReq):
            self._add_request(message)
        elif isinstance(message, AbortReq):
            self._abort(message.rid)
        elif isinstance(message, ControlReq):
            if message.kind == "unload_lora_adapter":
                self.pending_unloads.append(message)
                self._retry_unloads()
            else:
                self.replies.send(message.worker_id,
                                  ControlReply(message.request_id, self._control(message.kind, message.args)))
        elif isinstance(message, ShutdownReq):
            self.running = False
        else:
            logger.warning("ignoring unexpected message %r", type(message).__name__)

    def _add_request(self, message: TokenizedGenerateReq) -> None:
        from treadle.core.request import Req

        try:
            req = Req(
                rid=message.rid,
                origin_input_ids=list(message.input_ids),
                sampling_params=message.sampling_params,
                priority=message.priority,
                return_logprob=message.return_logprob,
                logprob_start_len=message.logprob_start_len,
                top_logprobs_num=message.top_logprobs_num,
                lora_name=message.lora_name,
                wants_embedding=message.wants_embedding,
                multimodal=message.multimodal,
            )
            self.scheduler.add_request(req)
        except ValueError as exc:  # InvalidRequestError and friends: the client's fault
            self.replies.send(message.worker_id, AddRequestFailed(
                message.rid, str(exc), getattr(exc, "param", None), 400, message.worker_id))
            return
        except Exception as exc:
            logger.error("add_request failed for %s:\n%s", message.rid, traceback.format_exc())
            self.replies.send(message.worker_id, AddRequestFailed(
                message.rid, f"internal error: {exc}", None, 500, message.worker_id))
            return
        self.arrivals[message.rid] = (time.monotonic(), message.worker_id)
        # add_request produces no output, so this still reaches the detokenizer before the first one.
        self.detokenizers.register(RegisterDecode(
            message.rid, message.sampling_params.skip_special_tokens, list(message.sampling_params.stop or []),
            message.worker_id))

    def _abort(self, rid: str) -> None:
        self.arrivals.pop(rid, None)
        output = self.scheduler.abort_request(rid)
        if output is not None:
            self._send_outputs([output])

    def _control(self, kind: str, args: dict[str, Any]) -> dict[str, Any]:
        if kind == "flush_cache":
            return {"success": bool(self.scheduler.flush_cache())}
        if kind == "stats":
            return {"kv": dict(self.scheduler.kv_stats())}
        if kind == "lora_adapters":
            lora = self.scheduler.lora
            return {"adapters": lora.describe() if lora is not None else []}
        if kind == "load_lora_adapter":
            try:
                self.scheduler.load_lora_adapter(args["lora_name"], args["lora_path"])
            except ValueError as exc:  # a bad folder, a name taken, no lora section: the client's to fix
                return {"error": str(exc)}
            return {"success": True}
        if kind == "abort_request":
            # The request and the sub-requests an HTTP worker made of it (``<rid>-<i>``), wherever they came from;
            # each one's final output reaches its own worker through the detokenizer.
            target = str(args.get("rid", ""))
            matching = [rid for rid, req in self.scheduler.live_by_rid.items()
                        if not req.finished and (rid == target or rid.startswith(target + "-"))]
            for rid in matching:
                self._abort(rid)
            return {"aborted": matching}
        return {"error": f"unknown control request '{kind}'"}

    def _retry_unloads(self) -> None:
        """Unload the adapters asked for whose requests have all finished; answer those requests."""
        waiting = []
        for message in self.pending_unloads:
            try:
                done = self.scheduler.unload_lora_adapter(message.args["lora_name"])
            except ValueError as exc:
                self.replies.send(message.worker_id, ControlReply(message.request_id, {"error": str(exc)}))
                continue
            if done:
                self.replies.send(message.worker_id, ControlReply(message.request_id, {"success": True}))
            else:
                waiting.append(message)
        self.pending_unloads = waiting


# The process one data-parallel replica runs (the data-parallel controller starts one per replica).
run_replica_process = run_scheduler_process
