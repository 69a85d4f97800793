"""The native routes (``/generate``, ``/abort_request``) and the admin and health routes."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from treadle import __version__
from treadle.core.request_io import SamplingParams
from treadle.server.ipc import RESOLVED_CONFIG_KEY, StrOutput, TokenizedGenerateReq, finish_detail
from treadle.server.protocol import AbortRequest, GenerateRequest, error_body
from treadle.server.streaming import collect, first_event, json_string, sse_response
from treadle.server.tokenizer_manager import RequestError, StreamEvent, TokenizerManager


class _NativeResult:
    """Accumulates one prompt's outputs into the /generate response shape."""

    def __init__(self, rid: str, input_ids: list[int], body: GenerateRequest) -> None:
        self.rid = rid
        self.input_ids = input_ids
        self.body = body
        self.text = ""
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top: list[list[tuple[int, float]]] = []
        self.input_logprobs: list[float | None] = []
        self.input_top: list[Any] = []
        self.last: StrOutput | None = None
        # output_ids as the inside of a JSON array, grown with each output: a streamed event carries the
        # whole list, and re-encoding it every event cost O(n) per token in the HTTP process.
        self._ids_json = ""

    def add(self, out: StrOutput) -> None:
        self.text += out.text_delta
        self.output_ids += out.new_token_ids
        if out.new_token_ids:
            piece = ",".join(map(str, out.new_token_ids))
            self._ids_json = f"{self._ids_json},{piece}" if self._ids_json else piece
        self.output_logprobs += out.new_output_logprobs
        self.output_top += out.new_output_top_logprobs
        if out.input_token_logprobs is not None:
            self.input_logprobs = list(out.input_token_logprobs)
            self.input_top = list(out.input_top_logprobs or [])
        self.last = out

    def to_json(self, stop: list[str]) -> dict[str, Any]:
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": self._meta(stop)}

    def to_json_text(self, stop: list[str], index: int | None = None) -> str:
        """``to_json`` serialized (plus ``index`` for a batch), reusing the already encoded output ids; the same
        bytes as ``json.dumps(..., ensure_ascii=False)``, written out by hand for the fields every event has."""
        meta = json.dumps(self._meta(stop), ensure_ascii=False) if self.body.return_logprob else self._meta_text(stop)
        tail = "" if index is None else f', "index": {index}'
        return f'{{"text": {json_string(self.text)}, "output_ids": [{self._ids_json}], "meta_info": {meta}{tail}}}'

    def _meta_text(self, stop: list[str]) -> str:
        """``json.dumps(self._meta(stop))`` without log-probs."""
        out = self.last
        if out is None:
            return json.dumps(self._meta(stop), ensure_ascii=False)
        reason = "null" if out.finished_reason is None else json.dumps(
            {"type": out.finished_reason, "matched": finish_detail(out, stop)}, ensure_ascii=False)
        return (f'{{"id": {json_string(self.rid)}, "finish_reason": {reason}, "prompt_tokens": {out.prompt_tokens}, '
                f'"completion_tokens": {out.completion_tokens}, "cached_tokens": {out.cached_tokens}, '
                f'"spec_verify_steps": {out.spec_verify_steps}}}')

    def _meta(self, stop: list[str]) -> dict[str, Any]:
        out = self.last
        reason = None
        if out is not None and out.finished_reason is not None:
            reason = {"type": out.finished_reason, "matched": finish_detail(out, stop)}
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": reason,
            "prompt_tokens": out.prompt_tokens if out else len(self.input_ids),
            "completion_tokens": out.completion_tokens if out else 0,
            "cached_tokens": out.cached_tokens if out else 0,
            "spec_verify_steps": out.spec_verify_steps if out else 0,
        }
        if self.body.return_logprob:
            start = max(self.body.logprob_start_len, 0)
            meta["input_token_logprobs"] = [
                [lp, tid] for lp, tid in zip(self.input_logprobs, self.input_ids[start:])]
            meta["output_token_logprobs"] = [[lp, tid] for lp, tid in zip(self.output_logprobs, self.output_ids)]
            meta["input_top_logprobs"] = [_top_pairs(top) for top in self.input_top]
            meta["output_top_logprobs"] = [_top_pairs(top) for top in self.output_top]
        return meta


def _top_pairs(top: list[tuple[int, float]] | None) -> list[list[Any]] | None:
    return None if top is None else [[lp, tid] for tid, lp in top]


