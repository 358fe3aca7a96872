"""Step scheduling: short passes run between the decoding steps of a long pass (engine/steps.py, the
batcher's ``_interleave``), on a fake decoding runner (no model, no HTTP).

A decoding runner's pass calls ``step_boundary()`` between steps, as ``generate_rows`` does. While it
runs, a classification that arrives must be answered before the decoding pass ends (not after it), the
decoding pass must still get all of its results, and a failing short pass must fail only its own request.
The waits are seconds against steps of tens of milliseconds, so a slow machine cannot flip the outcome.
"""

from __future__ import annotations

import asyncio
import gc
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from prefixcache.engine.steps import between_steps, step_boundary
from prefixcache.server.batcher import MicroBatcher
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ServerSettings

from tests.server.fakes import item, until

STEPS = 40
STEP_S = 0.05
SETTINGS = ServerSettings(max_batch=8, max_wait_ms=5, arrival_gap_ms=1)


class DecodingRunner:
    """A pass of ``STEPS`` steps with a step boundary after each; records which thread ran it."""

    kind = "extract"
    decodes = True

    def __init__(self):
        self.task = SimpleNamespace(name="decoding")
        self.started = threading.Event()
        self.threads: set[int] = set()
        self.started_at = self.ended_at = 0.0

    def run(self, batch):
        self.threads.add(threading.get_ident())
        self.started_at = time.perf_counter()
        self.started.set()
        for _ in range(STEPS):
            time.sleep(STEP_S)
            step_boundary()
        self.ended_at = time.perf_counter()
        return [f"decoded {item.record}" for item in batch]


class ShortRunner:
    """One quick pass; fails on a payload of "boom". Records when and where each pass ran."""

    kind = "classify"

    def __init__(self):
        self.task = SimpleNamespace(name="short")
        self.threads: set[int] = set()
        self.ran_at: list[float] = []

    def run(self, batch):
        self.threads.add(threading.get_ident())
        self.ran_at.append(time.perf_counter())
        if any(item.record == "boom" for item in batch):
            raise RuntimeError("boom")
        step_boundary()  # no hook inside an interleaved pass: this must not recurse
        return [f"scored {item.record}" for item in batch]


class BlockingShort(ShortRunner):
    """A short runner whose pass holds the model thread until ``release`` is set (``entered`` says it began)."""

    def __init__(self):
        super().__init__()
        self.entered, self.release = threading.Event(), threading.Event()

    def run(self, batch):
        self.entered.set()
        self.release.wait(10)
        return super().run(batch)


def scenario(short_payloads):
    decoding, short = DecodingRunner(), ShortRunner()

    async def main():
        with ThreadPoolExecutor(1) as model_thread:
            batcher = MicroBatcher(model_thread, SETTINGS, Metrics())
            batcher.start()
            try:
                async def submit(runner, payload):
                    with batcher.admit(1):
                        return await batcher.submit(runner, [item(payload)])

                long_request = asyncio.ensure_future(submit(decoding, "ticket"))
                await asyncio.get_running_loop().run_in_executor(None, decoding.started.wait, 10)
                shorts = await asyncio.gather(*(submit(short, p) for p in short_payloads), return_exceptions=True)
                answered_at = time.perf_counter()
                return await long_request, shorts, answered_at
            finally:
                await batcher.stop()

    long_result, shorts, answered_at = asyncio.run(main())
    return decoding, short, long_result, shorts, answered_at


async def _with_batcher(body):
    """Run ``body(batcher, submit)`` against a started batcher on its own model thread; stop it after."""
    with ThreadPoolExecutor(1) as model_thread:
        batcher = MicroBatcher(model_thread, SETTINGS, Metrics())
        batcher.start()

        async def submit(runner, payload):
            with batcher.admit(1):
                return await batcher.submit(runner, [item(payload)])

        try:
            return await body(batcher, submit)
        finally:
            await batcher.stop()


async def _until(event: threading.Event) -> None:
    assert await asyncio.get_running_loop().run_in_executor(None, event.wait, 10), "the pass never started"


def test_a_short_request_is_answered_between_decoding_steps_not_after_the_pass():
    decoding, short, long_result, shorts, answered_at = scenario(["a", "b"])
    assert long_result == ["decoded ticket"], "the decoding pass still gets its result"
    assert [r for s in shorts for r in s] == ["scored a", "scored b"]
    assert answered_at < decoding.ended_at, "the short requests waited for the whole decoding pass"
    assert short.threads == decoding.threads, "short passes run on the model thread, the one that touches the model"


