"""Fakes for the micro-batcher's tests (no model, no HTTP): a queued item, runners that hold or fail a pass, a
batcher on its own model thread for one scenario, and a bounded wait for a condition."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

from prefixcache.server.batcher import MicroBatcher
from prefixcache.server.prometheus import Metrics
from prefixcache.server.settings import ServerSettings


def item(payload, full=False):
    """A queued item as the batcher sees it: its record is the payload itself."""
    return SimpleNamespace(record=payload, full=full)


class GatedRunner:
    """Each pass sets ``started`` and blocks until ``gate`` is set; then answers each item's payload.

    Every pass's payloads are kept in ``passes`` and, with the runner's name, appended to ``log`` (a list
    several runners may share, to see which task's pass came first)."""

    kind = "classify"

    def __init__(self, name: str = "fake", log: list | None = None, gate: threading.Event | None = None,
                 started: threading.Event | None = None):
        self.task = SimpleNamespace(name=name)
        self.log = log if log is not None else []
        self.gate = gate if gate is not None else threading.Event()
        self.started = started if started is not None else threading.Event()
        self.passes: list[list] = []

    def run(self, batch):
        self.started.set()
        assert self.gate.wait(30), "test gate never opened"
        payloads = [i.record for i in batch]
        self.passes.append(payloads)
        self.log.append((self.task.name, payloads))
        return list(payloads)


class FailingRunner:
    """A pass that raises ``exc``, or else returns ``result`` as it is (of whatever length)."""

    kind = "classify"

    def __init__(self, result=None, exc=None):
        self.task = SimpleNamespace(name="failing")
        self.result, self.exc = result, exc

    def run(self, batch):
        if self.exc is not None:
            raise self.exc
        return self.result


def run_with(settings: ServerSettings, scenario, metrics: Metrics | None = None):
    """Run ``await scenario(batcher)`` against a started batcher on its own model thread; stop it after."""
    async def main():
        with ThreadPoolExecutor(1) as model_thread:
            batcher = MicroBatcher(model_thread, settings, metrics or Metrics())
            batcher.start()
            try:
                return await scenario(batcher)
            finally:
                await batcher.stop()

    return asyncio.run(main())


async def until(condition, what: str):
    """Wait until ``condition()`` holds; fail naming ``what`` if it never does."""
    for _ in range(3000):  # a bound on a hang, not a timing assertion
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never happened: {what}")
