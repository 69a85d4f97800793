"""Speculative decoding through the server (ngram): native /generate reports spec_verify_steps in meta_info with the
plain server's tokens, /metrics has the acceptance-length histogram, and `treadle bench serving` prints the
acceptance length."""

from __future__ import annotations

import json
import signal

import httpx
import pytest

from treadle.core.config import ServerConfig
from treadle.server.launch import ServerHandle, launch_server

REPEATING = list(range(40, 52)) * 3  # a phrase said three times: the n-gram look-up drafts its next words


@pytest.fixture(scope="module")
def server(tiny_model_dir: str) -> ServerHandle:
    config = ServerConfig(
        model={"path": tiny_model_dir, "served_model_name": "tiny"}, cache={"max_total_tokens": 8192},
        server={"port": 0, "log_level": "warning"}, plugins=["treadle.plugins.speculators.ngram"],
        speculative={"method": "ngram", "num_tokens": 3, "max_batch_size": 8})
    handle = launch_server(config, timeout=180)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


def test_generate_reports_verify_steps_with_the_plain_tokens(server: ServerHandle, tiny_model_dir: str) -> None:
    from treadle import Engine, SamplingParams

    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        body = http.post("/generate", json={"input_ids": REPEATING, "sampling_params": params}).json()
        metrics = http.get("/metrics").text
    plain = Engine({"model": {"path": tiny_model_dir}, "cache": {"max_total_tokens": 2048}}).generate(
        input_ids=[REPEATING], sampling_params=SamplingParams(**params))[0]
    assert body["output_ids"] == plain.token_ids
    steps = body["meta_info"]["spec_verify_steps"]
    assert 0 < steps < body["meta_info"]["completion_tokens"] - 1, "some drafts must be accepted"
    count = next(float(line.split()[1]) for line in metrics.splitlines()
                 if line.startswith("treadle_spec_acceptance_length_count"))
    assert count == steps


def test_bench_serving_prints_the_acceptance_length(server: ServerHandle, tmp_path, capsys) -> None:
    from treadle.bench.serving import main

    out = tmp_path / "serving.json"
    rc = main(["--base-url", server.base_url, "--num-prompts", "4", "--input-len", "4:12", "--output-len", "24:32",
               "--max-concurrency", "2", "--no-progress", "--output", str(out)])
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["spec_acceptance_length"] >= 1.0
    assert "acceptance length" in capsys.readouterr().out
