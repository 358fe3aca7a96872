"""Prefix builds and the model thread (issue 19, item 3): an upload whose prefix is too long is refused
before the model thread does anything for it, and builds take turns, so a pass of another task runs
between two uploads' builds instead of waiting behind both. On the tiny model, with the build slowed
down by a wrapper (seconds against a batcher wait of milliseconds, so a slow machine cannot flip it).
"""

from __future__ import annotations

import asyncio
import time

import pytest

from prefixcache.errors import TaskUploadError
from prefixcache.server import service as service_module
from prefixcache.server.prometheus import Metrics
from prefixcache.server.service import Service
from prefixcache.server.settings import ServerSettings
from prefixcache.task.definition import parse_task
from prefixcache.types import Record

from tests.support.tasks import TASK_YAML

BUILD_S = 1.0


def named(name: str, instruction: str | None = None):
    """The tiny task under another name (and another instruction, when given)."""
    text = TASK_YAML.replace("name: tiny-tickets", f"name: {name}")
    if instruction is not None:
        text = text.replace("instruction: Classify the customer support ticket.", f"instruction: {instruction}")
    return parse_task(text, f"{name}.yaml")


def record_builds(monkeypatch, events: list):
    real = service_module.build_runner

    def slow_build(loaded, task, *args):
        events.append(f"build {task.name}")
        time.sleep(BUILD_S)
        return real(loaded, task, *args)

    monkeypatch.setattr(service_module, "build_runner", slow_build)


def with_service(loaded, scenario, **settings):
    async def main():
        service = Service(loaded, ServerSettings(api_key=None, **settings), Metrics())
        await service.start([named("served")])
        try:
            return await scenario(service)
        finally:
            await service.stop()

    return asyncio.run(main())


def test_an_oversized_upload_is_refused_before_the_model_thread_builds_anything(loaded, monkeypatch):
    events: list[str] = []

    async def scenario(service):
        record_builds(monkeypatch, events)
        with pytest.raises(TaskUploadError, match="max_prefix_tokens=40"):
            await service.register(named("huge", "Sort the ticket. " * 200))
        return [t.task.name for t in service.tasks()]

    assert with_service(loaded, scenario, max_prefix_tokens=40) == ["served"]
    assert events == [], "the oversized task reached the model thread"


def test_a_pass_of_another_task_runs_between_two_uploads_builds(loaded, monkeypatch):
    events: list[str] = []

    async def scenario(service):
        served = service.runner("served", "classify")
        real_sequences = served.sequences
        served.sequences = lambda items: (events.append("classify pass"), real_sequences(items))[1]
        record_builds(monkeypatch, events)
        uploads = [asyncio.ensure_future(service.register(named(name))) for name in ("first", "second")]
        await asyncio.sleep(BUILD_S / 4)  # the first build is running; the second waits
        results, _ = await service.run("classify", "served", [Record("r", {"text": "refund my card"})])
        await asyncio.gather(*uploads)
        return results

    results = with_service(loaded, scenario)
    assert len(results) == 1
    builds = [i for i, event in enumerate(events) if event.startswith("build ")]
    assert len(builds) == 2 and sorted(events[i] for i in builds) == ["build first", "build second"]
    assert builds[0] < events.index("classify pass") < builds[1], f"the pass did not run between the builds: {events}"


def test_uploads_are_parsed_in_a_child_process_not_the_servers(loaded, monkeypatch):
    """Parsing holds the GIL: 20 parses at once on the server's threads starved its event loop (``/healthz`` p99
    926 ms in ``studies/hostile_uploads.py``), so uploads are parsed in a child process, one at a time. Here the
    server process's own parser is broken: uploads still work, and a bad one still gets its exact 422."""
    from concurrent.futures import ThreadPoolExecutor

    from fastapi.testclient import TestClient

    from prefixcache.server import create_app
    from prefixcache.server import uploads as uploads_module

    def not_here(*args, **kwargs):
        raise AssertionError("a task upload was parsed in the server's own process")

    monkeypatch.setattr(uploads_module, "parse_task", not_here)
    with TestClient(create_app(loaded, [named("served")], ServerSettings(api_key=None))) as c:
        def upload(n: int) -> int:
            body = TASK_YAML.replace("name: tiny-tickets", f"name: up{n}")
            return c.put(f"/v1/tasks/up{n}", content=body, headers={"Content-Type": "application/yaml"}).status_code

        with ThreadPoolExecutor(4) as pool:
            statuses = list(pool.map(upload, range(4)))
        bad = c.put("/v1/tasks/bad", content="name: bad\nlabels: [unclosed\n", headers={"Content-Type": "application/yaml"})
    assert statuses == [201] * 4
    assert bad.status_code == 422 and "upload:bad" in bad.json()["detail"] and "invalid YAML" in bad.json()["detail"]
