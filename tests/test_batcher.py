"""The micro-batcher's wait rule, on a fake runner (no model, no HTTP).

A pass that is not full waits while items keep arriving (each within ``arrival_gap_ms`` of the last),
up to ``max_wait_ms``: a burst of returning clients is gathered into one pass, and a lone item is
not held for the whole ``max_wait_ms``. The timings are generous (seconds against tens of milliseconds)
so that a slow machine cannot flip the outcome.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from prefixcache.server.batcher import MicroBatcher
from prefixcache.server.metrics import Metrics
from prefixcache.server.settings import ServerSettings


class CountingRunner:
    """Records the size of every pass; each item's result is its own payload."""

    kind = "classify"

    def __init__(self):
        self.task = SimpleNamespace(name="fake")
        self.passes: list[int] = []

    def run(self, batch):
        self.passes.append(len(batch))
        return [item.record for item in batch]


def item(payload):
    return SimpleNamespace(record=payload, full=False)


async def staggered(batcher: MicroBatcher, runner, count: int, spacing_s: float) -> list:
    async def one(n):
        await asyncio.sleep(n * spacing_s)
        with batcher.admit(1):
            return await batcher.submit(runner, [item(n)])

    return await asyncio.gather(*(one(n) for n in range(count)))


def run_batcher(settings: ServerSettings, scenario):
    async def main():
        with ThreadPoolExecutor(1) as model_thread:
            batcher = MicroBatcher(model_thread, settings, Metrics())
            batcher.start()
            try:
                return await scenario(batcher)
            finally:
                await batcher.stop()

    return asyncio.run(main())


def test_a_burst_arriving_within_the_gap_becomes_one_pass_longer_than_the_gap():
    runner = CountingRunner()
    settings = ServerSettings(max_batch=64, max_wait_ms=5000, arrival_gap_ms=400)
    # 12 items 30 ms apart: the burst lasts 330 ms in all, but no two arrivals are 400 ms apart
    results = run_batcher(settings, lambda b: staggered(b, runner, 12, 0.03))
    assert [r[0] for r in results] == list(range(12)), "every item gets its own result"
    assert runner.passes == [12], f"the burst was split: passes {runner.passes}"


def test_a_lone_item_waits_the_gap_not_the_max_wait():
    runner = CountingRunner()
    settings = ServerSettings(max_batch=64, max_wait_ms=20_000, arrival_gap_ms=50)
    started = time.perf_counter()
    results = run_batcher(settings, lambda b: staggered(b, runner, 1, 0.0))
    waited = time.perf_counter() - started
    assert results == [[0]] and runner.passes == [1]
    assert waited < 10, f"a lone item was held {waited:.1f} s, as if for max_wait_ms (20 s)"


def test_items_arriving_further_apart_than_the_gap_run_in_separate_passes():
    runner = CountingRunner()
    settings = ServerSettings(max_batch=64, max_wait_ms=20_000, arrival_gap_ms=20)
    run_batcher(settings, lambda b: staggered(b, runner, 3, 1.0))  # 1 s apart, gap 20 ms
    assert runner.passes == [1, 1, 1], runner.passes
