"""Data-parallel replicas on several nodes: the layout's validation, the link between node 0 and a node, and two
`treadle serve` processes acting as two nodes (dp=2, one replica each) through the openai client."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from treadle.core.config import ParallelConfig, ServerConfig
from treadle.core.engine import Engine
from treadle.server.launch import CONFIG_ENV, _free_port, launch_server

PROMPTS = ["The capital of France is", "Once upon a time there was"]


def _two_node_config(config: ServerConfig, node_rank: int, port: int, **parallel: object) -> ServerConfig:
    config = config.model_copy(deep=True)
    config.parallel = ParallelConfig(dp_size=2, nnodes=2, node_rank=node_rank, dist_init_addr=f"127.0.0.1:{port}",
                                     **parallel)
    return config


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
        assert handle.process.wait(timeout=20) == 1
        assert node1.wait(timeout=20) == 1
        assert "data-parallel node 1: data-parallel replica 1" in handle.log()
        assert not _gone_within(head_pids, 10)
    finally:
        if handle is not None:
            handle.shutdown(signal.SIGKILL)
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
