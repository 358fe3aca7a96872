"""The HTTP service, each test against a real uvicorn server on a free loopback port, with a tiny in-process model.

Covers: concurrent requests merged into shared passes and equal to sequential
results (invariant 2 under concurrency), auth, every limit (413, 422, 429),
task upload and deletion (and that an upload cannot make the server read a
file), the Prometheus metrics, the OpenAPI docs, and the web page in headless Chromium.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import shutil
import threading
import time

import pytest

from prefixcache.scheduler.classify import Classifier, Record, RunConfig
from prefixcache.server import ServerSettings, ServerThread, create_app
from prefixcache.server.settings import API_KEY_ENV

from tests.server.live import (
    TASK, assert_same_prediction, call, metric, metric_samples, model_thread_held, post_while_held, queued_while_held,
    requests_of_sizes, serving, unmerged_passes,
)
from tests.support.tasks import TASK_YAML, TEXTS


@pytest.fixture
def task_yaml_for():
    def make(name: str) -> str:
        return TASK_YAML.replace("name: tiny-tickets", f"name: {name}")

    return make


# --- batching and equality -------------------------------------------------------------------------


def test_concurrent_requests_are_merged_and_equal_sequential_results(loaded, task):
    """29 clients at once, with requests of 1 to 11 items (some larger than max_batch, so split across passes):
    every result equals the one-record-at-a-time result, scores within TOL, and passes held several requests."""
    max_batch = 8
    records = [Record(f"r{i}", {"text": TEXTS[i % len(TEXTS)] + f" (ticket {i})"}) for i in range(48)]
    reference = Classifier(loaded, task).classify_all(records, RunConfig("cached", 1))
    requests = requests_of_sizes(records, (1, 3, 11, 2, 1, 9, 5, 1, 8, 2), max_batch)
    requests += [[r] for r in records[:16]]  # the same items again, in other batches

    with serving(loaded, [task], max_batch=max_batch) as server:
        runner = server.app.state.service.runner(TASK, "classify")
        before = runner.bound.prefix.checksum()
        answers = post_while_held(server, "/v1/classify", TASK, requests)
        samples = metric_samples(server)
        after = runner.bound.prefix.checksum()

    by_id = {p.id: p for p in reference}
    for n, (status, _, body) in enumerate(answers):
        assert status == 200, f"request {n} ({len(requests[n])} items): {status} {body}"
        assert [r["id"] for r in body["results"]] == [r.id for r in requests[n]], f"request {n}: results missing or out of order"
        for result in body["results"]:
            assert_same_prediction(result, by_id[result["id"]], f"request {n} ({len(requests[n])} items)")
    items = sum(len(r) for r in requests)
    passes = metric(samples, "prefixcache_batch_size_count", task=TASK)
    unmerged = unmerged_passes(requests, max_batch)
    assert metric(samples, "prefixcache_batch_size_sum", task=TASK) == items
    assert passes < unmerged / 2, f"{items} items took {passes} passes (unmerged: {unmerged}): concurrent requests were not merged"
    assert after == before, "a pass changed the stored prefix (invariant 2)"


def test_a_request_larger_than_max_batch_is_answered_after_its_last_pass(loaded, task):
    """5 items at max_batch 2 take three passes; the answer holds all five, each equal to the sequential result."""
    records = [Record(i, {"text": text}) for i, text in enumerate(TEXTS[:5])]
    reference = Classifier(loaded, task).classify_all(records, RunConfig("cached", 1))
    with serving(loaded, [task], max_batch=2) as server:
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": TEXTS[:5]})
        samples = metric_samples(server)
    assert status == 200, f"{status} {body}"
    assert [r and r["id"] for r in body["results"]] == [0, 1, 2, 3, 4], f"results missing: {body['results']}"
    for result, want in zip(body["results"], reference):
        assert_same_prediction(result, want, "a request split over passes")
    assert metric(samples, "prefixcache_batch_size_count", task=TASK) == 3, "5 items at max_batch=2 must take 3 passes"


def test_ids_usage_and_string_items(loaded, task):
    with serving(loaded, [task]) as server:
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["refund me", {"id": "x7", "text": "crash"}, {"text": "hi"}]})
        prefix_tokens = server.app.state.service.runner(TASK, "classify").prefix_tokens
    assert status == 200, body
    assert [r["id"] for r in body["results"]] == [0, "x7", 2]
    for r in body["results"]:
        assert set(r) == {"id", "label", "confidence", "scores", "margin"}
        assert abs(sum(r["scores"].values()) - 1) < 1e-4 and r["margin"] >= 0
    assert body["usage"]["prefix_tokens_reused"] == 3 * prefix_tokens
    assert body["usage"]["suffix_tokens"] > 3


def test_blank_items_are_answered_with_a_warning(loaded, task):
    """A blank text is classified (the model's guess) and says so, as on the CLI; it is not a 500."""
    with serving(loaded, [task]) as server:
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["", "   ", "crash"]})
    assert status == 200, body
    blank, spaces, plain = body["results"]
    for r in (blank, spaces):
        assert "empty or only whitespace" in r["warning"] and r["label"] in r["scores"]
    assert set(plain) == {"id", "label", "confidence", "scores", "margin"}, "absent keys stay absent, not null"


