"""Data-parallel replicas on several nodes: the link between node 0's controller and every other node.

With ``parallel.dp_size > 1`` and ``parallel.nnodes > 1`` node 0 runs the HTTP front, the detokenizers, the
data-parallel controller and its own replicas; node *n* runs only its replicas (``replicas_per_node()[n]`` of
them) behind a **node agent**, the process ``treadle serve`` runs there. Each agent keeps one TCP connection to
the controller, which listens at ``parallel.dist_init_addr``::

    node 0: controller ── HeadLink (ROUTER, binds host:port) ◄──── TCP ────► NodeLink (DEALER) ── agent ── replicas

Frames on the link (the first frame says what the rest is):

- node → head: ``hello`` (the node's layout, checked against node 0's), ``ready`` (its replicas' pids),
  ``reply`` (a replica's answer for the controller), ``detok`` + shard (a replica's message for that detokenizer,
  relayed unopened), ``failed`` / ``dead`` + why (its replicas failed to start or one exited), ``beat``.
- head → node: ``welcome`` or ``refuse`` + why, ``to`` + replica (a request, abort,
  control or shutdown for that replica, relayed unopened), ``stop``, ``beat``.

Each side sends a ``beat`` every second; one that hears nothing for ``NODE_SILENCE_LIMIT_S`` treats the other as
gone. A node that has not been welcomed within ``parallel.dist_timeout_s`` fails its start (and node 0 fails its
own if some node has not said hello by then). Messages are pickles: the port must be reachable only from the
cluster's own machines, as torch.distributed's store is.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import zmq

from treadle.core.config import ServerConfig
from treadle.server.dp_replicas import Replicas, controller_replies_address, replica_addresses
from treadle.server.ipc import IpcAddresses, bind_pull, connect_push

logger = logging.getLogger("treadle.dp_nodes")

HEARTBEAT_S = 1.0
NODE_SILENCE_LIMIT_S = 20.0
_POLL_MS = 200
_STOP_LINGER_MS = 2000
# What must agree between nodes for them to serve as one (node_rank aside): the parallel layout, and the
# detokenizer count that a node's replicas split their outputs by (a node's shard k is node 0's shard k).
_SHARED_LAYOUT_KEYS = ("tp_size", "dp_size", "nnodes", "dp_replicas_per_node", "detokenizers")


class DpNodeError(RuntimeError):
    """A node could not join node 0's data-parallel controller, or the link between them failed."""


@dataclass(frozen=True)
class DpNodeLayout:
    """Which replicas run on which node, and where node 0's controller listens."""

    nnodes: int
    node_rank: int
    counts: tuple[int, ...]
    host: str
    port: int
    join_timeout_s: float

    @classmethod
    def of(cls, config: ServerConfig) -> "DpNodeLayout":
        par = config.parallel
        host, _, port = (par.dist_init_addr or "127.0.0.1:0").rpartition(":")
        return cls(par.nnodes, par.node_rank, tuple(par.replicas_per_node()), host.strip("[]"), int(port),
                   par.dist_timeout_s)

    @property
    def address(self) -> str:
        return f"tcp://{_bracketed(self.host)}:{self.port}"

    def replicas_of(self, node: int) -> range:
        first = sum(self.counts[:node])
        return range(first, first + self.counts[node])

    @property
    def local_replicas(self) -> range:
        return self.replicas_of(self.node_rank)

    def node_of(self, replica: int) -> int:
        return next(node for node in range(self.nnodes) if replica in self.replicas_of(node))


def layout_summary(config: ServerConfig) -> dict[str, Any]:
    """What a node says in its hello: the keys that must match node 0's, its rank and its model."""
    par = config.parallel
    return {"node_rank": par.node_rank, "model": config.model.path, "detokenizers": config.server.detokenizers,
            **{key: getattr(par, key) for key in _SHARED_LAYOUT_KEYS if key != "detokenizers"}}


