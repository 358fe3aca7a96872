"""The HTTP service with extraction tasks (POST /v1/extract) and its prefix pool (/metrics pool series).

Every test starts a real uvicorn server on a free loopback port with the tiny
in-process model (the helpers come from ``test_server``). A random model's
extractions are gibberish, so these tests check shape, ids, usage and routing,
and that every result equals what the extraction engine returns for the same
record when called directly.
"""

from __future__ import annotations

import json
import time
from importlib import resources

import pytest

from prefixcache.scheduler.extract import Extractor
from prefixcache.cache.kv import KVShape
from prefixcache.cache.pool import PoolConfig, PrefixPool
from prefixcache.scheduler.classify import Classifier, Record, RunConfig
from prefixcache.server import ServerSettings
from prefixcache.task.definition import ExtractTask, load_any_task, parse_task

from tests.support.tasks import EXTRACT_YAML as CONFTEST_EXTRACT_YAML
from tests.support.tasks import TASK_YAML, TEXTS
from tests.server.live import (
    TASK, assert_same_prediction, call, metric, metric_samples, post_while_held, requests_of_sizes, serving,
)

EXTRACT = "tiny-fields"
EXTRACT_YAML = CONFTEST_EXTRACT_YAML.replace("max_new_tokens: 10", "max_new_tokens: 8")
YAML_HEADERS = {"Content-Type": "application/yaml"}


@pytest.fixture(scope="module")
def extract_task() -> ExtractTask:
    return parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))


def engine_results(loaded, task, records) -> list[dict]:
    """What the extraction engine itself returns for ``records``, one record at a time over its own prefix."""
    return [e.to_json() for e in Extractor(loaded, task).extract_all(records, RunConfig("cached", 1))]


def expected_usage(loaded, task, records) -> dict:
    prompt = Extractor(loaded, task).prompt
    encoded = prompt.encode(loaded.tokenizer, [prompt.suffix_text(r.fields, r.id) for r in records])
    reused = sum(len(prompt.prefix_ids) for e in encoded if e.suffix_ids is not None)
    computed = sum(len(e.full_ids if e.suffix_ids is None else e.suffix_ids) for e in encoded)
    return {"prefix_tokens_reused": reused, "suffix_tokens": computed}


# --- /v1/extract -----------------------------------------------------------------------------------


def test_extract_equals_the_engine_and_concurrent_requests_are_merged(loaded, extract_task):
    """Requests of 1 to 6 items at once (some larger than max_batch): every result equals the engine's
    one-record-at-a-time result, and the engine loop's steps held sequences of several requests (finished rows
    refilled from the waiting ones)."""
    max_batch = 4
    records = [Record(f"e{i}", {"text": TEXTS[i % len(TEXTS)] + f" (order {i})"}) for i in range(16)]
    reference = {r["id"]: r for r in engine_results(loaded, extract_task, records)}
    requests = requests_of_sizes(records, (1, 6, 2, 1, 5, 1), max_batch)

    with serving(loaded, [extract_task], max_batch=max_batch) as server:
        answers = post_while_held(server, "/v1/extract", EXTRACT, requests)
        samples = metric_samples(server)

    for n, (status, _, body) in enumerate(answers):
        assert status == 200, f"request {n} ({len(requests[n])} items): {status} {body}"
        assert [r["id"] for r in body["results"]] == [r.id for r in requests[n]], f"request {n}: results missing or out of order"
        for result in body["results"]:
            assert set(result) == {"id", "fields", "raw", "error", "confidence", "flagged"}
            assert result == reference[result["id"]], f"request {n}: {result} != the engine's {reference[result['id']]}"
        assert body["usage"] == expected_usage(loaded, extract_task, requests[n])
    items = sum(len(r) for r in requests)
    steps = metric(samples, "prefixcache_batch_size_count", task=EXTRACT)
    fed = metric(samples, "prefixcache_batch_size_sum", task=EXTRACT)
    assert metric(samples, "prefixcache_items_total", task=EXTRACT, kind="extract") == items
    assert metric(samples, "prefixcache_batch_size_bucket", task=EXTRACT, le=str(float(max_batch))) == steps, (
        f"a step held more than max_batch={max_batch} sequences")
    assert fed / steps > max_batch * 3 / 4, (
        f"{items} waiting items took {steps} steps of {fed / steps:.1f} sequences on average (at most {max_batch}): "
        "finished rows were not refilled from the other requests")


