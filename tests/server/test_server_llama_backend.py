"""The server with its generating requests on llama.cpp (``serve --backend llama.cpp``), on the embedded model.

The engine loop is the same; its generating rows run in one llama.cpp context whose keys/values are reserved in
the prefix pool's budget. An extraction and an OpenAI ``json_schema`` chat are answered and parse, a classification
beside them still scores on torch, a request longer than the context can hold gets a 413 before any work, and every
row is given back. Skipped, saying why, where llama.cpp is not built here.
"""

from __future__ import annotations

import json
import re

import pytest

from prefixcache.model.llama_cpp import llama_cpp_problem
from prefixcache.model.load import embedded_gguf, load_model
from prefixcache.scheduler.backend_choice import context_bytes
from prefixcache.task.definition import load_any_task

from tests.server.inprocess import client

PROBLEM = llama_cpp_problem(str(embedded_gguf("smollm2-135m")), 1)
pytestmark = [pytest.mark.embedded,
              pytest.mark.skipif(PROBLEM is not None, reason=f"llama.cpp cannot run here: {PROBLEM}")]
SCHEMA = {"type": "object", "properties": {"order_id": {"type": ["string", "null"]},
                                           "sentiment": {"enum": ["positive", "neutral", "negative"]}},
          "required": ["order_id", "sentiment"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served():
    loaded = load_model("smollm2-135m", dtype="float32", threads=1)
    tasks = [load_any_task("ticket-fields"), load_any_task("support-tickets")]
    with client(loaded, tasks, backend="llama.cpp", cache_budget_bytes=128 * 2**20) as c:
        yield c


def test_extraction_and_a_json_schema_chat_run_on_llama_cpp(served):
    service = served.app.state.service
    assert service.backend.name == "llama.cpp"
    answer = served.post("/v1/extract", json={"task": "ticket-fields",
                                              "items": ["Order 48213 never arrived and I am upset.", "Love the app!"]})
    assert answer.status_code == 200, answer.text
    assert all(set(item["fields"]) == {"order_id", "sentiment", "product"} for item in answer.json()["results"])
    chat = served.post("/v1/chat/completions", json={
        "model": "smollm2-135m", "max_tokens": 48, "temperature": 0,
        "messages": [{"role": "user", "content": "Order 48213 never arrived. Answer in JSON."}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}}})
    assert chat.status_code == 200, chat.text
    assert set(json.loads(chat.json()["choices"][0]["message"]["content"])) == {"order_id", "sentiment"}
    classified = served.post("/v1/classify", json={"task": "support-tickets", "items": ["I was charged twice"]})
    assert classified.status_code == 200, classified.text
    backend = service.engine.engine.generation
    assert not backend.reserved, "every row given back"
    assert service.pool.stats().reserved_bytes == context_bytes(service.loaded, backend.llama.shape.cells) > 0


def test_a_chat_longer_than_the_context_holds_is_413_before_any_work(served):
    cells = served.app.state.service.engine.engine.generation.llama.shape.cells
    words = " ".join(["refund"] * cells)
    answer = served.post("/v1/chat/completions", json={
        "model": "smollm2-135m", "max_tokens": 16, "messages": [{"role": "user", "content": words}]})
    assert answer.status_code == 413, answer.text
    most = re.search(r"add up to at most (\d+) tokens", answer.json()["error"]["message"])
    assert most and int(most.group(1)) <= cells, "refused before any work, within the context's cells, the limit named"


def test_the_llama_cpp_context_caps_what_one_request_may_hold():
    from prefixcache.server.kv_room import KVRoom
    from tests.support.models import tiny_loaded

    model = tiny_loaded("llama").model
    assert KVRoom(model, 2**30).most_tokens > 1000
    assert KVRoom(model, 2**30, token_cap=1000).most_tokens == 1000, "the context's cells bound a request"


def test_hostile_requests_are_refused_before_they_reach_llama_cpp(served):
    """The hostile-request checks sit before the backend: on llama.cpp too a body nested past the parser's depth and a
    schema with no finite answer are 400s in OpenAI's shape, the server answers the next chat, and no row is held."""
    body = ('{"model": "smollm2-135m", "messages": [{"role": "user", "content": "hi"}], "stop": '
            + "[" * 995 + '"x"' + "]" * 995 + "}")
    nested = served.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    assert nested.status_code == 400 and "nested deeper" in nested.json()["error"]["message"], nested.text
    endless = served.post("/v1/chat/completions", json={
        "model": "smollm2-135m", "max_tokens": 40, "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}})
    assert endless.status_code == 400 and endless.json()["error"]["param"] == "response_format", endless.text
    fine = served.post("/v1/chat/completions", json={
        "model": "smollm2-135m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert fine.status_code == 200, fine.text
    assert not served.app.state.service.engine.engine.generation.reserved