# --- auth ------------------------------------------------------------------------------------------


def test_api_key_guards_everything_but_healthz_and_the_page(loaded, task, monkeypatch):
    monkeypatch.setenv(API_KEY_ENV, "s3cret-key")
    with ServerThread(create_app(loaded, [task], ServerSettings.from_env(max_body_bytes=4096))) as server:
        assert call(server, "GET", "/healthz")[0] == 200
        assert call(server, "GET", "/")[0] == 200, "the static page must load without a key (it sends the key itself)"
        for method, path in [("GET", "/v1/tasks"), ("GET", "/metrics"), ("GET", "/v1/stats"), ("GET", "/docs"),
                             ("GET", "/openapi.json"), ("DELETE", f"/v1/tasks/{TASK}"), ("GET", "/no-such-page")]:
            status, headers, body = call(server, method, path)
            assert status == 401, f"{method} {path} answered {status} without a key"
            assert headers.get("www-authenticate", "").startswith("Bearer")
        big = {"task": TASK, "items": ["x" * 10_000]}
        assert call(server, "POST", "/v1/classify", big)[0] == 401, "auth must come before reading the body"
        for header in ["Bearer wrong", "Bearer s3cret-key-and-more", "Basic s3cret-key", "s3cret-key", "Bearer "]:
            assert call(server, "GET", "/v1/tasks", headers={"Authorization": header})[0] == 401, header
        good = {"Authorization": "Bearer s3cret-key"}
        assert call(server, "GET", "/v1/tasks", headers=good)[0] == 200
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["refund"]}, headers=good)
        assert status == 200, body
        assert call(server, "GET", "/docs", headers=good)[0] == 200


# --- limits ----------------------------------------------------------------------------------------


def test_body_size_limit_413(loaded, task):
    with serving(loaded, [task], max_body_bytes=2000) as server:
        small = {"task": TASK, "items": ["refund"]}
        big = {"task": TASK, "items": ["refund " * 400]}
        assert call(server, "POST", "/v1/classify", small)[0] == 200
        status, _, body = call(server, "POST", "/v1/classify", big)
        assert status == 413 and "max_body_bytes=2000" in body["detail"]
        status, _, body = call(server, "POST", "/v1/classify", big, chunked=True)
        assert status == 413, "a chunked body (no Content-Length) must be counted too"
        status, _, _ = call(server, "PUT", "/v1/tasks/huge", raw=b"name: huge\n" + b"#" * 5000, headers={"Content-Type": "application/yaml"})
        assert status == 413


def test_max_items_per_request_422(loaded, task):
    with serving(loaded, [task], max_items=4) as server:
        assert call(server, "POST", "/v1/classify", {"task": TASK, "items": ["a"] * 4})[0] == 200
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["a"] * 5})
    assert status == 422 and "max_items=4" in body["detail"]


def test_max_tokens_per_item_422_names_the_item(loaded, task):
    with serving(loaded, [task], max_item_tokens=24) as server:
        items = ["refund", {"id": "long-one", "text": "my card was charged twice " * 10}, "crash"]
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": items})
    assert status == 422, body
    assert body["item"] == 1 and "item 1" in body["detail"] and "'long-one'" in body["detail"]
    assert "max_item_tokens=24" in body["detail"]


def test_an_item_over_the_models_context_is_422_naming_it(loaded, task):
    """The server prepares items with the engine's own preparation, so the context check applies too:
    the tiny model takes 512 positions, and the item below fits max_item_tokens but not the context."""
    long_text = "my card was charged twice " * 120
    with serving(loaded, [task], max_item_tokens=4096) as server:
        items = ["refund", {"id": "too-long", "text": long_text}]
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": items})
        assert status == 422, body
        assert body["item"] == 1 and "item 1" in body["detail"] and "too-long" in body["detail"], body
        assert "context" in body["detail"], body
        assert call(server, "POST", "/v1/classify", {"task": TASK, "items": ["refund"]})[0] == 200  # the server lives on


