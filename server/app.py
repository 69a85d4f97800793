"""The FastAPI app: middleware, error handling, and the routes of ``openai_routes`` and ``native_routes``.

Every error leaves as an OpenAI-shaped body ``{"error": {"message", "type", "param", "code"}}``; ``code`` is a
string (``context_length_exceeded``, ``not_found``...) or null, never a number.
"""

from __future__ import annotations

import json
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from treadle import __version__
from treadle.core.validation import InvalidRequestError
from treadle.server.embedding_routes import add_embedding_routes
from treadle.server.middleware import AdmissionMiddleware, ApiKeyMiddleware
from treadle.server.lora_routes import add_lora_routes
from treadle.server.native_routes import add_native_routes
from treadle.server.openai_routes import add_openai_routes
from treadle.server.protocol import error_body
from treadle.server.tokenizer_manager import RequestError, TokenizerManager


def build_app(manager: TokenizerManager, server_info: dict[str, Any] | None = None) -> FastAPI:
    """The HTTP app around a started TokenizerManager; ``server_info`` is merged into /get_server_info."""
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
    add_embedding_routes(app, manager)
    add_native_routes(app, manager, server_info or {})
    add_lora_routes(app, manager)
    return app


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

    @app.exception_handler(InvalidRequestError)
    async def _invalid_request(request: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(RequestError(str(exc), param=exc.param, code=exc.code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(http_error(request, exc))

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


def http_error(request: Request, exc: StarletteHTTPException) -> RequestError:
    """Starlette's own errors (an unknown route, a method the route does not take) with a string code."""
    status = exc.status_code
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:  # a status Python does not name
        phrase = "HTTP error"
    message = str(exc.detail)
    if status == HTTPStatus.NOT_FOUND and message == phrase:
        message = f"there is no route {request.method} {request.url.path}; see /docs for the routes"
    elif status == HTTPStatus.METHOD_NOT_ALLOWED and message == phrase:
        message = f"{request.url.path} does not take {request.method}; see /docs for the routes"
    return RequestError(message, status_code=status, code=phrase.lower().replace(" ", "_"),  # not_found, ...
                        headers=getattr(exc, "headers", None))
