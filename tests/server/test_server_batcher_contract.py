"""The micro-batcher's contract beyond the wait rule (tests/server/test_server_batcher.py): admission and its
bound, Retry-After, queue depth, which queue goes first, and how failures and shutdown reach requests.

A fake runner on a real model thread (no model, no HTTP). Passes are ordered by gating the model
thread with events, never by sleeping, so no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from prefixcache.server.batcher import MicroBatcher
from prefixcache.errors import QueueFullError, ShuttingDownError
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ServerSettings

from tests.server.fakes import FailingRunner, GatedRunner, item, run_with, until


# --- admission ------------------------------------------------------------------------------------


def test_admit_holds_room_exactly_up_to_max_queue_and_gives_it_back():
    metrics = Metrics()
    batcher = MicroBatcher(None, ServerSettings(max_queue=5, max_items=5), metrics)
    with batcher.admit(3):
        assert batcher.in_progress == 3
        with batcher.admit(2):  # 5 of 5: fits exactly
            assert batcher.in_progress == 5
            with pytest.raises(QueueFullError) as refused:
                with batcher.admit(1):
                    pass
            assert "5 items are in progress" in str(refused.value) and "at most 5" in str(refused.value)
            assert batcher.in_progress == 5, "a refused request reserved nothing"
        assert batcher.in_progress == 3
    assert batcher.in_progress == 0
    assert metrics.queue_rejections._value.get() == 1
    assert metrics.in_progress._value.get() == 0
    with batcher.admit(5):
        assert metrics.in_progress._value.get() == 5


def test_admit_gives_the_room_back_when_the_request_fails():
    batcher = MicroBatcher(None, ServerSettings(max_queue=4, max_items=4), Metrics())
    with pytest.raises(ValueError):
        with batcher.admit(4):
            raise ValueError("tokenizing failed")
    assert batcher.in_progress == 0
    with batcher.admit(4):
        pass


class RateMetrics(Metrics):
    def __init__(self, rate: float):
        super().__init__()
        self.rate = rate

    def items_per_second(self) -> float:
        return self.rate


@pytest.mark.parametrize(
    "rate, held, incoming, want",
    [
        (0.0, 10, 5, 1),  # no rate yet: 1 s
        (2.0, 10, 5, 3),  # 3 items over at 2/s: ceil(1.5) + 1
        (4.0, 10, 5, 2),  # ceil(0.75) + 1
        (100.0, 11, 2, 2),  # 1 item over at 100/s: ceil(0.01) + 1
        (0.01, 10, 5, 60),  # 301 s, capped at 60
    ],
)
def test_retry_after_comes_from_the_recent_rate(rate, held, incoming, want):
    batcher = MicroBatcher(None, ServerSettings(max_queue=12, max_items=12), RateMetrics(rate))
    with batcher.admit(held):
        with pytest.raises(QueueFullError) as refused:
            with batcher.admit(incoming):
                pass
    assert refused.value.retry_after == want


# --- submit, depth, order ---------------------------------------------------------------------------


def test_submit_of_nothing_answers_nothing_and_submit_before_start_is_refused():
    async def scenario():
        batcher = MicroBatcher(None, ServerSettings(), Metrics())
        assert await batcher.submit(object(), []) == []
        assert not batcher.running
        with pytest.raises(ShuttingDownError, match="^the server is not running$"):
            await batcher.submit(object(), [item(1)])

    asyncio.run(scenario())


def test_depth_counts_queued_items_and_the_oldest_queue_goes_first():
    """While one pass holds the model thread, "first" queues, then "second". The next pass must be
    first's (its head has waited longest), then second's; depth counts exactly what waits."""
    log: list = []
    gate, started = threading.Event(), threading.Event()
    blocker = GatedRunner("blocker", log, gate, started)
    first = GatedRunner("first", log, gate)
    second = GatedRunner("second", log, gate)
    metrics = Metrics()
    settings = ServerSettings(max_batch=8, max_wait_ms=1, arrival_gap_ms=1)

    async def scenario(batcher):
        assert batcher.running
        hold = asyncio.ensure_future(batcher.submit(blocker, [item("x")]))
        await until(started.is_set, "the blocking pass started")
        assert batcher.depth == 0
        a = asyncio.ensure_future(batcher.submit(first, [item("a1"), item("a2")]))
        await until(lambda: batcher.depth == 2, "first's items queued")
        b = asyncio.ensure_future(batcher.submit(second, [item("b1"), item("b2"), item("b3")]))
        await until(lambda: batcher.depth == 5, "second's items queued")
        assert metrics.queue_depth._value.get() == 5
        gate.set()
        results = await asyncio.gather(hold, a, b)
        assert batcher.depth == 0 and metrics.queue_depth._value.get() == 0
        return results

    results = run_with(settings, scenario, metrics)
    assert results == [["x"], ["a1", "a2"], ["b1", "b2", "b3"]]
    assert [name for name, _ in log] == ["blocker", "first", "second"], f"pass order {log}"


def test_pass_metrics_count_items_and_prefix_hits():
    metrics = Metrics()
    runner = FailingRunner()
    runner.run = lambda batch: [i.record for i in batch]
    settings = ServerSettings(max_batch=8, max_wait_ms=5000, arrival_gap_ms=50)

    async def scenario(batcher):
        with batcher.admit(3):
            return await batcher.submit(runner, [item(1), item(2, full=True), item(3)])

    began = time.monotonic()
    assert run_with(settings, scenario, metrics) == [1, 2, 3]
    elapsed = time.monotonic() - began
    assert metrics.items.labels("failing", "classify")._value.get() == 3
    assert metrics.prefix_hits.labels("failing")._value.get() == 2
    assert metrics.prefix_misses.labels("failing")._value.get() == 1
    sample = metrics.registry.get_sample_value
    # durations are bounded by the run's own wall time (a logical bound, not a speed claim)
    assert sample("prefixcache_batch_seconds_count", {"task": "failing"}) == 1
    assert 0 <= sample("prefixcache_batch_seconds_sum", {"task": "failing"}) <= elapsed
    assert sample("prefixcache_queue_wait_seconds_count") == 3
    assert 0 <= sample("prefixcache_queue_wait_seconds_sum") <= 3 * elapsed


# --- failures and shutdown --------------------------------------------------------------------------


def test_a_runner_exception_reaches_every_request_in_the_pass_and_the_loop_goes_on(caplog):
    boom = RuntimeError("forward pass failed")
    failing = FailingRunner(exc=boom)
    settings = ServerSettings(max_batch=8, max_wait_ms=5000, arrival_gap_ms=100)

    async def scenario(batcher):
        async def one(payloads):
            return await batcher.submit(failing, [item(p) for p in payloads])

        outcomes = await asyncio.gather(one([1, 2]), one([3]), return_exceptions=True)
        assert batcher.running, "the loop must survive a failed pass"
        failing.exc, failing.result = None, ["ok"]
        again = await batcher.submit(failing, [item(4)])
        return outcomes, again

    with caplog.at_level(logging.ERROR, logger="prefixcache.server.batcher"):
        outcomes, again = run_with(settings, scenario)
    assert outcomes == [boom, boom]
    assert again == ["ok"]
    logged = [(r.getMessage(), r.exc_info[1]) for r in caplog.records if r.levelno == logging.ERROR]
    assert logged == [("forward pass of 3 items for task 'failing' failed", boom)], "the log names the pass, its error"


def test_a_runner_returning_the_wrong_number_of_results_fails_the_requests():
    settings = ServerSettings(max_batch=8, max_wait_ms=5000, arrival_gap_ms=50)

    async def scenario(batcher):
        with pytest.raises(RuntimeError, match="returned 1 results for 2 items"):
            await batcher.submit(FailingRunner(result=["only one"]), [item(1), item(2)])

    run_with(settings, scenario)


def test_stop_fails_every_queued_request_with_shutting_down():
    log: list = []
    gate, started = threading.Event(), threading.Event()
    blocker = GatedRunner("blocker", log, gate, started)
    waiting = GatedRunner("waiting", log, gate)

    async def scenario():
        with ThreadPoolExecutor(1) as model_thread:
            batcher = MicroBatcher(model_thread, ServerSettings(max_batch=4), Metrics())
            batcher.start()
            hold = asyncio.ensure_future(batcher.submit(blocker, [item("x")]))
            await until(started.is_set, "the blocking pass started")
            queued = asyncio.ensure_future(batcher.submit(waiting, [item("y"), item("z")]))
            await until(lambda: batcher.depth == 2, "items queued")
            loop_task = batcher._loop_task
            await batcher.stop()
            assert loop_task.done(), "stop() returned before the batcher's loop had ended"
            gate.set()
            outcomes = await asyncio.gather(hold, queued, return_exceptions=True)
            assert not batcher.running and batcher.depth == 0
            with pytest.raises(ShuttingDownError):
                await batcher.submit(waiting, [item("late")])
            return outcomes

    hold, queued = asyncio.run(scenario())
    assert isinstance(hold, ShuttingDownError), f"the request in the running pass got {hold!r}"
    assert isinstance(queued, ShuttingDownError), f"the queued request got {queued!r}"
    assert str(queued) == str(hold) == "the server is shutting down; retry elsewhere"
    assert ("waiting", ["y", "z"]) not in log, "a stopped batcher must not run queued items"


@pytest.mark.parametrize("ending", ["crashed", "cancelled", "returned"])
def test_the_loop_ending_by_a_crash_is_logged_critical_with_its_exception_and_only_then(caplog, ending):
    """A batcher loop that dies (not stopped) leaves every later request waiting and /healthz at 503: the
    log must say so once, at CRITICAL, with the exception's traceback. stop() (a cancel) and a clean return
    log nothing."""
    from prefixcache.server.batcher import _report_crash

    async def body():
        if ending == "crashed":
            raise KeyError("lost slot")
        if ending == "cancelled":
            await asyncio.sleep(10)

    async def scenario():
        task = asyncio.get_running_loop().create_task(body())
        task.add_done_callback(_report_crash)
        await asyncio.sleep(0)
        if ending == "cancelled":
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await asyncio.sleep(0)  # done callbacks run on the next turn of the loop

    with caplog.at_level(logging.DEBUG, logger="prefixcache.server.batcher"):
        asyncio.run(scenario())
    records = [r for r in caplog.records if r.name == "prefixcache.server.batcher"]
    if ending != "crashed":
        assert records == []
        return
    (record,) = records
    assert (record.levelno, record.getMessage()) == (logging.CRITICAL, "the micro-batcher stopped")
    assert record.exc_info[0] is KeyError and str(record.exc_info[1]) == "'lost slot'"


def test_a_client_over_its_share_is_told_to_retry_after_its_excess_is_likely_answered():
    """Retry-After for a client's refusal counts only that client's excess over its share, at the recent rate."""
    settings = ServerSettings(max_batch=8, max_items=4, max_queue=100, max_queue_per_client=4)
    metrics = Metrics()
    metrics.items_per_second = lambda: 0.5  # the recent rate, pinned
    with ThreadPoolExecutor(1) as model_thread:
        batcher = MicroBatcher(model_thread, settings, metrics)
    batcher._reserve(3, "alice")
    with pytest.raises(QueueFullError, match="this client has 3 items in progress") as refused:
        batcher._reserve(3, "alice")  # 2 over the share of 4: answered in ~4 s at half an item a second
    assert refused.value.retry_after == 5


def test_a_clients_items_in_progress_add_up_over_its_requests_and_are_all_given_back():
    batcher = MicroBatcher(None, ServerSettings(max_items=2, max_queue=100, max_queue_per_client=4), Metrics())
    with batcher.admit(2, "alice"), batcher.admit(2, "alice"):
        with pytest.raises(QueueFullError, match="this client has 4 items in progress"):
            with batcher.admit(1, "alice"):
                pass
        with batcher.admit(4, "bob"):  # another client's share is its own
            assert batcher.in_progress == 8
    assert batcher.in_progress == 0
    with batcher.admit(4, "alice"):  # every item of alice's given back
        pass


def test_a_started_batchers_loop_that_dies_is_reported_critical_and_its_task_is_named(caplog):
    """``start()`` wires the crash report (the crash test above wires it by hand) and names the loop's
    task, so that it can be told apart in a dump of the event loop's tasks."""

    async def dies():
        raise KeyError("lost slot")

    async def scenario():
        with ThreadPoolExecutor(1) as model_thread:
            batcher = MicroBatcher(model_thread, ServerSettings(), Metrics())
            batcher._run_forever = dies
            batcher.start()
            names = {task.get_name() for task in asyncio.all_tasks()}
            await until(lambda: any(r.levelno == logging.CRITICAL for r in caplog.records), "the crash was logged")
            running = batcher.running
            await batcher.stop()
            return names, running

    with caplog.at_level(logging.DEBUG, logger="prefixcache.server.batcher"):
        names, running = asyncio.run(scenario())
    assert "prefixcache-batcher" in names
    assert not running
    (record,) = [r for r in caplog.records if r.name == "prefixcache.server.batcher"]
    assert record.getMessage() == "the micro-batcher stopped" and record.exc_info[0] is KeyError
