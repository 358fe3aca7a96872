"""The server's abstentions (issue 38): a task's threshold answers with label null, the best guess and confidence,
and /metrics counts abstentions per task and best-guess label. Tiny in-process model."""

from __future__ import annotations

import pytest

pytest.importorskip("fastapi")

from prefixcache.task.definition import parse_task  # noqa: E402

from tests.support.tasks import TASK_YAML  # noqa: E402
from tests.server.live import call, serving  # noqa: E402


def test_a_task_threshold_abstains_and_metrics_count_it(tiny_llama):
    strict = parse_task(TASK_YAML.replace("tiny-tickets", "strict") + "min_confidence: 1.0\n", "strict.yaml")
    easy = parse_task(TASK_YAML.replace("tiny-tickets", "easy") + "min_confidence: 0.0\n", "easy.yaml")
    items = ["I was charged twice", "the app crashes", "reset my password"]
    with serving(tiny_llama, [strict, easy]) as server:
        status, _, answer = call(server, "POST", "/v1/classify", {"task": "strict", "items": items})
        assert status == 200, answer
        results = answer["results"]
        assert all(r["label"] is None and r["abstained"] and r["best_guess"] and 0 < r["confidence"] < 1 for r in results)
        status, _, kept = call(server, "POST", "/v1/classify", {"task": "easy", "items": items})
        assert status == 200 and all(r["label"] and "abstained" not in r for r in kept["results"])
        assert [r["label"] for r in kept["results"]] == [r["best_guess"] for r in results]
        _, _, metrics = call(server, "GET", "/metrics")
        upload = TASK_YAML.replace("tiny-tickets", "up") + "calibration: x.json\n"
        refused = call(server, "PUT", "/v1/tasks/up", raw=upload.encode(), headers={"Content-Type": "application/yaml"})
        templated = TASK_YAML.replace("tiny-tickets", "up") + 'chat_template: "{{ messages[0].content }}"\n'
        no_template = call(server, "PUT", "/v1/tasks/up", raw=templated.encode(),
                           headers={"Content-Type": "application/yaml"})
    counted = {}
    for line in metrics.splitlines():
        if line.startswith("prefixcache_abstentions_total{"):
            counted[line.split("best_guess=\"")[1].split("\"")[0]] = float(line.split()[-1])
            assert 'task="strict"' in line
    assert sum(counted.values()) == 3 and set(counted) == {r["best_guess"] for r in results}
    assert refused[0] == 422 and "calibration" in refused[2]["detail"]
    assert no_template[0] == 422 and "chat_template" in no_template[2]["detail"]  # the server renders no sent template
