"""The load test's clients: one keep-alive connection each, sending from threads; and the figures they give."""

from __future__ import annotations

import http.client
import itertools
import json
import math
import os
import threading
import time
from typing import Callable

from .served import HOST

Send = Callable[[list[dict]], tuple[int, bytes]]
"""``send(items) -> (HTTP status, body)``: one request of ``items``, on one client's own connection."""


def post(conn: http.client.HTTPConnection, body: bytes, key: str) -> tuple[int, bytes]:
    conn.request("POST", "/v1/classify", body=body, headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    response = conn.getresponse()
    return response.status, response.read()


def classify_sender(port: int, key: str, task: str) -> Send:
    """A ``send(items) -> (status, body)`` for one client thread: POST /v1/classify on one keep-alive connection."""
    conn = http.client.HTTPConnection(HOST, port, timeout=300)

    def send(items: list[dict]) -> tuple[int, bytes]:
        nonlocal conn
        body = json.dumps({"task": task, "items": items}).encode()
        for attempt in (1, 2):
            try:
                return post(conn, body, key)
            except (OSError, http.client.HTTPException) as exc:
                conn.close()
                conn = http.client.HTTPConnection(HOST, port, timeout=300)
                # a kept-alive connection the server closed while idle (uvicorn's keep-alive timeout) is retried
                # once on a new one, as HTTP client libraries do; any other failure, or a second one, is an error
                stale = isinstance(exc, (BrokenPipeError, ConnectionResetError, http.client.RemoteDisconnected))
                if attempt == 2 or not stale:
                    return 0, f"{type(exc).__name__}: {exc}".encode()

    return send


def drive(requests: list[list[dict]], clients: int, make_sender: Callable[[], Send]):
    """Send every request once from ``clients`` threads, each with its own ``make_sender()``.
    Returns [(request index, status, body, seconds)], wall seconds."""
    counter = itertools.count()
    lock = threading.Lock()
    outcomes = []

    def client():
        send = make_sender()
        while True:
            with lock:
                n = next(counter)
            if n >= len(requests):
                break
            started = time.perf_counter()
            status, data = send(requests[n])
            outcomes.append((n, status, data, time.perf_counter() - started))

    threads = [threading.Thread(target=client) for _ in range(clients)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, time.perf_counter() - started


def pct(samples: list[float], q: float) -> float:
    """Nearest-rank percentile in milliseconds."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)] * 1000 if ordered else float("nan")


def machine_load() -> str:
    """The 1/5/15-minute load averages: figures from a shared machine mean little without them."""
    return "/".join(f"{x:.1f}" for x in os.getloadavg())
