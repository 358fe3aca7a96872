"""The service behind the routes: a task registry, a prefix pool, the engine thread and the prep threads.

Threads (per model):

* the *model* thread (:class:`~prefixcache.server.engine_thread.EngineThread`) steps the engine loop, and
  builds prefixes between steps; only it runs the model;
* the *prep* threads (:data:`PREP_THREADS`) tokenize request items, each call with a
  tokenizer copy it holds alone (so tokenization overlaps the model's work, a burst of
  requests is tokenized in parallel, and no tokenizer is used by two threads at once).

The event loop only routes: it never tokenizes and never runs the model.

Every task's prefix lives in one :class:`~prefixcache.cache.pool.PrefixPool` (byte
budget ``settings.cache_budget_bytes``, LRU eviction). Runners look their prefix
up once per request, on the model thread, and keep nothing of it between requests, so an
evicted prefix is freed once the sequences that hold it end, and rebuilt when its task is next used:
the prefix bytes alive are at most the budget plus the prefixes of sequences in flight.
The engine loop's slot store (running sequences' own keys/values) counts in the same budget: it is sized
from what the held prefixes leave when it is made, and reserved in the pool for as long as the service runs.
Tasks with the same prefix tokens share one entry. ``settings.max_tasks`` caps how many
tasks are registered.

The tasks given to ``start`` are the operator's *start-up tasks*: only a caller acting for the operator
(``operator=True``: the HTTP app passes it for the admin key) may replace or delete them.

A task is replaced or deleted by swapping the registry entry. Requests accepted
before the swap finish on the runner they were accepted for (a request holds its runner, not its
task's name), so no request ever mixes two versions of a task. The pool entry of a
deleted or replaced task is not dropped at once: it is unpinned (when no other
task pins it) and evicted when the budget needs the room.

This module knows nothing about HTTP.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence, TypeVar

from ..errors import (
    PoolBudgetError, ReadOnlyTaskError, RequestLimitError, SettingsError, TaskUploadError, UnknownTaskError,
    WrongTaskKindError, setting,
)
from ..model.load import LoadedModel
from ..cache.pool import PoolConfig, PrefixPool
from ..scheduler.backend_choice import choose, pooled_llama_generation
from ..scheduler.engine_loop import EngineLoop, LoopConfig
from ..types import Record
from ..task.definition import ExtractTask, Task
from .engine_thread import EngineThread
from .kv_room import KVRoom
from .prometheus import Metrics
from .openai_runners import OpenAIRunners
from .runners import TaskRunner, build_runner, check_prefix_size
from .settings import ADMIN_KEY_ENV, ServerSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Usage:
    """Tokens of one request: reused from stored prefixes, and computed for the items themselves."""

    prefix_tokens_reused: int
    suffix_tokens: int


T = TypeVar("T")
PREP_THREADS = 2  # tokenizing the returning clients of a pass in parallel shortens the model's idle gap


class Service:
    """Tasks served on one model. Call every coroutine from the event loop's thread.

    Lifecycle: ``await start(tasks)`` starts the engine thread and builds each task's prefix on it;
    ``await stop()`` fails what is still queued and releases the threads.
    """

    def __init__(self, loaded: LoadedModel, settings: ServerSettings, metrics: Metrics):
        self.loaded = loaded
        self.settings = settings
        self.metrics = metrics
        self._prep_threads = ThreadPoolExecutor(PREP_THREADS, thread_name_prefix="prefixcache-prep")
        self._prep_tokenizers: queue.SimpleQueue = queue.SimpleQueue()  # one copy per prep thread, lent per call
        for _ in range(PREP_THREADS):
            self._prep_tokenizers.put(copy.deepcopy(loaded.tokenizer))
        self.stream_tokenizer = copy.deepcopy(loaded.tokenizer)  # the event loop's own: decodes streamed tokens
        self.pool = PrefixPool(PoolConfig(budget_bytes=settings.cache_budget_bytes))  # used on the model thread only
        metrics.watch_pool(self.pool)
        loop_config = LoopConfig(settings.max_step_tokens, settings.max_batch)
        self.backend = choose(loaded, settings.backend, rows=settings.max_batch)  # what runs generating requests
        generation = (pooled_llama_generation(loaded, settings.max_batch, self.pool)
                      if self.backend.name == "llama.cpp" else None)  # None: torch's slots, in the budget
        loop = EngineLoop(loaded.model, loaded.tokenizer, loop_config, self.pool, generation)
        log.info("generating requests run on %s (%s)", self.backend.name, self.backend.why)
        self.engine = EngineThread(loop, settings, metrics)
        self._runners: dict[str, TaskRunner] = {}
        self._startup: set[str] = set()  # the registered tasks that are start-up tasks (not replaced since)
        cells = None if generation is None else generation.llama.shape.cells  # llama.cpp: a row and its prefix
        self.kv_room = KVRoom(loaded.model, settings.cache_budget_bytes, cells)  # what one request's slot may take
        self.openai = OpenAIRunners(loaded, self.pool, settings.method, self.kv_room)  # the OpenAI routes' runners
        self._builds = asyncio.Lock()  # one prefix build at a time on the model thread (steps run between builds)

    async def start(self, tasks: Sequence[Task | ExtractTask]) -> None:
        self.engine.start()
        try:
            for task in tasks:
                await self.register(task, uploaded=False)
        except BaseException:
            await self.engine.stop()
            raise

    async def stop(self) -> None:
        await self.engine.stop()
        self._prep_threads.shutdown(wait=True)

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

    async def register(
        self, task: Task | ExtractTask, uploaded: bool = True, operator: bool = False
    ) -> tuple[TaskRunner, bool]:
        """Build ``task``'s runner (and prefix) on the model thread, then swap it in.

        An uploaded task is first rendered and sized on a prep thread (:func:`check_prefix_size`), and builds
        take turns (one at a time), so uploads never queue several builds ahead of the passes of other tasks.

        An ``uploaded`` task's prefix may not exceed ``settings.max_prefix_tokens`` and may not be
        pinned (a pinned prefix is never evicted, so uploads could fill the pool and starve every
        other task); the operator's start-up tasks have neither limit.
        An upload may replace a start-up task only for the ``operator`` (it is then an uploaded task).
        A new uploaded name needs room under ``settings.max_tasks`` (:meth:`check_room`), checked before and
        after the build (two uploads may build at once); start-up tasks are counted by :meth:`check_startup`.
        Returns the runner and whether the name is new. Raises what ``build_runner`` raises
        (for an uploaded task, a prefix that cannot fit in the pool is a TaskUploadError),
        TaskUploadError for an uploaded ``pin: true``, ReadOnlyTaskError (:meth:`check_writable`),
        and what :meth:`check_room` raises.
        """
        if uploaded:
            self.check_writable(task.name, operator)
            self.check_room(task.name)
        if uploaded and task.pin:
            raise TaskUploadError(
                f"task {task.name!r}: field 'pin': only the tasks the server starts with may pin their prefix "
                "(an uploaded task's prefix is evicted like any other when the pool needs room); drop 'pin'"
            )
        limit = self.settings.max_prefix_tokens if uploaded else None
        if uploaded:  # sized on a prep thread: an oversized prefix never reaches the model thread
            await self.on_prep_thread(lambda tokenizer: check_prefix_size(task, tokenizer, limit))
        try:
            async with self._builds:  # queued builds wait here, not in the model thread's inbox ahead of requests
                runner = await self.engine.call(partial(build_runner, self.loaded, task, self.settings, limit, self.pool))
        except PoolBudgetError as exc:
            if not uploaded:
                raise
            raise TaskUploadError(f"task {task.name!r}: {exc.args[0]}") from None  # args[0]: its setting markers kept
        if uploaded:
            self.check_room(task.name)
        created = task.name not in self._runners
        old = self._runners.get(task.name)
        self._runners[task.name] = runner
        (self._startup.discard if uploaded else self._startup.add)(task.name)
        if old is not None:
            self._release(old)
        self._count_pinned()
        self.metrics.record_prefix(task.name, runner.kind, runner.prefix_tokens, runner.prefix_bytes, replaced=not created)
        self.metrics.tasks.set(len(self._runners))
        log.info("task %r %s: %d prefix tokens", task.name, "registered" if created else "replaced", runner.prefix_tokens)
        return runner, created

    def remove(self, name: str, operator: bool = False) -> None:
        """Drop task ``name``. Raises UnknownTaskError, and ReadOnlyTaskError (:meth:`check_writable`)."""
        if name not in self._runners:
            raise UnknownTaskError(f"unknown task {name!r}: nothing to delete")
        self.check_writable(name, operator)
        self._release(self._runners.pop(name))
        self._count_pinned()
        self._startup.discard(name)
        self.metrics.record_removed(name)
        self.metrics.tasks.set(len(self._runners))

    def check_writable(self, name: str, operator: bool) -> None:
        """Raise ReadOnlyTaskError if ``name`` is a start-up task and the caller is not the ``operator``."""
        if name in self._startup and not operator:
            raise ReadOnlyTaskError(
                f"task {name!r} was loaded at start-up and is read-only through the API: only the admin key "
                f"({ADMIN_KEY_ENV}) may replace or delete it; register yours under another name"
            )

    def check_startup(self, tasks: Sequence[Task | ExtractTask]) -> None:
        """Raise SettingsError when ``tasks`` (the start-up tasks) name more tasks than ``settings.max_tasks``."""
        count, limit = len({task.name for task in tasks}), self.settings.max_tasks
        if count > limit:
            raise SettingsError(f"{count} start-up tasks, more than max_tasks={limit}; raise {setting('max_tasks')} or "
                                "start with fewer tasks")

    def check_room(self, name: str) -> None:
        """Raise TaskUploadError when ``name`` is not registered and ``settings.max_tasks`` tasks already are."""
        limit = self.settings.max_tasks
        if name in self._runners or len(self._runners) < limit:
            return
        raise TaskUploadError(
            f"{len(self._runners)} tasks are registered, the most max_tasks={limit} allows: task {name!r} is not added; "
            "delete one (DELETE /v1/tasks/{name}) or replace a registered task"
        )

    def _count_pinned(self) -> None:
        """The pinned prefixes' bytes (each entry once), which no request's slot can have: into ``kv_room``."""
        pinned = {r.prefix_key: r.prefix_bytes for r in self._runners.values() if r.task.pin}
        self.kv_room.pinned_bytes = sum(pinned.values())

    def _release(self, old: TaskRunner) -> None:
        """Let the pool evict a dropped runner's prefix: unpin it, unless a registered task still pins it.

        The unpin runs on the model thread (the pool's only user), so the event loop never
        waits for the pool's lock while a prefix is being built.
        """
        if not old.task.pin:
            return
        if any(r.task.pin and r.prefix_key == old.prefix_key for r in self._runners.values()):
            return
        self.engine.call_soon(partial(self.pool.unpin, old.prefix_key))

    # --- items -------------------------------------------------------------------------------------

    async def run(
        self, kind: str, name: str, records: Sequence[Record], client: Hashable | None = None
    ) -> tuple[list[dict], Usage]:
        """Prepare ``records`` for task ``name`` (of ``kind``), run them through the engine loop, return results and
        usage.

        ``client`` names the caller for the per-client share and turns (None: bound by ``max_queue`` only).

        Raises:
            UnknownTaskError, WrongTaskKindError, RequestLimitError, ItemError, RequestTooLargeError, QueueFullError,
            ShuttingDownError, SequenceFailedError.
        """
        runner = self.runner(name, kind)
        if len(records) > self.settings.max_items:
            raise RequestLimitError(
                f"{len(records)} items in one request, more than max_items={self.settings.max_items}; split the request"
            )
        loop = asyncio.get_running_loop()
        with self.engine.admit(len(records), client) as hold:
            prepared = await loop.run_in_executor(self._prep_threads, self._prepare, runner, records)
            answers = await self.engine.submit(runner, prepared, client, hold)
        self.metrics.record_answers(name, answers.results)
        usage = Usage(answers.prefix_tokens_reused, sum(len(item.rows) for item in prepared))
        return answers.results, usage

    def _prepare(self, runner: TaskRunner, records: Sequence[Record]):
        """On a prep thread: ``runner.prepare`` with a tokenizer copy no other thread holds meanwhile, then each
        generating item checked against what the cache budget can hold for it (RequestTooLargeError)."""
        items = self._with_tokenizer(lambda tokenizer: runner.prepare(tokenizer, records, self.settings.max_item_tokens))
        max_new = getattr(runner, "max_new_tokens", None)  # None: scoring items, which take no slot
        if max_new is not None:
            for item in items:
                self.kv_room.check_item(item.index, item.record.id, len(item.rows), max_new)
        return items

    async def on_prep_thread(self, work: Callable[[object], T]) -> T:
        """``work(tokenizer)`` on a prep thread, with a tokenizer copy no other thread holds meanwhile."""
        return await asyncio.get_running_loop().run_in_executor(self._prep_threads, self._with_tokenizer, work)

    def _with_tokenizer(self, work: Callable[[object], T]) -> T:
        tokenizer = self._prep_tokenizers.get()  # never waits: there are as many copies as prep threads
        try:
            return work(tokenizer)
        finally:
            self._prep_tokenizers.put(tokenizer)


def _article(kind: str) -> str:
    return {"classify": "a classification", "extract": "an extraction"}.get(kind, f"a {kind!r}")