def test_an_extract_request_larger_than_max_batch_is_answered_after_its_last_pass(loaded, extract_task):
    """5 items at max_batch 2: no step holds more than two; the answer holds all five, each equal to the engine's."""
    records = [Record(i, {"text": text}) for i, text in enumerate(TEXTS[:5])]
    with serving(loaded, [extract_task], max_batch=2) as server:
        status, _, body = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": TEXTS[:5]})
        samples = metric_samples(server)
    assert status == 200, f"{status} {body}"
    assert body["results"] == engine_results(loaded, extract_task, records), "a request split over passes lost or changed results"
    steps = metric(samples, "prefixcache_batch_size_count", task=EXTRACT)
    assert steps > 0 and metric(samples, "prefixcache_batch_size_bucket", task=EXTRACT, le="2.0") == steps, (
        "a step held more than max_batch=2 sequences")
    assert metric(samples, "prefixcache_items_total", task=EXTRACT, kind="extract") == 5


def test_extract_string_items_default_ids_and_item_errors(loaded, extract_task):
    items = ["refund me", {"id": "x7", "text": "crash"}, {"text": "hi"}]
    records = [Record(0, {"text": "refund me"}), Record("x7", {"text": "crash"}), Record(2, {"text": "hi"})]
    with serving(loaded, [extract_task]) as server:
        status, _, body = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": items})
        missing = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": ["ok", {"id": "b", "body": "no text"}]})
    with serving(loaded, [extract_task], max_item_tokens=20) as server:  # an item that fits the context, not the cap
        too_long = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": ["ok", "word " * 60]})
    assert status == 200, body
    assert [r["id"] for r in body["results"]] == [0, "x7", 2]
    assert body["results"] == engine_results(loaded, extract_task, records)
    assert body["usage"] == expected_usage(loaded, extract_task, records) and body["usage"]["prefix_tokens_reused"] > 0
    assert missing[0] == 422 and missing[2]["item"] == 1 and "'text'" in missing[2]["detail"], missing
    assert too_long[0] == 422 and too_long[2]["item"] == 1 and "max_item_tokens" in too_long[2]["detail"], too_long


def test_an_item_whose_prompt_and_output_overflow_the_context_is_a_422_naming_it(loaded, extract_task):
    """The tiny model takes 512 positions: an item that fits alone but not with max_new_tokens more is refused."""
    prompt = Extractor(loaded, extract_task).prompt
    room = 512 - len(prompt.prefix_ids)
    words = ["refund crash login"] * 200
    text = next(" ".join(words[:n]) for n in range(1, 200)
                if room - extract_task.max_new_tokens < len(prompt.encode(loaded.tokenizer, [prompt.suffix_text({"text": " ".join(words[:n])})])[0].full_ids) - len(prompt.prefix_ids) <= room)
    with serving(loaded, [extract_task], max_item_tokens=512) as server:
        status, _, body = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": ["short one", {"id": "long", "text": text}]})
        assert status == 422 and body["item"] == 1, body
        assert "'long'" in body["detail"] and "max_new_tokens" in body["detail"] and "512-token context" in body["detail"]
        status, _, body = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": ["short one"]})
        assert status == 200, body


def test_wrong_endpoint_is_a_clear_422_both_ways(loaded, task, extract_task):
    ticket_fields = load_any_task("ticket-fields")  # what `prefixcache serve --task ticket-fields` loads
    with serving(loaded, [task, extract_task, ticket_fields]) as server:
        to_classify = call(server, "POST", "/v1/classify", {"task": EXTRACT, "items": ["x"]})
        to_extract = call(server, "POST", "/v1/extract", {"task": TASK, "items": ["x"]})
        unknown = call(server, "POST", "/v1/extract", {"task": "nope", "items": ["x"]})
        listed = call(server, "GET", "/v1/tasks")[2]["tasks"]
        bundled = call(server, "POST", "/v1/extract", {"task": "ticket-fields", "items": [{"id": "t1", "text": "Order A-7 is late"}]})
    status, _, body = to_classify
    assert status == 422 and f"'{EXTRACT}'" in body["detail"] and "not a classification task" in body["detail"], body
    assert "/v1/extract" in body["detail"]
    status, _, body = to_extract
    assert status == 422 and f"'{TASK}'" in body["detail"] and "not an extraction task" in body["detail"], body
    assert "/v1/classify" in body["detail"]
    assert unknown[0] == 404 and "'nope'" in unknown[2]["detail"]

    info = {t["name"]: t for t in listed}
    assert [t["name"] for t in listed] == ["ticket-fields", EXTRACT, TASK]
    assert info[TASK]["kind"] == "classify" and info[TASK]["labels"] == ["billing", "technical", "account"]
    assert info[EXTRACT]["kind"] == "extract" and info[EXTRACT]["fields"] == ["product", "sentiment"]
    assert info[EXTRACT]["labels"] == [] and info[EXTRACT]["input_fields"] == ["text"]
    assert info[EXTRACT]["max_new_tokens"] == 8 and info[EXTRACT]["prefix_tokens"] > 0 and info[EXTRACT]["prefix_bytes"] > 0
    assert info["ticket-fields"]["fields"] == ["order_id", "product", "sentiment"]
    status, _, body = bundled  # its 888-token prompt plus max_new_tokens cannot fit the tiny model's 512 positions
    assert status == 422 and body["item"] == 0 and "512-token context" in body["detail"], body


