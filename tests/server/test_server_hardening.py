"""Issue 19 ("Server hardening"), items 5, 7 and 8, against the app on a tiny in-process model (FastAPI's TestClient).

* 5: a deleted task leaves no series in ``/metrics``, counters included, even when a pass of it finishes
  after the delete; a task replaced by one of another kind keeps no series of the old kind.
* 7: inputs that used to answer 500 (a YAML integer over Python's digit limit, an impossible date, a lone
  surrogate, NaN or infinity in a request body) answer 4xx naming the field.
* 8: the admin key (``PREFIXCACHE_ADMIN_KEY``) guards task registration, deletion and ``/metrics``; the client key
  gets 403 there; start-up tasks are read-only to every caller but the admin.
"""

from __future__ import annotations

import json
import re
from dataclasses import fields

import pytest
from fastapi.testclient import TestClient

from prefixcache.errors import SettingsError, TaskError
from prefixcache.server import ServerSettings
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ADMIN_KEY_ENV, API_KEY_ENV
from prefixcache.task.definition import parse_task

from tests.server.inprocess import client, named
from tests.support import paths
from tests.support.tasks import EXTRACT_YAML, TASK_YAML

TASK = "tiny-tickets"
YAML = {"Content-Type": "application/yaml"}
CLIENT_KEY, ADMIN_KEY = "client-key-0123", "admin-key-4567"
CLIENT, ADMIN = {"Authorization": f"Bearer {CLIENT_KEY}"}, {"Authorization": f"Bearer {ADMIN_KEY}"}
DOCS = paths.DOCS / "server.md"


def post_raw(c: TestClient, body: dict, headers=None):
    """``body`` as JSON the way Python writes it: NaN and Infinity bare, lone surrogates as ``\\ud800`` escapes."""
    return c.post("/v1/classify", content=json.dumps(body).encode(), headers={"Content-Type": "application/json", **(headers or {})})


def strict_json(response) -> dict:
    """The body, which must be strict JSON in valid UTF-8 (no NaN, no lone surrogate)."""
    text = response.content.decode("utf-8")
    return json.loads(text, parse_constant=lambda name: pytest.fail(f"the answer holds {name}: {text}"))


# --- item 5: metric series die with their task --------------------------------------------------------------


def test_deleted_tasks_leave_no_series_in_metrics(loaded, task):
    """Register, use and delete several uploaded tasks: no series of theirs stays, counters and histograms included."""
    with client(loaded, [task]) as c:
        for i in range(4):
            name = f"gone-{i}"
            assert c.put(f"/v1/tasks/{name}", content=named(name), headers=YAML).status_code == 201
            assert c.post("/v1/classify", json={"task": name, "items": ["refund me"]}).status_code == 200
            assert c.delete(f"/v1/tasks/{name}").status_code == 204
        text = c.get("/metrics").text
    left = sorted({line.split("{")[0] for line in text.splitlines() if 'task="gone-' in line})
    assert not left, f"deleted tasks still have series in: {left}"
    assert f'prefixcache_prefix_builds_total{{task="{TASK}"}}' in text, "the start-up task's series must stay"


def test_a_replaced_task_keeps_no_series_of_its_old_kind(loaded, task):
    with client(loaded, [task]) as c:
        assert c.put("/v1/tasks/swap", content=named("swap"), headers=YAML).status_code == 201
        assert c.post("/v1/classify", json={"task": "swap", "items": ["refund me"]}).status_code == 200
        assert c.put("/v1/tasks/swap", content=named("swap", EXTRACT_YAML), headers=YAML).status_code == 200
        text = c.get("/metrics").text
    stale = [line for line in text.splitlines() if 'task="swap"' in line and 'kind="classify"' in line]
    assert not stale, f"series of the old kind remain: {stale}"
    assert 'prefixcache_prefix_builds_total{task="swap"} 2.0' in text, "a replaced task's own counters continue"


def test_a_pass_that_ends_after_its_task_was_deleted_brings_no_series_back():
    """Requests accepted before a DELETE still finish; their pass must not recreate the deleted task's series."""
    metrics = Metrics()
    metrics.record_prefix("t", "classify", tokens=10, nbytes=100, replaced=False)
    metrics.record_batch("t", "classify", size=2, hits=2, seconds=0.01)
    metrics.record_removed("t")
    metrics.record_batch("t", "classify", size=1, hits=0, seconds=0.01)
    text = metrics.exposition().decode()
    assert 'task="t"' not in text, [line for line in text.splitlines() if 'task="t"' in line]
    assert metrics.summary(0, 0, 0)["items_total"] == 3, "the unlabelled totals still count the late pass"


