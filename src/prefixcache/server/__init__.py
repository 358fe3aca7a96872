"""The HTTP service: FastAPI routes over one engine loop, and Prometheus metrics, over cached prefixes.

Modules: ``settings`` (limits, one frozen dataclass), ``runners`` (a task kind's items as engine-loop
sequences), ``engine_thread`` (admission, and the model thread that steps the engine loop),
``service`` (registry + threads), ``prometheus`` (metrics), ``middleware`` (metrics, auth, body limit),
``schemas`` (HTTP bodies), ``app`` (routes), ``launch`` (uvicorn on a socket),
``static/index.html`` (the web page).

Importing this package is cheap: FastAPI is imported only when ``create_app``
or ``run_server`` is first used, so the CLI can read settings without it.
"""

from __future__ import annotations

from .settings import ServerSettings

__all__ = ["ServerSettings", "create_app", "run_server", "ServerThread"]


def __getattr__(name: str):
    if name == "create_app":
        from .app import create_app

        return create_app
    if name in ("run_server", "ServerThread"):
        from . import launch

        return getattr(launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
