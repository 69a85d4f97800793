"""POST /v1/embeddings (OpenAI-compatible), /v1/score and /v1/rerank for a model served with ``model.task: embed``.

Each input is one scheduler request (``wants_embedding``): its prompt is prefilled, pooled and returned as one
vector. ``dimensions`` shortens a Matryoshka model's vectors; ``encoding_format: base64`` returns each vector as
little-endian float32 bytes in base64 (what the ``openai`` client asks for by default). ``/v1/score`` (vLLM's shape)
and ``/v1/rerank`` (Jina's and Cohere's) embed both sides and answer their cosine similarity (a bi-encoder's score).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from treadle.core import validation
from treadle.core.embedding.vectors import check_dimensions, truncate
from treadle.core.request_io import SamplingParams
from treadle.server.ipc import TokenizedGenerateReq
from treadle.server.lora_routes import model_adapter
from treadle.server.protocol import EmbeddingRequest, RerankRequest, ScoreRequest
from treadle.server.streaming import collect
from treadle.server.tokenizer_manager import RequestError, StreamEvent, TokenizerManager

_NAMES = {"prompt": "input", "input_ids": "input"}


def add_embedding_routes(app: FastAPI, manager: TokenizerManager) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        info = _embedding_model(manager, body.model, "/v1/embeddings")
        check_dimensions(body.dimensions, info)
        prompts = _input_token_lists(manager, body.input)
        vectors = await _embed(manager, request, prompts, body.rid, body.priority, body.timeout)
        tokens = sum(len(ids) for ids in prompts)
        return JSONResponse({
            "object": "list", "model": manager.served_model_name,
            "data": [{"object": "embedding", "index": i,
                      "embedding": _encode(truncate(vector, body.dimensions, bool(info["normalize"])),
                                           body.encoding_format)}
                     for i, vector in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    @app.post("/v1/score")
    async def score(body: ScoreRequest, request: Request) -> JSONResponse:
        _embedding_model(manager, body.model, "/v1/score")
        firsts, seconds = _texts(body.text_1), _texts(body.text_2)
        if len(firsts) != 1 and len(firsts) != len(seconds):
            raise RequestError(f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1 for all "
                               "of text_2, or as many of each", param="text_1")
        scores, tokens = await _similarities(manager, request, firsts, seconds, body)
        return JSONResponse({
            "id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": manager.served_model_name,
            "data": [{"index": i, "object": "score", "score": value} for i, value in enumerate(scores)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    @app.post("/v1/rerank")
    async def rerank(body: RerankRequest, request: Request) -> JSONResponse:
        _embedding_model(manager, body.model, "/v1/rerank")
        scores, tokens = await _similarities(manager, request, [body.query], body.documents, body)
        ranked = sorted(range(len(scores)), key=lambda i: -scores[i])[:body.top_n]
        return JSONResponse({
            "id": f"rerank-{uuid.uuid4().hex}", "model": manager.served_model_name,
            "results": [{"index": i, "relevance_score": scores[i],
                         **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                        for i in ranked],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })


def _embedding_model(manager: TokenizerManager, model: str | None, route: str) -> dict[str, Any]:
    """The served embedding model's info; a 400 for a generation model or a LoRA adapter's name."""
    if model_adapter(manager, model) is not None:  # a 404 for a model this server does not serve
        raise RequestError(f"LoRA adapters serve generation only; {route} takes the served model's name",
                           param="model")
    validation.check_task(True, str(manager.model_info.get("task") or "generate"))
    return manager.model_info["embedding"]


async def _embed(manager: TokenizerManager, request: Request, prompts: list[list[int]], rid: str | None,
                 priority: int, timeout: float | None) -> list[list[float]]:
    """One pooled vector per prompt (normalized when the model normalizes), through the scheduler."""
    params = SamplingParams(max_new_tokens=1)
    for ids in prompts:
        manager.check_request(ids, params, _NAMES)
    prefix = rid or uuid.uuid4().hex
    reqs = [TokenizedGenerateReq(prefix if len(prompts) == 1 else f"{prefix}-{i}", ids, params, priority=priority,
                                 wants_embedding=True) for i, ids in enumerate(prompts)]
    vectors: list[list[float]] = [[] for _ in prompts]

    def add(event: StreamEvent) -> None:
        if event.output is not None and event.output.embedding is not None:
            vectors[event.index] = event.output.embedding

    await collect(request, manager.submit(reqs, timeout=timeout), add)
    return vectors


async def _similarities(manager: TokenizerManager, request: Request, firsts: list[str], seconds: list[str],
                        body: ScoreRequest | RerankRequest) -> tuple[list[float], int]:
    """The cosine similarity of each pair (one first text against every second one, or pairwise), and the prompt
    tokens embedded."""
    prompts = [manager.tokenize(text, param="text_1") for text in firsts] + \
        [manager.tokenize(text, param="text_2") for text in seconds]
    if any(not ids for ids in prompts):
        raise RequestError("every text needs at least one token", param="text_1")
    vectors = np.asarray(await _embed(manager, request, prompts, body.rid, body.priority, body.timeout),
                         dtype=np.float64)
    vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    left, right = vectors[:len(firsts)], vectors[len(firsts):]
    scores = (left * right).sum(axis=1) if len(firsts) == len(seconds) else right @ left[0]
    return [float(value) for value in scores], sum(len(ids) for ids in prompts)


def _texts(given: str | list[str]) -> list[str]:
    return [given] if isinstance(given, str) else list(given)


def _input_token_lists(manager: TokenizerManager, given: Any) -> list[list[int]]:
    """``input`` as one token list per vector to return."""
    if isinstance(given, str):
        given = [given]
    if not given:
        raise RequestError("`input` must not be empty", param="input")
    if isinstance(given[0], int):
        return [list(given)]
    prompts = [manager.tokenize(item, param="input") if isinstance(item, str) else list(item) for item in given]
    for index, ids in enumerate(prompts):
        if not ids:
            raise RequestError(f"input[{index}] is empty; every input needs at least one token", param="input")
    return prompts


def _encode(vector: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
