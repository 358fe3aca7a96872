"""The micro-batcher's wait rule and its routing of results, on a fake runner (no model, no HTTP).

A pass that is not full waits while items keep arriving (each within ``arrival_gap_ms`` of the last),
up to ``max_wait_ms``: a burst of returning clients is gathered into one pass, and a lone item is
not held for the whole ``max_wait_ms``. The timings are generous (seconds against tens of milliseconds)
so that a slow machine cannot flip the outcome.

Routing: a request larger than ``max_batch`` is split over several passes, and passes mix items of
many requests; every request must still get all of its own results, in its own order, and only once
its last item has been scored.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from prefixcache.server.batcher import MicroBatcher
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ServerSettings

from tests.server.fakes import item


MODEL_THREAD = "the-model-thread"


class CountingRunner:
    """Records the size, the payloads and the thread of every pass; each item's result is its own payload."""

    kind = "classify"

    def __init__(self):
        self.task = SimpleNamespace(name="fake")
        self.passes: list[int] = []
        self.batches: list[list] = []
        self.threads: list[str] = []

    def run(self, batch):
        self.threads.append(threading.current_thread().name)
        self.passes.append(len(batch))
        self.batches.append([item.record for item in batch])
        return [item.record for item in batch]


async def staggered(batcher: MicroBatcher, runner, count: int, spacing_s: float) -> list:
    async def one(n):
        await asyncio.sleep(n * spacing_s)
        with batcher.admit(1):
            return await batcher.submit(runner, [item(n)])

    return await asyncio.gather(*(one(n) for n in range(count)))


def run_batcher(settings: ServerSettings, scenario):
    async def main():
        with ThreadPoolExecutor(1, thread_name_prefix=MODEL_THREAD) as model_thread:
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


async def submit_requests(batcher: MicroBatcher, runner, requests: list[list]) -> list[list]:
    """Submit every request at once; each answer is copied the moment its future resolves,
    so a later pass cannot fill in what a premature answer left out."""

    async def one(payloads):
        with batcher.admit(len(payloads)):
            return list(await batcher.submit(runner, [item(p) for p in payloads]))

    return await asyncio.gather(*(one(payloads) for payloads in requests))


def test_a_request_larger_than_max_batch_is_split_and_answered_whole():
    """5 items at max_batch 2: three passes, and the answer waits for the last one."""
    runner = CountingRunner()
    settings = ServerSettings(max_batch=2, max_wait_ms=5000, arrival_gap_ms=50)
    [answer] = run_batcher(settings, lambda b: submit_requests(b, runner, [list(range(5))]))
    assert answer == [0, 1, 2, 3, 4], f"the request was answered {answer} before all of its passes had run"
    assert runner.passes == [2, 2, 1], f"5 items at max_batch=2 ran as passes {runner.passes}"
    assert all(name.startswith(MODEL_THREAD) for name in runner.threads), (
        f"passes ran on {runner.threads}: only the model thread may touch the model"
    )


def test_a_full_batch_runs_at_once_without_waiting_for_the_gap_or_max_wait():
    runner = CountingRunner()
    settings = ServerSettings(max_batch=4, max_wait_ms=60_000, arrival_gap_ms=60_000)
    started = time.perf_counter()
    [answer] = run_batcher(settings, lambda b: submit_requests(b, runner, [list(range(4))]))
    waited = time.perf_counter() - started
    assert answer == [0, 1, 2, 3] and runner.passes == [4]
    assert waited < 30, f"a full batch was held {waited:.1f} s, as if for the arrival gap (60 s)"


def test_mixed_size_requests_each_get_all_their_results_in_order():
    """Requests of 1 to 9 items (several larger than max_batch) at once: passes mix requests and split the
    large ones, and every request gets exactly its own results, in its own order."""
    max_batch = 4
    sizes = [1, 2, 9, 3, 1, 5, 4, 7, 1, 6, 2]
    assert len(set(sizes)) >= 5 and sum(s > max_batch for s in sizes) >= 3, "the sizes must really vary"
    requests = [[(n, k) for k in range(size)] for n, size in enumerate(sizes)]
    runner = CountingRunner()
    settings = ServerSettings(max_batch=max_batch, max_wait_ms=5000, arrival_gap_ms=200)
    answers = run_batcher(settings, lambda b: submit_requests(b, runner, requests))

    for n, (answer, want) in enumerate(zip(answers, requests)):
        assert answer == want, f"request {n} ({len(want)} items) got {answer}, not its own results {want}"
    assert sorted(p for batch in runner.batches for p in batch) == sorted(p for r in requests for p in r), (
        "every item must run exactly once"
    )
    assert all(size <= max_batch for size in runner.passes), f"a pass exceeded max_batch={max_batch}: {runner.passes}"
    spans = {n: {i for i, batch in enumerate(runner.batches) for (m, _) in batch if m == n} for n in range(len(sizes))}
    assert all(len(spans[n]) > 1 for n, size in enumerate(sizes) if size > max_batch), f"passes per request: {spans}"
    assert any(len({m for m, _ in batch}) > 1 for batch in runner.batches), f"no pass mixed requests: {runner.batches}"
