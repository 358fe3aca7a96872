"""The server's engine loop keeps its slot store in the prefix pool's budget, and /metrics reports it
(``prefixcache_pool_reserved_bytes`` beside ``prefixcache_pool_bytes``, both within ``..._budget_bytes``)."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from prefixcache.task.definition import parse_task

from tests.server.inprocess import client
from tests.support.tasks import EXTRACT_YAML


def gauges(c) -> dict[str, float]:
    text = c.get("/metrics").text
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("prefixcache_pool_")}


def test_the_pool_gauges_count_the_slot_store_in_the_budget(loaded):
    task = parse_task(EXTRACT_YAML, "tiny-fields.yaml", kinds=("extract",))
    with client(loaded, [task]) as c:
        assert gauges(c)["prefixcache_pool_reserved_bytes"] == 0, "no slot store before a generating request"
        answer = c.post("/v1/extract", json={"task": task.name, "items": ["crash", "refund my money"]})
        assert answer.status_code == 200, answer.text
        after = gauges(c)
        service = c.app.state.service
        store, stats = service.engine.engine.store, service.pool.stats()
    assert store is not None and after["prefixcache_pool_reserved_bytes"] == store.nbytes == stats.reserved_bytes > 0
    assert after["prefixcache_pool_bytes"] == stats.bytes_held > 0
    assert after["prefixcache_pool_bytes"] + after["prefixcache_pool_reserved_bytes"] <= after["prefixcache_pool_budget_bytes"]
