"""The engine thread's contract (server/engine_thread.py): admission and its bound, Retry-After, queue depth,
which request goes first, step metrics, and how failures, a crash and shutdown reach requests.

A fake runner on a real model thread and engine loop (no model, no HTTP). Steps are ordered by gating the
model thread with events, never by sleeping, so no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from prefixcache.errors import QueueFullError, SequenceFailedError, ShuttingDownError
from prefixcache.server.engine_thread import Answers
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ServerSettings

from tests.server.fakes import FakeRunner, engine_thread, item, run_with, until


# --- admission ------------------------------------------------------------------------------------


def test_admit_holds_room_exactly_up_to_max_queue_and_gives_it_back():
    metrics = Metrics()
    batcher = engine_thread(ServerSettings(max_queue=5, max_items=5), metrics)
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
    batcher = engine_thread(ServerSettings(max_queue=4, max_items=4), Metrics())
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
    batcher = engine_thread(ServerSettings(max_queue=12, max_items=12), RateMetrics(rate))
    with batcher.admit(held):
        with pytest.raises(QueueFullError) as refused:
            with batcher.admit(incoming):
                pass
    assert refused.value.retry_after == want


# --- submit, depth, order ---------------------------------------------------------------------------


def test_submit_of_nothing_answers_nothing_and_submit_before_start_is_refused():
    async def scenario():
        thread = engine_thread(ServerSettings())
        assert await thread.submit(object(), []) == Answers([], 0)
        assert not thread.running
        with pytest.raises(ShuttingDownError, match="^the server is not running$"):
            await thread.submit(object(), [item(1)])

    asyncio.run(scenario())


def test_depth_counts_queued_items_and_the_oldest_request_goes_first():
    """While one step holds the model thread, "first" queues, then "second". The next step must feed first's
    items before second's (the loop takes waiting sequences in turn, first come first); depth counts exactly
    what waits."""
    log: list = []
    gate, started = threading.Event(), threading.Event()
    blocker = FakeRunner("blocker", log, gate, started)
    first = FakeRunner("first", log, gate)
    second = FakeRunner("second", log, gate)
    metrics = Metrics()

    async def scenario(thread):
        assert thread.running
        hold = asyncio.ensure_future(thread.submit(blocker, [item("x")]))
        await until(started.is_set, "the blocking step started")
        assert thread.depth == 0
        a = asyncio.ensure_future(thread.submit(first, [item("a1"), item("a2")]))
        await until(lambda: thread.depth == 2, "first's items queued")
        b = asyncio.ensure_future(thread.submit(second, [item("b1"), item("b2"), item("b3")]))
        await until(lambda: thread.depth == 5, "second's items queued")
        assert metrics.queue_depth._value.get() == 5
        gate.set()
        results = await asyncio.gather(hold, a, b)
        assert thread.depth == 0 and metrics.queue_depth._value.get() == 0
        return [answers.results for answers in results]

    results = run_with(ServerSettings(max_batch=8), scenario, metrics)
    assert results == [["x"], ["a1", "a2"], ["b1", "b2", "b3"]]
    assert [name for name, _ in log] == ["blocker", "first", "second"], f"call order {log}"


def test_step_metrics_count_items_and_prefix_hits_and_the_usage_counts_reused_tokens():
    metrics = Metrics()
    runner = FakeRunner("counted")

    async def scenario(thread):
        with thread.admit(3):
            return await thread.submit(runner, [item(1), item(2, full=True), item(3)])

    began = time.monotonic()
    answers = run_with(ServerSettings(max_batch=8), scenario, metrics)
    elapsed = time.monotonic() - began
    assert answers == Answers([1, 2, 3], 2 * runner.prefix.length), "two items followed the 4-token prefix"
    assert metrics.items.labels("counted", "classify")._value.get() == 3
    assert metrics.prefix_hits.labels("counted")._value.get() == 2
    assert metrics.prefix_misses.labels("counted")._value.get() == 1
    sample = metrics.registry.get_sample_value
    # durations are bounded by the run's own wall time (a logical bound, not a speed claim)
    assert sample("prefixcache_batch_seconds_count", {"task": "counted"}) == 1
    assert sample("prefixcache_batch_size_sum", {"task": "counted"}) == 3
    assert 0 <= sample("prefixcache_batch_seconds_sum", {"task": "counted"}) <= elapsed
    assert sample("prefixcache_queue_wait_seconds_count") == 3
    assert 0 <= sample("prefixcache_queue_wait_seconds_sum") <= 3 * elapsed


# --- failures and shutdown --------------------------------------------------------------------------


def test_a_failing_engine_call_fails_only_its_own_requests_and_the_loop_goes_on():
    """A scorer call that raises fails the requests whose sequences it held, each with an error naming the
    cause; another task's request in the same step is answered; later requests run."""
    boom = RuntimeError("forward pass failed")
    failing, fine = FakeRunner("failing", exc=boom), FakeRunner("fine")
    gate, started = threading.Event(), threading.Event()
    blocker = FakeRunner("blocker", gate=gate, started=started)

    async def scenario(thread):
        hold = asyncio.ensure_future(thread.submit(blocker, [item(0)]))
        await until(started.is_set, "the blocking step started")
        outcomes = [asyncio.ensure_future(thread.submit(failing, [item(p) for p in payloads])) for payloads in ([1, 2], [3])]
        other = asyncio.ensure_future(thread.submit(fine, [item(9)]))
        await until(lambda: thread.depth == 4, "all queued")
        gate.set()
        outcomes = await asyncio.gather(hold, *outcomes, other, return_exceptions=True)
        assert thread.running, "the loop must survive a failed call"
        failing.exc = None
        again = await thread.submit(failing, [item(4)])
        return outcomes, again

    (hold, first, second, other), again = run_with(ServerSettings(max_batch=8), scenario)
    assert hold.results == [0] and other.results == [9], "the step's other calls are answered"
    for outcome in (first, second):
        assert isinstance(outcome, SequenceFailedError) and "RuntimeError: forward pass failed" in str(outcome), outcome
    assert again.results == [4]


