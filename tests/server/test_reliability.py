"""Admission control, limits, deadlines, keys and CORS, through real HTTP against one small server.

The server admits 2 running + 2 queued requests, takes bodies up to 256 KiB,
reads its API key from a file and has a separate admin key. After every test
the KV pool must be fully accounted for: nothing running, nothing used.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import openai
import pytest

from treadle.server.launch import ServerHandle, launch_server

API_KEY = "user-key-from-file"
ADMIN_KEY = "admin-key"
MAX_BYTES = 256 * 1024
ORIGIN = "https://ui.example.com"
LONG = {"max_new_tokens": 480, "ignore_eos": True}  # ~1 s on the tiny model


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, make_config, tmp_path_factory) -> ServerHandle:
    key_file = tmp_path_factory.mktemp("keys") / "api_key"
    key_file.write_text(API_KEY + "\n")
    config = make_config(tiny_model_dir, api_key_file=str(key_file), admin_api_key=ADMIN_KEY,
                         max_queued_requests=2, max_request_bytes=MAX_BYTES, cors_allow_origins=[ORIGIN])
    config.scheduler.max_running_requests = 2
    handle = launch_server(config, timeout=180)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


@pytest.fixture()
def http(server: ServerHandle) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(autouse=True)
def kv_accounted(http: httpx.Client):
    yield
    deadline = time.monotonic() + 20
    while True:
        kv = http.get("/get_server_info").json()["kv"]
        if kv["running"] == kv["waiting"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert kv["running"] == kv["waiting"] == 0, kv
    assert kv["used_slots"] == 0 and kv["free_slots"] + kv["cached_slots"] == kv["total_slots"], kv


def _abort_all(http: httpx.Client) -> None:
    info = http.get("/get_server_info").json()
    assert info["kv"] is not None
    for prefix in ("long-",):
        for i in range(8):
            http.post("/abort_request", json={"rid": f"{prefix}{i}"}, headers={"Authorization": f"Bearer {ADMIN_KEY}"})


def _metric(http: httpx.Client, name: str) -> float:
    total = 0.0
    found = False
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    assert found, f"metric {name} not found"
    return total


# ------------------------------------------------------------------ admission control


def test_queue_overflow_gets_503_with_retry_after_never_500(server: ServerHandle, http: httpx.Client) -> None:
    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            tasks = [asyncio.create_task(client.post("/generate", json={
                "text": f"request {i}", "rid": f"long-{i}", "sampling_params": LONG})) for i in range(8)]
            return await asyncio.gather(*tasks)

    responses = asyncio.run(run())
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, [r.text for r in responses]
    assert statuses.count(200) >= 4 and statuses.count(503) >= 1, statuses
    for response in responses:
        if response.status_code == 503:
            assert response.headers["retry-after"] == "1"
            error = response.json()["error"]
            assert error["code"] == "server_overloaded" and "server.max_queued_requests" in error["message"]
        else:
            assert len(response.json()["output_ids"]) == 480
    assert _metric(http, "treadle_requests_rejected_total") >= statuses.count(503)
    assert _metric(http, "treadle_queue_time_seconds_count") >= 4


def test_more_sequences_than_the_server_holds_is_a_400_naming_n(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={"prompt": ["a", "b", "c"], "n": 2, "max_tokens": 1})
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "n" and response.json()["error"]["code"] == "too_many_sequences"


# ------------------------------------------------------------------ limits


def test_oversized_bodies_get_413(http: httpx.Client) -> None:
    big = json.dumps({"prompt": "x" * (MAX_BYTES + 10), "max_tokens": 1}).encode()
    response = http.post("/v1/completions", content=big, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    error = response.json()["error"]
    assert error["param"] == "body" and "server.max_request_bytes" in error["message"]

    def chunks():  # no Content-Length: the size is counted as the body streams in
        for _ in range(MAX_BYTES // 4096 + 2):
            yield b" " * 4096

    response = http.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "request_too_large"


LIMITS = [
    ("/v1/completions", {"prompt": "x", "n": 129}, "n"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
     "top_logprobs"),
    ("/generate", {"text": "x", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "timeout": 0}, "timeout"),
]


@pytest.mark.parametrize("path,body,param", LIMITS, ids=[limit[2] for limit in LIMITS])
def test_every_limit_is_a_4xx_naming_it(http: httpx.Client, path: str, body: dict, param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "w" * 200_000, "max_tokens": 16}, "prompt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "w" * 200_000}], "max_tokens": 16}, "messages"),
    ("/v1/completions", {"prompt": [7] * 600, "max_tokens": 16}, "prompt"),
    ("/generate", {"text": "w" * 200_000}, "text"),
])
def test_a_prompt_longer_than_the_context_says_the_prompt_is_too_long(http: httpx.Client, path: str, body: dict,
                                                                       param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == "context_length_exceeded"
    assert "too long" in error["message"] and "max_tokens to at most" not in error["message"]


# ------------------------------------------------------------------ deadlines


def test_a_deadline_returns_what_was_generated_with_finish_reason_length(server: ServerHandle,
                                                                         http: httpx.Client) -> None:
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)
    start = time.monotonic()
    reply = client.completions.create(model="tiny", prompt="tick", max_tokens=480, extra_body={
        "ignore_eos": True, "timeout": 0.2})
    assert time.monotonic() - start < 0.9
    assert reply.choices[0].finish_reason == "length"
    assert reply.choices[0].model_extra["matched_stop"] == "timeout"  # as docs/server.md says
    assert 0 < reply.usage.completion_tokens < 480
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "tock"}], max_tokens=480, stream=True,
        extra_body={"ignore_eos": True, "timeout": 0.2}))
    assert chunks[-1].choices[0].finish_reason == "length"
    assert _metric(http, "treadle_requests_timed_out_total") >= 2


def test_a_deadline_before_the_first_token_is_a_408(server: ServerHandle, http: httpx.Client) -> None:
    async def run() -> httpx.Response:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            busy = [asyncio.create_task(client.post("/generate", json={
                "text": f"busy {i}", "rid": f"long-{i}", "sampling_params": LONG})) for i in range(2)]
            await asyncio.sleep(0.1)  # both running: the next one waits in the queue
            late = await client.post("/generate", json={"text": "late", "timeout": 0.2,
                                                        "sampling_params": {"max_new_tokens": 4}})
            _abort_all(http)
            await asyncio.gather(*busy)
            return late

    late = asyncio.run(run())
    assert late.status_code == 408, late.text
    assert late.json()["error"]["code"] == "request_timeout" and late.json()["error"]["param"] == "timeout"


# ------------------------------------------------------------------ keys and CORS


def test_api_key_from_a_file_and_a_separate_admin_key(server: ServerHandle) -> None:
    base = server.base_url
    user, admin = {"Authorization": f"Bearer {API_KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.get(f"{base}/v1/models", headers=user).status_code == 200
    assert httpx.get(f"{base}/v1/models", headers=admin).status_code == 200
    assert httpx.get(f"{base}/v1/models").status_code == 401
    for path in ("/flush_cache", "/abort_request"):
        response = httpx.post(f"{base}{path}", json={"rid": "x"}, headers=user)
        assert response.status_code == 401 and "admin API key" in response.json()["error"]["message"]
    assert httpx.post(f"{base}/abort_request", json={"rid": "x"}, headers=admin).status_code == 200
    info = httpx.get(f"{base}/get_server_info", headers=user)
    assert API_KEY not in info.text and ADMIN_KEY not in info.text
    assert info.json()["config"]["server"]["admin_api_key"] == "**********"
    assert API_KEY not in server.log() and ADMIN_KEY not in server.log()


def test_cors_answers_only_the_configured_origins(server: ServerHandle) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    allowed = httpx.options(f"{server.base_url}/v1/completions", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = httpx.options(f"{server.base_url}/v1/completions", headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in other.headers


def test_server_info_reports_kv_counts_and_memory(http: httpx.Client) -> None:
    info = http.get("/get_server_info").json()
    assert {"total_slots", "free_slots", "cached_slots", "used_slots"} <= set(info["kv"])
    assert info["max_inflight_requests"] == 4
    assert all(v and v > 0 for v in info["memory"]["rss_bytes"].values())
    assert set(info["pids"]) == {"server", "scheduler", "detokenizer"}
    assert _metric(http, "treadle_oom_retries") == 0


# ------------------------------------------------------------------ soak mode of the serving benchmark


def test_bench_serving_soak_mode_checks_failures_kv_and_memory(server: ServerHandle, tmp_path, capsys) -> None:
    from treadle.bench.serving import main

    out = tmp_path / "soak.json"
    # 2 in flight, each at most n = 2 sequences: never past this server's 4, so any 503 is a real failure.
    rc = main(["--base-url", server.base_url, "--api-key", API_KEY, "--admin-api-key", ADMIN_KEY,
               "--duration", "3", "--warmup", "1", "--max-concurrency", "2", "--input-len", "2:12",
               "--output-len", "2:12", "--abort-fraction", "0.2", "--disconnect-fraction", "0.2", "--structured",
               "--max-memory-growth", "1.0", "--output", str(out)])
    summary = json.loads(out.read_text())["summary"]
    assert rc == 0, (summary["checks"], summary["first_failures"])
    assert summary["failures"] == 0 and summary["requests"] > 10
    assert summary["aborted_on_purpose"] > 0 and summary["disconnected_on_purpose"] > 0
    assert summary["checks"]["kv_accounted"] and summary["memory"]["growth"] is not None
    assert "resident memory growth" in capsys.readouterr().out