def test_bad_items_422_name_the_item(loaded, task):
    with serving(loaded, [task]) as server:
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["ok", {"id": "q", "body": "no text"}]})
        assert status == 422 and body["item"] == 1 and "'text'" in body["detail"], body
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["ok", {"text": "x", "extra": {"nested": 1}}]})
        assert status == 422 and body["detail"][0]["loc"][:3] == ["body", "items", 1], body
        status, _, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["ok"], "colour": "blue"})
        assert status == 422 and body["detail"][0]["loc"] == ["body", "colour"], body
        assert call(server, "POST", "/v1/classify", {"task": TASK, "items": []})[0] == 422


def test_full_queue_429_with_retry_after(loaded, task):
    """A request that does not fit in the bounded queue is refused whole, with Retry-After."""
    with serving(loaded, [task], max_queue=4, max_items=4, max_batch=64) as server:
        first: list = []
        with model_thread_held(server):
            waiting = queued_while_held(server, {"task": TASK, "items": ["a", "b", "c"]}, first)
            status, headers, body = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["d", "e"]})
        waiting.join()
        samples = metric_samples(server)
    assert status == 429, body
    assert int(headers["retry-after"]) >= 1 and "retry later" in body["detail"]
    assert first[0][0] == 200, "the queued request must still be answered"
    assert metric(samples, "prefixcache_queue_rejections_total") == 1


# --- tasks -----------------------------------------------------------------------------------------


def test_register_replace_and_delete_a_task(loaded, task, task_yaml_for):
    with serving(loaded, [task]) as server:
        yaml_headers = {"Content-Type": "application/yaml"}
        status, _, info = call(server, "PUT", "/v1/tasks/tiny-two", raw=task_yaml_for("tiny-two").encode(), headers=yaml_headers)
        assert status == 201, info
        assert info["name"] == "tiny-two" and info["labels"] == ["billing", "technical", "account"] and info["prefix_tokens"] > 0
        names = [t["name"] for t in call(server, "GET", "/v1/tasks")[2]["tasks"]]
        assert names == ["tiny-tickets", "tiny-two"]
        status, _, body = call(server, "POST", "/v1/classify", {"task": "tiny-two", "items": ["refund"]})
        assert status == 200 and body["results"][0]["label"] in info["labels"]

        replacement = (
            "name: tiny-two\ninstruction: Is the ticket about money or about bugs?\n"
            "labels:\n  billing: money\n  technical: bugs\ninput_template: 'Ticket: {text}'\n"
        )
        status, _, info = call(server, "PUT", "/v1/tasks/tiny-two", raw=replacement.encode(), headers=yaml_headers)
        assert status == 200 and info["labels"] == ["billing", "technical"], info
        body = call(server, "POST", "/v1/classify", {"task": "tiny-two", "items": ["refund"]})[2]
        assert set(body["results"][0]["scores"]) == {"billing", "technical"}

        replaced = metric_samples(server)
        assert call(server, "DELETE", "/v1/tasks/tiny-two")[0] == 204
        assert call(server, "POST", "/v1/classify", {"task": "tiny-two", "items": ["refund"]})[0] == 404
        assert call(server, "DELETE", "/v1/tasks/tiny-two")[0] == 404

        as_json = json.dumps({"name": "tiny-json", "instruction": "Classify.", "labels": {"a": "first", "b": "second"}})
        status, _, info = call(server, "PUT", "/v1/tasks/tiny-json", raw=as_json.encode(), headers={"Content-Type": "application/json"})
        assert status == 201, info
        samples = metric_samples(server)
    assert metric(replaced, "prefixcache_prefix_builds_total", task="tiny-two") == 2
    assert metric(replaced, "prefixcache_prefix_evictions_total", task="tiny-two") == 1  # replaced once
    left = [name for name, labels in samples if ("task", "tiny-two") in labels]
    assert not left, f"a deleted task's series remain: {left}"  # counters included (issue 19, item 5)


