"""The service behind the routes: a task registry, two threads and the micro-batcher.

Threads (per model):

* the *model* thread runs every forward pass and every prefix build, one at a time;
* the *prep* thread tokenizes request items with its own copy of the tokenizer
  (so tokenization overlaps the model's work and no tokenizer is shared by two threads).

The event loop only routes: it never tokenizes and never runs the model.

A task is replaced or deleted by swapping the registry entry. Requests accepted
before the swap finish on the runner they were accepted for (the batcher keys
its queues by runner, not by name), so no request ever mixes two versions of a task.

This module knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Sequence

from ..models import LoadedModel
from ..runner import Record
from ..task import Task
from .batcher import MicroBatcher
from .errors import RequestLimitError, UnknownTaskError, WrongTaskKindError
from .metrics import Metrics
from .runners import TaskRunner, build_runner
from .settings import ServerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Usage:
    """Tokens of one request: reused from stored prefixes, and computed for the items themselves."""

    prefix_tokens_reused: int
    suffix_tokens: int


class Service:
    """Tasks served on one model. Call every coroutine from the event loop's thread.

    Lifecycle: ``await start(tasks)`` builds each task's prefix, then starts batching;
    ``await stop()`` fails what is still queued and releases the threads.
    """

    def __init__(self, loaded: LoadedModel, settings: ServerSettings, metrics: Metrics):
        self.loaded = loaded
        self.settings = settings
        self.metrics = metrics
        self._model_thread = ThreadPoolExecutor(1, thread_name_prefix="prefixcache-model")
        self._prep_thread = ThreadPoolExecutor(1, thread_name_prefix="prefixcache-prep")
        self._prep_tokenizer = copy.deepcopy(loaded.tokenizer)  # used by the prep thread only
        self.batcher = MicroBatcher(self._model_thread, settings, metrics)
        self._runners: dict[str, TaskRunner] = {}

    async def start(self, tasks: Sequence[Task]) -> None:
        for task in tasks:
            await self.register(task, uploaded=False)
        self.batcher.start()

    async def stop(self) -> None:
        await self.batcher.stop()
        self._prep_thread.shutdown(wait=True)
        self._model_thread.shutdown(wait=True)

    # --- tasks -------------------------------------------------------------------------------------

    def tasks(self) -> list[TaskRunner]:
        return [self._runners[name] for name in sorted(self._runners)]

    def runner(self, name: str, kind: str) -> TaskRunner:
        """The runner serving task ``name``.

        Raises:
            UnknownTaskError: no such task.
            WrongTaskKindError: the task is not of ``kind``.
        """
        runner = self._runners.get(name)
        if runner is None:
            known = ", ".join(sorted(self._runners)) or "none"
            raise UnknownTaskError(f"unknown task {name!r} (registered: {known}); PUT /v1/tasks/{name} registers it")
        if runner.kind != kind:
            raise WrongTaskKindError(
                f"task {name!r} is not {_article(kind)} task (its kind is {runner.kind!r}); "
                f"send it to /v1/{runner.kind}"
            )
        return runner

    async def register(self, task: Task, uploaded: bool = True) -> tuple[TaskRunner, bool]:
        """Build ``task``'s runner (and prefix) on the model thread, then swap it in.

        An ``uploaded`` task's prefix may not exceed ``settings.max_prefix_tokens``; the
        operator's start-up tasks have no such limit.
        Returns the runner and whether the name is new. Raises what ``build_runner`` raises.
        """
        loop = asyncio.get_running_loop()
        limit = self.settings.max_prefix_tokens if uploaded else None
        runner = await loop.run_in_executor(self._model_thread, build_runner, self.loaded, task, self.settings, limit)
        created = task.name not in self._runners
        self._runners[task.name] = runner
        self.metrics.record_prefix(task.name, runner.prefix_tokens, runner.prefix_bytes, replaced=not created)
        self.metrics.tasks.set(len(self._runners))
        log.info("task %r %s: %d prefix tokens", task.name, "registered" if created else "replaced", runner.prefix_tokens)
        return runner, created

    def remove(self, name: str) -> None:
        """Drop task ``name``. Raises UnknownTaskError."""
        if name not in self._runners:
            raise UnknownTaskError(f"unknown task {name!r}: nothing to delete")
        del self._runners[name]
        self.metrics.record_removed(name)
        self.metrics.tasks.set(len(self._runners))

    # --- items -------------------------------------------------------------------------------------

    async def run(self, kind: str, name: str, records: Sequence[Record]) -> tuple[list[dict], Usage]:
        """Prepare ``records`` for task ``name`` (of ``kind``), run them through the batcher, return results and usage.

        Raises:
            UnknownTaskError, WrongTaskKindError, RequestLimitError, ItemError, QueueFullError, ShuttingDownError.
        """
        runner = self.runner(name, kind)
        if len(records) > self.settings.max_items:
            raise RequestLimitError(
                f"{len(records)} items in one request, more than max_items={self.settings.max_items}; split the request"
            )
        loop = asyncio.get_running_loop()
        with self.batcher.admit(len(records)):
            prepared = await loop.run_in_executor(
                self._prep_thread, runner.prepare, self._prep_tokenizer, records, self.settings.max_item_tokens
            )
            results = await self.batcher.submit(runner, prepared)
        usage = Usage(sum(p.prefix_tokens for p in prepared), sum(len(p.rows) for p in prepared))
        return results, usage


def _article(kind: str) -> str:
    return {"classify": "a classification", "extract": "an extraction"}.get(kind, f"a {kind!r}")