def test_stop_fails_every_queued_request_with_shutting_down():
    log: list = []
    gate, started = threading.Event(), threading.Event()
    blocker = FakeRunner("blocker", log, gate, started)
    waiting = FakeRunner("waiting", log, gate)

    async def scenario():
        thread = engine_thread(ServerSettings(max_batch=4))
        thread.start()
        hold = asyncio.ensure_future(thread.submit(blocker, [item("x")]))
        await until(started.is_set, "the blocking step started")
        queued = asyncio.ensure_future(thread.submit(waiting, [item("y"), item("z")]))
        await until(lambda: thread.depth == 2, "items queued")
        stopping = asyncio.ensure_future(thread.stop())
        await until(lambda: thread._stopping, "stop() asked")
        gate.set()
        await stopping
        outcomes = await asyncio.gather(hold, queued, return_exceptions=True)
        assert not thread.running and thread.depth == 0
        with pytest.raises(ShuttingDownError):
            await thread.submit(waiting, [item("late")])
        return outcomes

    hold, queued = asyncio.run(scenario())
    assert isinstance(queued, ShuttingDownError), f"the queued request got {queued!r}"
    assert str(queued) == "the server is shutting down; retry elsewhere"
    assert isinstance(hold, (Answers, ShuttingDownError)), f"the request of the step in progress got {hold!r}"
    assert ("waiting", ["y", "z"]) not in log, "a stopped thread must not run queued items"


def test_a_model_thread_that_dies_is_logged_critical_and_its_requests_are_told(caplog):
    """A model thread that dies (not stopped) leaves /healthz at 503: the log says so once, at CRITICAL, with the
    exception, and the request waiting on it gets the exception instead of waiting for ever."""

    async def scenario():
        thread = engine_thread(ServerSettings())

        def dies():
            raise KeyError("lost slot")

        thread._step = dies
        thread.start()
        outcome = await asyncio.gather(thread.submit(FakeRunner(), [item(1)]), return_exceptions=True)
        await until(lambda: not thread.running, "the thread ended")
        await thread.stop()
        return outcome[0]

    with caplog.at_level(logging.DEBUG, logger="prefixcache.server.engine_thread"):
        outcome = asyncio.run(scenario())
    assert isinstance(outcome, KeyError), outcome
    (record,) = [r for r in caplog.records if r.name == "prefixcache.server.engine_thread" and r.levelno >= logging.ERROR]
    assert (record.levelno, record.getMessage()) == (logging.CRITICAL, "the model thread stopped")
    assert record.exc_info[0] is KeyError


def test_a_call_runs_on_the_model_thread_between_steps_and_returns_or_raises():
    async def scenario(thread):
        name = await thread.call(lambda: threading.current_thread().name)
        with pytest.raises(ZeroDivisionError):
            await thread.call(lambda: 1 / 0)
        return name

    assert run_with(ServerSettings(), scenario) == "prefixcache-model"


def test_a_call_without_waiting_runs_in_turn_and_only_its_failure_is_logged(caplog):
    """``call_soon``'s calls run on the model thread in the order given; one that raises is logged once at ERROR
    with its exception, and one that returns logs nothing (nobody waits on either)."""
    ran = []

    async def scenario(thread):
        thread.call_soon(lambda: ran.append(threading.current_thread().name) or 1 / 0)
        thread.call_soon(lambda: ran.append("second"))
        await thread.call(lambda: None)  # the inbox is taken in order: both have run when this returns

    with caplog.at_level(logging.DEBUG, logger="prefixcache.server.engine_thread"):
        run_with(ServerSettings(), scenario)
    assert ran == ["prefixcache-model", "second"]
    (record,) = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert (record.name, record.levelno, record.getMessage()) == (
        "prefixcache.server.engine_thread", logging.ERROR, "model-thread call failed")
    assert record.exc_info[0] is ZeroDivisionError