def test_bad_task_uploads_are_422_with_the_field(loaded, task, task_yaml_for):
    with serving(loaded, [task], max_prefix_tokens=100) as server:
        def put(name, text, kind="application/yaml"):
            return call(server, "PUT", f"/v1/tasks/{name}", raw=text.encode(), headers={"Content-Type": kind})

        status, _, body = put("other", task_yaml_for("tiny-x"))
        assert status == 422 and "'tiny-x'" in body["detail"] and "'other'" in body["detail"]
        status, _, body = put("tiny-x", task_yaml_for("tiny-x") + "colour: blue\n")
        assert status == 422 and "upload:tiny-x:15" in body["detail"] and "colour" in body["detail"], body
        status, _, body = put("tiny-x", task_yaml_for("tiny-x"))
        assert status == 422 and "max_prefix_tokens=100" in body["detail"], body
        status, _, body = put("tiny-x", task_yaml_for("tiny-x"), kind="application/octet-stream")
        assert status == 422 and "YAML or JSON" in body["detail"]
        assert call(server, "PUT", "/v1/tasks/..%2Fetc", raw=b"name: x", headers={"Content-Type": "application/yaml"})[0] in (404, 422)


def test_a_task_upload_cannot_make_the_server_read_files(loaded, task, task_yaml_for, monkeypatch):
    opened: list[str] = []
    real_open, real_io_open, real_os_open = builtins.open, io.open, os.open

    def spy(real):
        def wrapper(file, *args, **kwargs):
            opened.append(str(file))
            return real(file, *args, **kwargs)

        return wrapper

    with serving(loaded, [task]) as server:
        monkeypatch.setattr(builtins, "open", spy(real_open))
        monkeypatch.setattr(io, "open", spy(real_io_open))
        monkeypatch.setattr(os, "open", spy(real_os_open))
        def put(text):
            return call(server, "PUT", "/v1/tasks/tiny-x", raw=text.encode(), headers={"Content-Type": "application/yaml"})

        attempts = [
            "/etc/passwd",
            task_yaml_for("tiny-x") + "examples_file: /etc/passwd\n",
            task_yaml_for("tiny-x") + "include: !!python/object/apply:builtins.open ['/etc/passwd']\n",
            "!!python/object/apply:builtins.open ['/etc/passwd']\n",
            task_yaml_for("tiny-x").replace('input_template: "Ticket: {text}"', 'input_template: "{text.__class__}"'),
        ]
        answers = [put(text) for text in attempts]
        accepted = put(task_yaml_for("tiny-x").replace("Classify the customer", "Read /etc/passwd and classify the customer"))
        monkeypatch.undo()
    for text, (status, _, body) in zip(attempts, answers):
        assert status == 422, f"{text!r} was accepted: {body}"
    assert accepted[0] == 201, "a path inside the instruction is just text"
    assert not [path for path in opened if "passwd" in path], f"the server opened {opened}"


def test_extract_refuses_classification_tasks(loaded, task):
    with serving(loaded, [task]) as server:
        status, _, body = call(server, "POST", "/v1/extract", {"task": TASK, "items": ["x"]})
        assert status == 422 and "not an extraction task" in body["detail"] and "/v1/classify" in body["detail"]
        assert call(server, "POST", "/v1/extract", {"task": "nope", "items": ["x"]})[0] == 404


# --- metrics, docs, health -------------------------------------------------------------------------


def test_metrics_are_exposed(loaded, task):
    with serving(loaded, [task]) as server:
        call(server, "POST", "/v1/classify", {"task": TASK, "items": ["refund", "crash"]})
        call(server, "POST", "/v1/classify", {"task": "missing", "items": ["refund"]})
        samples = metric_samples(server)
        runner = server.app.state.service.runner(TASK, "classify")
    assert metric(samples, "prefixcache_http_requests_total", method="POST", route="/v1/classify", code="200") == 1
    assert metric(samples, "prefixcache_http_requests_total", method="POST", route="/v1/classify", code="404") == 1
    assert metric(samples, "prefixcache_http_request_seconds_count", method="POST", route="/v1/classify") == 2
    assert metric(samples, "prefixcache_items_total", task=TASK, kind="classify") == 2
    assert metric(samples, "prefixcache_batch_size_count", task=TASK) == 1
    assert metric(samples, "prefixcache_batch_seconds_count", task=TASK) == 1
    assert metric(samples, "prefixcache_queue_wait_seconds_count") == 2
    assert ("prefixcache_queue_depth", ()) in samples and ("prefixcache_in_progress", ()) in samples
    assert metric(samples, "prefixcache_prefix_bytes", task=TASK) == runner.prefix_bytes > 0
    assert metric(samples, "prefixcache_prefix_tokens", task=TASK) == runner.prefix_tokens
    assert metric(samples, "prefixcache_prefix_builds_total", task=TASK) == 1
    assert metric(samples, "prefixcache_prefix_hits_total", task=TASK) == 2
    assert ("prefixcache_prefix_misses_total", (("task", TASK),)) in samples
    assert ("prefixcache_prefix_evictions_total", (("task", TASK),)) in samples
    assert metric(samples, "prefixcache_tasks") == 1


