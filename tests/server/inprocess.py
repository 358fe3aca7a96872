"""The app on an in-process test client (FastAPI's TestClient, no socket), and task files renamed for uploads."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from prefixcache.server import ServerSettings, create_app

from tests.support.tasks import TASK_YAML


def client(loaded, tasks, **settings) -> TestClient:
    """A test client for an app serving ``tasks``; no API key unless one is given; server errors become 500s."""
    settings.setdefault("api_key", None)
    return TestClient(create_app(loaded, tasks, ServerSettings(**settings)), raise_server_exceptions=False)


def named(name: str, text: str = TASK_YAML) -> str:
    """A task file's text under another ``name:``."""
    return re.sub(r"(?m)^name: .*$", f"name: {name}", text)
