"""ASGI middleware in front of every route: API keys, draining on shutdown, request body size.

They run before FastAPI parses anything, so an unauthenticated or oversized
request costs neither JSON parsing nor tokenization.
"""

from __future__ import annotations

import secrets
from collections import deque
from typing import Any, Callable

from fastapi.responses import JSONResponse

from treadle.server.protocol import error_body

# Routes reachable without the API key: load balancers and orchestrators probe it.
OPEN_PATHS = frozenset({"/health"})
# Routes that change server state; they need server.admin_api_key when one is set.
ADMIN_PATHS = frozenset({"/flush_cache", "/abort_request", "/load_lora_adapter", "/unload_lora_adapter"})
# Routes still answered while the server drains, so operators can watch it.
DRAINING_PATHS = frozenset({"/metrics", "/get_server_info"})
_METHODS_WITH_BODY = frozenset({"POST", "PUT", "PATCH"})


async def _send_error(scope: dict, receive: Callable, send: Callable, status: int, message: str,
                      code: str, type_: str = "invalid_request_error", param: str | None = None,
                      headers: dict[str, str] | None = None) -> None:
    response = JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)
    await response(scope, receive, send)


class ApiKeyMiddleware:
    """Answers 401 unless the request carries ``Authorization: Bearer <key>`` (except OPEN_PATHS).

    Admin routes need the admin key when one is set (the API key does not open
    them); every other route accepts the API key or the admin key.
    """

    def __init__(self, app: Any, api_key: str | None, admin_api_key: str | None = None) -> None:
        self.app = app
        self.user = f"Bearer {api_key}".encode() if api_key else None
        self.admin = f"Bearer {admin_api_key}".encode() if admin_api_key else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            if scope["path"] in ADMIN_PATHS:
                accepted = [self.admin] if self.admin else [self.user] if self.user else []
                what = "the admin API key" if self.admin else "the API key"
            else:
                accepted = [key for key in (self.user, self.admin) if key] if self.user else []
                what = "the API key"
            # Compare against every candidate, so the time taken does not reveal which one matched.
            if accepted and not any([secrets.compare_digest(given, key) for key in accepted]):
                await _send_error(scope, receive, send, 401,
                                  f"missing or wrong API key; this route needs {what} as "
                                  "`Authorization: Bearer <key>`", "invalid_api_key",
                                  headers={"WWW-Authenticate": "Bearer"})
                return
        await self.app(scope, receive, send)


class AdmissionMiddleware:
    """503 while the server drains for shutdown; 413 for a body over ``max_request_bytes``.

    The body is read here (counting bytes as they arrive, whatever Content-Length
    claims) and replayed to the app, so an oversized body is never parsed.
    """

    def __init__(self, app: Any, manager: Any, max_request_bytes: int) -> None:
        self.app = app
        self.manager = manager
        self.max_request_bytes = max_request_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.manager.draining and scope["path"] not in DRAINING_PATHS:
            await _send_error(scope, receive, send, 503, "the server is shutting down and accepts no new requests; "
                              "retry on another replica", "server_shutting_down", type_="server_error",
                              headers={"Retry-After": "5", "Connection": "close"})
            return
        if scope["method"] not in _METHODS_WITH_BODY:
            await self.app(scope, receive, send)
            return
        limit = self.max_request_bytes
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._too_large(scope, receive, send, f"{int(declared)} bytes")
            return
        messages: deque[dict] = deque()
        size = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > limit:
                await self._too_large(scope, receive, send, f"more than {limit} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> dict:
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable, size: str) -> None:
        await _send_error(scope, receive, send, 413,
                          f"the request body has {size}, over server.max_request_bytes = {self.max_request_bytes}; "
                          "send a smaller request", "request_too_large", param="body",
                          headers={"Connection": "close"})