def test_health_docs_and_openapi(loaded, task):
    with serving(loaded, [task]) as server:
        assert call(server, "GET", "/healthz")[2] == {"status": "ok", "tasks": 1}
        status, _, page = call(server, "GET", "/docs")
        assert status == 200 and "swagger" in page.lower()
        schema = call(server, "GET", "/openapi.json")[2]
        assert {"/v1/classify", "/v1/extract", "/v1/tasks", "/v1/tasks/{name}", "/healthz", "/metrics"} <= set(schema["paths"])
        assert schema["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
        assert schema["paths"]["/healthz"]["get"]["security"] == []


def test_cli_serve_defaults_match_server_settings():
    """The CLI's --max-* defaults are written out for --help; they must equal ServerSettings'."""
    import typer.main

    from prefixcache.cli.app import app

    command = typer.main.get_command(app).commands["serve"]
    defaults = {p.name: p.default for p in command.params}
    settings = ServerSettings()
    for name in ("host", "port", "max_batch", "max_step_tokens", "max_queue", "max_items", "max_item_tokens",
                 "max_body_bytes", "max_prefix_tokens"):
        assert defaults[name] == getattr(settings, name), f"--{name.replace('_', '-')} default differs from ServerSettings"


def test_cli_serve_never_trusts_remote_code_unless_told(loaded, tmp_path, monkeypatch):
    """`serve` wires the operator's flags through: remote code stays off by default; the key comes from the env."""
    from typer.testing import CliRunner

    import prefixcache.cli.app
    import prefixcache.cli.loading
    import prefixcache.server.launch

    task_file = tmp_path / "task.yaml"
    task_file.write_text(TASK_YAML)
    calls = []
    monkeypatch.setattr(prefixcache.cli.loading, "open_model", lambda spec, dtype, threads, **kw: calls.append(kw) or loaded)
    served = []
    monkeypatch.setattr(prefixcache.server.launch, "run_server", lambda loaded, tasks, settings, level: served.append((tasks, settings)))
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    runner = CliRunner()
    for extra, trusted in (([], False), (["--trust-remote-code"], True)):
        result = runner.invoke(prefixcache.cli.app.app, ["serve", "--task", str(task_file), "--port", "0", "--max-batch", "7", *extra])
        assert result.exit_code == 0, result.output
        assert calls[-1] == {"trust_remote_code": trusted}
    tasks, settings = served[-1]
    assert [t.name for t in tasks] == [TASK] and settings.max_batch == 7 and settings.api_key == "from-env"
    result = runner.invoke(prefixcache.cli.app.app, ["serve", "--task", str(task_file), "--max-items", "5000"])
    assert result.exit_code == 2 and "max_items" in result.output, "a bad setting is a clean usage error"


# --- the web page ----------------------------------------------------------------------------------


def _chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


@pytest.mark.browser
@pytest.mark.skipif(_chromium() is None, reason="no Chromium on this machine (CI installs Debian's chromium and chromium-driver)")
def test_web_page_in_headless_chromium(loaded, task, tmp_path, monkeypatch):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    driver_path = shutil.which("chromedriver")
    assert driver_path, "Chromium is installed but chromedriver is not: apt-get install chromium-driver"
    monkeypatch.setenv("SE_OFFLINE", "true")  # never let Selenium Manager reach for the network
    options = webdriver.ChromeOptions()
    options.binary_location = _chromium()
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={tmp_path / 'profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})

    from tests.support.tasks import EXTRACT_YAML

    from prefixcache.task.definition import parse_task

    extract_task = parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))
    auth = {"Authorization": "Bearer page-key"}
    with serving(loaded, [task, extract_task], api_key="page-key") as server:
        reference = call(server, "POST", "/v1/classify", {"task": TASK, "items": TEXTS[:4]}, headers=auth)[2]
        extracted = call(server, "POST", "/v1/extract", {"task": "tiny-fields", "items": TEXTS[:3]}, headers=auth)[2]
        browser = webdriver.Chrome(options=options, service=Service(driver_path))
        try:
            wait = WebDriverWait(browser, 30)
            browser.get(server.url + "/")
            wait.until(lambda b: "401" in b.find_element(By.ID, "status").text)  # no key yet: the page says why
            key = browser.find_element(By.ID, "api-key")
            key.send_keys("page-key")
            browser.execute_script("arguments[0].dispatchEvent(new Event('change'))", key)
            wait.until(lambda b: Select(b.find_element(By.ID, "task")).options)
            assert Select(browser.find_element(By.ID, "task")).first_selected_option.text == TASK
            browser.find_element(By.ID, "records").send_keys("\n".join(TEXTS[:4]))
            browser.find_element(By.ID, "classify").click()
            wait.until(ec.presence_of_element_located((By.CSS_SELECTOR, "#results tbody tr")))
            rows = browser.find_elements(By.CSS_SELECTOR, "#results tbody tr")
            assert len(rows) == 4
            for row, want in zip(rows, reference["results"]):
                cells = row.find_elements(By.TAG_NAME, "td")
                assert cells[2].text == want["label"]
                shown = {e.get_attribute("data-label"): e.text for e in row.find_elements(By.CSS_SELECTOR, ".prob")}
                assert shown == {label: f"{100 * p:.1f}%" for label, p in want["scores"].items()}
            assert "prefix tokens reused" in browser.find_element(By.ID, "status").text
            wait.until(lambda b: b.find_element(By.ID, "hit-rate").text == "100.0%")
            wait.until(lambda b: float(b.find_element(By.ID, "items-per-second").text or 0) > 0)
            wait.until(lambda b: b.find_element(By.ID, "items-total").text == "11")

            # an extraction task: its own button, columns and result cells, equal to the API's answer
            Select(browser.find_element(By.ID, "task")).select_by_value("tiny-fields")
            assert browser.find_element(By.ID, "classify").text == "Extract"
            assert "extracts: product, sentiment" in browser.find_element(By.ID, "task-labels").text
            records = browser.find_element(By.ID, "records")
            records.clear()
            records.send_keys("\n".join(TEXTS[:3]))
            browser.find_element(By.ID, "classify").click()
            wait.until(lambda b: "generated text" in b.find_element(By.ID, "results").text
                       and len(b.find_elements(By.CSS_SELECTOR, "#results tbody tr")) == 3)
            for row, want in zip(browser.find_elements(By.CSS_SELECTOR, "#results tbody tr"), extracted["results"]):
                cells = row.find_elements(By.TAG_NAME, "td")
                text = [c.get_attribute("textContent") for c in cells]  # exact DOM text (generated text may hold odd spaces)
                assert text[3] == (want["raw"] or "") and text[4] == (want["error"] or "")
                shown = {e.get_attribute("data-field"): e.get_attribute("textContent") for e in row.find_elements(By.CSS_SELECTOR, "dd")}
                expected = {k: "–" if v is None else v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))
                            for k, v in (want["fields"] or {}).items()}
                assert shown == expected
            errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
            assert not errors, f"console errors: {errors}"
        finally:
            browser.quit()


