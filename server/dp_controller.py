"""The data-parallel controller process: one front for ``parallel.dp_size`` scheduler replicas.

With ``dp_size > 1`` the server starts this process where it would start the
scheduler. It binds the scheduler's input address, starts the replicas (each a
scheduler process, or a tensor-parallel group of them, on its own devices), and::

    TokenizerManager ──► controller ──► replica i ──► Detokenizer ──► TokenizerManager
                             ▲              │
                             └── replies ───┘  (finished rids, errors, control answers)

- New requests go to the replica ``parallel.dp_policy`` picks (see :mod:`treadle.server.dp_routing`);
  aborts go where their request went.
- ``stats``, ``flush_cache`` and ``abort_request`` reach every replica; the answer (to the HTTP worker that
  asked) sums them and lists each replica. Errors and queue times go to the worker named in the message.
- A replica that dies takes the controller down (exit status 1), and with it the server.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import zmq

from treadle.core.config import ServerConfig
from treadle.server.dp_routing import ReplicaRouter
from treadle.server.ipc import (
    AbortReq,
    AddRequestFailed,
    ControlReply,
    ControlReq,
    IpcAddresses,
    ReplicaFinished,
    ShutdownReq,
    TokenizedGenerateReq,
    WorkerSockets,
    bind_pull,
    connect_push,
)
from treadle.server.process_utils import configure_child_process

logger = logging.getLogger("treadle.dp_controller")

_POLL_MS = 200
_REPLICA_STOP_TIMEOUT_S = 10.0
_CONTROL_TIMEOUT_S = 60.0


def run_dp_controller_process(config: ServerConfig, addresses: IpcAddresses, ready: Connection) -> None:
    """Process entry point: start the replicas, report readiness on ``ready``, route until told to stop."""
    parent_pid = configure_child_process(config.server.log_level)
    replicas = Replicas(config, addresses)
    try:
        try:
            model_info, tokenizer = replicas.start()
        except BaseException as exc:
            logger.error("the data-parallel replicas failed to start:\n%s", traceback.format_exc())
            ready.send(("error", f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1)
        controller = DataParallelController(config, addresses, replicas, parent_pid)
        ready.send(("ready", model_info, tokenizer))
        ready.close()
        try:
            controller.run()
        except Exception:
            logger.error("the data-parallel controller crashed:\n%s", traceback.format_exc())
            raise SystemExit(1)
        finally:
            controller.close()
        if replicas.dead:
            raise SystemExit(1)
    finally:
        replicas.stop()


def replica_addresses(addresses: IpcAddresses, replica: int) -> IpcAddresses:
    """Replica ``replica`` receives on its own address and answers the controller, not the tokenizer manager."""
    folder = addresses.folder
    return dataclasses.replace(
        addresses,
        scheduler_input=f"ipc://{os.path.join(folder, f'scheduler-replica{replica}')}",
        tokenizer_input=controller_replies_address(addresses),
        extra_worker_inputs=(),
    )


def controller_replies_address(addresses: IpcAddresses) -> str:
    return f"ipc://{os.path.join(addresses.folder, 'dp-controller-replies')}"


class Replicas:
    """The replica processes: start (each on its slice of the visible GPUs), watch, stop."""

    def __init__(self, config: ServerConfig, addresses: IpcAddresses) -> None:
        self.config = config
        self.addresses = addresses
        self.size = config.parallel.dp_size
        self.context = mp.get_context("spawn")
        self.processes: list[Any] = []
        self.dead: str | None = None

    def start(self) -> tuple[dict[str, Any], Any]:
        from treadle.server.scheduler_process import run_replica_process

        replica_config = self.config.model_copy(deep=True)
        replica_config.parallel.dp_size = 1
        pipes = []
        for replica in range(self.size):
            receive, send = self.context.Pipe(duplex=False)
            process = self.context.Process(
                target=run_replica_process, name=f"scheduler-dp{replica}",
                args=(replica_config, replica_addresses(self.addresses, replica), send),
                kwargs={"report_finished": True},
            )
            with _visible_devices(self.config, replica):
                process.start()
            send.close()
            self.processes.append(process)
            pipes.append(receive)
        infos = [self._wait_ready(replica, pipe) for replica, pipe in enumerate(pipes)]
        model_info, tokenizer = infos[0]
        model_info = {**model_info, "dp_size": self.size, "replica_pids": [p.pid for p in self.processes]}
        return model_info, tokenizer

    def _wait_ready(self, replica: int, pipe: Connection) -> tuple[dict[str, Any], Any]:
        process = self.processes[replica]
        while not pipe.poll(0.2):
            if not process.is_alive():
                raise RuntimeError(f"data-parallel replica {replica} exited during startup "
                                   f"(exit code {process.exitcode}); see its log above")
        try:
            message = pipe.recv()
        except EOFError:
            raise RuntimeError(f"data-parallel replica {replica} exited during startup") from None
        if message[0] != "ready":
            raise RuntimeError(f"data-parallel replica {replica} failed to start: {message[1]}")
        return message[1], message[2]

    def check_alive(self) -> bool:
        """False (and ``dead`` set) once any replica has exited."""
        ready = wait([p.sentinel for p in self.processes], timeout=0)
        if ready:
            replica = next(i for i, p in enumerate(self.processes) if p.sentinel in ready)
            process = self.processes[replica]
            process.join(timeout=1)
            self.dead = (f"data-parallel replica {replica} (pid {process.pid}) exited unexpectedly "
                         f"(exit code {process.exitcode}); shutting the server down")
            logger.error(self.dead)
            return False
        return True

    def stop(self) -> None:
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + _REPLICA_STOP_TIMEOUT_S
        for process in self.processes:
            process.join(timeout=max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join(timeout=5)


class DataParallelController:
    """Routes the tokenizer manager's messages to replicas and merges what comes back."""

    def __init__(self, config: ServerConfig, addresses: IpcAddresses, replicas: Replicas, parent_pid: int) -> None:
        self.replicas = replicas
        self.parent_pid = parent_pid
        self.router = ReplicaRouter(config.parallel.dp_policy, replicas.size)
        self.context = zmq.Context()
        self.requests = bind_pull(self.context, addresses.scheduler_input)
        self.replies = bind_pull(self.context, controller_replies_address(addresses))
        self.to_workers = WorkerSockets(self.context, addresses.worker_inputs)
        self.to_replicas = [
            connect_push(self.context, replica_addresses(addresses, i).scheduler_input) for i in range(replicas.size)]
        self.rid_replica: dict[str, int] = {}
        self.pending_controls: dict[str, _PendingControl] = {}
        self.running = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        while self.running:
            events = dict(poller.poll(_POLL_MS))
            if self.replies in events:
                self._drain(self.replies, self._on_reply)
            if self.requests in events:
                self._drain(self.requests, self._on_request)
            if not self.replicas.check_alive():
                return
            if os.getppid() != self.parent_pid:
                logger.error("the server process is gone; the data-parallel controller exits")
                return
            self._expire_controls()

    def close(self) -> None:
        self.context.destroy(linger=0)

    @staticmethod
    def _drain(sock: zmq.Socket, handle: Any) -> None:
        while True:
            try:
                message = sock.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                return
            handle(message)

    # ------------------------------------------------------------ tokenizer manager → replicas

    def _on_request(self, message: Any) -> None:
        if isinstance(message, TokenizedGenerateReq):
            replica = self.router.choose(message.input_ids)
            self.rid_replica[message.rid] = replica
            self.to_replicas[replica].send_pyobj(message)
        elif isinstance(message, AbortReq):
            replica = self.rid_replica.get(message.rid)
            targets = self.to_replicas if replica is None else [self.to_replicas[replica]]
            for sock in targets:
                sock.send_pyobj(message)
        elif isinstance(message, ControlReq):
            self.pending_controls[message.request_id] = _PendingControl(
                message.kind, self.replicas.size, message.worker_id)
            for replica, sock in enumerate(self.to_replicas):
                sock.send_pyobj(ControlReq(f"{message.request_id}/{replica}", message.kind, args=message.args))
        elif isinstance(message, ShutdownReq):
            for sock in self.to_replicas:
                sock.send_pyobj(message)
            self.running = False
        else:
            logger.warning("ignoring unexpected message %r", type(message).__name__)

    # ------------------------------------------------------------ replicas → tokenizer manager

    def _on_reply(self, message: Any) -> None:
        if isinstance(message, ReplicaFinished):
            for rid in message.rids:
                self._forget(rid)
        elif isinstance(message, AddRequestFailed):
            self._forget(message.rid)
            self.to_workers.send(message.worker_id, message)
        elif isinstance(message, ControlReply):
            request_id, _, replica = message.request_id.rpartition("/")
            pending = self.pending_controls.get(request_id)
            if pending is None:
                return  # expired
            pending.payloads[int(replica)] = message.payload
            if len(pending.payloads) == self.replicas.size:
                del self.pending_controls[request_id]
                self.to_workers.send(pending.worker_id, ControlReply(request_id, pending.merged()))
        else:  # QueueTimes
            self.to_workers.send(getattr(message, "worker_id", 0), message)

    def _forget(self, rid: str) -> None:
        replica = self.rid_replica.pop(rid, None)
        if replica is not None:
            self.router.finished(replica)

    def _expire_controls(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, p in self.pending_controls.items() if now - p.created > _CONTROL_TIMEOUT_S]:
            del self.pending_controls[request_id]