def _bracketed(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _pickled(message: Any) -> bytes:
    return pickle.dumps(message, pickle.DEFAULT_PROTOCOL)


# ---------------------------------------------------------------- node 0's end


@dataclass
class _RemoteNode:
    identity: bytes
    last_heard: float
    pids: list[int] | None = None  # its replicas' pids, once ready


class HeadLink:
    """The controller's end: accepts the nodes, relays their replicas' traffic, notices one that fails.

    ``fatal`` holds why the server must go down (a node's replica died, a node fell silent) once it must.
    """

    def __init__(self, config: ServerConfig, detokenizer_addresses: Sequence[str]) -> None:
        self.layout = DpNodeLayout.of(config)
        self.expected = layout_summary(config)
        self.context = zmq.Context()  # its own: closing it at SIGTERM must not wait for the controller's sockets
        self.router = self.context.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.setsockopt(zmq.IPV6, 1)
        # A ROUTER drops what it cannot queue: no queue limit, so a burst of requests for a node is never lost.
        self.router.setsockopt(zmq.SNDHWM, 0)
        self.router.setsockopt(zmq.RCVHWM, 0)
        try:
            self.router.bind(f"tcp://{_bracketed(_resolve(self.layout.host))}:{self.layout.port}")
        except (zmq.ZMQError, OSError) as exc:
            self.context.destroy(linger=0)
            raise DpNodeError(f"cannot listen for data-parallel nodes at {self.layout.host}:{self.layout.port} "
                              f"(parallel.dist_init_addr): {exc}; it must be an address of node 0 and a free port")
        self.detokenizers = [connect_push(self.context, address) for address in detokenizer_addresses]
        self.nodes: dict[int, _RemoteNode] = {}
        self.rank_of: dict[bytes, int] = {}  # a joined node's socket identity -> its node_rank
        self.fatal: str | None = None
        self.started = time.monotonic()
        self._last_beat = 0.0
        self._closed = False

    @property
    def remote_replicas(self) -> list[int]:
        return [r for node in range(1, self.layout.nnodes) for r in self.layout.replicas_of(node)]

    def all_ready(self) -> bool:
        return len(self.nodes) == self.layout.nnodes - 1 and all(n.pids is not None for n in self.nodes.values())

    def replica_pids(self) -> dict[int, int]:
        """Remote replica -> its pid on its node."""
        return {replica: pid for rank, node in self.nodes.items() if node.pids
                for replica, pid in zip(self.layout.replicas_of(rank), node.pids)}

    def send(self, replica: int, message: Any) -> None:
        node = self.nodes.get(self.layout.node_of(replica))
        if node is not None:
            self.router.send_multipart([node.identity, b"to", str(replica).encode(), _pickled(message)])

    def service(self, on_reply: Callable[[Any], None] | None = None) -> None:
        """Take every frame waiting (relaying replies to ``on_reply``), send beats, check deadlines."""
        while True:
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            self._handle(frames, on_reply)
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            for node in self.nodes.values():
                self.router.send_multipart([node.identity, b"beat"])
        self._check_deadlines(now)

    def wait_ready(self, check_local: Callable[[], None]) -> None:
        """Service the link until every node's replicas are ready; raise :class:`DpNodeError` on a failure."""
        while not self.all_ready():
            self.router.poll(_POLL_MS)
            self.service()
            check_local()
            if self.fatal:
                raise DpNodeError(self.fatal)

    def _handle(self, frames: list[bytes], on_reply: Callable[[Any], None] | None) -> None:
        identity, kind, rest = frames[0], frames[1], frames[2:]
        rank = self.rank_of.get(identity)
        if kind == b"hello":
            self._hello(identity, pickle.loads(rest[0]))
            return
        if rank is None:
            return  # not joined (refused, or a stranger)
        node = self.nodes[rank]
        node.last_heard = time.monotonic()
        if kind == b"detok":
            # A request's worker w is below node 0's worker count, so the node sent it to shard w % detokenizers,
            # which is node 0's shard for w too; only messages for every shard (DetokenizerInit) wrap around.
            self.detokenizers[int(rest[0]) % len(self.detokenizers)].send(rest[1])
        elif kind == b"reply":
            if on_reply is not None:
                on_reply(pickle.loads(rest[0]))
        elif kind == b"ready":
            node.pids = pickle.loads(rest[0])
            logger.info("data-parallel node %d is ready: replicas %s", rank, list(self.layout.replicas_of(rank)))
        elif kind in (b"failed", b"dead"):
            self._fail(f"data-parallel node {rank}: {rest[0].decode()}")

    def _hello(self, identity: bytes, summary: dict[str, Any]) -> None:
        rank = summary.get("node_rank")
        mismatched = [f"{key} {summary.get(key)!r} (node 0: {self.expected[key]!r})"
                      for key in _SHARED_LAYOUT_KEYS if summary.get(key) != self.expected[key]]
        if mismatched:
            why = f"its parallel config differs from node 0's: {', '.join(mismatched)}"
        elif not isinstance(rank, int) or not 0 < rank < self.layout.nnodes:
            why = f"node_rank {rank!r} is not one of 1 .. {self.layout.nnodes - 1}"
        elif rank in self.nodes and self.nodes[rank].identity != identity:
            why = f"node_rank {rank} has already joined"
        else:
            why = None
        if why is not None:
            logger.error("refused a data-parallel node (node_rank %s): %s", rank, why)
            self.router.send_multipart([identity, b"refuse", why.encode()])
            return
        if summary.get("model") != self.expected["model"]:
            logger.warning("data-parallel node %d serves model %r, node 0 %r", rank, summary.get("model"),
                           self.expected["model"])
        self.nodes[rank] = _RemoteNode(identity, time.monotonic())
        self.rank_of[identity] = rank
        self.router.send_multipart([identity, b"welcome"])
        logger.info("data-parallel node %d joined", rank)

    def _check_deadlines(self, now: float) -> None:
        missing = [rank for rank in range(1, self.layout.nnodes) if rank not in self.nodes]
        if missing and now - self.started > self.layout.join_timeout_s:
            self._fail(f"data-parallel node(s) {missing} did not join at {self.layout.address} within "
                       f"{self.layout.join_timeout_s:.0f} s (parallel.dist_timeout_s); start `treadle serve` there "
                       "with the same config and its own parallel.node_rank, and check that they can reach this port")
        for rank, node in self.nodes.items():
            if now - node.last_heard > NODE_SILENCE_LIMIT_S:
                self._fail(f"data-parallel node {rank} has not been heard from for {NODE_SILENCE_LIMIT_S:.0f} s; "
                           "shutting the server down")

    def _fail(self, reason: str) -> None:
        if self.fatal is None:
            self.fatal = reason
            logger.error(reason)

    def close(self) -> None:
        """Tell every node to stop its replicas (waiting up to 2 s for the words to leave), then close."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes.values():
            try:
                self.router.send_multipart([node.identity, b"stop"], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
        for sock in self.detokenizers:
            sock.close(linger=0)
        self.router.close(linger=_STOP_LINGER_MS)
        self.context.term()


def _resolve(host: str) -> str:
    try:
        return socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)[0][4][0]
    except socket.gaierror as exc:
        raise DpNodeError(f"cannot resolve node 0's host '{host}' (parallel.dist_init_addr): {exc}") from None


# ---------------------------------------------------------------- a node's end


def serve_dp_node(config: ServerConfig) -> int:
    """Node ``parallel.node_rank`` > 0 of a data-parallel server: join node 0, run this node's replicas and relay
    their traffic until node 0 says stop (returns 0) or something fails (returns 1; raises :class:`DpNodeError`
    when the node cannot join or its replicas cannot start)."""
    layout = DpNodeLayout.of(config)
    link = NodeLink(config, layout)
    addresses = IpcAddresses.new(1, config.server.detokenizers)
    replicas = Replicas(config, addresses, layout.local_replicas)
    try:
        agent = NodeAgent(link, addresses, layout)  # binds the replicas' outboxes before they start
        replicas.launch()  # the model loads while this node joins
        link.join()
        logger.info("node %d joined node 0 at %s; data-parallel replicas %s are starting", layout.node_rank,
                    layout.address, list(layout.local_replicas))
        try:
            replicas.wait_ready(while_waiting=agent.relay_once)
        except DpNodeStopped:
            return 0
        except Exception as exc:
            link.tell(b"failed", f"its replicas failed to start ({exc})")
            raise DpNodeError(f"this node's data-parallel replicas failed to start: {exc}") from None
        link.send([b"ready", _pickled([p.pid for p in replicas.processes])])
        try:
            return agent.run(replicas)
        except DpNodeStopped:
            return 0
    except (KeyboardInterrupt, SystemExit):
        link.tell(b"dead", "it was stopped by a signal; shutting the server down")
        return 0
    finally:
        replicas.stop()
        link.close()
        shutil.rmtree(addresses.folder, ignore_errors=True)


class DpNodeStopped(Exception):
    """Node 0 said stop."""


class NodeLink:
    """A node's connection to node 0's controller (one DEALER socket named after the node)."""

    def __init__(self, config: ServerConfig, layout: DpNodeLayout | None = None) -> None:
        self.layout = layout or DpNodeLayout.of(config)
        self.summary = layout_summary(config)
        self.context = zmq.Context()
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.LINGER, 0)
        self.dealer.setsockopt(zmq.IPV6, 1)
        self.dealer.setsockopt(zmq.SNDHWM, 0)  # never block the relay on a slow link
        self.dealer.setsockopt(zmq.RCVHWM, 0)
        self.dealer.setsockopt(zmq.ROUTING_ID, f"node{self.layout.node_rank}".encode())
        self.dealer.connect(self.layout.address)
        self.last_heard = time.monotonic()
        self._last_beat = 0.0
        self.joined = False

    def join(self) -> None:
        """Say hello and wait for node 0's welcome (raises :class:`DpNodeError` on a refusal or the timeout)."""
        self.send([b"hello", _pickled(self.summary)])
        deadline = time.monotonic() + self.layout.join_timeout_s
        while time.monotonic() < deadline:
            if not self.dealer.poll(_POLL_MS):
                continue
            frames = self.dealer.recv_multipart()
            if frames[0] == b"welcome":
                self.last_heard = time.monotonic()
                self.joined = True
                return
            if frames[0] == b"refuse":
                raise DpNodeError(f"node 0 at {self.layout.address} refused node {self.layout.node_rank}: "
                                  f"{frames[1].decode()}")
        raise DpNodeError(f"node {self.layout.node_rank} could not reach node 0's data-parallel controller at "
                          f"{self.layout.address} within {self.layout.join_timeout_s:.0f} s "
                          "(parallel.dist_timeout_s); is node 0 started, with this parallel.dist_init_addr, "
                          "and is the port reachable from here?")

    def send(self, frames: list[bytes]) -> None:
        self.dealer.send_multipart(frames)

    def tell(self, kind: bytes, why: str) -> None:
        try:
            self.send([kind, why.encode()])
        except zmq.ZMQError:
            pass

    def beat(self) -> None:
        now = time.monotonic()
        if now - self._last_beat >= HEARTBEAT_S:
            self._last_beat = now
            self.send([b"beat"])

    def close(self) -> None:
        """Close the link and the agent's sockets (once joined, a last ``dead`` or ``failed`` gets 2 s to leave)."""
        self.context.destroy(linger=_STOP_LINGER_MS if self.joined else 0)


class NodeAgent:
    """Relays between the link and this node's replicas' sockets."""

    def __init__(self, link: NodeLink, addresses: IpcAddresses, layout: DpNodeLayout) -> None:
        self.link = link
        context = link.context
        self.replies = bind_pull(context, controller_replies_address(addresses))
        self.detokenizers = [bind_pull(context, address) for address in addresses.detokenizer_inputs]
        self.to_replicas = {replica: connect_push(context, replica_addresses(addresses, replica).scheduler_input)
                            for replica in layout.local_replicas}
        self.poller = zmq.Poller()
        for sock in (link.dealer, self.replies, *self.detokenizers):
            self.poller.register(sock, zmq.POLLIN)

    def run(self, replicas: Any) -> int:
        while True:
            self.relay_once()
            if not replicas.check_alive():
                self.link.tell(b"dead", replicas.dead)
                return 1
            if time.monotonic() - self.link.last_heard > NODE_SILENCE_LIMIT_S:
                logger.error("node 0 has not been heard from for %.0f s; stopping this node's replicas",
                             NODE_SILENCE_LIMIT_S)
                return 1

    def relay_once(self) -> None:
        """Wait up to 200 ms for traffic; relay all of it. Raises :class:`DpNodeStopped` when node 0 says stop."""
        events = dict(self.poller.poll(_POLL_MS))
        if self.link.dealer in events:
            self._from_head()
        if self.replies in events:
            for frame in _drain(self.replies):
                self.link.send([b"reply", frame])
        for shard, sock in enumerate(self.detokenizers):
            if sock in events:
                for frame in _drain(sock):
                    self.link.send([b"detok", str(shard).encode(), frame])
        self.link.beat()

    def _from_head(self) -> None:
        while True:
            try:
                frames = self.link.dealer.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.link.last_heard = time.monotonic()
            if frames[0] == b"to":
                self.to_replicas[int(frames[1])].send(frames[2])
            elif frames[0] == b"stop":
                logger.info("node 0 stopped the server; stopping this node's replicas")
                raise DpNodeStopped()


def _drain(sock: zmq.Socket) -> list[bytes]:
    frames = []
    while True:
        try:
            frames.append(sock.recv(zmq.NOBLOCK))
        except zmq.Again:
            return frames
