"""Per-client fairness (issue 19 item 9): each client's share of the queue, and turns within a pass.

* Admission: one client may hold at most ``client_share`` items in progress; over it is a 429 even while
  ``max_queue`` has room, and another client is still admitted. ``max_queue`` still bounds everyone.
* Turns: the engine loop's step takes one waiting sequence per client in turn, each client's in arrival order,
  so a 1-item request arriving behind a 200-item flood runs in the next step, not after the flood.

Steps are ordered by gating the model thread with events, never by sleeping: no assertion is timed.
The HTTP test tells two clients apart by their source address (127.0.0.1 and 127.0.0.2, both loopback).
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from urllib.parse import urlparse

import pytest

from prefixcache.errors import QueueFullError, SettingsError
from prefixcache.server import ServerSettings, ServerThread, create_app
from prefixcache.server.middleware import CLIENT, BearerAuth, client_identity
from prefixcache.server.prometheus import Metrics

from tests.server.live import model_thread_held
from tests.server.fakes import FakeRunner, engine_thread, item, run_with, until

TASK = "tiny-tickets"


async def request(thread, runner, client, payloads):
    with thread.admit(len(payloads), client):
        return list((await thread.submit(runner, [item(p) for p in payloads], client)).results)


# --- admission -------------------------------------------------------------------------------------


def test_a_client_over_its_share_gets_429_while_another_client_is_admitted():
    thread = engine_thread(ServerSettings(max_queue=10, max_items=4, max_queue_per_client=4), Metrics())
    with thread.admit(3, "a"):
        with pytest.raises(QueueFullError) as refused:
            with thread.admit(2, "a"):
                pass
        assert "at most 4" in str(refused.value) and refused.value.retry_after >= 1
        assert thread.in_progress == 3, "a refused request reserved nothing"
        with thread.admit(4, "b"):  # the queue has room, and b has its own share
            with thread.admit(1, "a"):  # a's share: 4 of 4
                with pytest.raises(QueueFullError, match="at most 10"):  # 8 + 3 > max_queue: the global bound holds
                    with thread.admit(3, "c"):
                        pass
                with thread.admit(2, None):  # no client named: max_queue only
                    assert thread.in_progress == 10
    assert thread.in_progress == 0
    with thread.admit(4, "a"):  # a's share is given back whole
        pass


def test_the_share_defaults_to_half_the_queue_but_fits_a_full_request():
    assert ServerSettings().client_share == 512
    assert ServerSettings(max_queue=300, max_items=256).client_share == 256
    assert ServerSettings(max_queue=300, max_items=256, max_queue_per_client=260).client_share == 260
    for share in (255, 301):
        with pytest.raises(SettingsError, match="max_queue_per_client"):
            ServerSettings(max_queue=300, max_items=256, max_queue_per_client=share)


# --- turns -----------------------------------------------------------------------------------------


def test_one_item_behind_a_200_item_flood_runs_in_the_next_pass_and_every_result_is_its_own():
    """Client a floods 200 items (four requests of 50); its first pass holds the model thread while client b
    sends one item. The next pass must hold b's item; every request gets exactly its own results, in order,
    and a's items run in the order a sent them."""
    runner = FakeRunner(gate=threading.Event())
    settings = ServerSettings(max_batch=32)
    flood = [[("a", r, k) for k in range(50)] for r in range(4)]

    async def scenario(thread):
        a = [asyncio.ensure_future(request(thread, runner, "a", payloads)) for payloads in flood]
        await until(runner.started.is_set, "a's first pass started")
        await until(lambda: thread.depth == 200 - 32, "a's other items queued")
        b = asyncio.ensure_future(request(thread, runner, "b", [("b", 0, 0)]))
        await until(lambda: thread.depth == 200 - 32 + 1, "b's item queued")
        runner.gate.set()
        return await asyncio.gather(*a), await b

    a_answers, b_answer = run_with(settings, scenario)
    assert a_answers == flood and b_answer == [("b", 0, 0)], "a request got results that are not its own"
    where = [n for n, batch in enumerate(runner.calls) if ("b", 0, 0) in batch]
    assert where == [1], f"b's item ran in pass {where} of {len(runner.calls)}, not the one after a's first"
    a_order = [p for batch in runner.calls for p in batch if p[0] == "a"]
    assert a_order == [p for payloads in flood for p in payloads], "a's items must run in the order a sent them"
    assert all(len(batch) <= 32 for batch in runner.calls), [len(batch) for batch in runner.calls]


