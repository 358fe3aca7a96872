"""Every path of the server that can end in a 5xx (docs/server.md, Status): a request the server cannot hold is a
4xx that names the limit, before any work; a server fault stays a 5xx, logged with the request's id and counted in
``prefixcache_server_errors_total``; a client that left before any answer is counted as 499, never as a 500.

The tiny Llama's keys/values take 512 bytes a token (2 layers, 2 heads of 16, float32) and its context is 512
tokens, so a cache budget of 448 tokens' bytes holds a prompt and output of at most 448 tokens: a chat of about
300 tokens with ``max_tokens=200`` fits the context and not the budget.
"""

from __future__ import annotations

import logging
import socket
from urllib.parse import urlparse

import pytest

from prefixcache.engine.generate import GenerationConfig
from prefixcache.errors import RequestTooLargeError, SequenceFailedError, SequenceTooLongError
from prefixcache.scheduler.sequence import Generate, Sequence, Status
from prefixcache.server.http_errors import status_of
from prefixcache.server.runners import failed
from prefixcache.task.definition import parse_task

from tests.server.live import call, metric, metric_samples, serving
from tests.support.models import tiny_loaded
from tests.support.tasks import EXTRACT_YAML

PER_TOKEN = 2 * 2 * 2 * 16 * 4  # bytes of one token's keys and values in the tiny Llama
BUDGET = 448 * PER_TOKEN
LONG = "hello world " * 36  # about 300 tokens in a chat


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("llama")


def chat(content: str, max_tokens: int, **more) -> dict:
    return {"model": "tiny-llama", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **more}


def ran(server) -> float:
    return metric(metric_samples(server), "prefixcache_items_total", task="openai", kind="generate")


def test_a_chat_the_cache_budget_cannot_hold_is_a_413_before_any_work(loaded, task):
    with serving(loaded, [task], cache_budget_bytes=BUDGET) as server:
        before = ran(server)
        for stream in (False, True):
            status, headers, body = call(server, "POST", "/v1/chat/completions", chat(LONG, 200, stream=stream))
            assert status == 413 and "application/json" in headers["content-type"], (stream, body)
            error = body["error"]
            assert (error["type"], error["param"]) == ("invalid_request_error", "messages"), body
            for named in ("max_tokens=200", "at most 448 tokens", "cache_budget_bytes", "shorten the prompt"):
                assert named in error["message"], (named, error["message"])
        assert ran(server) == before, "a refused chat reached the engine loop"
        status, _, body = call(server, "POST", "/v1/chat/completions", chat(LONG, 100))  # the same prompt, fitting
        assert status == 200 and body["usage"]["prompt_tokens"] + 100 > 300, body
        status, _, body = call(server, "POST", "/v1/classify", {"task": task.name, "items": ["a classify beside it"]})
        assert status == 200 and body["results"][0]["label"] in task.labels, body
        assert metric(metric_samples(server), "prefixcache_server_errors_total", route="/v1/chat/completions",
                      code="500") == 0


def test_an_extraction_item_the_budget_cannot_hold_beside_a_pinned_prefix_is_a_413_naming_it(loaded):
    """The budget less the pinned start-up prefix is what one item's slot may take: an item over it is refused
    whole, naming the item and the pinned bytes, and a short item of the same task runs."""
    task = parse_task(EXTRACT_YAML + "pin: true\n", "tiny-fields.yaml", kinds=("extract",))
    with serving(loaded, [task], cache_budget_bytes=BUDGET, max_item_tokens=512) as server:
        long = {"task": task.name, "items": ["fine", {"id": "T-2", "text": "hello world " * 10}]}
        status, _, body = call(server, "POST", "/v1/extract", long)
        assert status == 413 and body["item"] == 1, body
        for named in ("item 1 (id 'T-2')", "max_new_tokens=10", "pinned prefixes", "cache_budget_bytes"):
            assert named in body["detail"], (named, body["detail"])
        assert metric(metric_samples(server), "prefixcache_items_total", task=task.name, kind="extract") == 0
        status, _, body = call(server, "POST", "/v1/extract", {"task": task.name, "items": ["fine"]})
        assert status == 200 and body["results"][0]["raw"] is not None, body


