"""Data-parallel replicas on several nodes: the layout's validation, the link between node 0 and a node, and two
`treadle serve` processes acting as two nodes (dp=2, one replica each) through the openai client."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Iterator

import httpx
import openai
import pytest
import zmq

from treadle.core.config import ConfigError, ParallelConfig, ServerConfig, load_config
from treadle.core.engine import Engine
from treadle.server.dp_nodes import DpNodeError, DpNodeStopped, HeadLink, NodeAgent, NodeLink, serve_dp_node
from treadle.server.dp_replicas import controller_replies_address, replica_addresses
from treadle.server.ipc import AbortReq, BatchTokenIDOut, IpcAddresses, ReplicaFinished, bind_pull, connect_push
from treadle.server.launch import CONFIG_ENV, _free_port, launch_server

PROMPTS = ["The capital of France is", "Once upon a time there was"]


def _two_node_config(config: ServerConfig, node_rank: int, port: int, **parallel: object) -> ServerConfig:
    config = config.model_copy(deep=True)
    config.parallel = ParallelConfig(dp_size=2, nnodes=2, node_rank=node_rank, dist_init_addr=f"127.0.0.1:{port}",
                                     **parallel)
    return config


# ------------------------------------------------------------------ the layout


def test_replicas_spread_evenly_or_as_counted() -> None:
    assert ParallelConfig(dp_size=4, nnodes=2, dist_init_addr="h:1").replicas_per_node() == [2, 2]
    three = ParallelConfig(dp_size=3, nnodes=2, dist_init_addr="h:1", dp_replicas_per_node=[2, 1], tp_size=4)
    assert three.replicas_per_node() == [2, 1]  # tp_size need not split over the nodes: each replica has one


@pytest.mark.parametrize(("overrides", "message"), [
    ({"parallel.dp_size": 3, "parallel.nnodes": 2, "parallel.dist_init_addr": "h:1"}, "does not split evenly"),
    ({"parallel.dp_size": 3, "parallel.nnodes": 2, "parallel.dist_init_addr": "h:1",
      "parallel.dp_replicas_per_node": [2, 2]}, "3 .dp_size. in all"),
    ({"parallel.dp_size": 2, "parallel.nnodes": 2, "parallel.dist_init_addr": "h:1",
      "parallel.dp_replicas_per_node": [2, 0]}, "at least one"),
    ({"parallel.dp_size": 2, "parallel.dp_replicas_per_node": [2]}, "leave it unset"),
    ({"parallel.dp_size": 2, "parallel.nnodes": 2}, "needs dist_init_addr"),
])
def test_bad_data_parallel_layouts_are_config_errors(overrides: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides, use_env=False)


# ------------------------------------------------------------------ the link, without models


def _layout_config(port: int, node_rank: int, counts: list[int], timeout: float = 30) -> ServerConfig:
    config = ServerConfig(model={"path": "/models/tiny"})  # nothing is loaded
    config.parallel = ParallelConfig(dp_size=sum(counts), nnodes=2, node_rank=node_rank, dp_replicas_per_node=counts,
                                     dist_init_addr=f"127.0.0.1:{port}", dist_timeout_s=timeout)
    return config


class _Head:
    """Node 0's end of the link, serviced in a thread; replies it relays land in ``replies``."""

    def __init__(self, config: ServerConfig, detokenizer: str) -> None:
        self.link = HeadLink(config, [detokenizer])
        self.replies: list[Any] = []
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._serve)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stopping.is_set():
            self.link.router.poll(50)
            self.link.service(self.replies.append)
        self.link.close()  # says stop to the nodes

    def close(self) -> None:
        self.stopping.set()
        self.thread.join(10)


@pytest.fixture
def head_and_node(tmp_path) -> Iterator[tuple[_Head, NodeLink, zmq.Socket]]:
    port = _free_port("127.0.0.1")
    context = zmq.Context()
    detokenizer = bind_pull(context, f"ipc://{tmp_path}/detokenizer")
    head = _Head(_layout_config(port, 0, [2, 1]), f"ipc://{tmp_path}/detokenizer")
    node = NodeLink(_layout_config(port, 1, [2, 1]))
    yield head, node, detokenizer
    head.close()
    node.close()
    context.destroy(linger=0)


class _Replicas:
    dead: str | None = None

    def check_alive(self) -> bool:
        return self.dead is None


def _until(condition: Any, seconds: float = 10) -> None:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert condition()


def test_the_link_relays_both_ways_and_node_0_stops_the_node(head_and_node) -> None:
    head, node, detokenizer = head_and_node
    node.join()
    addresses = IpcAddresses.new(1, 1)
    agent = NodeAgent(node, addresses, node.layout)
    replica2 = bind_pull(node.context, replica_addresses(addresses, 2).scheduler_input)
    node.send([b"ready", pickle.dumps([7])])  # its replica's pid
    _until(lambda: agent.relay_once() is None and head.link.all_ready())
    assert head.link.replica_pids() == {2: 7}

    head.link.send(2, AbortReq("r1"))  # from this thread: the head thread only reads from the ROUTER
    _until(lambda: agent.relay_once() is None and replica2.poll(0))
    assert replica2.recv_pyobj() == AbortReq("r1")
    to_controller = connect_push(node.context, controller_replies_address(addresses))
    to_detokenizer = connect_push(node.context, addresses.detokenizer_input)
    to_controller.send_pyobj(ReplicaFinished(["r1"]))
    to_detokenizer.send_pyobj(BatchTokenIDOut([]))
    _until(lambda: agent.relay_once() is None and bool(head.replies) and detokenizer.poll(0))
    assert head.replies == [ReplicaFinished(["r1"])] and detokenizer.recv_pyobj() == BatchTokenIDOut([])

    head.close()
    with pytest.raises(DpNodeStopped):
        for _ in range(50):
            agent.relay_once()


