"""The FastAPI app: routes, the one place errors become HTTP answers, and the middleware stack.

``create_app(loaded, tasks, settings)`` takes an already-loaded model, so tests
pass a tiny in-process model and the CLI passes the one ``--model`` names.
The app builds every task's prefix on start-up (before it accepts requests)
and serves until shut down.

Routes (all but ``/healthz`` and the web page need the client key, ``PREFIXCACHE_API_KEY``, when one is
set; those marked *admin* need the admin key, ``PREFIXCACHE_ADMIN_KEY``, when one is set, and the client key
gets 403 there; start-up tasks can be replaced or deleted only with the admin key):

* ``POST /v1/classify``, ``POST /v1/extract``: items in, one result per item out, in order;
* ``GET /v1/tasks``, ``PUT /v1/tasks/{name}`` (YAML or JSON body; admin), ``DELETE /v1/tasks/{name}`` (admin);
* ``GET /v1/stats`` (the web page's live figures), ``GET /metrics`` (Prometheus; admin);
* ``GET /healthz``, ``GET /`` (the web page), ``GET /docs`` (OpenAPI).
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from contextlib import asynccontextmanager
from dataclasses import asdict
from importlib import resources
from typing import Sequence

from fastapi import FastAPI, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse

from ..errors import PrefixCacheError, QueueFullError
from ..model.load import LoadedModel
from ..task.definition import ExtractTask, Task
from .prometheus import Metrics
from .openai_routes import BODY_SCHEMAS, OPENAI_PATHS, add_openai_routes, openai_error
from .middleware import CLIENT, ERROR, PUBLIC_PATHS, REQUEST_ID, ROLE, BearerAuth, BodyLimit, RequestMetrics, admin_only
from .runners import RUNNER_KINDS
from .schemas import (
    ClassifyResponse, ErrorOut, ExtractResponse, Health, ItemsRequest, Stats, TaskInfo, TaskList, UsageOut,
    validation_error_body,
)
from .service import Service
from .settings import ServerSettings
from .http_errors import http_spelling, status_of  # noqa: F401  (http_spelling: read here by tests)
from .uploads import UploadParser

TASK_NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]*$"
ERRORS = {code: {"model": ErrorOut} for code in (401, 404, 413, 422, 429)}  # 422: a message, or FastAPI's field list
FORBIDDEN = {403: {"model": ErrorOut, "description": "The client key where the admin key is needed, or a start-up task."}}


def create_app(
    loaded: LoadedModel, tasks: Sequence[Task | ExtractTask], settings: ServerSettings | None = None
) -> FastAPI:
    """A ready-to-serve app for ``tasks`` on ``loaded``. Prefixes are built when the app starts.

    Raises SettingsError when ``tasks`` are more than ``settings.max_tasks``."""
    settings = settings or ServerSettings.from_env()
    metrics = Metrics()
    service = Service(loaded, settings, metrics)
    service.check_startup(tasks)
    uploads = UploadParser()  # task uploads are parsed in a child process, one at a time

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await service.start(list(tasks))
        try:
            yield
        finally:
            uploads.close()
            await service.stop()

    app = FastAPI(
        title="prefixcache",
        summary="Micro-batched classification and extraction over cached prompt prefixes.",
        version=_version(),
        lifespan=lifespan,
        responses=ERRORS,
    )
    app.state.service = service
    app.state.settings = settings
    _routes(app, service, uploads)
    app.add_exception_handler(PrefixCacheError, _error_response)
    app.add_exception_handler(Exception, _unexpected_response)  # Starlette's last resort: a server fault, 500
    app.add_exception_handler(RequestValidationError, _validation_response)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(BearerAuth, key=settings.api_key, admin_key=settings.admin_key)
    app.add_middleware(RequestMetrics, metrics=metrics)  # added last: outermost, so it sees 401s and 413s
    app.openapi = _openapi_with_bearer(app)
    return app


def _routes(app: FastAPI, service: Service, uploads: UploadParser) -> None:
    """Every route, in the order the OpenAPI document lists them: service, items, tasks."""
    _service_routes(app, service)
    _item_routes(app, service)
    _task_routes(app, service, uploads)
    add_openai_routes(app, service)


def _service_routes(app: FastAPI, service: Service) -> None:
    """The web page, health, Prometheus metrics and the page's live figures."""
    page, page_csp = _web_page()

    @app.get("/", include_in_schema=False)
    async def web_page() -> HTMLResponse:
        return HTMLResponse(page, headers={"content-security-policy": page_csp, "x-content-type-options": "nosniff"})

    @app.get("/healthz", response_model=Health, tags=["service"], responses={503: {"model": Health}})
    async def healthz(response: Response) -> Health:
        """200 once every start-up prefix is built and while the engine thread runs; 503 if it stopped. Needs no key."""
        if not service.engine.running:
            response.status_code = 503
            return Health(status="engine stopped", tasks=len(service.tasks()))
        return Health(status="ok", tasks=len(service.tasks()))

    @app.get("/metrics", tags=["service"], response_class=Response, responses=FORBIDDEN)
    def metrics() -> Response:  # sync: runs on a worker thread, since reading the pool waits for a prefix build
        """Prometheus text format: requests, items, latencies, batch sizes, queue depth, prefix and pool counters.
        Needs the admin key when one is set."""
        return Response(service.metrics.exposition(), media_type=service.metrics.content_type)

    @app.get("/v1/stats", response_model=Stats, tags=["service"])
    async def stats() -> Stats:
        """Live figures: items/s over the last 10 s, prefix hit rate, queue depth."""
        return Stats(**service.metrics.summary(service.engine.depth, service.engine.in_progress, len(service.tasks())))


