"""Data parallelism: dp=2 servers end to end through the openai client (the routing policies alone:
test_dp_routing.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import httpx
import openai
import pytest

from treadle.server.launch import ServerHandle, launch_server

# ------------------------------------------------------------------ servers


def _launch(tiny_model_dir: str, make_config, policy: str) -> ServerHandle:
    config = make_config(tiny_model_dir)
    config.cache.max_total_tokens = 4096
    config.parallel.dp_size = 2
    config.parallel.dp_policy = policy
    return launch_server(config, timeout=180)


def _info(handle: ServerHandle) -> dict:
    return httpx.get(f"{handle.base_url}/get_server_info", timeout=30).json()


def _wait_idle(handle: ServerHandle, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = _info(handle)
        if info["kv"]["running"] == 0 and info["kv"]["waiting"] == 0 or time.monotonic() > deadline:
            return info


def _assert_kv_accounted(info: dict) -> None:
    for replica in info["replicas"]:
        kv = replica["kv"]
        assert kv["running"] == 0 and kv["waiting"] == 0
        assert kv["free_slots"] + kv["cached_slots"] == kv["total_slots"]


@pytest.fixture(scope="module")
def round_robin_server(tiny_model_dir: str, make_config) -> ServerHandle:
    handle = _launch(tiny_model_dir, make_config, "round_robin")
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


def test_round_robin_spreads_requests_and_reports_each_replica(round_robin_server: ServerHandle) -> None:
    client = openai.OpenAI(base_url=f"{round_robin_server.base_url}/v1", api_key="none", max_retries=0, timeout=60)
    replicas_before = _info(round_robin_server)["replicas"]
    before = [r["kv"]["finished"] for r in replicas_before]
    texts = [client.completions.create(model="tiny", prompt="hello there", max_tokens=4, temperature=0)
             .choices[0].text for _ in range(6)]
    assert len(set(texts)) == 1  # the replicas run the same model: same greedy answer
    info = _wait_idle(round_robin_server)
    finished = [r["kv"]["finished"] - b for r, b in zip(info["replicas"], before)]
    assert finished == [3, 3]
    assert info["kv"]["finished"] == sum(r["kv"]["finished"] for r in info["replicas"])
    assert info["model_info"]["dp_size"] == 2
    # What the controller routed: three requests each, of equal work (prompt + max_tokens tokens), none unfinished.
    routing = [r["routing"] for r in info["replicas"]]
    assert [r["routed_requests"] - b["routing"]["routed_requests"] for r, b in zip(routing, replicas_before)] == [3, 3]
    work = [r["routed_work_tokens"] - b["routing"]["routed_work_tokens"] for r, b in zip(routing, replicas_before)]
    assert work[0] == work[1] and work[0] % 3 == 0 and work[0] > 3 * 4
    assert all(r["unfinished_requests"] == r["unfinished_work_tokens"] == 0 for r in routing)
    assert all(r["last_finish_s_ago"] is not None and r["last_finish_s_ago"] >= 0 for r in routing)
    _assert_kv_accounted(info)
    metrics = httpx.get(f"{round_robin_server.base_url}/metrics", timeout=30).text
    assert 'treadle_replica_num_running_requests{replica="1"}' in metrics


def test_disconnects_and_aborts_free_kv_on_every_replica(round_robin_server: ServerHandle) -> None:
    base = round_robin_server.base_url

    async def disconnect(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": "tiny", "prompt": f"disconnect {i}", "max_tokens": 300, "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break

    async def abort(client: httpx.AsyncClient, rid: str) -> dict:
        pending = asyncio.create_task(client.post("/generate", json={
            "text": "abort me", "rid": rid, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}))
        for _ in range(100):
            await asyncio.sleep(0.05)
            if (await client.post("/abort_request", json={"rid": rid})).json()["success"]:
                break
        return (await pending).json()

    async def run() -> list:
        async with httpx.AsyncClient(base_url=base, timeout=60) as client:
            await asyncio.gather(*(disconnect(client, i) for i in range(6)))
            return await asyncio.gather(abort(client, "abort-a"), abort(client, "abort-b"))

    for result in asyncio.run(run()):
        assert result["meta_info"]["finish_reason"]["type"] == "abort"
    _assert_kv_accounted(_wait_idle(round_robin_server))
    assert httpx.post(f"{base}/flush_cache", timeout=30).json() == {"success": True}
    info = _info(round_robin_server)
    assert all(r["kv"]["cached_slots"] == 0 for r in info["replicas"])


def test_prefix_aware_routes_a_shared_prompt_to_one_replica(tiny_model_dir: str, make_config) -> None:
    handle = _launch(tiny_model_dir, make_config, "prefix_aware")
    try:
        client = openai.OpenAI(base_url=f"{handle.base_url}/v1", api_key="none", max_retries=0, timeout=60)
        system = "You are a careful assistant who answers in one short sentence. " * 3
        for question in ["Why is the sky blue?", "What is rain?", "Who wrote Hamlet?", "Name a prime."]:
            client.chat.completions.create(model="tiny", max_tokens=3, temperature=0, messages=[
                {"role": "system", "content": system}, {"role": "user", "content": question}])
        info = _wait_idle(handle)
        finished = [r["kv"]["finished"] for r in info["replicas"]]
        cached = [r["kv"]["cached_tokens_total"] for r in info["replicas"]]
        assert sorted(finished) == [0, 4]
        busy = finished.index(4)
        assert cached[busy] > 3 * len(system) // 2 and cached[1 - busy] == 0
        _assert_kv_accounted(info)
    finally:
        handle.shutdown()


def test_a_killed_replica_takes_the_server_down_cleanly(round_robin_server: ServerHandle) -> None:
    # The last test of the module (pytest keeps the file's order): it ends the shared server rather than paying a
    # dp=2 start of its own; the routing policy plays no part in it.
    handle = round_robin_server
    try:
        info = _info(handle)
        replica_pids = info["model_info"]["replica_pids"]
        others = [replica_pids[0], info["pids"]["scheduler"], info["pids"]["detokenizer"]]
        os.kill(replica_pids[1], signal.SIGKILL)
        deadline = time.monotonic() + 15
        while handle.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert handle.process.returncode == 1
        assert "data-parallel replica 1" in handle.log()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{pid}") for pid in others):
            time.sleep(0.1)
        assert not [pid for pid in others if os.path.exists(f"/proc/{pid}")]
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", handle.port), timeout=5).close()
    finally:
        handle.shutdown(signal.SIGKILL)
