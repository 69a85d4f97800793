"""POST /v1/embeddings (OpenAI-compatible) for a model served with ``model.task: embed``.

Each input is one scheduler request (``wants_embedding``): its prompt is prefilled, pooled and returned as one
vector. ``dimensions`` shortens a Matryoshka model's vectors; ``encoding_format: base64`` returns each vector as
little-endian float32 bytes in base64 (what the ``openai`` client asks for by default).
"""

from __future__ import annotations

import base64
import uuid
from typing import Any

import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from treadle.core import validation
from treadle.core.embedding.vectors import check_dimensions, truncate
from treadle.core.request import SamplingParams
from treadle.server.ipc import TokenizedGenerateReq
from treadle.server.lora_routes import model_adapter
from treadle.server.protocol import EmbeddingRequest
from treadle.server.streaming import collect
from treadle.server.tokenizer_manager import RequestError, StreamEvent, TokenizerManager

_NAMES = {"prompt": "input", "input_ids": "input"}


def add_embedding_routes(app: FastAPI, manager: TokenizerManager) -> None:
    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request) -> JSONResponse:
        if model_adapter(manager, body.model) is not None:  # a 404 for a model this server does not serve
            raise RequestError("LoRA adapters serve generation only; /v1/embeddings takes the served model's name",
                               param="model")
        validation.check_task(True, str(manager.model_info.get("task") or "generate"))
        info = manager.model_info["embedding"]
        check_dimensions(body.dimensions, info)
        prompts = _input_token_lists(manager, body.input)
        params = SamplingParams(max_new_tokens=1)
        for ids in prompts:
            manager.check_request(ids, params, _NAMES)
        prefix = body.rid or uuid.uuid4().hex
        reqs = [TokenizedGenerateReq(prefix if len(prompts) == 1 else f"{prefix}-{i}", ids, params,
                                     priority=body.priority, wants_embedding=True) for i, ids in enumerate(prompts)]
        vectors: list[list[float]] = [[] for _ in prompts]

        def add(event: StreamEvent) -> None:
            if event.output is not None and event.output.embedding is not None:
                vectors[event.index] = truncate(event.output.embedding, body.dimensions, bool(info["normalize"]))

        await collect(request, manager.submit(reqs, timeout=body.timeout), add)
        tokens = sum(len(ids) for ids in prompts)
        return JSONResponse({
            "object": "list", "model": manager.served_model_name,
            "data": [{"object": "embedding", "index": i, "embedding": _encode(vector, body.encoding_format)}
                     for i, vector in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })


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
