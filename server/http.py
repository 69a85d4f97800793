"""The FastAPI app: error handling, API-key check, native and admin routes.

The OpenAI routes live in ``server/openai_routes.py``; both share the helpers
here for streaming (:func:`sse_response`) and waiting (:func:`collect`).
Every error leaves as an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle import __version__
from treadle.core.request import SamplingParams
from treadle.server.ipc import RESOLVED_CONFIG_KEY, StrOutput, TokenizedGenerateReq
from treadle.server.middleware import AdmissionMiddleware, ApiKeyMiddleware
from treadle.server.protocol import AbortRequest, GenerateRequest, error_body
from treadle.server.tokenizer_manager import GenerationStream, RequestError, StreamEvent, TokenizerManager

_DISCONNECT_POLL_S = 0.25


def build_app(manager: TokenizerManager, server_info: dict[str, Any] | None = None) -> FastAPI:
    """The HTTP app around a started TokenizerManager; ``server_info`` is merged into /get_server_info."""
    from treadle.server.openai_routes import add_openai_routes

    app = FastAPI(title="treadle", version=__version__)
    app.state.manager = manager
    _add_error_handlers(app)
    settings = manager.config.server
    # Starlette runs the middleware added last first: CORS, then keys, then draining/body size.
    app.add_middleware(AdmissionMiddleware, manager=manager, max_request_bytes=settings.max_request_bytes)
    api_key, admin_api_key = settings.resolved_api_key(), settings.resolved_admin_api_key()
    if api_key or admin_api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key, admin_api_key=admin_api_key)
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.cors_allow_origins),
                           allow_methods=["*"], allow_headers=["*"])
    add_openai_routes(app, manager)
    _add_native_routes(app, manager, server_info or {})
    return app


# ---------------------------------------------------------------- errors and auth


def error_response(exc: RequestError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status_code,
                        headers=exc.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), "invalid_request_error", None, exc.status_code),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal server error: {type(exc).__name__}: {exc}", "server_error"),
                            status_code=500)


def validation_error(exc: RequestValidationError) -> RequestError:
    """A 400 naming the first bad field (``messages.0.role``) and what was wrong with it."""
    errors = exc.errors()
    if not errors:
        return RequestError("invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return RequestError(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', first['msg'])}")
    got = first.get("input")
    if isinstance(got, (bytes, bytearray)):  # FastAPI parses a body as JSON only when its Content-Type says so
        return RequestError("the request body must be a JSON object sent with 'Content-Type: application/json'")
    param = ".".join(loc) or None
    where = f"{param}: " if param else ""
    detail = f" (got {json.dumps(got, default=str)[:100]})" if got is not None and not isinstance(got, dict) else ""
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return RequestError(f"{where}{first['msg']}{detail}{more}", param=param)


# ---------------------------------------------------------------- waiting and streaming


class ClientGone(Exception):
    """The HTTP client disconnected while its request was running."""


async def collect(request: Request, stream: GenerationStream,
                  on_event: Callable[[StreamEvent], None]) -> None:
    """Feed every event of ``stream`` to ``on_event`` until all sub-requests finish.

    Raises the first sub-request error (after aborting the siblings) and
    aborts everything if the client disconnects.
    """
    watcher = asyncio.get_running_loop().create_task(_watch_disconnect(request, stream))
    try:
        while not stream.finished:
            event = await stream.next_event()
            if event.error is not None:
                stream.abort()
                raise event.error
            on_event(event)
    finally:
        watcher.cancel()
        if not stream.finished:
            stream.abort()


async def _watch_disconnect(request: Request, stream: GenerationStream) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(_DISCONNECT_POLL_S)
    stream.abort()
    stream.queue.put_nowait(StreamEvent(-1, error=RequestError("client disconnected", status_code=499)))


async def first_event(stream: GenerationStream) -> StreamEvent:
    """The first event, raising its error: lets a streaming route answer 4xx before the 200 goes out."""
    event = await stream.next_event()
    if event.error is not None:
        stream.abort()
        raise event.error
    return event


def sse_response(stream: GenerationStream, first: StreamEvent,
                 render: Callable[[StreamEvent], list[dict[str, Any]] | list[str]],
                 closing: Callable[[], list[dict[str, Any]]] | None = None,
                 accumulate: Callable[[StreamEvent], None] | None = None) -> StreamingResponse:
    """Server-sent events: ``render(event)`` chunks (dicts, or JSON already serialized) for every event,
    ``closing()`` chunks, then ``[DONE]``.

    Events already waiting when the response writes go out in one write, so a response that fell behind
    (at saturation the HTTP process spends ~0.1 ms per event) catches up in fewer, larger writes. With
    ``accumulate`` each chunk carries its sub-request's whole state: every event is accumulated, and of
    the waiting events only each sub-request's last is rendered.

    If the client goes away, the body iterator is cancelled and the ``finally``
    aborts the sub-requests still running, which frees their KV slots.
    """

    def rendered(events: list[StreamEvent]) -> bytes:
        if accumulate is not None:
            for event in events:
                accumulate(event)
            events = list({event.index: event for event in events}.values())
        return b"".join(_sse(chunk) for event in events for chunk in render(event))

    async def body() -> AsyncIterator[bytes]:
        try:
            events = [first]
            while True:
                failed = next((i for i, event in enumerate(events) if event.error is not None), None)
                data = rendered(events if failed is None else events[:failed])
                if failed is not None:
                    stream.abort()
                    err = events[failed].error
                    assert err is not None
                    yield data + _sse(error_body(err.message, err.type, err.param, err.code)) + _DONE
                    return
                if stream.finished:
                    yield data + b"".join(_sse(chunk) for chunk in (closing() if closing else [])) + _DONE
                    return
                if data:
                    yield data
                events = [await stream.next_event(), *stream.ready_events()]
        finally:
            if not stream.finished:
                stream.abort()

    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_DONE = b"data: [DONE]\n\n"


def _sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event from a JSON-ready dict, or from a JSON document already serialized."""
    text = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    # JSON leaves U+0085, U+2028 and U+2029 raw, but str.splitlines ends a line at each, and so do
    # clients built on it (httpx's iter_lines): escaped, an event is one line for every reader.
    if not text.isascii():  # one scan for the common case, not three
        text = text.replace("\x85", "\\u0085").replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
    return b"data: " + text.encode() + b"\n\n"