# --- registering extraction tasks ------------------------------------------------------------------


def test_register_replace_and_delete_an_extract_task(loaded, task, extract_task):
    other = extract_task.model_copy(update={"name": "tiny-other"})
    with serving(loaded, [task]) as server:
        status, _, info = call(
            server, "PUT", "/v1/tasks/tiny-other", raw=EXTRACT_YAML.replace(EXTRACT, "tiny-other").encode(), headers=YAML_HEADERS
        )
        assert status == 201, info
        assert info["kind"] == "extract" and info["fields"] == ["product", "sentiment"] and info["prefix_tokens"] > 0
        status, _, body = call(server, "POST", "/v1/extract", {"task": "tiny-other", "items": ["my laptop broke", "thanks"]})
        assert status == 200, body
        assert body["results"] == engine_results(loaded, other, [Record(0, {"text": "my laptop broke"}), Record(1, {"text": "thanks"})])
        assert call(server, "POST", "/v1/classify", {"task": "tiny-other", "items": ["x"]})[0] == 422

        replacement = json.dumps({
            "name": "tiny-other", "kind": "extract", "instruction": "Extract the order id.",
            "fields": {"order_id": "the order number, else null"}, "max_new_tokens": 4,
        })
        status, _, info = call(server, "PUT", "/v1/tasks/tiny-other", raw=replacement.encode(), headers={"Content-Type": "application/json"})
        assert status == 200 and info["fields"] == ["order_id"] and info["max_new_tokens"] == 4, info
        status, _, body = call(server, "POST", "/v1/extract", {"task": "tiny-other", "items": ["order A-1"]})
        assert status == 200 and body["results"] == engine_results(loaded, parse_task(replacement, kinds=("extract",)), [Record(0, {"text": "order A-1"})])

        bad = EXTRACT_YAML.replace(EXTRACT, "tiny-bad").replace("fields: {product: app, sentiment: negative}", "fields: {product: app}")
        status, _, body = call(server, "PUT", "/v1/tasks/tiny-bad", raw=bad.encode(), headers=YAML_HEADERS)
        assert status == 422 and "upload:tiny-bad" in body["detail"] and "sentiment" in body["detail"], body

        assert call(server, "DELETE", "/v1/tasks/tiny-other")[0] == 204
        assert call(server, "POST", "/v1/extract", {"task": "tiny-other", "items": ["x"]})[0] == 404
        assert [t["name"] for t in call(server, "GET", "/v1/tasks")[2]["tasks"]] == [TASK]


# --- the prefix pool -------------------------------------------------------------------------------


def test_settings_default_budget_is_the_pools():
    assert ServerSettings().cache_budget_bytes == PoolConfig().budget_bytes