def test_a_failing_short_pass_fails_only_its_own_request():
    decoding, _, long_result, shorts, _ = scenario(["boom"])
    assert long_result == ["decoded ticket"]
    assert isinstance(shorts[0], RuntimeError) and str(shorts[0]) == "boom"


def test_the_hook_is_cleared_while_it_runs_and_gone_after_the_block():
    calls = []

    def hook():
        calls.append("outer")
        step_boundary()  # a pass run by the hook cannot yield again

    with between_steps(hook):
        step_boundary()
        step_boundary()
    step_boundary()
    assert calls == ["outer", "outer"]


@pytest.mark.parametrize("decodes", [False, True])
def test_generation_gives_the_same_tokens_whatever_runs_between_its_steps(tiny_llama, decodes):
    from prefixcache.engine.generate import GenerationConfig, generate_rows
    from prefixcache.cache.kv import PrefixKV
    from prefixcache.scheduler.classify import Classifier, records_from_texts
    from prefixcache.task.definition import parse_task
    from tests.support.tasks import TASK_YAML, TEXTS

    tok = tiny_llama.tokenizer
    prefix = PrefixKV.build(tiny_llama.model, tok("a shared prefix for every row")["input_ids"])
    rows = [tok(t or "x")["input_ids"] for t in TEXTS[:3]]
    config = GenerationConfig(12)
    alone, _ = generate_rows(tiny_llama.model, tok, prefix, rows, config)
    classifier = Classifier(tiny_llama, parse_task(TASK_YAML))
    between = []

    def classify_between_steps():
        between.append(classifier.classify_all(records_from_texts(TEXTS[:2])))

    with between_steps(classify_between_steps if decodes else (lambda: None)):
        interleaved, _ = generate_rows(tiny_llama.model, tok, prefix, rows, config)
    assert interleaved == alone
    assert not decodes or len(between) >= 5, "the hook ran at the step boundaries"


def test_a_lone_one_item_request_is_let_in_too():
    decoding, _, _, shorts, answered_at = scenario(["only"])
    assert shorts == [["scored only"]]
    assert answered_at < decoding.ended_at, "one queued item waited for the whole decoding pass"


def test_short_work_of_two_tasks_is_let_in_oldest_first():
    decoding, first, second = DecodingRunner(), ShortRunner(), ShortRunner()

    async def body(batcher, submit):
        long_request = asyncio.ensure_future(submit(decoding, "ticket"))
        await _until(decoding.started)
        shorts = await asyncio.gather(submit(first, "a"), submit(second, "b"))
        answered_at = time.perf_counter()
        await long_request
        return shorts, answered_at

    shorts, answered_at = asyncio.run(_with_batcher(body))
    assert shorts == [["scored a"], ["scored b"]]
    assert answered_at < decoding.ended_at, "with two short tasks queued, neither was let in between steps"
    assert first.ran_at[0] < second.ran_at[0], "the older task's pass went first"


def test_a_second_decoding_pass_is_never_run_between_the_steps_of_another():
    first, second, short = DecodingRunner(), DecodingRunner(), ShortRunner()

    async def body(batcher, submit):
        long_request = asyncio.ensure_future(submit(first, "one"))
        await _until(first.started)
        queued = asyncio.ensure_future(submit(second, "two"))  # older than the short item below
        await asyncio.sleep(0)
        return await asyncio.gather(long_request, queued, submit(short, "a"))

    results = asyncio.run(_with_batcher(body))
    assert results == [["decoded one"], ["decoded two"], ["scored a"]]
    assert second.started_at >= first.ended_at, "a decoding pass ran nested inside another's steps"
    assert short.ran_at[0] < first.ended_at, "the short item still got in between the first pass's steps"


def test_stopping_during_a_short_pass_between_steps_fails_its_request_at_once():
    from prefixcache.errors import ShuttingDownError

    decoding, blocking = DecodingRunner(), BlockingShort()

    async def body(batcher, submit):
        asyncio.ensure_future(submit(decoding, "ticket"))
        await _until(decoding.started)
        short_request = asyncio.ensure_future(submit(blocking, "a"))
        await _until(blocking.entered)
        await batcher.stop()
        await asyncio.sleep(0)
        done = short_request.done()
        blocking.release.set()
        return done, (await asyncio.gather(short_request, return_exceptions=True))[0]

    done, outcome = asyncio.run(_with_batcher(body))
    assert done, "the short pass's request was left waiting after stop()"
    assert isinstance(outcome, ShuttingDownError) and str(outcome) == "the server is shutting down; retry elsewhere"