# --- item 7: no 500 for odd inputs --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value, words",
    [("9" * 4400, "digits"), ("2024-13-45", "date"), ("2024-01-01 10:00:00 +99:00", "date"), ('"acc\\ud800"', "surrogate")],
    ids=["int-over-4300-digits", "month-13", "utc-offset-99h", "lone-surrogate"],
)
def test_odd_yaml_scalars_are_a_task_error_naming_the_field(value, words):
    text = TASK_YAML.replace("  account: login, password and profile", f"  account: {value}")
    with pytest.raises(TaskError) as refused:
        parse_task(text, "odd.yaml")
    message = str(refused.value)
    assert "odd.yaml:6" in message and "labels.account" in message and words in message, message


def test_a_lone_surrogate_in_a_yaml_key_is_named_escaped():
    with pytest.raises(TaskError) as refused:
        parse_task(TASK_YAML.replace("  account: login", '  "acc\\ud800": login'), "odd.yaml")
    message = str(refused.value)
    assert "labels" in message and "\\ud800" in message and "surrogate" in message, message
    message.encode("utf-8")  # the message itself is valid text


def test_odd_task_uploads_are_422_naming_the_field(loaded, task):
    uploads = {
        "int": TASK_YAML.replace("  account: login, password and profile", "  account: " + "9" * 4400),
        "date": TASK_YAML.replace("  account: login, password and profile", "  account: 2024-13-45"),
        "key": TASK_YAML.replace("  account: login", '  "acc\\ud800": login'),
        "json": '{"name": "odd", "instruction": "x", "labels": {"a": "1", "b": "2"}, "select": ' + "9" * 5000 + "}",
    }
    with client(loaded, [task]) as c:
        for what, text in uploads.items():
            response = c.put("/v1/tasks/odd", content=named("odd", text).encode(), headers=YAML)
            assert response.status_code == 422, f"{what}: {response.status_code} {response.text[:300]}"
            detail = strict_json(response)["detail"]
            assert "upload:odd" in detail and ("labels" in detail or "select" in detail), f"{what}: {detail}"


REQUESTS = {  # body, the field the answer must name
    "nan-item": ({"task": TASK, "items": ["ok", float("nan")]}, "items[1]"),
    "nan-id": ({"task": TASK, "items": [{"id": float("nan"), "text": "a"}]}, "items[0].id"),
    "inf-id": ({"task": TASK, "items": [{"id": float("inf"), "text": "a"}]}, "items[0].id"),
    "nan-field": ({"task": TASK, "items": [{"text": "a", "score": float("nan")}]}, "items[0].score"),
    "surrogate-task": ({"task": "\ud800", "items": ["a"]}, "task"),
    "surrogate-id": ({"task": TASK, "items": [{"id": "x\ud800", "text": "a"}]}, "items[0].id"),
    "surrogate-string-item": ({"task": TASK, "items": ["ok", "ok", "\ud800"]}, "items[2].text"),
    "surrogate-text": ({"task": TASK, "items": [{"text": "a\udfff"}]}, "items[0].text"),
    "surrogate-field": ({"task": TASK, "items": [{"text": "a", "note": "\udc00"}]}, "items[0].note"),
    "surrogate-key": ({"task": TASK, "items": [{"text": "a", "n\ud800": "x"}]}, "items[0]"),
}


def test_nan_infinity_and_lone_surrogates_in_requests_are_422_naming_the_field(loaded, task):
    with client(loaded, [task]) as c:
        answers = {what: post_raw(c, body) for what, (body, _) in REQUESTS.items()}
        assert post_raw(c, {"task": TASK, "items": ["still serving"]}).status_code == 200
    for what, response in answers.items():
        field = REQUESTS[what][1]
        assert response.status_code == 422, f"{what}: {response.status_code} {response.text[:300]}"
        detail = strict_json(response)["detail"]
        assert isinstance(detail, list) and any(e["field"].startswith(field) for e in detail), f"{what}: {detail}"
        assert all({"loc", "msg", "type", "field"} >= set(e) for e in detail), f"{what}: {detail}"


def test_schema_422s_still_list_loc_and_msg_without_echoing_the_input(loaded, task):
    with client(loaded, [task]) as c:
        response = c.post("/v1/classify", json={"task": TASK, "items": ["ok", {"text": 5}]})
    (error,) = strict_json(response)["detail"]
    assert response.status_code == 422 and error["loc"] == ["body", "items", 1, "object", "text"], error
    assert error["field"] == "items[1].text" and "string" in error["msg"] and "input" not in error


# --- item 8: roles ------------------------------------------------------------------------------------------


def test_settings_read_the_admin_key_from_the_environment_and_never_show_it(monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, CLIENT_KEY)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    settings = ServerSettings.from_env()
    assert settings.admin_key == ADMIN_KEY and ADMIN_KEY not in repr(settings)
    monkeypatch.setenv(ADMIN_KEY_ENV, "  ")
    with pytest.raises(SettingsError, match=ADMIN_KEY_ENV):
        ServerSettings.from_env()
    with pytest.raises(SettingsError, match="differ"):
        ServerSettings(api_key="same-key", admin_key="same-key")