# ---------------------------------------------------------------- native and admin routes


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
        """``to_json`` serialized (plus ``index`` for a batch), reusing the already encoded output ids."""
        text = json.dumps(self.text, ensure_ascii=False)
        meta = json.dumps(self._meta(stop), ensure_ascii=False)
        tail = "" if index is None else f', "index": {index}'
        return f'{{"text": {text}, "output_ids": [{self._ids_json}], "meta_info": {meta}{tail}}}'

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


def finish_detail(out: StrOutput, stop: list[str]) -> str | int | None:
    """The matched stop string, or the stop token id as an int."""
    detail = out.finished_detail
    if isinstance(detail, str) and detail not in stop and detail.lstrip("-").isdigit():
        return int(detail)
    return detail


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


def _add_native_routes(app: FastAPI, manager: TokenizerManager, server_info: dict[str, Any]) -> None:
    @app.post("/generate")
    async def generate(body: GenerateRequest, request: Request) -> Response:
        prompts, is_batch = _native_prompts(manager, body)
        param = "text" if body.text is not None else "input_ids"
        params = SamplingParams(**body.sampling_params.model_dump())
        if isinstance(body.rid, list):
            if len(body.rid) != len(prompts):
                raise RequestError(f"{len(body.rid)} rids for {len(prompts)} prompts", param="rid")
            rids = list(body.rid)
        elif body.rid is not None:
            rids = [body.rid] if len(prompts) == 1 else [f"{body.rid}-{i}" for i in range(len(prompts))]
        else:
            rids = [manager.new_rid() for _ in prompts]
        reqs = []
        for rid, ids in zip(rids, prompts):
            manager.check_request(ids, params, param)
            reqs.append(TokenizedGenerateReq(rid, ids, params, body.return_logprob, body.logprob_start_len,
                                             body.top_logprobs_num, body.priority))
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

    @app.get("/health")
    async def health() -> JSONResponse:
        if manager.dead_reason is not None:
            return JSONResponse(error_body(manager.dead_reason, "server_error"), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate(request: Request) -> JSONResponse:
        params = SamplingParams(max_new_tokens=1, temperature=0.0)
        token = int(manager.model_info.get("bos_token_id") or 0)
        stream = manager.submit([TokenizedGenerateReq(manager.new_rid(), [token], params)])
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
        info["is_generation"] = True
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
            **({"replicas": [{"kv": kv} for kv in stats["replicas"]]} if "replicas" in stats else {}),
            # The scheduler's count (prompt tokens found in the prefix cache at admission), as under kv.
            "cached_tokens_total": stats["kv"]["cached_tokens_total"],
            "running_requests": len(manager.states),
            "max_inflight_requests": manager.max_inflight_requests,
            "draining": manager.draining,
            "model_info": _public_model_info(manager),
            **server_info,
            "pids": pids,
            "memory": {"rss_bytes": {name: resident_bytes(pid) for name, pid in pids.items()}},
        })

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
        targets = [rid for rid in list(manager.states) if rid == body.rid or rid.startswith(body.rid + "-")]
        for rid in targets:
            manager.abort(rid, keep_waiting=True)
        return JSONResponse({"success": bool(targets), "aborted": targets})

    @app.get("/metrics")
    async def metrics() -> Response:
        try:
            stats = await manager.control("stats", timeout=2.0)
            manager.metrics.set_scheduler_stats(stats["kv"], stats.get("replicas"))
        except RequestError:
            pass  # still serve the counters when the scheduler is busy or gone
        return Response(manager.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


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


