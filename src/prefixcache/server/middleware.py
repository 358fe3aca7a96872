"""ASGI middleware, outermost first: request metrics, API-key auth, body-size limit.

Each is a plain ASGI wrapper, so it also covers routes FastAPI builds itself
(``/docs``, ``/openapi.json``) and requests that match no route.

* :class:`RequestMetrics` gives every request its id (:data:`REQUEST_ID`: the client's ``X-Request-Id`` when it
  is a short plain token, else a new one; sent back as ``X-Request-Id``), times it and counts it by route template
  (``/v1/tasks/{name}``, never the raw path, so labels stay bounded) and status. A 5xx is logged at ERROR with the
  id (and the error, with its traceback when none of ours handled it) and counted in
  ``prefixcache_server_errors_total``; a request whose client left before any answer is counted as 499, not 500.
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
import logging
import re
import time
import uuid
from typing import Awaitable, Callable

from .jobs import REQUEST_ID_VAR
from .openai_errors import error_body
from .prometheus import Metrics
from .settings import ADMIN_KEY_ENV

log = logging.getLogger(__name__)

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
    """Give every HTTP request its id; count and time it by method, route template and status code; log a 5xx."""

    def __init__(self, app: ASGIApp, metrics: Metrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        rid = scope[REQUEST_ID] = request_id(scope["headers"])
        REQUEST_ID_VAR.set(rid)  # this request's task (and the tasks it starts) log with it
        status = {"code": None}

        async def send_and_note(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", rid.encode())])
            await send(message)

        failure: BaseException | None = None
        try:
            await self.app(scope, receive, send_and_note)
        except Exception as exc:  # none of ours handled it: a server fault (Starlette answers 500)
            failure = exc
            raise
        finally:
            code = status["code"] or (500 if failure is not None else CLIENT_GONE)
            route = scope.get("route")
            template = getattr(route, "path", None) or "(unmatched)"
            self.metrics.record_request(scope["method"], template, code, time.perf_counter() - started)
            if code >= 500:
                self._server_error(scope, template, code, failure)

    def _server_error(self, scope: Scope, template: str, code: int, failure: BaseException | None) -> None:
        error = failure or scope.get(ERROR)
        log.error("request %s: %s %s answered %d: %s", scope[REQUEST_ID], scope["method"], scope["path"], code,
                  f"{type(error).__name__}: {error}" if error is not None else "(no error recorded)",
                  exc_info=failure)
        self.metrics.server_errors.labels(template, str(code)).inc()


CLIENT_GONE = 499
"""The status counted for a request whose client went away before any answer was sent (nginx's "client closed
request"): nothing was answered, so it is neither the client's error nor a server fault."""

REQUEST_ID = "prefixcache.request_id"
"""The scope key of the request's id (also the ``X-Request-Id`` answer header, and every 5xx log line)."""

ERROR = "prefixcache.error"
"""The scope key where the app's error handler leaves the domain error it answered (the 5xx log line names it)."""

_SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


def request_id(headers) -> str:
    """The client's ``X-Request-Id`` when it is a plain token of at most 64 characters (so a log line cannot be
    forged or flooded through it), else a new random one."""
    for name, value in headers:
        if name == b"x-request-id":
            text = value.decode("latin-1")
            if _SAFE_ID.fullmatch(text):
                return text
            break
    return uuid.uuid4().hex


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