def test_pool_metrics_evictions_and_budget(loaded, task, extract_task):
    """A budget that holds one prefix at a time (and the extraction's one slot, which counts in the same budget):
    tasks evict each other and are rebuilt on use, exactly."""
    pool = PrefixPool()
    classify_bytes = pool.size_of(loaded, len(Classifier(loaded, task).prompt.prefix_ids))
    extract_bytes = pool.size_of(loaded, len(Extractor(loaded, extract_task).prompt.prefix_ids))
    one_slot = KVShape.of(loaded.model.config).nbytes(64, 4)  # an item's own tokens here fit one 64-token slot
    budget = max(classify_bytes, extract_bytes) + one_slot
    assert min(classify_bytes, extract_bytes) > one_slot, "the budget must not hold both prefixes"
    records = [Record(0, {"text": "refund my money"}), Record(1, {"text": "crash"})]
    reference = Classifier(loaded, task).classify_all(records, RunConfig("cached", 1))

    with serving(loaded, [task, extract_task], cache_budget_bytes=budget) as server:
        start = metric_samples(server)  # built the classify prefix, then evicted it for the extract one
        first = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["refund my money", "crash"]})  # rebuilt
        second = call(server, "POST", "/v1/classify", {"task": TASK, "items": ["refund my money", "crash"]})  # held
        extracted = call(server, "POST", "/v1/extract", {"task": EXTRACT, "items": ["crash"]})  # rebuilt again
        samples = metric_samples(server)
        too_big = call(
            server, "PUT", "/v1/tasks/ticket-fields", headers=YAML_HEADERS,
            raw=(resources.files("prefixcache.tasks") / "ticket-fields.yaml").read_bytes(),
        )

    assert metric(start, "prefixcache_pool_misses_total") == 2 and metric(start, "prefixcache_pool_evictions_total") == 1
    assert metric(start, "prefixcache_pool_bytes") == extract_bytes and metric(start, "prefixcache_pool_entries") == 1
    for status, _, body in (first, second):
        assert status == 200, body
        for result, want in zip(body["results"], reference):
            assert_same_prediction(result, want, "after an eviction")
    # usage is what the pass did: the rebuilt prefix reused only the leading part it shares with the extract
    # task's (the pool's extension, when that part is long enough); the held one, all of it, for both items
    classify_ids, extract_ids = Classifier(loaded, task).prompt.prefix_ids, Extractor(loaded, extract_task).prompt.prefix_ids
    shared = next((i for i, (a, b) in enumerate(zip(classify_ids, extract_ids)) if a != b), min(len(classify_ids), len(extract_ids)))
    shared = shared if shared >= PoolConfig().min_shared_tokens else 0
    assert first[2]["usage"]["prefix_tokens_reused"] == shared + len(classify_ids) < 2 * len(classify_ids), first[2]["usage"]
    assert second[2]["usage"]["prefix_tokens_reused"] == 2 * len(classify_ids), second[2]["usage"]
    assert "_prefix_tokens_reused" not in json.dumps(first[2])
    assert extracted[0] == 200 and extracted[2]["results"] == engine_results(loaded, extract_task, [Record(0, {"text": "crash"})])
    assert metric(samples, "prefixcache_pool_misses_total") == 4
    assert metric(samples, "prefixcache_pool_hits_total") == 1
    assert metric(samples, "prefixcache_pool_evictions_total") == 3
    assert metric(samples, "prefixcache_pool_bytes") == extract_bytes <= budget
    # the extraction's slot store, in the same budget; a store of fewer slots than a step's rows is given back when
    # the model thread goes idle (EngineLoop.trim), so by the time the metrics are read it may be gone
    reserved = metric(samples, "prefixcache_pool_reserved_bytes")
    assert (reserved == 0 or one_slot <= reserved) and extract_bytes + reserved <= budget
    assert metric(samples, "prefixcache_pool_budget_bytes") == budget
    assert metric(samples, "prefixcache_pool_entries") == 1 and metric(samples, "prefixcache_pool_pinned") == 0
    assert metric(samples, "prefixcache_pool_prefill_tokens_saved_total") > 0
    assert metric(samples, "prefixcache_pool_prefill_tokens_computed_total") > 0
    status, _, body = too_big
    assert status == 422 and "'ticket-fields'" in body["detail"] and "budget" in body["detail"], body


def test_deleting_a_pinned_task_unpins_its_prefix(loaded, task):
    pinned = parse_task(TASK_YAML.replace("name: tiny-tickets", "name: tiny-pinned") + "pin: true\n", "pinned.yaml")
    admin = {"Authorization": "Bearer admin-key"}  # a start-up task: only the admin key may delete it
    with serving(loaded, [task, pinned], admin_key="admin-key") as server:  # pinning is the operator's: a start-up task
        held = metric_samples(server, admin)
        assert call(server, "DELETE", "/v1/tasks/tiny-pinned", headers=admin)[0] == 204
        deadline = time.monotonic() + 10
        while metric(samples := metric_samples(server, admin), "prefixcache_pool_pinned") and time.monotonic() < deadline:
            time.sleep(0.05)  # the unpin runs on the model thread, after the DELETE answered
    assert metric(held, "prefixcache_pool_pinned") == 1
    assert metric(held, "prefixcache_pool_entries") == 1, "the same prefix tokens share one pool entry"
    assert metric(samples, "prefixcache_pool_pinned") == 0 and metric(samples, "prefixcache_pool_entries") == 1


def test_an_uploaded_task_cannot_pin_its_prefix(loaded, task):
    """A pinned prefix is never evicted: uploads that pin could fill the pool and starve every other task."""
    pinned = TASK_YAML.replace("name: tiny-tickets", "name: tiny-pinned") + "pin: true\n"
    with serving(loaded, [task]) as server:
        status, _, body = call(server, "PUT", "/v1/tasks/tiny-pinned", raw=pinned.encode(), headers=YAML_HEADERS)
        samples = metric_samples(server)
        listed = [t["name"] for t in call(server, "GET", "/v1/tasks")[2]["tasks"]]
    assert status == 422 and "'tiny-pinned'" in body["detail"] and "field 'pin'" in body["detail"], body
    assert metric(samples, "prefixcache_pool_pinned") == 0 and listed == ["tiny-tickets"]