def _item_routes(app: FastAPI, service: Service) -> None:
    """Classification and extraction of request items."""
    @app.post("/v1/classify", response_model=ClassifyResponse, response_model_exclude_none=True, tags=["items"])
    async def classify(body: ItemsRequest, request: Request) -> ClassifyResponse:
        """Classify every item with the task's labels. Results come back in the items' order."""
        results, usage = await service.run("classify", body.task, body.records(), request.scope.get(CLIENT))
        return ClassifyResponse(results=results, usage=UsageOut(**asdict(usage)))

    @app.post("/v1/extract", response_model=ExtractResponse, tags=["items"])
    async def extract(body: ItemsRequest, request: Request) -> ExtractResponse:
        """Extract the task's fields from every item with an extraction task (``kind: extract``).

        Each result holds the parsed ``fields`` (null when no JSON object was found), the generated
        text (``raw``) and an ``error`` when the output could not be parsed into the declared fields.
        Results come back in the items' order. A classification task here answers 422, an unknown one 404.
        """
        results, usage = await service.run("extract", body.task, body.records(), request.scope.get(CLIENT))
        return ExtractResponse(results=results, usage=UsageOut(**asdict(usage)))


def _task_routes(app: FastAPI, service: Service, uploads: UploadParser) -> None:
    """Listing, uploading and deleting tasks."""
    @app.get("/v1/tasks", response_model=TaskList, tags=["tasks"])
    async def list_tasks() -> TaskList:
        return TaskList(tasks=[TaskInfo(**runner.describe()) for runner in service.tasks()])

    @app.put(
        "/v1/tasks/{name}",
        response_model=TaskInfo,
        status_code=201,
        tags=["tasks"],
        responses=FORBIDDEN,
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": (
                    "A task file's text: the same keys as a task YAML (name, instruction, labels, ...; "
                    "or kind: extract, name, instruction, fields, ... for an extraction task)."
                ),
                "content": {
                    "application/yaml": {"schema": {"type": "string"}},
                    "application/json": {"schema": {"type": "object"}},
                },
            }
        },
    )
    async def put_task(request: Request, response: Response, name: str = Path(pattern=TASK_NAME, max_length=128)) -> TaskInfo:
        """Register (201) or replace (200) a task from a YAML or JSON task body, and build its prefix.

        The body is the task itself, parsed as text: it can name no file, and nothing in it is read from disk.
        Requests already accepted for a replaced task finish with the old version. Needs the admin key when
        one is set; a start-up task can be replaced only with it (403 otherwise). A body over ``max_task_bytes``
        answers 413; more labels or examples than ``max_labels`` or ``max_examples``, or a new name once
        ``max_tasks`` tasks are registered, 422 naming the limit.
        """
        operator = request.scope.get(ROLE) == "admin"
        service.check_writable(name, operator)  # before the body is parsed: a start-up task is refused whatever it holds
        service.check_room(name)  # and a new task when max_tasks are registered
        body = await request.body()
        # parsed in a child process, one upload at a time: parsing holds the GIL, so a large or pathological task
        # file parsed in this process would hold up the event loop and the model thread (see uploads.py)
        content_type = request.headers.get("content-type", "")
        task = await uploads.parse(name, content_type, body, service.settings, RUNNER_KINDS)
        runner, created = await service.register(task, operator=operator)
        response.status_code = 201 if created else 200
        return TaskInfo(**runner.describe())

    @app.delete("/v1/tasks/{name}", status_code=204, tags=["tasks"], response_class=Response, responses=FORBIDDEN)
    async def delete_task(request: Request, name: str = Path(pattern=TASK_NAME, max_length=128)) -> Response:
        """Unregister a task and drop its prefix. Requests already accepted for it still finish.
        Needs the admin key when one is set; a start-up task can be deleted only with it (403 otherwise)."""
        service.remove(name, operator=request.scope.get(ROLE) == "admin")
        return Response(status_code=204)


