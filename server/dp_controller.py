"""The data-parallel controller process: one front for ``parallel.dp_size`` scheduler replicas.

With ``dp_size > 1`` the server starts this process where it would start the
scheduler. It binds the scheduler's input address, starts the replicas (each a
scheduler process, or a tensor-parallel group of them, on its own devices), and::

    TokenizerManager ──► controller ──► replica i ──► Detokenizer ──► TokenizerManager
                             ▲              │
                             └── replies ───┘  (finished rids, errors, control answers)

- New requests go to the replica ``parallel.dp_policy`` picks (see :mod:`treadle.server.dp_routing`);
  aborts go where their request went.
- ``stats``, ``flush_cache``, ``abort_request`` and the LoRA controls reach every replica; the answer (to the
  HTTP worker that asked) merges them and lists each replica. Errors and queue times go to the worker named in
  the message.
- With ``parallel.nnodes > 1`` the replicas of nodes 1, 2, ... run there and are reached through the
  :class:`~treadle.server.dp_nodes.HeadLink`; their traffic for the detokenizers passes through here.
- A replica that dies (on any node), or a node that falls silent, takes the controller down (exit status 1),
  and with it the server; stopping the controller stops the other nodes' replicas too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import traceback
from multiprocessing.connection import Connection
from typing import Any

import zmq

from treadle.core.config import ServerConfig
from treadle.server.dp_nodes import DpNodeError, HeadLink
from treadle.server.dp_replicas import Replicas, controller_replies_address, replica_addresses
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
from treadle.server.process_utils import before_exit_on_sigterm, configure_child_process

logger = logging.getLogger("treadle.dp_controller")

_POLL_MS = 200
_CONTROL_TIMEOUT_S = 60.0


def run_dp_controller_process(config: ServerConfig, addresses: IpcAddresses, ready: Connection) -> None:
    """Process entry point: start the replicas (this node's; with other nodes, wait for theirs), report readiness
    on ``ready``, route until told to stop."""
    parent_pid = configure_child_process(config.server.log_level)
    link: HeadLink | None = None
    replicas = Replicas(config, addresses, range(config.parallel.replicas_per_node()[0]))
    try:
        try:
            if config.parallel.nnodes > 1:
                link = HeadLink(config, addresses.detokenizer_inputs)
                before_exit_on_sigterm(link.close)  # SIGTERM: the other nodes stop their replicas too
            model_info, tokenizer = _start_replicas(config, replicas, link)
        except BaseException as exc:
            if not isinstance(exc, DpNodeError):
                logger.error("the data-parallel replicas failed to start:\n%s", traceback.format_exc())
            ready.send(("error", str(exc) if isinstance(exc, DpNodeError) else f"{type(exc).__name__}: {exc}"))
            raise SystemExit(1)
        controller = DataParallelController(config, addresses, replicas, parent_pid, link)
        ready.send(("ready", model_info, tokenizer))
        ready.close()
        try:
            controller.run()
        except Exception:
            logger.error("the data-parallel controller crashed:\n%s", traceback.format_exc())
            raise SystemExit(1)
        finally:
            controller.close()
        if replicas.dead or (link is not None and link.fatal):
            raise SystemExit(1)
    finally:
        if link is not None:
            link.close()
        replicas.stop()


def _start_replicas(config: ServerConfig, replicas: Replicas, link: HeadLink | None) -> tuple[dict[str, Any], Any]:
    """Start this node's replicas, and wait for the other nodes' (serving the link meanwhile)."""
    while_waiting = None
    if link is not None:
        def while_waiting() -> None:
            link.router.poll(_POLL_MS)
            link.service()
            if link.fatal:
                raise DpNodeError(link.fatal)

    model_info, tokenizer = replicas.start(while_waiting)
    pids = {replica: p.pid for replica, p in zip(replicas.indices, replicas.processes)}
    nodes = [0] * len(replicas.indices)
    if link is not None:
        def check_local() -> None:
            if not replicas.check_alive():
                raise DpNodeError(replicas.dead or "a replica exited")

        link.wait_ready(check_local)
        pids.update(link.replica_pids())
        nodes = [link.layout.node_of(replica) for replica in range(config.parallel.dp_size)]
    size = config.parallel.dp_size
    return {**model_info, "dp_size": size, "replica_pids": [pids[i] for i in range(size)],
            "replica_nodes": nodes}, tokenizer


class DataParallelController:
    """Routes the tokenizer manager's messages to replicas and merges what comes back."""

    def __init__(self, config: ServerConfig, addresses: IpcAddresses, replicas: Replicas, parent_pid: int,
                 link: HeadLink | None = None) -> None:
        self.replicas = replicas
        self.link = link
        self.parent_pid = parent_pid
        self.size = config.parallel.dp_size
        self.router = ReplicaRouter(config.parallel.dp_policy, self.size)
        self.context = zmq.Context()
        self.requests = bind_pull(self.context, addresses.scheduler_input)
        self.replies = bind_pull(self.context, controller_replies_address(addresses))
        self.to_workers = WorkerSockets(self.context, addresses.worker_inputs)
        self.to_replicas: list[Any] = [
            connect_push(self.context, replica_addresses(addresses, i).scheduler_input) for i in replicas.indices]
        if link is not None:
            self.to_replicas += [_RemoteReplica(link, i) for i in link.remote_replicas]
        self.pending_controls: dict[str, _PendingControl] = {}
        self.last_finished = [0.0] * self.size  # monotonic time each replica last finished a request
        self.running = True

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.requests, zmq.POLLIN)
        poller.register(self.replies, zmq.POLLIN)
        if self.link is not None:
            poller.register(self.link.router, zmq.POLLIN)
        while self.running:
            events = dict(poller.poll(_POLL_MS))
            if self.replies in events:
                self._drain(self.replies, self._on_reply)
            if self.link is not None:
                self.link.service(self._on_reply)  # relays, beats, and notices a failed node
                if self.link.fatal:
                    return
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
            replica = self.router.choose(message.rid, message.input_ids, message.sampling_params.max_new_tokens)
            self.to_replicas[replica].send_pyobj(message)
        elif isinstance(message, AbortReq):
            replica = self.router.replica_of(message.rid)
            targets = self.to_replicas if replica is None else [self.to_replicas[replica]]
            for sock in targets:
                sock.send_pyobj(message)
        elif isinstance(message, ControlReq):
            self.pending_controls[message.request_id] = _PendingControl(
                message.kind, self.size, message.worker_id)
            for replica, sock in enumerate(self.to_replicas):
                sock.send_pyobj(ControlReq(f"{message.request_id}/{replica}", message.kind, args=message.args))
        elif isinstance(message, ShutdownReq):  # the other nodes' replicas stop when the link closes
            for sock in self.to_replicas[:len(self.replicas.indices)]:
                sock.send_pyobj(message)
            self.running = False
        else:
            logger.warning("ignoring unexpected message %r", type(message).__name__)

    # ------------------------------------------------------------ replicas → tokenizer manager

    def _on_reply(self, message: Any) -> None:
        if isinstance(message, ReplicaFinished):
            now = time.monotonic()
            for rid in message.rids:
                replica = self.router.finished(rid)
                if replica is not None:
                    self.last_finished[replica] = now
        elif isinstance(message, AddRequestFailed):
            self.router.finished(message.rid)
            self.to_workers.send(message.worker_id, message)
        elif isinstance(message, ControlReply):
            request_id, _, replica = message.request_id.rpartition("/")
            pending = self.pending_controls.get(request_id)
            if pending is None:
                return  # expired
            pending.payloads[int(replica)] = message.payload
            if len(pending.payloads) == self.size:
                del self.pending_controls[request_id]
                merged = pending.merged()
                if pending.kind == "stats":
                    merged["routing"] = self._routing_stats()
                self.to_workers.send(pending.worker_id, ControlReply(request_id, merged))
        else:  # QueueTimes
            self.to_workers.send(getattr(message, "worker_id", 0), message)

    def _routing_stats(self) -> list[dict[str, Any]]:
        """Per replica: requests and work (tokens, as the router counts them) routed there so far and unfinished now,
        and how long ago it last finished a request (after an all-at-once run: how much sooner it was done than the
        last one; None before its first)."""
        now, router = time.monotonic(), self.router
        return [{"routed_requests": router.routed[i], "routed_work_tokens": router.routed_work[i],
                 "unfinished_requests": router.loads[i], "unfinished_work_tokens": router.work[i],
                 "last_finish_s_ago": round(now - self.last_finished[i], 3) if self.last_finished[i] else None}
                for i in range(self.size)]

    def _expire_controls(self) -> None:
        now = time.monotonic()
        for request_id in [r for r, p in self.pending_controls.items() if now - p.created > _CONTROL_TIMEOUT_S]:
            del self.pending_controls[request_id]


class _RemoteReplica:
    """A replica on another node, reached through the link: sends like a PUSH socket to a local one."""

    def __init__(self, link: HeadLink, replica: int) -> None:
        self.link = link
        self.replica = replica

    def send_pyobj(self, message: Any) -> None:
        self.link.send(self.replica, message)


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