def test_without_an_admin_key_start_up_tasks_are_read_only(loaded, task):
    with client(loaded, [task], api_key=CLIENT_KEY) as c:
        replaced = c.put(f"/v1/tasks/{TASK}", content=named(TASK, TASK_YAML.replace("billing", "refunds")), headers=YAML | CLIENT)
        deleted = c.delete(f"/v1/tasks/{TASK}", headers=CLIENT)
        labels = c.get("/v1/tasks", headers=CLIENT).json()["tasks"][0]["labels"]
        uploaded = c.put("/v1/tasks/mine", content=named("mine"), headers=YAML | CLIENT).status_code
        replaced_mine = c.put("/v1/tasks/mine", content=named("mine"), headers=YAML | CLIENT).status_code
        deleted_mine = c.delete("/v1/tasks/mine", headers=CLIENT).status_code
        metrics = c.get("/metrics", headers=CLIENT).status_code
    for response in (replaced, deleted):
        detail = response.json()["detail"]
        assert response.status_code == 403 and repr(TASK) in detail and "start-up" in detail, response.text
    assert labels == ["billing", "technical", "account"], "a refused PUT changed the start-up task"
    assert (uploaded, replaced_mine, deleted_mine, metrics) == (201, 200, 204, 200), "uploads work as before"


def test_the_admin_key_guards_task_changes_and_metrics(loaded, task):
    with client(loaded, [task], api_key=CLIENT_KEY, admin_key=ADMIN_KEY) as c:
        for method, path in [("PUT", "/v1/tasks/mine"), ("DELETE", f"/v1/tasks/{TASK}"), ("GET", "/metrics")]:
            kwargs = {"content": named("mine")} if method == "PUT" else {}
            forbidden = c.request(method, path, headers=CLIENT | YAML, **kwargs)
            assert forbidden.status_code == 403 and ADMIN_KEY_ENV in forbidden.json()["detail"], f"{method} {path}: {forbidden.text}"
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                assert c.request(method, path, headers=headers | YAML, **kwargs).status_code == 401, f"{method} {path}"
        assert c.post("/v1/classify", json={"task": TASK, "items": ["refund"]}, headers=CLIENT).status_code == 200
        assert c.post("/v1/classify", json={"task": TASK, "items": ["refund"]}, headers=ADMIN).status_code == 200
        assert c.get("/metrics", headers=ADMIN).status_code == 200
        assert c.put("/v1/tasks/mine", content=named("mine"), headers=ADMIN | YAML).status_code == 201
        new = named(TASK, TASK_YAML.replace("billing", "refunds"))
        response = c.put(f"/v1/tasks/{TASK}", content=new, headers=ADMIN | YAML)
        assert response.status_code == 200 and response.json()["labels"][0] == "refunds", "the admin may replace a start-up task"
        assert c.delete(f"/v1/tasks/{TASK}", headers=ADMIN).status_code == 204
        schema = c.get("/openapi.json", headers=CLIENT).json()
    for path, method in [("/v1/tasks/{name}", "put"), ("/v1/tasks/{name}", "delete"), ("/metrics", "get")]:
        operation = schema["paths"][path][method]
        assert "403" in operation["responses"] and operation["security"] == [{"admin": []}], f"{method} {path}"
    assert schema["security"] == [{"bearer": []}] and set(schema["components"]["securitySchemes"]) == {"bearer", "admin"}


def test_an_admin_key_alone_leaves_classification_open(loaded, task):
    with client(loaded, [task], admin_key=ADMIN_KEY) as c:
        assert c.post("/v1/classify", json={"task": TASK, "items": ["refund"]}).status_code == 200
        assert c.put("/v1/tasks/mine", content=named("mine"), headers=YAML).status_code == 401
        assert c.get("/metrics").status_code == 401
        assert c.put("/v1/tasks/mine", content=named("mine"), headers=YAML | ADMIN).status_code == 201


def test_docs_list_every_limit_with_its_default_and_status():
    text = DOCS.read_text(encoding="utf-8")
    table = text.split("## Limits and roles", 1)[1].split("\n## ", 1)[0]
    limits = [f.name for f in fields(ServerSettings) if f.name.startswith("max_") or f.name == "cache_budget_bytes"]
    for name in limits:
        rows = [line for line in table.splitlines() if line.startswith("|") and f"`{name}`" in line]
        assert rows, f"docs/server.md's 'Limits and roles' table lacks {name}"
        assert re.search(r"\b(4\d\d|503)\b|—", rows[0]), f"{name}: no status code in {rows[0]}"
    assert ADMIN_KEY_ENV in table and API_KEY_ENV in table