def _native_prompts(manager: TokenizerManager, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    if (body.text is None) == (body.input_ids is None):
        raise RequestError("send exactly one of `text` and `input_ids`", param="text")
    if body.text is not None:
        texts = [body.text] if isinstance(body.text, str) else body.text
        if not texts:
            raise RequestError("`text` is an empty list", param="text")
        return [manager.tokenize(t, "text") for t in texts], isinstance(body.text, list)
    ids = body.input_ids
    if ids and isinstance(ids[0], list):
        return [list(x) for x in ids], True  # type: ignore[arg-type]
    if not ids:
        raise RequestError("`input_ids` is empty", param="input_ids")
    return [list(ids)], False  # type: ignore[arg-type]


def _per_prompt_adapters(lora_path: str | list[str | None] | None, count: int) -> list[str | None]:
    if isinstance(lora_path, list):
        if len(lora_path) != count:
            raise RequestError(f"{len(lora_path)} lora_path entries for {count} prompts", param="lora_path")
        return [name or None for name in lora_path]
    return [lora_path or None] * count


async def _native_media(manager: TokenizerManager, body: GenerateRequest, prompts: list[list[int]],
                        is_batch: bool) -> list[Any]:
    """Each prompt's images (``image_data``) and videos (``video_data``) prepared, its ids expanded in place; None
    for a prompt without."""
    images = _per_prompt_media(body.image_data, len(prompts), is_batch, "image_data")
    videos = _per_prompt_media(body.video_data, len(prompts), is_batch, "video_data")
    prepared: list[Any] = []
    for index, (image_sources, video_sources) in enumerate(zip(images, videos)):
        if not image_sources and not video_sources:
            prepared.append(None)
            continue
        prompts[index], multimodal = await manager.media.prepare(prompts[index], image_sources, "image_data",
                                                                 video_sources, "video_data")
        prepared.append(multimodal)
    return prepared


def _per_prompt_media(given: Any, count: int, is_batch: bool, param: str) -> list[list[Any]]:
    """``image_data`` or ``video_data`` as one list of items per prompt (a lone URL is a list of one)."""
    if given is None:
        return [[] for _ in range(count)]
    per_prompt = list(given) if is_batch else [given]
    if len(per_prompt) != count:
        raise RequestError(f"{param} has {len(per_prompt)} entries for {count} prompts", param=param)
    return [[items] if isinstance(items, str) else list(items or []) for items in per_prompt]


def add_native_routes(app: FastAPI, manager: TokenizerManager, server_info: dict[str, Any]) -> None:
    """``/generate``, the health and info routes, the admin routes and ``/metrics``."""
    _add_generate_route(app, manager)
    _add_health_and_info_routes(app, manager, server_info)
    _add_admin_routes(app, manager)


def _add_generate_route(app: FastAPI, manager: TokenizerManager) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        prompts, is_batch = _native_prompts(manager, body)
        param = "text" if body.text is not None else "input_ids"
        multimodal = await _native_media(manager, body, prompts, is_batch)
        params = SamplingParams(**body.sampling_params.model_dump())
        if isinstance(body.rid, list):
            if len(body.rid) != len(prompts):
                raise RequestError(f"{len(body.rid)} rids for {len(prompts)} prompts", param="rid")
            rids = list(body.rid)
        elif body.rid is not None:
            rids = [body.rid] if len(prompts) == 1 else [f"{body.rid}-{i}" for i in range(len(prompts))]
        else:
            rids = [manager.new_rid() for _ in prompts]
        adapters = _per_prompt_adapters(body.lora_path, len(prompts))
        reqs = []
        for rid, ids, adapter, mm in zip(rids, prompts, adapters, multimodal):
            manager.check_request(ids, params, {"prompt": param, "input_ids": param}, body.top_logprobs_num)
            reqs.append(TokenizedGenerateReq(rid, ids, params, body.return_logprob, body.logprob_start_len,
                                             body.top_logprobs_num, body.priority, lora_name=adapter, multimodal=mm))
        results = [_NativeResult(rid, ids, body) for rid, ids in zip(rids, prompts)]
        stop = list(params.stop or [])
        stream = manager.submit(reqs, timeout=body.timeout)

        def add(event: StreamEvent) -> None:
            results[event.index].add(event.output)  # type: ignore[arg-type]

        if body.stream:
            first = await first_event(stream)

            def render(event: StreamEvent) -> list[str]:
                return [results[event.index].to_json_text(stop, event.index if is_batch else None)]

            return sse_response(stream, first, render, accumulate=add)
        await collect(request, stream, add)
        payload = [r.to_json(stop) for r in results]
        return JSONResponse(payload if is_batch else payload[0])


def _add_health_and_info_routes(app: FastAPI, manager: TokenizerManager, server_info: dict[str, Any]) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        if manager.dead_reason is not None:
            return JSONResponse(error_body(manager.dead_reason, "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        token = int(manager.model_info.get("bos_token_id") or 0)
        embeds = manager.model_info.get("task") == "embed"  # an embedding model: embed one token instead
        stream = manager.submit([TokenizedGenerateReq(manager.new_rid(), [token], params, wants_embedding=embeds)])
        try:
            await asyncio.wait_for(collect(request, stream, lambda event: None), timeout=60)
        except asyncio.TimeoutError:
            stream.abort()
            raise RequestError("the model did not produce a token within 60 s", status_code=503,
                               type_="server_error") from None
        return JSONResponse({"status": "ok"})

    @app.get("/get_model_info")
    async def get_model_info() -> JSONResponse:
        info = _public_model_info(manager)
        info.setdefault("served_model_name", manager.served_model_name)
        info["is_generation"] = manager.model_info.get("task", "generate") != "embed"
        info["has_tokenizer"] = manager.tokenizer is not None
        return JSONResponse(info)

    @app.get("/get_server_info")
    async def get_server_info() -> JSONResponse:
        stats = await manager.control("stats")
        pids = {"server": os.getpid(), **server_info.get("pids", {})}
        return JSONResponse({
            "version": __version__,
            "config": resolved_config(manager.config.model_dump(mode="json"),  # secrets are SecretStr: masked
                                      manager.model_info.get(RESOLVED_CONFIG_KEY)),
            "kv": stats["kv"],
            **({"replicas": _replicas(stats)} if "replicas" in stats else {}),
            # The scheduler's count (prompt tokens found in the prefix cache at admission), as under kv.
            "cached_tokens_total": stats["kv"]["cached_tokens_total"],
            "running_requests": manager.inflight_requests(),  # every HTTP worker's
            "max_inflight_requests": manager.max_inflight_requests,
            "draining": manager.draining,
            "http_worker": manager.worker_id,  # the worker process that answered (0 .. server.workers - 1)
            "model_info": _public_model_info(manager),
            **server_info,
            "pids": pids,
            "memory": {"rss_bytes": {name: resident_bytes(pid) for name, pid in pids.items()}},
        })

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await manager.control("stats", timeout=2.0)
            manager.metrics.set_scheduler_stats(stats["kv"], stats.get("replicas"))
        except RequestError:
            pass  # still serve the counters when the scheduler is busy or gone
        return Response(manager.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _add_admin_routes(app: FastAPI, manager: TokenizerManager) -> None:
    async def flush_cache() -> JSONResponse:
        result = await manager.control("flush_cache")
        if not result.get("success"):
            body = error_body("cannot flush the cache while requests are running; retry when idle",
                              "invalid_request_error", None, "requests_in_flight")
            return JSONResponse({"success": False, **body}, status_code=409)
        return JSONResponse({"success": True})

    app.add_api_route("/flush_cache", flush_cache, methods=["POST", "GET"])

    @app.post("/abort_request")
    async def abort_request(body: AbortRequest) -> JSONResponse:
        # The request may run on any HTTP worker: the scheduler (every replica) aborts it and its ``<rid>-<i>``
        # siblings, and each one's final 'abort' output reaches the handler on its own worker.
        aborted = (await manager.control("abort_request", args={"rid": body.rid}))["aborted"]
        manager.metrics.requests_aborted.inc(len(aborted))
        return JSONResponse({"success": bool(aborted), "aborted": aborted})


def resident_bytes(pid: int | None) -> int | None:
    """Resident memory of a process from /proc (None off Linux or once it is gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def resolved_config(config: dict[str, Any], resolved: dict[str, Any] | None) -> dict[str, Any]:
    """The HTTP process's config dump with each ``auto`` setting replaced by the value the scheduler chose."""
    for section, values in (resolved or {}).items():
        ours = config.get(section)
        if not isinstance(values, dict) or not isinstance(ours, dict):
            continue
        for key, value in values.items():
            if ours.get(key) == "auto" and value != "auto":
                ours[key] = value
    return config


def _public_model_info(manager: TokenizerManager) -> dict[str, Any]:
    """``model_info`` as the info routes show it: without the scheduler's config copy (``config`` shows that)."""
    return _jsonable({key: value for key, value in manager.model_info.items() if key != RESOLVED_CONFIG_KEY})


def _jsonable(values: dict[str, Any]) -> dict[str, Any]:
    return json.loads(json.dumps(values, default=str))


def _replicas(stats: dict[str, Any]) -> list[dict[str, Any]]:
    """``/get_server_info``'s per-replica entries under data parallelism: each replica's KV stats and what the
    controller routed to it (``routing``: requests and tokens of work, in all and unfinished, and the seconds since
    it last finished a request)."""
    routing = stats.get("routing") or [None] * len(stats["replicas"])
    return [{"kv": kv, **({"routing": routed} if routed is not None else {})}
            for kv, routed in zip(stats["replicas"], routing)]