async def _error_response(request: Request, exc: PrefixCacheError) -> JSONResponse:
    """The one place domain errors become HTTP answers (``PREFIXCACHE_DEBUG=1`` re-raises instead)."""
    if os.environ.get("PREFIXCACHE_DEBUG"):
        raise exc
    status = status_of(exc)
    if request is not None:
        request.scope[ERROR] = exc  # a 5xx is logged with it (middleware.RequestMetrics)
    headers = {"retry-after": str(exc.retry_after)} if isinstance(exc, QueueFullError) else None
    if request is not None and request.url.path in OPENAI_PATHS:
        body = openai_error(exc.render(http_spelling), status, getattr(exc, "param", None))
        return JSONResponse(body, status_code=status, headers=headers)
    body = {"detail": exc.render(http_spelling)}
    if getattr(exc, "item", None) is not None:
        body["item"] = exc.item
    return JSONResponse(body, status_code=status, headers=headers)


async def _unexpected_response(request: Request, exc: Exception) -> JSONResponse:
    """An error none of ours: a server fault. 500, naming the request's id (its log line holds the traceback)."""
    rid = request.scope.get(REQUEST_ID)
    message = f"internal server error (request id {rid}): the server logged it; retry, and report the id if it persists"
    body = openai_error(message, 500) if request.url.path in OPENAI_PATHS else {"detail": message}
    return JSONResponse(body, status_code=500, headers={"x-request-id": rid} if rid else None)


async def _validation_response(request: Request, exc: RequestValidationError) -> JSONResponse:
    """A body that breaks the schema: 422 with FastAPI's list of errors, made safe to send (NaN, lone surrogates)."""
    return JSONResponse(validation_error_body(exc.errors()), status_code=422)


def _web_page() -> tuple[str, str]:
    """The static page, and a Content-Security-Policy that allows only its own inline script and this origin."""
    page = (resources.files("prefixcache.server") / "static" / "index.html").read_text(encoding="utf-8")
    scripts = re.findall(r"<script>(.*?)</script>", page, flags=re.S)
    hashes = " ".join(f"'sha256-{base64.b64encode(hashlib.sha256(s.encode()).digest()).decode()}'" for s in scripts)
    csp = (
        f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; connect-src 'self'; "
        "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return page, csp


def _openapi_with_bearer(app: FastAPI):
    """Declare the Bearer scheme in the OpenAPI document (enforcement is the BearerAuth middleware)."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            schema.setdefault("components", {}).setdefault("schemas", {}).update(BODY_SCHEMAS)
            schema["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            schema["security"] = [{"bearer": []}]
            for path in PUBLIC_PATHS & set(schema["paths"]):
                for operation in schema["paths"][path].values():
                    operation["security"] = []
            if app.state.settings.admin_key is not None:
                _declare_admin_key(schema)
            app.openapi_schema = schema
        return app.openapi_schema

    return openapi


def _declare_admin_key(schema: dict) -> None:
    """Declare the admin key's scheme, and require it on the admin-only operations (``middleware.admin_only``)."""
    schema["components"]["securitySchemes"]["admin"] = {
        "type": "http", "scheme": "bearer", "description": "The admin key (PREFIXCACHE_ADMIN_KEY).",
    }
    for path, operations in schema["paths"].items():
        for method, operation in operations.items():
            if admin_only(method.upper(), path):
                operation["security"] = [{"admin": []}]


def _version() -> str:
    from .. import __version__

    return __version__
