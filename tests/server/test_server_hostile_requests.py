"""Hostile requests from a key holder (issue 37): a body nested past what the parser takes is a 400 in the
route's error shape, never a 500; a stream refused for a full queue is a 429 with Retry-After before any 200,
never an error event after it."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests.support.models import tiny_loaded
from tests.server.live import TASK, call, model_thread_held, queued_while_held, serving


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded("llama")


def nested_stop(depth: int) -> bytes:
    body = '{"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "stop": ' + "[" * depth + '"x"' + "]" * depth + "}"
    return body.encode()


@pytest.mark.parametrize("depth", [70, 995, 20_000])
def test_a_deeply_nested_body_is_a_400_in_openai_shape(loaded, task, depth):
    with serving(loaded, [task]) as server:
        status, _, body = call(server, "POST", "/v1/chat/completions", raw=nested_stop(depth),
                               headers={"Content-Type": "application/json"})
        assert status == 400, body
        assert body["error"]["type"] == "invalid_request_error" and "nested deeper" in body["error"]["message"], body
        ok = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        assert call(server, "POST", "/v1/chat/completions", ok)[0] == 200, "the server goes on"


def test_a_stream_refused_for_a_full_queue_is_a_429_before_the_200(loaded, task):
    with serving(loaded, [task], max_queue=3, max_items=3, max_batch=64) as server:
        first: list = []
        stream = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        with model_thread_held(server):
            holder = queued_while_held(server, {"task": TASK, "items": ["a", "b", "c"]}, first)
            status, headers, body = call(server, "POST", "/v1/chat/completions", stream)
        holder.join()
        assert status == 429, body
        assert int(headers["retry-after"]) >= 1 and body["error"]["type"] == "rate_limit_exceeded", body
        assert first[0][0] == 200
        status, _, text = call(server, "POST", "/v1/chat/completions", stream)
        assert status == 200 and "[DONE]" in text, text
        assert call(server, "GET", "/v1/stats")[2]["in_progress"] == 0, "a finished stream gives its room back"


def test_guided_choice_is_capped_by_settings_named_in_the_400(loaded, task):
    with serving(loaded, [task], max_choice_chars=40, max_choice_tokens=60) as server:
        ask = {"model": "tiny-llama", "messages": [{"role": "user", "content": "route this ticket "}]}
        long = dict(ask, guided_choice=["billing", "b" * 41])
        status, _, body = call(server, "POST", "/v1/chat/completions", long)
        assert status == 400 and "max_choice_chars=40" in body["error"]["message"], body
        assert body["error"]["param"] == "guided_choice[1]", body
        many = dict(ask, guided_choice=[f"choice number {i} of many" for i in range(12)])
        status, _, body = call(server, "POST", "/v1/chat/completions", many)
        assert status == 400 and "max_choice_tokens=60" in body["error"]["message"], body
        status, _, body = call(server, "POST", "/v1/chat/completions", dict(ask, guided_choice=["billing", "account"]))
        assert status == 200 and body["choices"][0]["message"]["content"] in ("billing", "account"), body


@pytest.mark.parametrize("schema, why", [
    ({"$ref": "#"}, "only the empty text"),
    ({"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}, "admits no value"),
])
def test_a_schema_with_no_finite_answer_is_a_400_before_decoding(loaded, task, schema, why):
    with serving(loaded, [task]) as server:
        ask = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 40,
               "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
        status, _, body = call(server, "POST", "/v1/chat/completions", ask)
        assert status == 400 and why in body["error"]["message"], body
        assert body["error"]["param"] == "response_format"
        fine = dict(ask, response_format={"type": "json_object"})
        status, _, body = call(server, "POST", "/v1/chat/completions", fine)
        assert status == 200 and json.loads(body["choices"][0]["message"]["content"]) is not None, body


def test_streams_dropped_while_queued_are_never_run(loaded, task):
    """While the model thread is held, five streams are opened, read to their first event and dropped: their
    sequences leave the engine loop before they are ever fed (only the request sent after them runs), and their
    room is given back once the model thread has dropped them.

    No step of the test depends on timing: the model thread is let go only once the server has counted all five
    requests abandoned (``prefixcache_requests_abandoned_total``: each is counted after its sequences are flagged),
    so every drop is one the server has noticed before any step could take it; the waits below bound a hang only."""
    import socket
    from urllib.parse import urlparse

    from tests.server.live import metric, metric_samples, model_thread_held

    ask = {"model": "tiny-llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    with serving(loaded, [task], max_batch=1) as server:
        samples = metric_samples(server)
        before = metric(samples, "prefixcache_items_total", task="openai", kind="generate")
        abandoned = metric(samples, "prefixcache_requests_abandoned_total")
        url = urlparse(server.url)
        body = json.dumps(dict(ask, stream=True)).encode()
        with model_thread_held(server):
            for _ in range(5):
                with socket.create_connection((url.hostname, url.port), timeout=30) as sock:
                    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                                 + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
                    received = b""
                    while b"data:" not in received:  # the headers, then the stream's first event
                        chunk = sock.recv(4096)
                        assert chunk, f"the stream ended before its first event: {received!r}"
                        received += chunk
            deadline = time.monotonic() + 60
            while metric(metric_samples(server), "prefixcache_requests_abandoned_total") < abandoned + 5:
                assert time.monotonic() < deadline, "the server never noticed the five clients had gone"
                time.sleep(0.01)
        deadline = time.monotonic() + 30
        while call(server, "GET", "/v1/stats")[2]["in_progress"] > 0:  # each one's room: kept until the thread drops it
            assert time.monotonic() < deadline, "the dropped streams never gave their room back"
            time.sleep(0.05)
        status, _, answer = call(server, "POST", "/v1/chat/completions", ask)
        samples = metric_samples(server)
    assert status == 200, answer
    ran = metric(samples, "prefixcache_items_total", task="openai", kind="generate") - before  # the registry is the process's
    assert ran == 1, f"dropped streams ran: {ran - 1} of 5"


def test_a_long_system_prompt_is_built_in_chunks_and_answers_as_built_whole(loaded, task, monkeypatch):
    """A chat whose reusable part is longer than ``max_step_tokens`` has it computed a step's worth of tokens at a
    time, between steps; its next-token log-probs are those a server that builds it in one pass gives (a random
tiny model's near ties make a comparison of greedy text too brittle)."""
    from prefixcache.server import openai_runners

    chunks: list[int] = []
    whole = openai_runners.build_in_chunks

    def counted(model, ids, chunk_tokens):
        for built in whole(model, ids, chunk_tokens):
            chunks.append(built.length)
            yield built

    monkeypatch.setattr(openai_runners, "build_in_chunks", counted)
    system = " ".join(f"rule {i}: answer briefly." for i in range(12))
    ask = {"model": "tiny-llama", "max_tokens": 1, "logprobs": True, "top_logprobs": 5,
           "messages": [{"role": "system", "content": system}, {"role": "user", "content": "hi"}]}
    answers = []
    for step_tokens in (8, 4096):
        with serving(loaded, [task], max_step_tokens=step_tokens) as server:
            status, _, body = call(server, "POST", "/v1/chat/completions", ask)
            assert status == 200, body
            answers.append(body["choices"][0]["logprobs"]["content"][0]["top_logprobs"])
            if step_tokens == 8:
                assert len(chunks) > 3 and all(b - a <= 8 for a, b in zip([0] + chunks, chunks)), chunks
                built = len(chunks)
    assert len(chunks) == built, "a prefix that fits one step was built in chunks"
    chunked, whole = ({top["token"]: top["logprob"] for top in answer} for answer in answers)
    assert chunked.keys() == whole.keys() and all(abs(chunked[t] - whole[t]) < 1e-4 for t in whole), answers
