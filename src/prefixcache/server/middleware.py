"""ASGI middleware, outermost first: request metrics, API-key auth, body-size limit.

Each is a plain ASGI wrapper, so it also covers routes FastAPI builds itself
(``/docs``, ``/openapi.json``) and requests that match no route.

* :class:`RequestMetrics` times every request and counts it by route template
  (``/v1/tasks/{name}``, never the raw path, so labels stay bounded) and status.
* :class:`BearerAuth`: two keys, each compared in constant time. When the client
  key is configured, every path but the public ones needs ``Authorization: Bearer
  <key>`` (the client key or the admin key). When the admin key is configured,
  the admin paths (:func:`admin_only`) need it: the client key gets 403 there, no
  key or a wrong one 401. Either answer comes before the body is read. The caller's
  role goes into the scope (:data:`ROLE`) for the routes, and so does who is calling
  (:data:`CLIENT`, for the per-client share and the engine loop's turns).
* :class:`BodyLimit`: bodies over ``max_bytes`` get 413, whether announced by
  ``Content-Length`` or streamed in chunks; the app sees a body only once it
  is known to fit.
"""

from __future__ import annotations

import hmac
import json
import time
from typing import Awaitable, Callable

from .openai_errors import error_body
from .prometheus import Metrics
from .settings import ADMIN_KEY_ENV

Scope = dict
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ROLE = "prefixcache.role"
"""The scope key of the caller's role: ``"admin"`` (it sent the admin key, and one is configured),
``"client"`` (it sent the client key) or None (no key, or no key is configured)."""

CLIENT = "prefixcache.client"
"""The scope key of who is calling, as admission and the engine loop tell clients apart: the role and the peer's host
(``"client@10.0.0.7"``, ``"admin@10.0.0.7"``, ``"anonymous@10.0.0.7"``). Not a key hash: there is one client
key, so every key holder would be one client. Not the port: a client opening more connections would get
more shares. Behind a proxy the host is the proxy's unless uvicorn is told to trust it (``--forwarded-allow-ips``),
and then every client the proxy forwards is one client."""

PUBLIC_PATHS = frozenset({"/healthz", "/"})
"""Paths open without a key: the health check, and the static web page (a browser cannot attach a
Bearer header to a page load; the page holds no data and sends the key on every API call it makes)."""


async def send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()), *headers],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class RequestMetrics:
    """Count and time every HTTP request by method, route template and status code."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = scope.get("route")
            template = getattr(route, "path", None) or "(unmatched)"
            self.metrics.record_request(scope["method"], template, status["code"], time.perf_counter() - started)


def admin_only(method: str, path: str) -> bool:
    """The paths that need the admin key when one is configured: registering, replacing and deleting
    tasks (``PUT``/``DELETE /v1/tasks/...``), and the Prometheus metrics."""
    return path.rstrip("/") == "/metrics" or (method in ("PUT", "DELETE") and path.startswith("/v1/tasks/"))


class BearerAuth:
    """Require the client ``key`` (or the ``admin_key``) on every non-public path when ``key`` is set, and
    the ``admin_key`` on the :func:`admin_only` paths when it is set. Sets ``scope[ROLE]``."""

    def __init__(self, app: ASGIApp, key: str | None, admin_key: str | None = None):
        self.app = app
        self.key = key.encode() if key else None
        self.admin_key = admin_key.encode() if admin_key else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        role = scope[ROLE] = self._role(scope)
        scope[CLIENT] = client_identity(role, scope.get("client"))
        if scope["path"] in PUBLIC_PATHS:
            allowed = True
        elif self.admin_key is not None and admin_only(scope["method"], scope["path"]):
            allowed = role == "admin"
        else:
            allowed = self.key is None or role is not None
        if allowed:
            await self.app(scope, receive, send)
        elif role == "client":
            detail = (f"this needs the admin key ({ADMIN_KEY_ENV}): registering, replacing and deleting tasks "
                      "and reading /metrics are the operator's; the client key classifies and extracts")
            await send_json(send, 403, error_body(scope["path"], 403, detail))
        else:
            await send_json(
                send, 401, error_body(scope["path"], 401, "missing or wrong API key: send 'Authorization: Bearer <key>'"),
                [(b"www-authenticate", b'Bearer realm="prefixcache"')],
            )

    def _role(self, scope: Scope) -> str | None:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        token = token.strip() if scheme.lower() == b"bearer" else b""
        # compare_digest runs in time independent of where the strings differ; both keys are always compared
        admin = self.admin_key is not None and hmac.compare_digest(token, self.admin_key)
        client = self.key is not None and hmac.compare_digest(token, self.key)
        return "admin" if admin else "client" if client else None


def client_identity(role: str | None, peer: tuple | None) -> str:
    """``role@host`` (:data:`CLIENT`) from the caller's role and the ASGI ``client`` (host, port), which may be None."""
    host = peer[0] if peer else "unknown"
    return f"{role or 'anonymous'}@{host}"


class BodyLimit:
    """Refuse request bodies larger than ``max_bytes`` with 413; buffer the rest and replay it to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = self._content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(send, scope["path"])
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(send, scope["path"])
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    @staticmethod
    def _content_length(scope: Scope) -> int | None:
        for name, value in scope["headers"]:
            if name == b"content-length":
                return int(value) if value.isdigit() else None
        return None

    async def _refuse(self, send: Send, path: str) -> None:
        await send_json(send, 413, error_body(path, 413, f"request body larger than max_body_bytes={self.max_bytes}"))
