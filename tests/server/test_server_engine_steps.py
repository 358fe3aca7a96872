"""Continuous batching on the server's model thread, on a tiny real model (no HTTP): a short request joins an
extraction's decoding at the next step, not after it, and a request dropped mid-generation leaves at the next
step with its slot freed.

The engine loop is paused inside one step (its ``on_schedule`` hook waits on an event) while the test submits or
cancels; steps are ordered by events, never by sleeping, so no assertion depends on how fast the machine is.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from prefixcache.scheduler.classify import Record, RunConfig
from prefixcache.scheduler.extract import Extractor
from prefixcache.server.runners import ExtractRunner
from prefixcache.server.settings import ServerSettings
from prefixcache.task.definition import parse_task

from tests.server.fakes import FakeRunner, item, run_with, until
from tests.support.tasks import EXTRACT_YAML, TEXTS

SETTINGS = ServerSettings(max_batch=8)


@pytest.fixture(scope="module")
def extract_task():
    # a budget with room for several decoding steps: the answer's keys and separators are fast-forwarded, not stepped
    return parse_task(EXTRACT_YAML.replace("max_new_tokens: 10", "max_new_tokens: 40"), "tiny-fields.yaml",
                      kinds=("extract",))


class StepPause:
    """Pauses the engine loop at the start of its ``at``-th step (``reached``) until ``go`` is set."""

    def __init__(self, engine, at: int):
        self.engine, self.at, self.steps = engine, at, 0
        self.reached, self.go = threading.Event(), threading.Event()
        self.inner = engine.on_schedule
        engine.on_schedule = self

    def __call__(self, plan) -> None:
        self.steps += 1
        if self.steps == self.at:
            self.reached.set()
            assert self.go.wait(30), "the test never let the step go"
        self.inner(plan)


def with_real_engine(loaded, scenario):
    return run_with(SETTINGS, scenario, loaded=loaded)


def records(count: int) -> list[Record]:
    return [Record(i, {"text": TEXTS[i % len(TEXTS)]}) for i in range(count)]


def prepared(runner: ExtractRunner, loaded, count: int):
    return runner.prepare(loaded.tokenizer, records(count), SETTINGS.max_item_tokens)


def test_a_short_request_joins_an_extraction_at_the_next_step_and_the_extraction_is_unchanged(loaded, extract_task):
    seen: dict = {}

    class Short(FakeRunner):
        def score(self, prefix, seqs):
            seen["running"] = [seq.tag.record.id for seq in thread_of["engine"].running]
            seen["generated"] = thread_of["engine"].stats.tokens_generated
            return super().score(prefix, seqs)

    thread_of: dict = {}

    async def scenario(thread):
        thread_of["engine"] = thread.engine
        runner = await thread.call(lambda: ExtractRunner(loaded, extract_task, SETTINGS))
        pause = StepPause(thread.engine, at=3)  # the extraction's prefill, then two decoding steps
        extraction = asyncio.ensure_future(thread.submit(runner, prepared(runner, loaded, 3)))
        await until(pause.reached.is_set, "the extraction's third step")
        short = asyncio.ensure_future(thread.submit(Short("short"), [item("ticket")]))
        await until(lambda: thread.depth == 1, "the short request queued")
        pause.go.set()
        return await short, await extraction

    short, extraction = with_real_engine(loaded, scenario)
    assert short.results == ["ticket"]
    assert seen["running"] == [0, 1, 2], "the short request was not scored while the extraction decoded"
    assert seen["generated"] >= 2 * 3, "it was scored before the extraction's decoding steps, not between them"
    alone = [e.to_json() for e in Extractor(loaded, extract_task).extract_all(records(3), RunConfig("cached", 1))]
    assert extraction.results == alone, "sharing steps with another request changed the extraction"


def test_a_request_dropped_mid_generation_leaves_at_the_next_step_and_frees_its_slots_then_its_room(loaded, extract_task):
    async def scenario(thread):
        runner = await thread.call(lambda: ExtractRunner(loaded, extract_task, SETTINGS))
        pause = StepPause(thread.engine, at=3)

        async def request():
            with thread.admit(3, "dropper") as hold:
                return await thread.submit(runner, prepared(runner, loaded, 3), "dropper", hold)

        extraction = asyncio.ensure_future(request())
        await until(pause.reached.is_set, "the extraction's third step")
        extraction.cancel()
        await asyncio.gather(extraction, return_exceptions=True)
        held_while_running = thread.in_progress
        pause.go.set()
        await until(lambda: not thread.engine.has_work, "the dropped sequences left")
        await until(lambda: thread.in_progress == 0, "the dropped request's room given back")
        steps = pause.steps
        store = thread.engine.store
        after = await thread.submit(FakeRunner(), [item("next")])
        return steps, store.free, store.slots, after, extraction, held_while_running

    steps, free, slots, after, extraction, held = with_real_engine(loaded, scenario)
    assert extraction.cancelled()
    assert held == 3, "a dropped request's room was given back before its sequences left the loop"
    assert steps == 3, f"the dropped request took {steps - 3} more steps after it was cancelled"
    assert free == slots, f"{slots - free} slots were not given back"
    assert after.results == ["next"], "the loop goes on after a dropped request"
