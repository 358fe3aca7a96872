"""The HTTP API fuzzed from its own OpenAPI schema (issue 18, item 4), with schemathesis.

A real uvicorn server on a tiny in-process model, with an API key, serving a classification and an
extraction task. Schemathesis generates requests for every operation of the server's own
``/openapi.json`` (valid ones and ones that break the schema) and checks each response: never a
500, and always a status code and a body that the schema documents. Afterwards the server must
still answer a real request.
"""

from __future__ import annotations

import json
import os
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from schemathesis.specs.openapi.checks import positive_data_acceptance

from prefixcache.server import ServerSettings, ServerThread, create_app
from prefixcache.task.definition import parse_task

from tests.support.tasks import EXTRACT_YAML, TASK_YAML

pytestmark = pytest.mark.slow  # a real server answering hundreds of generated requests

KEY = "fuzz-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
EXAMPLES = int(os.environ.get("PREFIXCACHE_FUZZ_EXAMPLES", "25"))  # generated requests per operation (issue 19: 200)
# A task upload is YAML text: its schema is "a string", so schemathesis takes any string for a valid task and
# expects it accepted. Whether a text is a task only the parser can tell (and its 422 names the line and field).
# Likewise, whether an OpenAI-style prompt fits the model's context, or a choice can follow the prompt as whole
# tokens, only the tokenizer can tell: a schema-valid request may get a 400 naming the field.
EXCLUDED = {"PUT /v1/tasks/{name}": [positive_data_acceptance], "POST /v1/chat/completions": [positive_data_acceptance],
            "POST /v1/completions": [positive_data_acceptance]}


@pytest.fixture(scope="module")
def server(tiny_qwen2):
    tasks = [parse_task(TASK_YAML, "tiny.yaml"), parse_task(EXTRACT_YAML, "fields.yaml", kinds=("extract",))]
    with ServerThread(create_app(tiny_qwen2, tasks, ServerSettings(api_key=KEY))) as running:
        yield running


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json", headers=AUTH)


def _operations(api_schema) -> list:
    return [result.ok() for result in api_schema.get_all_operations()]


def test_every_operation_answers_within_its_schema(api_schema):
    """For each operation, generated requests (schemathesis' Hypothesis strategy, positive and negative
    data), each checked by ``call_and_validate``: no server error, a documented status, a conforming body."""
    operations = _operations(api_schema)
    assert {op.label for op in operations} >= {"POST /v1/classify", "POST /v1/extract", "PUT /v1/tasks/{name}", "GET /healthz",
                                               "POST /v1/chat/completions", "POST /v1/completions", "GET /v1/models"}
    sent = dict.fromkeys(op.label for op in operations)
    for operation in operations:
        sent[operation.label] = 0

        @given(case=operation.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            sent[operation.label] += 1
            case.call_and_validate(headers=AUTH, excluded_checks=EXCLUDED.get(operation.label, []), timeout=120)

        check()
    print("\n[fuzz] requests per operation:", sent)
    assert min(sent.values()) >= 1 and sum(sent.values()) >= 5 * len(sent), sent  # /healthz takes no input: one case

def test_the_server_still_answers_after_the_fuzzing(server):
    request = urllib.request.Request(server.url + "/v1/classify", method="POST", headers=AUTH | {"Content-Type": "application/json"},
                                     data=json.dumps({"task": "tiny-tickets", "items": [{"text": "refund me"}]}).encode())
    with urllib.request.urlopen(request, timeout=60) as response:
        body = json.loads(response.read())
    assert response.status == 200 and body["results"][0]["label"] in ("billing", "technical", "account")
