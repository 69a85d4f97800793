"""The HTTP server end to end: real processes, real HTTP on 127.0.0.1, the official openai client.

One server (with an API key) serves the whole module; the last test shuts it down. It runs four HTTP worker
processes (``server.workers: 4``) and two detokenizers, so every test here also checks that requests, outputs,
errors and control requests find their way through several workers; the rest of the server tests run the default
single worker and detokenizer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import pstats
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from treadle.server.front_profile import PROFILE_ENV
from treadle.server.launch import ServerHandle, launch_server

API_KEY = "test-key"
WORKERS = 4
DETOKENIZERS = 2  # workers 0 and 2 decode in one, 1 and 3 in the other
MODEL = "tiny"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def front_profile(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("front-profile"))


@pytest.fixture(scope="module")
def server(tiny_model_dir: str, make_config, front_profile: str) -> ServerHandle:
    # Room for the 200 concurrent streams below (the default queue is sized from the small KV pool).
    handle = launch_server(make_config(tiny_model_dir, api_key=API_KEY, workers=WORKERS, detokenizers=DETOKENIZERS,
                                       max_queued_requests=256), timeout=180,
                           env={PROFILE_ENV: front_profile})  # the front's processes profile themselves
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture()
def http(server: ServerHandle) -> httpx.Client:
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


def async_client(server: ServerHandle) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def kv_stats(http: httpx.Client) -> dict:
    return http.get("/get_server_info").json()["kv"]


def wait_idle(http: httpx.Client, timeout: float = 20.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        kv = kv_stats(http)
        if kv["running"] == 0 and kv["waiting"] == 0 or time.monotonic() > deadline:
            return kv


# ------------------------------------------------------------------ generation


def test_chat_streaming_text_equals_non_streaming_under_greedy(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens


def test_async_completions_streaming_equals_non_streaming(server: ServerHandle) -> None:
    async def run() -> tuple[str, str, list]:
        client = async_client(server)
        full = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
        stream = await client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10,
                                                 temperature=0, stream=True)
        pieces = [c async for c in stream]
        await client.close()
        return full.choices[0].text, "".join(c.choices[0].text for c in pieces), pieces

    full, streamed, pieces = asyncio.run(run())
    assert streamed == full and full
    assert all(c.usage is None for c in pieces)  # no include_usage: no usage chunk


def test_n_choices_share_the_prompt(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=5, temperature=0, n=3)
    assert [c.index for c in result.choices] == [0, 1, 2]
    assert len({c.message.content for c in result.choices}) == 1  # greedy: identical
    assert result.usage.completion_tokens == 15
    sampled = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, n=2, seed=7)
    again = client.completions.create(model=MODEL, prompt="Hello", max_tokens=16, temperature=1.0, n=2, seed=7)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # seeded: reproducible


def test_streaming_n_choices_and_chat_logprobs(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 6
    assert all(entry.logprob <= 0 and entry.top_logprobs[0].token == entry.token for entry in content)
    texts = {0: "", 1: ""}
    for chunk in client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, n=2,
                                                stream=True):
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: full.choices[0].message.content, 1: full.choices[0].message.content}


def test_stop_string_is_trimmed_in_both_modes(client: openai.OpenAI) -> None:
    base = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=16, temperature=0).choices[0]
    text = base.text
    stop = text[len(text) // 2: len(text) // 2 + 2]
    expected = text[: text.find(stop)]
    full = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=16, temperature=0, stop=[stop])
    assert full.choices[0].text == expected
    assert full.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=MODEL, prompt="The quick brown", max_tokens=16, temperature=0,
                                         stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == expected


def test_32_concurrent_streams_all_finish(server: ServerHandle, http: httpx.Client) -> None:
    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[str, str | None]:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"request number {i}"}], max_tokens=8,
            temperature=0, stream=True)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].delta.content or ""
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def run() -> list:
        client = async_client(server)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(32)))
        finally:
            await client.close()

    results = asyncio.run(run())
    assert len(results) == 32 and all(reason in ("length", "stop") for _, reason in results)
    kv = wait_idle(http)
    assert kv["free_slots"] + kv["cached_slots"] == kv["total_slots"]


def test_200_concurrent_streams_over_the_workers_have_the_right_text_and_are_counted_once(
        server: ServerHandle, client: openai.OpenAI, http: httpx.Client) -> None:
    prompts = [f"stream {i} says" for i in range(8)]
    expected = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
                for p in prompts]
    before = http.get("/metrics").text

    async def one(client: openai.AsyncOpenAI, i: int) -> tuple[int, str, int]:
        stream = await client.completions.create(model=MODEL, prompt=prompts[i % 8], max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        text, tokens = "", 0
        async for chunk in stream:
            text += "".join(choice.text for choice in chunk.choices)
            tokens = chunk.usage.completion_tokens if chunk.usage else tokens
        return i, text, tokens

    async def run() -> list:
        # Each stream its own connection (no keep-alive reuse), so the kernel spreads them over the workers.
        clients = [async_client(server) for _ in range(4)]
        try:
            return await asyncio.gather(*(one(clients[i % 4], i) for i in range(200)))
        finally:
            for c in clients:
                await c.close()

    results = asyncio.run(run())
    assert [text for _, text, _ in results] == [expected[i % 8] for i in range(200)]
    after = http.get("/metrics").text
    assert _total(after, "treadle_requests_received_total") - _total(before, "treadle_requests_received_total") == 200
    assert _total(after, "treadle_requests_finished_total") - _total(before, "treadle_requests_finished_total") == 200
    generated = _total(after, "treadle_generation_tokens_total") - _total(before, "treadle_generation_tokens_total")
    assert generated == sum(tokens for _, _, tokens in results)
    kv = wait_idle(http)
    assert kv["free_slots"] + kv["cached_slots"] == kv["total_slots"]


def test_every_worker_takes_connections_and_answers_control_requests(server: ServerHandle) -> None:
    for worker in range(WORKERS):
        with contextlib.closing(_client_on_worker(server, worker)) as http:
            info = http.get("/get_server_info").json()
            assert info["http_worker"] == worker and info["config"]["server"]["workers"] == WORKERS
            assert info["kv"]["total_slots"] == 8192 and len(info["pids"]) == 2 + DETOKENIZERS + WORKERS - 1
            assert http.post("/flush_cache").json() == {"success": True}
            assert http.post("/abort_request", json={"rid": "nothing-here"}).json() == {"success": False, "aborted": []}


def test_abort_through_one_worker_ends_a_request_on_another(server: ServerHandle) -> None:
    with contextlib.closing(_client_on_worker(server, 1)) as runner, \
            contextlib.closing(_client_on_worker(server, 2)) as admin:
        def generate() -> dict:
            return runner.post("/generate", json={"text": "abort me", "rid": "cross-abort", "sampling_params": {
                "max_new_tokens": 400, "ignore_eos": True}}).json()

        async def run() -> tuple[dict, list]:
            pending = asyncio.get_running_loop().run_in_executor(None, generate)
            for _ in range(200):
                await asyncio.sleep(0.05)
                answer = admin.post("/abort_request", json={"rid": "cross-abort"}).json()
                if answer["success"]:
                    break
            return await pending, answer["aborted"]

        result, aborted = asyncio.run(run())
    assert aborted == ["cross-abort"]
    assert result["meta_info"]["finish_reason"]["type"] == "abort" and len(result["output_ids"]) < 400


def _client_on_worker(server: ServerHandle, worker: int) -> httpx.Client:
    """A client whose kept-alive connection landed on HTTP worker ``worker`` (the kernel picks by address hash)."""
    for _ in range(400):
        http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
        if http.get("/get_server_info").json()["http_worker"] == worker:
            return http
        http.close()
    raise AssertionError(f"no connection reached worker {worker}")


def test_20_mid_stream_disconnects_free_their_kv(server: ServerHandle, http: httpx.Client) -> None:
    aborted_before = _metric(http, "treadle_requests_aborted_total")

    async def disconnect_after_first_chunk(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"disconnect {i}", "max_tokens": 400, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break  # leaving the block closes the connection mid-stream

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            await asyncio.gather(*(disconnect_after_first_chunk(client, i) for i in range(20)))

    asyncio.run(run())
    kv = wait_idle(http)
    assert kv["running"] == 0 and kv["waiting"] == 0
    assert kv["free_slots"] + kv["cached_slots"] == kv["total_slots"]
    assert _metric(http, "treadle_requests_aborted_total") - aborted_before == 20
    assert http.get("/health").status_code == 200
    assert http.post("/v1/completions", json={"prompt": "still alive", "max_tokens": 2}).status_code == 200


def test_random_streams_hang_ups_and_cancellations_under_load_leave_nothing_behind(
        server: ServerHandle, http: httpx.Client) -> None:
    """48 concurrent requests over every endpoint with random lengths, n, stops and sampling; a third of them go
    away early (after a random number of stream events, or a non-streaming one cancelled mid-flight). Afterwards no
    request is left in the scheduler, every KV slot is free or cached, and each greedy stream that ran to its end
    has exactly the text of the same request without streaming."""
    rng = random.Random(7)
    completed: list[tuple[str, dict, str]] = []  # (path, body, streamed text) of greedy streams that finished

    def body_for(i: int) -> tuple[str, dict]:
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/generate"])
        greedy = rng.random() < 0.6
        params = {"max_tokens": rng.randint(1, 40), "temperature": 0 if greedy else 0.9, "seed": i}
        if rng.random() < 0.3:
            params["stop"] = [rng.choice(["e", " t", "o"])]
        if path == "/generate":
            sampling = {("max_new_tokens" if k == "max_tokens" else k): v for k, v in params.items() if k != "seed"}
            return path, {"text": f"load {i} " * rng.randint(1, 30), "sampling_params": sampling}
        if rng.random() < 0.2:
            params["n"] = 2
        body = {"model": MODEL, **params}
        if path == "/v1/completions":
            body["prompt"] = f"load {i} " * rng.randint(1, 30)
        else:
            body["messages"] = [{"role": "user", "content": f"request {i} " * rng.randint(1, 20)}]
        return path, body

    async def one(client: httpx.AsyncClient, i: int) -> None:
        path, body = body_for(i)
        leave_after = rng.randint(0, 6) if rng.random() < 0.35 else None
        if rng.random() < 0.6:
            body = {**body, "stream": True}
            text, events = "", 0
            async with client.stream("POST", path, json=body) as response:
                assert response.status_code == 200, await response.aread()
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if leave_after is not None and events >= leave_after:
                        return  # hang up: leaving the block closes the connection mid-stream
                    events += 1
                    if line == "data: [DONE]":
                        break
                    text += _stream_text(path, json.loads(line[len("data: "):]))
            if body.get("temperature") == 0 and body.get("n", 1) == 1 and "sampling_params" not in body:
                completed.append((path, {k: v for k, v in body.items() if k != "stream"}, text))
        elif leave_after is not None:
            task = asyncio.ensure_future(client.post(path, json=body))
            await asyncio.sleep(0.005 * leave_after)
            task.cancel()  # the client gives up on a non-streaming request
            with pytest.raises(asyncio.CancelledError):
                await task
        else:
            response = await client.post(path, json=body)
            assert response.status_code == 200, response.text

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            await asyncio.gather(*(one(client, i) for i in range(48)))

    asyncio.run(run())
    kv = wait_idle(http)
    deadline = time.monotonic() + 20
    while kv.get("live_requests", 0) and time.monotonic() < deadline:  # a late hang-up's abort may still be on its way
        time.sleep(0.05)
        kv = kv_stats(http)
    assert kv["running"] == 0 and kv["waiting"] == 0 and kv["live_requests"] == 0, kv
    assert kv["free_slots"] + kv["cached_slots"] == kv["total_slots"], kv
    assert completed, "no greedy stream ran to its end"
    for path, body, streamed in completed:
        response = http.post(path, json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        assert streamed == (choice["text"] if path == "/v1/completions" else choice["message"]["content"]), body
    assert http.get("/health").status_code == 200


def _stream_text(path: str, event: dict) -> str:
    if path == "/v1/completions":
        return "".join(c.get("text") or "" for c in event["choices"])
    if path == "/v1/chat/completions":
        return "".join((c.get("delta") or {}).get("content") or "" for c in event["choices"])
    return ""  # /generate streams cumulative text; its runs are not compared


def test_embeddings_on_a_chat_model_are_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="serves no embeddings") as info:
        client.embeddings.create(model=MODEL, input="hello")
    assert info.value.body["code"] == "model_task_mismatch"


def test_native_generate_text_ids_batch_and_stream(http: httpx.Client) -> None:
    one = http.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
    assert one.status_code == 200
    body = one.json()
    assert len(body["output_ids"]) == 6 and body["meta_info"]["finish_reason"] == {"type": "length", "matched": None}
    by_ids = http.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 3,
                                                                                      "temperature": 0}}).json()
    assert by_ids["meta_info"]["prompt_tokens"] == 3 and len(by_ids["output_ids"]) == 3
    batch = http.post("/generate", json={"text": ["a", "b"], "sampling_params": {"max_new_tokens": 2}}).json()
    assert isinstance(batch, list) and len(batch) == 2
    with http.stream("POST", "/generate", json={"text": "Hello", "stream": True,
                                                "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["text"] == body["text"]  # cumulative text, same as non-streaming
    assert all(body["text"].startswith(c["text"]) for c in chunks)


def test_native_generate_follows_regex_and_json_schema(http: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
              "required": ["n"]}
    results = http.post("/generate", json={"text": ["Hello", "Goodbye"], "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "regex": "[a-c]{3}-[0-9]{2}"}}).json()
    results.append(http.post("/generate", json={"text": "Hello", "sampling_params": {
        "max_new_tokens": 32, "temperature": 0, "json_schema": schema}}).json())
    assert all(re.fullmatch("[a-c]{3}-[0-9]{2}", r["text"]) for r in results[:2])
    assert results[0]["meta_info"]["finish_reason"]["type"] == "stop"
    assert list(json.loads(results[2]["text"])) == ["n"]


def test_logit_bias_bans_and_forces_tokens_on_every_route(client: openai.OpenAI, http: httpx.Client) -> None:
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    first = http.post("/generate", json={"text": "Hello", "sampling_params": greedy}).json()["output_ids"][0]
    banned = http.post("/generate", json={"text": "Hello", "sampling_params": {
        **greedy, "logit_bias": {str(first): -100}}}).json()
    forced = http.post("/generate", json={"text": "Hello", "sampling_params": {
        **greedy, "logit_bias": {str(first): 100}}}).json()
    assert first not in banned["output_ids"] and forced["output_ids"] == [first] * 3
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0,
                                           logit_bias={str(first): 100}, extra_body={"ignore_eos": True})
    assert completion.choices[0].text == forced["text"]
    chat = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=3, temperature=0.7, seed=1,
                                          logit_bias={str(first): 100}, extra_body={"ignore_eos": True},
                                          logprobs=True)
    assert chat.choices[0].message.content == forced["text"]


def test_native_generate_logprobs(http: httpx.Client) -> None:
    result = http.post("/generate", json={
        "input_ids": [1, 10, 11, 12], "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2,
        "sampling_params": {"max_new_tokens": 3, "temperature": 0}}).json()
    meta = result["meta_info"]
    assert [pair[1] for pair in meta["input_token_logprobs"]] == [1, 10, 11, 12]
    assert meta["input_token_logprobs"][0][0] is None and all(p[0] <= 0 for p in meta["input_token_logprobs"][1:])
    assert [pair[1] for pair in meta["output_token_logprobs"]] == result["output_ids"]
    # greedy: the chosen token is the top-1 alternative
    assert [top[0][1] for top in meta["output_top_logprobs"]] == result["output_ids"]


def test_info_routes_and_metrics(http: httpx.Client, tiny_model_dir: str) -> None:
    models = http.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    info = http.get("/get_model_info").json()
    assert info["context_len"] == 512 and info["vocab_size"] == 512
    server_info = http.get("/get_server_info").json()
    assert server_info["config"]["model"]["path"] == tiny_model_dir
    assert server_info["config"]["server"]["api_key"] == "**********"
    # "auto" settings show the values the scheduler chose (the CPU's: torch_native, 64 running requests).
    assert server_info["config"]["attention"]["backend"] == "torch_native"
    assert server_info["config"]["scheduler"]["max_running_requests"] == info["max_running_requests"]
    assert "resolved_config" not in info and "resolved_config" not in server_info["model_info"]
    assert {"total_slots", "free_slots", "cached_slots"} <= set(server_info["kv"])
    assert server_info["cached_tokens_total"] > 0  # earlier tests repeated prompts
    # One count, reported twice: the top-level total is the scheduler's (aborted and timed-out requests included).
    assert server_info["cached_tokens_total"] == server_info["kv"]["cached_tokens_total"]
    assert http.get("/health_generate").status_code == 200
    metrics = http.get("/metrics").text
    for name in ("treadle_requests_finished_total", "treadle_prompt_tokens_total", "treadle_generation_tokens_total",
                 "treadle_time_to_first_token_seconds_bucket", "treadle_inter_token_latency_seconds_bucket",
                 "treadle_num_queued_requests", "treadle_kv_usage_ratio", "treadle_kv_total_slots"):
        assert name in metrics
    assert _metric(http, "treadle_generation_tokens_total") > 0
    assert _metric(http, "treadle_kv_total_slots") == 8192


def test_flush_cache_empties_the_prefix_cache(http: httpx.Client) -> None:
    wait_idle(http)
    assert http.post("/flush_cache").json() == {"success": True}
    kv = kv_stats(http)
    assert kv["cached_slots"] == 0 and kv["free_slots"] == kv["total_slots"]


def test_abort_request_ends_a_running_request(server: ServerHandle, http: httpx.Client) -> None:
    async def run() -> dict:
        async with httpx.AsyncClient(base_url=server.base_url, headers=server.headers, timeout=60) as client:
            pending = asyncio.create_task(client.post("/generate", json={
                "text": "abort me", "rid": "abort-me",
                "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}))
            for _ in range(100):
                await asyncio.sleep(0.05)
                if (await client.post("/abort_request", json={"rid": "abort-me"})).json()["success"]:
                    break
            return (await pending).json()

    result = asyncio.run(run())
    assert result["meta_info"]["finish_reason"]["type"] == "abort"
    assert len(result["output_ids"]) < 400


# ------------------------------------------------------------------ errors

BAD_REQUESTS = [
    ("invalid json", "/v1/chat/completions", b"{not json", 400, None),
    ("body is a list", "/v1/chat/completions", [1, 2], 400, None),
    ("messages not a list", "/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("empty messages", "/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("unknown role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400,
     "messages.0.role"),
    ("max_tokens wrong type", "/v1/chat/completions", {"messages": CHAT, "max_tokens": "many"}, 400, "max_tokens"),
    ("stream wrong type", "/v1/completions", {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("negative temperature", "/v1/chat/completions", {"messages": CHAT, "temperature": -1}, 400, "temperature"),
    ("seed past 64 bits", "/v1/chat/completions", {"messages": CHAT, "seed": 10**20}, 400, "seed"),
    ("native seed past 64 bits", "/generate", {"text": "x", "sampling_params": {"seed": -(2**64)}}, 400, "seed"),
    ("top_p zero", "/v1/completions", {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("penalty out of range", "/v1/completions", {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("n zero", "/v1/completions", {"prompt": "x", "n": 0}, 400, "n"),
    ("unknown model", "/v1/chat/completions", {"model": "gpt-17", "messages": CHAT}, 404, "model"),
    ("prompt longer than context", "/v1/completions", {"prompt": [7] * 600}, 400, "prompt"),
    ("chat longer than context", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "word " * 700}]}, 400, "messages"),
    ("max_tokens past the context", "/v1/completions", {"prompt": [7] * 500, "max_tokens": 100}, 400, "max_tokens"),
    ("empty prompt", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("token id out of vocab", "/generate", {"input_ids": [1, 99999]}, 400, "input_ids"),
    ("text and input_ids", "/generate", {"text": "x", "input_ids": [1]}, 400, "text"),
    ("unknown sampling param", "/generate", {"text": "x", "sampling_params": {"temprature": 0}}, 400,
     "sampling_params.temprature"),
    ("streaming with bad value", "/v1/completions", {"prompt": "x", "stream": True, "top_k": 0}, 400, "top_k"),
    ("invalid regex", "/generate", {"text": "x", "sampling_params": {"regex": "(ab"}}, 400, "regex"),
    ("unsupported schema type", "/generate", {"text": "x", "sampling_params": {"json_schema": {"type": "nope"}}},
     400, "json_schema"),
    ("schema not json", "/generate", {"text": "x", "sampling_params": {"json_schema": "{"}}, 400, "json_schema"),
    ("two constraints", "/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}},
     400, "ebnf"),
    ("best_of above n", "/v1/completions", {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("image content part to a text model", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]},
     400, "messages"),
    ("audio content part", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "x"}}]}]},
     400, "messages.0.content"),
    ("logit_bias key not a token id", "/v1/chat/completions", {"messages": CHAT, "logit_bias": {"a": 1}}, 400,
     "logit_bias.a.[key]"),
    ("logit_bias out of range", "/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, 400, "logit_bias.5"),
    ("logit_bias beyond the vocabulary", "/generate",
     {"text": "x", "sampling_params": {"logit_bias": {"99999999": 1}}}, 400, "logit_bias"),
]


@pytest.mark.parametrize("content_type", [None, "application/x-www-form-urlencoded", "text/plain"])
def test_a_json_body_without_its_content_type_gets_a_400_saying_so(http: httpx.Client, content_type) -> None:
    """curl -d sends form encoding: FastAPI leaves such a body unparsed (its error once made a 500 here, and the
    keep-alive connection was reset for the next request)."""
    body = json.dumps({"model": MODEL, "messages": CHAT, "max_tokens": 2}).encode()
    for _ in range(2):  # the same connection answers again
        headers = {"Content-Type": content_type} if content_type else {}
        response = http.post("/v1/chat/completions", content=body, headers=headers)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "Content-Type: application/json" in error["message"] and error["type"] == "invalid_request_error"
    assert http.post("/v1/chat/completions", json=json.loads(body)).status_code == 200


ODD_VALUES = [None, -1, 0, 3.5, 10**20, "", "x", [], {}, True, [1, 2], {"a": 1}]
FIELDS = ["max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs", "top_logprobs", "presence_penalty",
          "stream", "response_format", "tools", "tool_choice", "logit_bias", "user", "top_k", "echo", "messages",
          "prompt", "model"]


def test_random_malformed_bodies_get_4xx_and_the_connection_keeps_serving(http: httpx.Client) -> None:
    """Odd values in random fields of every endpoint's body: each answer is a success or an OpenAI-shaped 4xx,
    never a 5xx, on one keep-alive connection (a randomized run of this kind found the 500 for bodies without
    their Content-Type, which also reset the connection)."""
    rng = random.Random(0)
    bases = [("/v1/chat/completions", {"model": MODEL, "messages": CHAT, "max_tokens": 3}),
             ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3}),
             ("/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 3}})]
    statuses = set()
    for _ in range(90):
        path, base = rng.choice(bases)
        body = dict(base)
        for _ in range(rng.randint(1, 3)):
            body[rng.choice(FIELDS)] = rng.choice(ODD_VALUES)
        response = http.post(path, json=body)
        statuses.add(response.status_code)
        assert response.status_code < 500, (body, response.text)
        if response.status_code >= 400:
            error = response.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["message"], (body, error)
    assert {200, 400} <= statuses
    assert http.get("/health").status_code == 200


@pytest.mark.parametrize("name,path,body,status,param", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_input_gets_openai_shaped_4xx(http: httpx.Client, name: str, path: str, body, status: int,
                                          param: str | None) -> None:
    if isinstance(body, bytes):
        response = http.post(path, content=body, headers={"Content-Type": "application/json"})
    else:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_unknown_routes_and_methods_get_the_openai_error_shape_with_a_string_code(http: httpx.Client) -> None:
    missing = http.post("/v1/no_such_route", json={})
    assert missing.status_code == 404
    assert missing.json()["error"] == {"message": "there is no route POST /v1/no_such_route; see /docs for the routes",
                                       "type": "invalid_request_error", "param": None, "code": "not_found"}
    wrong_method = http.get("/v1/completions")
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"
    # One convention for every 4xx: ``code`` is a string or null, never the status number.
    others = [http.post("/v1/chat/completions", json={"model": "gpt-17", "messages": CHAT}),
              http.post("/v1/completions", json={"prompt": "x", "temperature": -1}),
              http.post("/v1/completions", json={"prompt": [7] * 600}),
              httpx.post(f"{http.base_url}/v1/completions", json={"prompt": "x"})]
    codes = [response.json()["error"]["code"] for response in others]
    assert [response.status_code for response in others] == [404, 400, 400, 401]
    assert codes == ["model_not_found", None, "context_length_exceeded", "invalid_api_key"]


def test_the_published_schema_shows_the_sampling_fields(http: httpx.Client) -> None:
    import dataclasses

    from treadle.core.request import SamplingParams

    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    assert set(schemas["NativeSamplingParams"]["properties"]) == {f.name for f in dataclasses.fields(SamplingParams)}
    assert {"max_tokens", "temperature", "top_p", "top_k", "logit_bias", "regex", "response_format", "echo",
            "logprobs"} <= set(schemas["CompletionRequest"]["properties"])
    assert "description" in schemas["NativeSamplingParams"]["properties"]["json_schema"]


def test_openai_client_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=MODEL, messages=CHAT, temperature=-2)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT)


def test_api_key_is_required(server: ServerHandle) -> None:
    assert httpx.get(f"{server.base_url}/health").status_code == 200  # open for probes
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        response = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x"}, headers=headers)
        assert response.status_code == 401
        assert response.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.base_url}/metrics").status_code == 401
    wrong = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()


# ------------------------------------------------------------------ bench serving (needs this server)


@pytest.mark.parametrize("api", ["native", "openai"])
def test_bench_serving_reports_throughput_and_latency(server: ServerHandle, tmp_path, capsys, api: str) -> None:
    from treadle.bench.serving import main

    out = tmp_path / "serving.json"
    rc = main(["--base-url", server.base_url, "--api-key", API_KEY, "--api", api, "--num-prompts", "6",
               "--input-len", "4:12", "--output-len", "4:6", "--request-rate", "50", "--max-concurrency", "4",
               "--output", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    summary = record["summary"]
    assert summary["completed"] == 6 and summary["failed"] == 0
    assert summary["total_output_tokens"] == record["workload"]["output_tokens"]
    assert 0 < summary["ttft_ms"]["p50"] <= summary["ttft_ms"]["p99"]
    assert summary["itl_ms"]["p90"] > 0
    printed = capsys.readouterr()
    assert "ITL (ms)" in printed.out
    assert "requests: 100%" in printed.err and "6/6" in printed.err  # the progress bar, on stderr
    assert record["command"].startswith("treadle bench serving --base-url") and record["machine"]["cpu_count"]
    assert API_KEY not in out.read_text() and "--api-key ***" in record["command"]
    assert all(request["itl_s"] is None for request in record["requests"])  # left out unless asked for


@pytest.mark.parametrize("api", ["native", "openai"])
def test_bench_serving_reports_the_prefix_cache_hit_rate_of_a_shared_prefix_workload(
        server: ServerHandle, tmp_path, capsys, api: str) -> None:
    from treadle.bench.serving import main

    out = tmp_path / "serving.json"
    rc = main(["--base-url", server.base_url, "--api-key", API_KEY, "--api", api, "--workload", "shared-prefix",
               "--num-prompts", "4", "--prefix-len", "40", "--num-prefixes", "2", "--question-len", "3:5",
               "--output-len", "2:3", "--max-concurrency", "1", "--seed", "7", "--output", str(out)])
    assert rc == 0
    record = json.loads(out.read_text())
    summary = record["summary"]
    assert record["workload"]["params"]["num_prefixes"] == 2
    # One at a time: requests 3 and 4 find their system prompt (whole 16-token pages at least) in the cache.
    assert summary["cached_tokens"] >= 2 * 32
    assert summary["cache_hit_rate"] == summary["cached_tokens"] / summary["total_input_tokens"]
    assert "prefix cache hit rate" in capsys.readouterr().out


def test_bench_serving_keeps_each_requests_token_gaps_when_asked(server: ServerHandle, tmp_path) -> None:
    from treadle.bench.serving import main

    out = tmp_path / "serving.json"
    assert main(["--base-url", server.base_url, "--api-key", API_KEY, "--num-prompts", "3", "--input-len", "4:8",
                 "--output-len", "5:5", "--keep-token-gaps", "--output", str(out)]) == 0
    requests = json.loads(out.read_text())["requests"]
    for request in requests:
        # At most one gap per token after the first (a chunk of several tokens splits its gap among them), all
        # of them inside the time from the first token to the last.
        gaps = request["itl_s"]
        assert 0 < len(gaps) <= request["output_tokens"] - 1 and all(gap > 0 for gap in gaps)
        assert sum(gaps) <= request["latency_s"] - request["ttft_s"] + 1e-6


def test_bench_serving_runs_as_a_module_with_several_client_processes(server: ServerHandle, tmp_path) -> None:
    """``python -m treadle.bench.serving`` (how the docs and device.sh run it), with ``--workers 2``: every request
    is sent once and the results come back in request order (as from one process)."""
    from treadle.bench.serving import main

    common = ["--base-url", server.base_url, "--api-key", API_KEY, "--api", "native", "--num-prompts", "5",
              "--input-len", "4:12", "--output-len", "2:4"]
    one = tmp_path / "one.json"
    assert main(common + ["--output", str(one)]) == 0
    two = tmp_path / "two.json"
    done = subprocess.run(
        [sys.executable, "-m", "treadle.bench.serving", *common, "--workers", "2", "--output", str(two)],
        capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "2 client processes" in done.stdout
    assert "requests: 100%" in done.stderr and "5/5" in done.stderr  # the workers' requests, counted here
    records = [json.loads(path.read_text()) for path in (one, two)]
    assert records[1]["summary"]["completed"] == 5 and records[1]["client_workers"] == 2
    assert [r["prompt_tokens"] for r in records[1]["requests"]] == [r["prompt_tokens"] for r in records[0]["requests"]]
    assert [r["output_tokens"] for r in records[1]["requests"]] == [r["output_tokens"] for r in records[0]["requests"]]


# ------------------------------------------------------------------ shutdown (keep last)


def test_sigterm_drains_the_streams_of_every_worker_then_stops_children_and_frees_the_port(
        server: ServerHandle, http: httpx.Client, front_profile: str) -> None:
    pids = http.get("/get_server_info").json()["pids"]
    streams = [_DrainedStream(_client_on_worker(server, worker)) for worker in (1, WORKERS - 1)]
    for stream in streams:
        stream.start()
    assert all(stream.first.wait(60) for stream in streams)
    server.process.send_signal(signal.SIGTERM)
    assert not any(stream.lines[-1:] == ["data: [DONE]"] for stream in streams)  # still under way when it came
    assert server.process.wait(60) == 0
    for stream in streams:
        stream.join(10)
        assert stream.lines[-1] == "data: [DONE]", stream.lines[-3:]
        last = json.loads(stream.lines[-2][6:])
        assert last["meta_info"]["finish_reason"]["type"] == "length" and len(last["output_ids"]) == DRAIN_TOKENS
    log = server.log()
    for alarm in ("Traceback", "unexpectedly", "leaked"):
        assert alarm not in log, log[-3000:]
    # TREADLE_FRONT_PROFILE: every HTTP worker and detokenizer wrote its profile as it stopped.
    names = [f"http-worker-{w}" for w in range(WORKERS)] + [f"detokenizer-{d}" for d in range(DETOKENIZERS)]
    assert sorted(os.listdir(front_profile)) == sorted(f"{name}.prof" for name in names)
    assert "handle_routed" in str(pstats.Stats(os.path.join(front_profile, "detokenizer-1.prof")).stats)
    for pid in pids.values():
        assert not _alive(pid), f"child {pid} survived the shutdown"
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()
    with socket.socket() as sock:  # a restarted server can listen on it again
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", server.port))
        sock.listen()


DRAIN_TOKENS = 480  # the context is 512


class _DrainedStream(threading.Thread):
    """One long streaming /generate on a given client's connection, read in the background."""

    def __init__(self, http: httpx.Client) -> None:
        super().__init__(daemon=True)
        self.http = http
        self.first = threading.Event()
        self.lines: list[str] = []

    def run(self) -> None:
        body = {"text": "drain me", "stream": True,
                "sampling_params": {"max_new_tokens": DRAIN_TOKENS, "ignore_eos": True}}
        with contextlib.closing(self.http), self.http.stream("POST", "/generate", json=body) as response:
            for line in response.iter_lines():
                if line:
                    self.lines.append(line)
                    self.first.set()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie waiting for init to reap it is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def _total(metrics: str, name: str) -> float:
    """The sum of every sample of ``name`` (all its label values) in a /metrics text."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
               if line.startswith(name + " ") or line.startswith(name + "{"))


def _metric(http: httpx.Client, name: str) -> float:
    for line in http.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")