@dataclasses.dataclass
class _PendingControl:
    kind: str
    size: int
    worker_id: int
    payloads: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    created: float = dataclasses.field(default_factory=time.monotonic)

    def merged(self) -> dict[str, Any]:
        ordered = [self.payloads[i] for i in range(self.size)]
        if self.kind == "flush_cache":
            return {"success": all(p.get("success") for p in ordered)}
        if self.kind == "abort_request":
            return {"aborted": [rid for p in ordered for rid in p.get("aborted", [])]}
        if self.kind == "stats":
            kvs = [p["kv"] for p in ordered]
            total = {key: (kvs[0][key] if key == "page_size" else sum(kv[key] for kv in kvs)) for key in kvs[0]}
            return {"kv": total, "replicas": kvs}
        errors = [p["error"] for p in ordered if "error" in p]
        return {"error": errors[0]} if errors else ordered[0]


class _visible_devices:
    """Around a replica's start on CUDA: show it only its ``tp_size`` GPUs (the replica sees them as 0..tp-1)."""

    def __init__(self, config: ServerConfig, replica: int) -> None:
        self.active = config.model.device != "cpu" and _cuda_device_count() > 0
        tp = config.parallel.tp_size
        if self.active:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            devices = visible.split(",") if visible else [str(i) for i in range(_cuda_device_count())]
            self.devices = ",".join(devices[replica * tp:(replica + 1) * tp])

    def __enter__(self) -> None:
        if self.active:
            self.saved = os.environ.get("CUDA_VISIBLE_DEVICES")
            os.environ["CUDA_VISIBLE_DEVICES"] = self.devices

    def __exit__(self, *exc: object) -> None:
        if self.active:
            if self.saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = self.saved


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:
        return 0
