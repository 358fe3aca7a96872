"""A real uvicorn server on a free loopback port, and the HTTP calls the server tests make to it: plain and
concurrent requests, the Prometheus samples, and the comparison of an answer with the sequential result."""

from __future__ import annotations

import http.client
import itertools
import json
import math
import threading
import time
from contextlib import contextmanager
from urllib.parse import urlparse

from prometheus_client.parser import text_string_to_metric_families

from prefixcache.scheduler.classify import Record
from prefixcache.server import ServerSettings, ServerThread, create_app

TASK = "tiny-tickets"
TOL = 1e-5  # probabilities are rounded to 6 decimals; batch shape may move the 7th


@contextmanager
def serving(loaded, tasks, **settings):
    settings.setdefault("api_key", None)
    with ServerThread(create_app(loaded, tasks, ServerSettings(**settings))) as server:
        yield server


@contextmanager
def model_thread_held(server):
    """Keep the server's model thread busy (a call that blocks) until the block ends: requests sent meanwhile are
    admitted and wait in the inbox, as under load, and are answered once it ends."""
    started, gate = threading.Event(), threading.Event()

    def hold():
        started.set()
        assert gate.wait(60), "the test never let the model thread go"

    server.app.state.service.engine.call_soon(hold)
    assert started.wait(30), "the model thread never took the holding call"
    try:
        yield
    finally:
        gate.set()


def call(server, method, path, body=None, headers=None, raw: bytes | None = None, chunked=False):
    """One HTTP request on a fresh connection. Returns (status, headers, parsed JSON or text)."""
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60)
    headers = dict(headers or {})
    payload = raw
    if body is not None:
        payload = json.dumps(body).encode()
        headers.setdefault("Content-Type", "application/json")
    try:
        if chunked:
            conn.request(method, path, body=iter([payload[i : i + 512] for i in range(0, len(payload), 512)]),
                         headers=headers, encode_chunked=True)
        else:
            conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        data = response.read().decode()
        kind = response.getheader("content-type", "")
        return response.status, dict(response.getheaders()), json.loads(data) if "json" in kind and data else data
    finally:
        conn.close()


def post_concurrently(server, path: str, task: str, requests: list[list[Record]]) -> list:
    """Send every request at once (one thread each, released together); answers in request order."""
    barrier = threading.Barrier(len(requests))
    answers: list = [None] * len(requests)

    def client(n):
        items = [{"id": r.id, "text": r.fields["text"]} for r in requests[n]]
        barrier.wait()
        answers[n] = call(server, "POST", path, {"task": task, "items": items})

    threads = [threading.Thread(target=client, args=(n,)) for n in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


def requests_of_sizes(records: list[Record], sizes: tuple[int, ...], max_batch: int) -> list[list[Record]]:
    """Split ``records`` into consecutive requests whose sizes cycle through ``sizes`` (the last may be shorter).

    Checks that the sizes really vary and that some requests are larger than ``max_batch`` (so they
    must be split across passes), so that a test built on them cannot silently degrade to one item each.
    """
    requests, start = [], 0
    for size in itertools.cycle(sizes):
        if start >= len(records):
            break
        requests.append(records[start : start + size])
        start += size
    got = [len(r) for r in requests]
    assert len(set(got)) >= 3 and min(got) == 1, f"request sizes {got} do not really vary"
    assert sum(n > max_batch for n in got) >= 2, f"request sizes {got}: too few exceed max_batch={max_batch}"
    return requests


def queued_while_held(server, body: dict, first: list) -> threading.Thread:
    """Under :func:`model_thread_held`: send ``body`` to ``/v1/classify`` from a thread (its answer appended to
    ``first``) and return once its items are admitted and waiting; join the thread after the hold."""
    sender = threading.Thread(target=lambda: first.append(call(server, "POST", "/v1/classify", body)))
    sender.start()
    deadline = time.monotonic() + 10  # a bound on a hang, not a timing assertion
    while call(server, "GET", "/v1/stats")[2]["in_progress"] < len(body["items"]):
        assert time.monotonic() < deadline, "the first request never reached the queue"
        time.sleep(0.01)
    return sender


def post_while_held(server, path: str, task: str, requests: list[list[Record]]) -> list:
    """:func:`post_concurrently`, with the model thread held until every item is admitted: the engine loop then
    finds them all waiting at its next step, as under load. Answers in request order."""
    answers: list = []
    items = sum(len(r) for r in requests)
    with model_thread_held(server):
        sender = threading.Thread(target=lambda: answers.extend(post_concurrently(server, path, task, requests)))
        sender.start()
        for _ in range(3000):  # a bound on a hang, not a timing assertion
            if call(server, "GET", "/v1/stats")[2]["in_progress"] >= items:
                break
            time.sleep(0.01)
        else:
            raise AssertionError(f"the {items} items were never all admitted")
    sender.join()
    return answers


def unmerged_passes(requests: list[list], max_batch: int) -> int:
    """The passes the requests would take if no pass held items of two requests."""
    return sum(math.ceil(len(r) / max_batch) for r in requests)


def metric_samples(server, headers=None) -> dict[tuple, float]:
    status, _, text = call(server, "GET", "/metrics", headers=headers)
    assert status == 200, text
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def metric(samples, name, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def assert_same_prediction(got: dict, want, context: str):
    assert got["id"] == want.id, f"{context}: result routed to the wrong item ({got['id']!r} != {want.id!r})"
    assert got["label"] == want.label, f"{context}: label {got['label']} != sequential {want.label}"
    for label, p in want.scores.probabilities.items():
        assert abs(got["scores"][label] - p) < TOL, f"{context}: P({label}) {got['scores'][label]} != sequential {p}"
