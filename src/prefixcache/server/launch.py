"""Running the app on uvicorn: in the foreground (the CLI) or on a background thread (tests, scripts).

Both bind the listening socket themselves before uvicorn starts, so ``port=0``
gets a free port with no race, and the real address is known (``ServerThread.url``;
the CLI prints a ``listening on http://host:port`` line on stdout).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import sys
import threading
import time
from typing import Sequence

import uvicorn

from ..errors import SettingsError
from ..model.load import LoadedModel
from ..task.definition import Task
from .app import create_app
from .settings import ServerSettings

log = logging.getLogger(__name__)


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0``: any free port)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def run_server(loaded: LoadedModel, tasks: Sequence[Task], settings: ServerSettings, log_level: str = "info") -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM finish in-flight requests first)."""
    if settings.api_key is None and not _is_loopback(settings.host):
        log.warning("listening on %s without PREFIXCACHE_API_KEY: anyone who can reach it can use it", settings.host)
    try:
        sock = bind_socket(settings.host, settings.port)
    except OSError as exc:
        raise SettingsError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from None
    host, port = sock.getsockname()[:2]
    app = create_app(loaded, tasks, settings)
    server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, access_log=log_level == "debug"))
    print(f"prefixcache serve: listening on http://{_url_host(host)}:{port}", flush=True, file=sys.stdout)
    server.run(sockets=[sock])


class ServerThread:
    """A real uvicorn server on a background thread, for tests and scripts::

        with ServerThread(create_app(loaded, tasks, settings)) as server:
            urllib.request.urlopen(server.url + "/healthz")

    ``__enter__`` returns once start-up (prefix builds) is done, or raises if it failed.
    ``__exit__`` shuts down gracefully and joins the thread.
    """

    def __init__(self, app, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 120.0):
        self.app = app
        self.sock = bind_socket(host, port)
        self.host, self.port = self.sock.getsockname()[:2]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self.thread = threading.Thread(target=self._run, daemon=True, name=f"uvicorn-{self.port}")
        self.startup_timeout = startup_timeout
        self.exit_code: int | str | None = None

    @property
    def url(self) -> str:
        return f"http://{_url_host(self.host)}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except SystemExit as exc:  # uvicorn exits this way when start-up fails; __enter__ reports it
            self.exit_code = exc.code

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"the server exited during start-up with code {self.exit_code} (its log says why)")
            if time.monotonic() > deadline:
                self.server.should_exit = True
                raise TimeoutError(f"the server did not start within {self.startup_timeout} s")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host