def test_clients_take_turns_item_by_item_and_the_turn_carries_over_to_the_next_pass():
    runner = FakeRunner(gate=threading.Event())
    settings = ServerSettings(max_batch=4)

    async def scenario(thread):
        hold = asyncio.ensure_future(request(thread, runner, "z", ["z0"]))
        await until(runner.started.is_set, "the blocking pass started")
        a = asyncio.ensure_future(request(thread, runner, "a", ["a0", "a1", "a2", "a3", "a4"]))
        await until(lambda: thread.depth == 5, "a's items queued")
        b = asyncio.ensure_future(request(thread, runner, "b", ["b0", "b1"]))
        c = asyncio.ensure_future(request(thread, runner, "c", ["c0"]))
        await until(lambda: thread.depth == 8, "b's and c's items queued")
        runner.gate.set()
        return await asyncio.gather(hold, a, b, c)

    answers = run_with(settings, scenario)
    assert answers == [["z0"], ["a0", "a1", "a2", "a3", "a4"], ["b0", "b1"], ["c0"]]
    assert runner.calls == [["z0"], ["a0", "b0", "c0", "a1"], ["b1", "a2", "a3", "a4"]], runner.calls


# --- over HTTP -------------------------------------------------------------------------------------


def post(server, source: str, body: dict, path: str = "/v1/classify"):
    """POST ``path`` from the loopback address ``source``. Returns (status, parsed JSON)."""
    url = urlparse(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=60, source_address=(source, 0))
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = conn.getresponse()
        return response.status, json.loads(response.read())
    finally:
        conn.close()


def one_client_full(server, same_body: dict, other_body: dict, route: str, admitted_at: int):
    """With the model thread held, 127.0.0.1 queues a 3-item classification; then it sends ``same_body`` to
    ``route`` while that is queued, and 127.0.0.2 sends ``other_body``, which must reach the queue (``admitted_at``
    items in progress). Returns ((status, body) of 127.0.0.1's second request, of 127.0.0.2's, of the first)."""
    service = server.app.state.service
    first: list = []
    other: list = []
    with model_thread_held(server):  # the first request stays in progress meanwhile
        waiting = threading.Thread(
            target=lambda: first.append(post(server, "127.0.0.1", {"task": TASK, "items": ["a", "b", "c"]})))
        waiting.start()
        deadline = time.monotonic() + 10  # a bound on a hang
        while service.engine.in_progress < 3:
            assert time.monotonic() < deadline, "the first request never reached the queue"
            time.sleep(0.01)
        same = post(server, "127.0.0.1", same_body, route)
        admitted = threading.Thread(target=lambda: other.append(post(server, "127.0.0.2", other_body, route)))
        admitted.start()
        while service.engine.in_progress < admitted_at:
            assert time.monotonic() < deadline, "the other client's request was not admitted"
            time.sleep(0.01)
    waiting.join()
    admitted.join()
    return same, other[0], first[0]


def test_over_http_a_client_is_its_address_and_its_share_is_its_own(loaded, task):
    settings = ServerSettings(max_queue=8, max_items=4, max_queue_per_client=4, max_batch=64)
    with ServerThread(create_app(loaded, [task], settings)) as server:
        (same_status, same_body), (other_status, other_body), first = one_client_full(
            server, {"task": TASK, "items": ["d", "e"]}, {"task": TASK, "items": ["f", "g"]}, "/v1/classify", 5)
    assert same_status == 429 and "one client may have at most 4" in same_body["detail"], same_body
    assert other_status == 200 and [r["id"] for r in other_body["results"]] == [0, 1], other_body
    assert first[0] == 200, "the first client's queued request must still be answered"


def test_an_openai_request_counts_against_its_clients_share(loaded, task):
    settings = ServerSettings(max_queue=8, max_items=3, max_queue_per_client=3, max_batch=64)
    with ServerThread(create_app(loaded, [task], settings)) as server:
        chat = {"model": server.app.state.service.loaded.spec, "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2}
        (same_status, same_body), other, first = one_client_full(server, chat, chat, "/v1/chat/completions", 4)
    assert same_status == 429 and "one client may have at most 3" in same_body["error"]["message"], same_body
    assert other[0] == 200, other
    assert first[0] == 200, "the first client's queued request must still be answered"


def test_the_auth_middleware_names_the_client_by_role_and_host():
    seen = {}

    async def app(scope, receive, send):
        seen.update(scope)

    scope = {"type": "http", "path": "/v1/classify", "method": "POST", "client": ("10.0.0.7", 5123),
             "headers": [(b"authorization", b"Bearer admin-secret")]}
    asyncio.run(BearerAuth(app, key="client-secret", admin_key="admin-secret")(scope, None, None))
    assert seen[CLIENT] == "admin@10.0.0.7"
    assert client_identity(None, None) == "anonymous@unknown"
    assert client_identity("client", ("10.0.0.7", 1)) == client_identity("client", ("10.0.0.7", 2)), (
        "a client's connections share its one share")