def test_a_cancelled_request_leaves_before_it_runs_and_frees_its_room():
    gate, started = threading.Event(), threading.Event()
    blocker = FakeRunner("blocker", gate=gate, started=started)
    dropped = FakeRunner("dropped", gate=gate)

    async def doomed_request(thread):
        with thread.admit(2, "doomed") as hold:
            return await thread.submit(dropped, [item(1), item(2)], "doomed", hold)

    async def scenario(thread):
        hold = asyncio.ensure_future(thread.submit(blocker, [item(0)]))
        await until(started.is_set, "the blocking step started")
        doomed = asyncio.ensure_future(doomed_request(thread))
        await until(lambda: thread.depth == 2, "queued")
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        kept = thread.in_progress  # its items are still in the inbox: the room is kept until the thread drops them
        gate.set()
        await hold
        await until(lambda: thread.depth == 0, "the cancelled items left")
        await until(lambda: thread.in_progress == 0, "the cancelled request's room given back")
        return kept, await thread.submit(dropped, [item(3)])

    kept, after = run_with(ServerSettings(), scenario)
    assert kept == 2, "a cancelled request's room was given back before the model thread dropped its items"
    assert after.results == [3]
    assert dropped.calls == [[3]], f"a cancelled request's items ran: {dropped.calls}"


def test_a_prefix_built_in_chunks_lets_other_requests_step_in_between():
    """A request whose runner has a prefix to build gets one chunk per turn of the model thread's loop: a request
    submitted with it is scored between the chunks, not after them all; a request cancelled while its prefix is
    being built never runs and gives its room back."""
    log: list = []
    building, cancelled = threading.Event(), threading.Event()

    class Chunked(FakeRunner):
        hold = False  # the first chunk waits (on the model thread) until the request has been cancelled

        def prefix_build(self, chunk_tokens: int):
            def chunks():
                for i in range(3):
                    self.log.append(("chunk", i))
                    if self.hold and i == 0:
                        building.set()
                        cancelled.wait(10)
                    yield
            return chunks()

    long, short, dropped = Chunked("long", log), FakeRunner("short", log), Chunked("dropped", [])
    dropped.hold = True

    async def scenario(thread):
        first = asyncio.ensure_future(thread.submit(long, [item("a")]))
        second = asyncio.ensure_future(thread.submit(short, [item("b")]))
        answers = await first, await second

        async def doomed_request():
            with thread.admit(1, "doomed") as hold:
                return await thread.submit(dropped, [item("c")], "doomed", hold)

        doomed = asyncio.ensure_future(doomed_request())
        await until(building.is_set, "the cancelled request's prefix build started")
        doomed.cancel()
        await asyncio.gather(doomed, return_exceptions=True)
        cancelled.set()
        await until(lambda: thread.in_progress == 0, "the cancelled request's room given back")
        return answers

    (a, b) = run_with(ServerSettings(max_step_tokens=16), scenario)
    assert a.results == ["a"] and b.results == ["b"]
    assert log.index(("short", ["b"])) < log.index(("chunk", 2)), f"the short request waited for the build: {log}"
    assert log[-1] == ("long", ["a"]), "the long request ran before its prefix was built"
    assert dropped.calls == [], "a request cancelled while its prefix was built ran"


def test_a_client_over_its_share_is_told_to_retry_after_its_excess_is_likely_answered():
    """Retry-After for a client's refusal counts only that client's excess over its share, at the recent rate."""
    settings = ServerSettings(max_batch=8, max_items=4, max_queue=100, max_queue_per_client=4)
    metrics = Metrics()
    metrics.items_per_second = lambda: 0.5  # the recent rate, pinned
    batcher = engine_thread(settings, metrics)
    batcher.admission._reserve(3, "alice")
    with pytest.raises(QueueFullError, match="this client has 3 items in progress") as refused:
        batcher.admission._reserve(3, "alice")  # 2 over the share of 4: answered in ~4 s at half an item a second
    assert refused.value.retry_after == 5


def test_a_clients_items_in_progress_add_up_over_its_requests_and_are_all_given_back():
    batcher = engine_thread(ServerSettings(max_items=2, max_queue=100, max_queue_per_client=4), Metrics())
    with batcher.admit(2, "alice"), batcher.admit(2, "alice"):
        with pytest.raises(QueueFullError, match="this client has 4 items in progress"):
            with batcher.admit(1, "alice"):
                pass
        with batcher.admit(4, "bob"):  # another client's share is its own
            assert batcher.in_progress == 8
    assert batcher.in_progress == 0
    with batcher.admit(4, "alice"):  # every item of alice's given back
        pass


