"""The HTTP process checks a request against the limits the scheduler reported in ``model_info`` (core.validation)
and answers 400 before anything is queued."""

from __future__ import annotations

import re
import shutil

import pytest
from fastapi.testclient import TestClient

from treadle.core.config import ServerConfig
from treadle.core.validation import REQUEST_LIMITS_KEY, RequestLimits
from treadle.server.app import build_app
from treadle.server.ipc import IpcAddresses
from treadle.server.metrics import ServerMetrics
from treadle.server.tokenizer_manager import TokenizerManager

LIMITS = RequestLimits(context_len=512, vocab_size=512, kv_slots=16, max_request_tokens=40)


@pytest.fixture()
def http():
    addresses = IpcAddresses.new()
    info = {"context_len": 512, "vocab_size": 512, "architecture": "LlamaForCausalLM", REQUEST_LIMITS_KEY: LIMITS.as_dict()}
    manager = TokenizerManager(ServerConfig(), info, None, addresses, ServerMetrics())
    try:
        with TestClient(build_app(manager)) as client:
            yield client, manager
    finally:
        manager.close()
        shutil.rmtree(addresses.folder, ignore_errors=True)


@pytest.mark.parametrize("path, body, param, words", [
    ("/generate", {"input_ids": [1] * 20, "sampling_params": {"max_new_tokens": 1}}, "input_ids",
     "KV cache holds only 16"),
    ("/v1/completions", {"prompt": [1] * 20, "max_tokens": 1}, "prompt", "KV cache holds only 16"),
    ("/generate", {"input_ids": [1] * 10, "sampling_params": {"max_new_tokens": 31}}, "max_new_tokens",
     r"plus max_new_tokens \(31\) exceeds server.max_request_tokens = 40"),
    ("/v1/completions", {"prompt": [1] * 10, "max_tokens": 31}, "max_tokens",
     r"plus max_tokens \(31\) exceeds server.max_request_tokens = 40"),
    ("/v1/completions", {"prompt": [1] * 10, "max_completion_tokens": -1}, "max_completion_tokens",
     "max_completion_tokens must be >= 0"),
    ("/generate", {"input_ids": [1, 2], "sampling_params": {"logit_bias": {"-3": 1}}}, "logit_bias",
     "logit_bias keys must be token ids"),
])
def test_a_request_past_the_schedulers_limits_is_refused_before_it_is_queued(http, path, body, param, words):
    client, manager = http
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and re.search(words, error["message"]), error
    assert error["type"] == "invalid_request_error"
    assert not manager.states  # nothing reached the scheduler