@pytest.mark.parametrize("answered_before", [[], ["a"], ["a", "b"]], ids=["fresh", "after-one", "after-two"])
def test_with_no_short_work_queued_the_steps_never_wait_on_the_event_loop(monkeypatch, answered_before):
    """Each hand-off makes a decoding step wait for the event loop (up to 5 s when it is busy): none without
    short work, also once earlier short requests have been answered (the count of queued short items is back
    to zero)."""
    import prefixcache.server.batcher as batcher_module

    handoffs = []
    real = batcher_module.asyncio.run_coroutine_threadsafe

    def counted(coroutine, loop):
        handoffs.append(threading.get_ident())
        return real(coroutine, loop)

    monkeypatch.setattr(batcher_module.asyncio, "run_coroutine_threadsafe", counted)
    decoding, short = DecodingRunner(), ShortRunner()

    async def body(batcher, submit):
        assert await asyncio.gather(*(submit(short, p) for p in answered_before)) == [
            [f"scored {p}"] for p in answered_before
        ]
        return await submit(decoding, "ticket")

    assert asyncio.run(_with_batcher(body)) == ["decoded ticket"]
    assert handoffs == [], f"{len(handoffs)} of {STEPS} steps handed off to the loop with nothing queued"


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # the stalled loop never runs it
def test_a_step_gives_up_on_a_loop_that_does_not_hand_over_short_work(monkeypatch):
    """Between two steps the model thread asks the event loop for queued short work; a loop that never
    answers (stopping, or stalled) must cost one bounded wait, after which decoding goes on."""
    import prefixcache.server.batcher as batcher_module

    monkeypatch.setattr(batcher_module, "_HANDOFF_S", 0.1)
    with ThreadPoolExecutor(1) as model_thread:
        batcher = MicroBatcher(model_thread, SETTINGS, Metrics())
    batcher._short_queued = 1  # the loop's count says short work waits
    stalled = asyncio.new_event_loop()  # never run: the hand-off is never answered
    step = threading.Thread(target=batcher._interleave, args=(stalled,), daemon=True)
    step.start()
    step.join(timeout=30)  # 0.1 s expected; 30 s leaves any machine room
    stalled.close()
    assert not step.is_alive(), "the model thread waits on the loop with no limit"


class Payload:
    """An item that can be watched by a weak reference (SimpleNamespace cannot)."""

    full = False

    def __init__(self, record):
        self.record = record


def test_a_short_pass_between_steps_is_let_go_once_it_is_answered():
    """The batcher remembers the short pass running between steps (so that ``stop()`` can fail it) only
    while it runs: once answered, its requests' items are free, though the decoding pass goes on."""
    decoding, short = DecodingRunner(), ShortRunner()

    async def body(batcher, submit):
        long_request = asyncio.ensure_future(submit(decoding, "ticket"))
        await _until(decoding.started)
        payload = Payload("a")
        watched = weakref.ref(payload)
        with batcher.admit(1):
            answer = await batcher.submit(short, [payload])
        del payload
        gc.collect()
        still_decoding = decoding.ended_at == 0.0
        kept = watched() is not None
        await long_request
        return answer, still_decoding, kept

    answer, still_decoding, kept = asyncio.run(_with_batcher(body))
    assert answer == ["scored a"]
    assert still_decoding, "the short request was not answered between steps, so this checks nothing"
    assert not kept, "an answered short pass's items are still held by the batcher while decoding goes on"


def test_short_work_queued_behind_a_decoding_request_is_let_in_between_its_steps():
    """While the model is busy, a decoding request queues, then a short one. The decoding pass goes next
    (it is older); the short request must still be let in between its steps, not wait for all of them."""
    decoding, short, blocker = DecodingRunner(), ShortRunner(), BlockingShort()

    async def body(batcher, submit):
        busy = asyncio.ensure_future(submit(blocker, "x"))
        await _until(blocker.entered)
        long_request = asyncio.ensure_future(submit(decoding, "ticket"))
        await until(lambda: batcher.depth == 1, "the decoding request queued")
        short_request = asyncio.ensure_future(submit(short, "a"))
        await until(lambda: batcher.depth == 2, "the short request queued behind it")
        blocker.release.set()
        return await asyncio.gather(busy, long_request, short_request)

    assert asyncio.run(_with_batcher(body)) == [["scored x"], ["decoded ticket"], ["scored a"]]
    assert decoding.started_at < short.ran_at[0] < decoding.ended_at, "the short request waited for every step"