def test_a_slow_task_upload_does_not_hold_up_other_requests(loaded, task):
    """Issue 19, item 1: a task upload is parsed off the event loop (now in a child process, see
    ``uploads.UploadParser``), so /healthz, sent while that upload is in flight, is answered before it (on the
    event loop, it waited for the whole parse). The upload is the server's first, so it also waits for the
    parser's process to start: well over the 0.05 s after which /healthz is sent (a body of about 230 KB, under max_task_bytes)."""
    body = "name: slow\ninstruction: x\nlabels:\n" + "".join(f"  label{i}: [{i}, {i}]\n" for i in range(9_000))
    done: dict[str, float] = {}
    with serving(loaded, [task]) as server:
        def upload():
            status, _, answer = call(server, "PUT", "/v1/tasks/slow", raw=body.encode(), headers={"Content-Type": "application/yaml"})
            done["upload"] = time.perf_counter()
            done["upload_status"] = status

        uploading = threading.Thread(target=upload)
        uploading.start()
        time.sleep(0.05)  # let the upload reach the server
        sent = time.perf_counter()
        assert call(server, "GET", "/healthz")[0] == 200
        done["health"] = time.perf_counter()
        uploading.join()
    assert done["upload_status"] == 422
    assert sent < done["upload"], "the upload finished before /healthz was sent: make the parse slower"
    assert done["health"] < done["upload"], "/healthz waited behind the task upload's parse"