def test_a_sequence_no_slot_held_is_a_413_and_an_engine_failure_stays_a_500():
    """The model thread's backstop: a sequence the loop failed at admission for its size (never fed) answers as
    the request's own size (413); one whose engine call raised is the server's fault (500)."""
    seq = Sequence(object(), [1, 2], Generate(GenerationConfig(3)))
    seq.status, seq.failure = Status.FAILED, SequenceTooLongError("70 tokens of its own need 9 bytes")
    assert isinstance(failed(seq), RequestTooLargeError) and status_of(failed(seq)) == 413
    assert "70 tokens of its own" in str(failed(seq))
    seq.failure, seq.error = None, "RuntimeError: boom"
    assert isinstance(failed(seq), SequenceFailedError) and status_of(failed(seq)) == 500


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/classify"])
def test_an_unexpected_error_is_a_500_in_the_routes_shape_logged_and_counted_with_its_request_id(
        loaded, task, monkeypatch, caplog, path):
    from prefixcache.server import openai_routes, service as service_module

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")

    monkeypatch.setattr(openai_routes, "plan", broken)
    monkeypatch.setattr(service_module.Service, "runner", broken)
    body = chat("hi", 2) if path != "/v1/classify" else {"task": task.name, "items": ["hi"]}
    with caplog.at_level(logging.ERROR), serving(loaded, [task]) as server:
        status, headers, answer = call(server, "POST", path, body, headers={"X-Request-Id": "req-17"})
        samples = metric_samples(server)
    assert status == 500 and headers["x-request-id"] == "req-17", answer
    message = answer["error"]["message"] if path != "/v1/classify" else answer["detail"]
    assert "req-17" in message and "a bug" not in message, message
    if path != "/v1/classify":
        assert answer["error"]["type"] == "server_error", answer
    logged = [r for r in caplog.records if "req-17" in r.getMessage() and "answered 500" in r.getMessage()]
    assert len(logged) == 1 and "RuntimeError: a bug" in logged[0].getMessage() and logged[0].exc_info, caplog.text
    assert metric(samples, "prefixcache_server_errors_total", route=path, code="500") == 1


def test_an_engine_failure_stays_a_500_logged_with_the_id_in_an_answer_and_in_a_stream(loaded, task, monkeypatch,
                                                                                      caplog):
    from prefixcache.scheduler import generation

    def broken(*args, **kwargs):
        raise RuntimeError("the slot pass broke")

    monkeypatch.setattr(generation, "forward_slots", broken)  # torch's generation backend's pass
    with caplog.at_level(logging.ERROR), serving(loaded, [task]) as server:
        status, headers, answer = call(server, "POST", "/v1/chat/completions", chat("hi", 2))
        rid = headers["x-request-id"]
        s_status, s_headers, events = call(server, "POST", "/v1/chat/completions", chat("hi", 2, stream=True))
        samples = metric_samples(server)
    assert status == 500 and answer["error"]["type"] == "server_error", answer
    assert "the slot pass broke" in answer["error"]["message"], answer
    assert s_status == 200 and '"type": "server_error"' in events and "the slot pass broke" in events, events
    lines = [r.getMessage() for r in caplog.records]
    assert any(rid in line and "answered 500" in line and "SequenceFailedError" in line for line in lines), lines
    assert any(s_headers["x-request-id"] in line and "stream ended with 500" in line for line in lines), lines
    assert metric(samples, "prefixcache_server_errors_total", route="/v1/chat/completions", code="500") == 1
    assert metric(samples, "prefixcache_server_errors_total", route="(stream)", code="500") == 1


def test_a_client_gone_before_any_answer_is_counted_as_499_not_as_a_server_error(loaded, task):
    """A body cut off by its client: nothing is answered; the request is counted with 499, and no 5xx is."""
    import time

    with serving(loaded, [task]) as server:
        url = urlparse(server.url)
        with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/classify HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 1000\r\n\r\n{\"task\": ")
        deadline = time.monotonic() + 30  # bounds a hang, not a timing assertion
        while (gone := metric(metric_samples(server), "prefixcache_http_requests_total", method="POST",
                              route="(unmatched)", code="499")) < 1:
            assert time.monotonic() < deadline, "the cut-off request was never counted"
            time.sleep(0.01)
        samples = metric_samples(server)
    assert gone == 1
    assert not [k for k, v in samples.items() if k[0] == "prefixcache_http_requests_total" and v
                and dict(k[1])["code"].startswith("5")], "a client that left was counted as a server error"


def test_a_request_id_is_the_clients_when_it_is_a_plain_token_else_a_new_one(loaded, task):
    with serving(loaded, [task]) as server:
        mine = call(server, "GET", "/v1/tasks", headers={"X-Request-Id": "batch-7.item:3"})[1]["x-request-id"]
        forged = call(server, "GET", "/v1/tasks", headers={"X-Request-Id": "x\" answered 200 " + "y" * 80})[1]
        fresh = call(server, "GET", "/v1/tasks")[1]["x-request-id"]
    assert mine == "batch-7.item:3"
    assert forged["x-request-id"] != fresh and len(fresh) == 32 and " " not in forged["x-request-id"]
