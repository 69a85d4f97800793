"""POST /v1/embeddings end to end: real server processes and the official openai client."""

from __future__ import annotations

import signal

import httpx
import openai
import pytest
import torch

from treadle.core.config import ServerConfig
from treadle.server.launch import ServerHandle, launch_server
from treadle.testing.embedding import hf_embeddings, make_tiny_embedding_model
from treadle.testing.tokenizer import make_tiny_tokenizer

TEXTS = ["The capital of France is Paris.", "Embeddings map text to vectors.", "hi"]
PLUGINS = ["treadle.plugins.poolings.builtin"]  # until the package is reinstalled with this branch's entry points


def start(model_dir: str) -> ServerHandle:
    return launch_server(ServerConfig(
        model={"path": model_dir, "served_model_name": "tiny", "matryoshka": True},
        cache={"max_total_tokens": 4096}, server={"port": 0, "log_level": "warning"}, plugins=PLUGINS), timeout=180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen3-emb-text")
    make_tiny_embedding_model(path, "qwen3", pooling="last")
    make_tiny_tokenizer(path)
    return str(path)


@pytest.fixture(scope="module")
def server(model_dir: str) -> ServerHandle:
    handle = start(model_dir)
    yield handle
    handle.shutdown(signal.SIGKILL if handle.process.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def client(server: ServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0, timeout=60)


def test_openai_client_embeddings_match_hf(client: openai.OpenAI, model_dir: str) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    want = hf_embeddings(model_dir, [tokenizer.encode(text) for text in TEXTS], "last", normalize=True)
    batch = client.embeddings.create(model="tiny", input=TEXTS)  # the client asks for base64 by default
    floats = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    assert [item.index for item in batch.data] == [0, 1, 2]
    for item, reference in zip(batch.data, want):
        torch.testing.assert_close(torch.tensor(item.embedding), reference, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(floats.data[0].embedding), want[0], atol=2e-5, rtol=1e-4)
    assert batch.usage.prompt_tokens == sum(len(tokenizer.encode(text)) for text in TEXTS)


def test_token_ids_and_dimensions(client: openai.OpenAI) -> None:
    ids = [[5, 17, 42, 8], [300, 301, 9]]
    full = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    one = client.embeddings.create(model="tiny", input=ids[1], encoding_format="float")
    short = client.embeddings.create(model="tiny", input=ids, dimensions=8, encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), torch.tensor(full.data[1].embedding))
    head = torch.nn.functional.normalize(torch.tensor(full.data[0].embedding[:8]), dim=0)
    torch.testing.assert_close(torch.tensor(short.data[0].embedding), head)


@pytest.mark.parametrize("body, param, message", [
    ({"input": []}, "input", "must not be empty"),
    ({"input": [[]]}, "input", "input[0] is empty"),
    ({"input": "x", "dimensions": 0}, "dimensions", "between 1 and 64"),
    ({"input": [1.5]}, "input", None),
    ({"input": [[1, 999999]]}, "input", None),
])
def test_bad_inputs_are_400(server: ServerHandle, body: dict, param: str, message: str | None) -> None:
    response = httpx.post(f"{server.base_url}/v1/embeddings", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] is not None and error["param"].startswith(param)
    if message:
        assert message in error["message"]


def test_generation_on_an_embedding_model_is_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="serves embeddings") as info:
        client.completions.create(model="tiny", prompt="hello", max_tokens=4)
    assert info.value.body["code"] == "model_task_mismatch"


def test_health_generate_and_model_info(server: ServerHandle) -> None:
    assert httpx.get(f"{server.base_url}/health_generate", timeout=60).status_code == 200
    info = httpx.get(f"{server.base_url}/get_model_info", timeout=30).json()
    assert info["is_generation"] is False and info["task"] == "embed"
    assert info["embedding"] == {"dimensions": 64, "pooling": "last", "normalize": True, "matryoshka": True}


def test_score_and_rerank_are_cosine_similarities(server: ServerHandle, client: openai.OpenAI) -> None:
    """/v1/score (one text_1 against each text_2, and pairwise) and /v1/rerank answer the cosine similarity of the
    texts' embeddings; rerank orders the documents by it and keeps top_n; a mismatched pairing is a 400."""
    vectors = torch.tensor([item.embedding for item in client.embeddings.create(model="tiny", input=TEXTS).data])
    vectors = torch.nn.functional.normalize(vectors.double(), dim=-1)
    want = (vectors[1:] @ vectors[0]).tolist()
    one_to_many = httpx.post(f"{server.base_url}/v1/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]},
                             timeout=60).json()
    assert [item["score"] for item in one_to_many["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = httpx.post(f"{server.base_url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS[1:]},
                          timeout=60).json()
    assert [item["score"] for item in pairwise["data"]] == pytest.approx(
        [want[0], float(vectors[1] @ vectors[2])], abs=1e-5)
    ranked = httpx.post(f"{server.base_url}/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1},
                        timeout=60).json()["results"]
    best = max(range(2), key=lambda i: want[i])
    assert len(ranked) == 1 and ranked[0]["index"] == best and ranked[0]["document"]["text"] == TEXTS[1 + best]
    assert ranked[0]["relevance_score"] == pytest.approx(want[best], abs=1e-5)
    mismatched = httpx.post(f"{server.base_url}/v1/score", json={"text_1": TEXTS[:2], "text_2": TEXTS}, timeout=60)
    assert mismatched.status_code == 400 and "text_1 has 2 texts" in mismatched.json()["error"]["message"]
