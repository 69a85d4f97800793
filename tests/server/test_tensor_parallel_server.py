"""Tensor-parallel servers through the openai client: tp=2 on one node, tp=2 over two `treadle serve`
processes (nnodes=2, gloo), and a dead rank taking the server down."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from treadle.core.engine import Engine
from treadle.server.launch import CONFIG_ENV, ServerHandle, _free_port, launch_server

PROMPTS = ["The capital of France is", "Once upon a time there was"]


@pytest.fixture(scope="module")
def expected_texts(tiny_model_dir: str, make_config) -> list[str]:
    """Greedy continuations at tp 1, in process."""
    config = make_config(tiny_model_dir)
    config.model.device = "cpu"
    with Engine(config) as engine:
        outputs = engine.generate(PROMPTS, {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True})
    return [out.text for out in outputs]


def _completions(handle: ServerHandle) -> list[str]:
    client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="none", max_retries=0, timeout=120)
    return [client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True}).choices[0].text for prompt in PROMPTS]


def _info(handle: ServerHandle) -> dict:
    return httpx.get(f"{handle.base_url}/get_server_info", timeout=30).json()


def test_tp2_server_matches_tp1_and_a_dead_rank_takes_it_down(tiny_model_dir, make_config, expected_texts):
    config = make_config(tiny_model_dir)
    config.model.device = "cpu"
    config.parallel.tp_size = 2
    handle = launch_server(config, timeout=240)
    try:
        assert _completions(handle) == expected_texts
        info = _info(handle)
        assert info["model_info"]["tp_size"] == 2
        kv = info["kv"]
        assert kv["running"] == 0 and kv["free_slots"] + kv["cached_slots"] == kv["total_slots"]

        rank1 = int(info["model_info"]["tp_rank_pids"]["1"])
        channel = f"/dev/shm/{info['model_info']['step_channel']}"
        os.kill(rank1, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while handle.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert handle.process.returncode == 1
        assert "tensor-parallel rank 1" in handle.log()
        assert not os.path.exists(channel)  # removed before rank 0 exits
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", handle.port), timeout=5).close()
    finally:
        handle.shutdown(signal.SIGKILL)


def test_tp2_server_stopped_by_sigterm_leaves_nothing_behind(tiny_model_dir, make_config, tmp_path):
    """A clean stop at tp 2: exit 0, nothing alarming in the log, no rank left, no file store left in the temp
    folder."""
    config = make_config(tiny_model_dir)
    config.model.device = "cpu"
    config.parallel.tp_size = 2
    handle = launch_server(config, timeout=240, env={"TMPDIR": str(tmp_path)})
    try:
        model_info = _info(handle)["model_info"]
        rank1 = int(model_info["tp_rank_pids"]["1"])
        channel = f"/dev/shm/{model_info['step_channel']}"
        assert model_info["step_broadcast"] == "shared_memory" and os.path.exists(channel)
        assert _completions(handle)
    finally:
        assert handle.shutdown(signal.SIGTERM) == 0, handle.log()[-3000:]
    time.sleep(1)  # the resource tracker, which would warn of leaks, ends just after the server
    for alarm in ("resource_tracker", "leaked", "Traceback", "unexpectedly"):
        assert alarm not in handle.log(), handle.log()[-3000:]
    assert not list(tmp_path.glob("treadle-tp-*"))
    assert not os.path.exists(channel)
    assert _gone_within(rank1, 5)


def _gone_within(pid: int, seconds: float) -> bool:
    """Whether ``pid`` ends (or is a zombie: ended, not yet reaped) within ``seconds``."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ")[1][0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_two_nodes_serve_one_tp2_group(tiny_model_dir, make_config, expected_texts, tmp_path):
    config = make_config(tiny_model_dir)
    config.model.device = "cpu"
    config.parallel.tp_size = 2
    config.parallel.dist_init_addr = f"127.0.0.1:{_free_port('127.0.0.1')}"
    config.parallel.nnodes = 2
    node1_config = config.model_copy(deep=True)
    node1_config.parallel.node_rank = 1
    node1_log = open(tmp_path / "node1.log", "w")
    node1 = subprocess.Popen(
        [sys.executable, "-m", "treadle.server.launch", "--config-env"], stdout=node1_log, stderr=subprocess.STDOUT,
        env={**os.environ, CONFIG_ENV: node1_config.model_dump_json()})
    try:
        try:
            handle = launch_server(config, timeout=240)
        except Exception:
            node1_log.flush()
            print("node 1 log:\n", (tmp_path / "node1.log").read_text()[-5000:])
            raise
        try:
            assert _completions(handle) == expected_texts
            assert _info(handle)["model_info"]["tp_rank_pids"] == {}  # rank 1 runs on "node 1"
        finally:
            assert handle.shutdown() == 0
        assert node1.wait(timeout=60) == 0, (tmp_path / "node1.log").read_text()[-3000:]
    finally:
        if node1.poll() is None:
            node1.kill()
        node1_log.close()
