"""Fakes for the engine thread's tests (no model, no HTTP): a queued item, a runner whose items are scoring
sequences that it scores itself (optionally held at a gate, or failing), an engine thread for one scenario,
and a bounded wait for a condition."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from prefixcache.scheduler.engine_loop import EngineLoop, LoopConfig
from prefixcache.scheduler.sequence import Scores, Sequence, Status
from prefixcache.server.engine_thread import EngineThread
from prefixcache.server.prometheus import Metrics
from prefixcache.server.runners import Submitted, failed
from prefixcache.server.settings import ServerSettings


def item(payload, full=False):
    """A queued item as a runner sees it: its record is the payload itself."""
    return SimpleNamespace(record=payload, full=full)


class FakeRunner:
    """Each item is a one-token scoring sequence that this runner scores: its result is the item's payload.

    A scoring call sets ``started`` and waits for ``gate`` (open unless one is given), then raises ``exc`` if
    set. Every call's payloads are kept in ``calls`` and, with the runner's name, appended to ``log`` (a list
    several runners may share, to see which task's call came first)."""

    kind = "classify"

    def __init__(self, name: str = "fake", log: list | None = None, gate: threading.Event | None = None,
                 started: threading.Event | None = None, exc: Exception | None = None):
        self.task = SimpleNamespace(name=name)
        self.log = log if log is not None else []
        if gate is None:
            gate = threading.Event()
            gate.set()
        self.gate = gate
        self.started = started if started is not None else threading.Event()
        self.exc = exc
        self.calls: list[list] = []
        self.prefix, self.empty = SimpleNamespace(length=4), SimpleNamespace(length=0)

    def prefix_build(self, chunk_tokens: int) -> None:
        return None

    def sequences(self, items) -> Submitted:
        seqs = [Sequence(self.empty if it.full else self.prefix, (1,), Scores(self), tag=it) for it in items]
        return Submitted(seqs, self.prefix.length * sum(1 for it in items if not it.full))

    def score(self, prefix, seqs) -> list:
        self.started.set()
        assert self.gate.wait(30), "test gate never opened"
        if self.exc is not None:
            raise self.exc
        payloads = [seq.tag.record for seq in seqs]
        self.calls.append(payloads)
        self.log.append((self.task.name, payloads))
        return payloads

    def answer(self, seq):
        if seq.status is not Status.FINISHED:
            raise failed(seq)
        return seq.result


def engine_thread(settings: ServerSettings, metrics: Metrics | None = None, loaded=None) -> EngineThread:
    """An engine thread over a loop with no model (fake runners' sequences only score), or ``loaded``'s."""
    model, tokenizer = (None, None) if loaded is None else (loaded.model, loaded.tokenizer)
    loop = EngineLoop(model, tokenizer, LoopConfig(settings.max_step_tokens, settings.max_batch))
    return EngineThread(loop, settings, metrics or Metrics())


def run_with(settings: ServerSettings, scenario, metrics: Metrics | None = None, loaded=None):
    """Run ``await scenario(thread)`` against a started engine thread (over ``loaded``'s model, if given); stop it
    after."""
    async def main():
        thread = engine_thread(settings, metrics, loaded)
        thread.start()
        try:
            return await scenario(thread)
        finally:
            await thread.stop()

    return asyncio.run(main())


async def until(condition, what: str):
    """Wait until ``condition()`` holds; fail naming ``what`` if it never does."""
    for _ in range(3000):  # a bound on a hang, not a timing assertion
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")