def test_a_dead_replica_on_a_node_fails_node_0(head_and_node) -> None:
    head, node, _ = head_and_node
    node.join()
    agent = NodeAgent(node, IpcAddresses.new(1, 1), node.layout)
    replicas = _Replicas()
    replicas.dead = "data-parallel replica 2 (pid 9) exited unexpectedly (exit code -9); shutting the server down"
    assert agent.run(replicas) == 1
    _until(lambda: head.link.fatal is not None)
    assert head.link.fatal.startswith("data-parallel node 1: data-parallel replica 2 (pid 9) exited")


def test_node_0_refuses_a_node_whose_layout_differs(tmp_path) -> None:
    port = _free_port("127.0.0.1")
    head = _Head(_layout_config(port, 0, [2, 1]), f"ipc://{tmp_path}/detokenizer")
    node = NodeLink(_layout_config(port, 1, [1, 2]))
    try:
        with pytest.raises(DpNodeError, match=r"refused node 1: .*dp_replicas_per_node \[1, 2\] \(node 0: \[2, 1\]\)"):
            node.join()
    finally:
        head.close()
        node.close()


def test_a_node_that_cannot_reach_node_0_fails_within_the_timeout() -> None:
    config = _layout_config(_free_port("127.0.0.1"), 1, [1, 1], timeout=0.5)
    started = time.monotonic()
    with pytest.raises(DpNodeError, match="could not reach node 0's data-parallel controller at tcp://127.0.0.1"):
        serve_dp_node(config)
    assert time.monotonic() - started < 5


def test_node_0_fails_when_a_node_does_not_join_in_time(tmp_path) -> None:
    link = HeadLink(_layout_config(_free_port("127.0.0.1"), 0, [1, 1], timeout=0.2),
                    [f"ipc://{tmp_path}/detokenizer"])
    try:
        with pytest.raises(DpNodeError, match=r"node\(s\) \[1\] did not join at tcp://127.0.0.1:\d+ within"):
            link.wait_ready(lambda: None)
    finally:
        link.close()


# ------------------------------------------------------------------ two nodes, end to end


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.05)
    return [pid for pid in pids if _alive(pid)]


def test_two_nodes_serve_dp2_and_a_dead_remote_replica_takes_both_down(tiny_model_dir, make_config, tmp_path):
    base = make_config(tiny_model_dir)
    base.model.device = "cpu"
    base.cache.max_total_tokens = 4096
    port = _free_port("127.0.0.1")
    head = _two_node_config(base, 0, port, dp_policy="round_robin", dist_timeout_s=120)
    node1_log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(  # "node 1", started first: it waits for node 0
        [sys.executable, "-m", "treadle.server.launch", "--config-env"], stdout=node1_log, stderr=subprocess.STDOUT,
        env={**os.environ, CONFIG_ENV: _two_node_config(base, 1, port, dp_policy="round_robin",
                                                        dist_timeout_s=120).model_dump_json()})
    handle = None
    try:
        handle = launch_server(head, timeout=240)
        client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        texts = [client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                           extra_body={"ignore_eos": True}).choices[0].text
                 for prompt in PROMPTS for _ in range(2)]
        with Engine(base) as engine:  # dp=1, in process
            expected = [out.text for out in engine.generate(
                PROMPTS, {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True})]
        assert texts == [expected[0], expected[0], expected[1], expected[1]]

        info = httpx.get(f"{handle.base_url}/get_server_info", timeout=30).json()  # a control request to both
        assert [r["kv"]["finished"] for r in info["replicas"]] == [2, 2]  # round robin over the two nodes
        assert info["model_info"]["replica_nodes"] == [0, 1]
        assert httpx.post(f"{handle.base_url}/flush_cache", timeout=30).json() == {"success": True}
        info = httpx.get(f"{handle.base_url}/get_server_info", timeout=30).json()
        assert [r["kv"]["cached_slots"] for r in info["replicas"]] == [0, 0]

        remote_replica = info["model_info"]["replica_pids"][1]
        with open(f"/proc/{remote_replica}/stat") as f:
            assert int(f.read().split(") ")[1].split()[1]) == node1.pid  # it runs under "node 1"
        head_pids = [info["model_info"]["replica_pids"][0], info["pids"]["scheduler"], info["pids"]["detokenizer"]]
        os.kill(remote_replica, signal.SIGKILL)
        assert handle.process.wait(timeout=60) == 1
        assert node1.wait(timeout=60) == 1
        assert "data-parallel node 1: data-parallel replica 1" in handle.log()
        assert not _gone_within(head_pids, 30)
    finally:
        if handle is not None:
            handle.shutdown(signal.SIGKILL)
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
