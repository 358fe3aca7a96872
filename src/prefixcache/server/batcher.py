"""Micro-batching: concurrent requests for the same task become one forward pass.

Requests put their prepared items into a per-runner queue and await a future.
One loop per model (an asyncio task) repeatedly:

1. picks the runner whose oldest item has waited longest;
2. waits until ``max_batch`` items are queued for it, or ``max_wait_ms`` have
   passed since that oldest item could first be served (its arrival, or the end
   of the previous pass if it arrived during one), or no item has arrived for
   ``arrival_gap_ms`` (counting from the newest arrival or the end of the
   previous pass), whichever comes first;
3. takes up to ``max_batch`` items, which may come from many requests (and a
   large request may be split over several passes);
4. runs them on the model thread (``runner.run``), the one thread that touches
   the model, so the event loop never blocks on torch;
5. routes each result back to its request by (request, position): a request's
   future resolves when its last item is done, with results in its own order.

While a pass runs, new items keep queueing, so under load the next pass is
full: batching grows with load. The arrival gap matters for closed-loop
clients: the requests answered by a pass come back one after another in the
milliseconds after it ends, and a pass that waits while they keep arriving
takes them all, where a fixed short wait would split the clients into two
cohorts of half-size passes. A lone request waits only the gap.

Invariant 2 under concurrency: every pass forks the read-only prefix (see
``kv.PrefixKV.fork``), and passes run one at a time on the model thread.

The queue is bounded: at most ``max_queue`` items (over all tasks) may be
*admitted* and not yet answered, counting from before tokenization to the end
of their pass. A request that does not fit is refused whole, at once, with
:class:`QueueFullError` (HTTP 429), before any work is spent on it.

This module knows nothing about HTTP or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from .prometheus import Metrics
from ..errors import QueueFullError, ShuttingDownError
from ..run.loop import WorkItem
from .runners import TaskRunner
from .settings import ServerSettings

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Job:
    """One request's items and the future its handler awaits."""

    items: Sequence[WorkItem]
    future: asyncio.Future
    enqueued_at: float
    results: list = field(init=False)
    remaining: int = field(init=False)

    def __post_init__(self):
        self.results = [None] * len(self.items)
        self.remaining = len(self.items)


@dataclass(eq=False)
class _Queue:
    """Items waiting for one runner, as (job, position in the job) slots in arrival order."""

    runner: TaskRunner
    slots: deque[tuple[_Job, int]] = field(default_factory=deque)

    def head_time(self) -> float:
        return self.slots[0][0].enqueued_at

    def newest_time(self) -> float:
        return self.slots[-1][0].enqueued_at

    def take(self, limit: int) -> tuple[list[tuple[_Job, int]], int]:
        """Up to ``limit`` live slots, and how many slots left the queue (cancelled ones are dropped)."""
        taken, removed = [], 0
        while self.slots and len(taken) < limit:
            job, position = self.slots.popleft()
            removed += 1
            if not job.future.done():  # done early: its client went away or another pass failed
                taken.append((job, position))
        return taken, removed


class MicroBatcher:
    """Merges the queued items of each runner into forward passes on one model thread.

    Contract: ``admit(n)`` reserves room for ``n`` items or raises ``QueueFullError``
    at once; inside it, ``submit`` returns exactly one result per item, in the items'
    order, or raises (the runner's exception if its pass failed; ``ShuttingDownError``
    if the batcher stopped first). Call every method from the event loop's thread.
    """

    def __init__(self, model_executor: Executor, settings: ServerSettings, metrics: Metrics):
        self._executor = model_executor
        self._max_batch = settings.max_batch
        self._max_wait = settings.max_wait_s
        self._arrival_gap = settings.arrival_gap_s
        self._max_queue = settings.max_queue
        self._metrics = metrics
        self._queues: dict[TaskRunner, _Queue] = {}
        self._depth = 0  # queued, not yet in a pass
        self._admitted = 0  # admitted and not yet answered (preparing, queued or in a pass)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._free_since = 0.0  # loop time the model thread last became free

    @property
    def depth(self) -> int:
        """Items queued and not yet taken into a pass."""
        return self._depth

    @property
    def in_progress(self) -> int:
        """Items admitted and not yet answered (being prepared, queued or in a pass)."""
        return self._admitted

    @property
    def running(self) -> bool:
        """True while the loop is taking passes (False before start, after stop, or if it died)."""
        return self._loop_task is not None and not self._loop_task.done()

    def start(self) -> None:
        self._loop_task = asyncio.get_running_loop().create_task(self._run_forever(), name="prefixcache-batcher")
        self._loop_task.add_done_callback(_report_crash)

    async def stop(self) -> None:
        """Stop taking passes; every request still queued fails with ShuttingDownError."""
        if self._loop_task is not None:
            self._loop_task.cancel()
            await asyncio.gather(self._loop_task, return_exceptions=True)
            self._loop_task = None
        for queue in self._queues.values():
            _fail(queue.slots, ShuttingDownError("the server is shutting down; retry elsewhere"))
        self._queues.clear()
        self._set_depth(0)

    @contextmanager
    def admit(self, count: int) -> Iterator[None]:
        """Hold room for ``count`` items while the request is prepared, queued and run.

        Raises:
            QueueFullError: the room is not there; nothing was reserved.
        """
        if self._admitted + count > self._max_queue:
            self._metrics.queue_rejections.inc()
            raise QueueFullError(
                f"{self._admitted} items are in progress and at most {self._max_queue} may be; retry later",
                retry_after=self._retry_after(count),
            )
        self._admitted += count
        self._metrics.in_progress.set(self._admitted)
        try:
            yield
        finally:
            self._admitted -= count
            self._metrics.in_progress.set(self._admitted)

    async def submit(self, runner: TaskRunner, items: Sequence[WorkItem]) -> list[dict]:
        """Queue ``items`` for ``runner`` and wait for their results (one per item, in order).

        Call it inside ``admit(len(items))``: the queue bound is enforced there.
        """
        if not items:
            return []
        if self._loop_task is None:
            raise ShuttingDownError("the server is not running")
        loop = asyncio.get_running_loop()
        job = _Job(items, loop.create_future(), loop.time())
        queue = self._queues.get(runner)
        if queue is None:
            queue = self._queues[runner] = _Queue(runner)
        queue.slots.extend((job, position) for position in range(len(items)))
        self._set_depth(self._depth + len(items))
        self._wake.set()
        return await job.future

    # --- the loop ----------------------------------------------------------------------------------

    async def _run_forever(self) -> None:
        while True:
            queue = await self._oldest_queue()
            await self._fill(queue)
            batch, removed = queue.take(self._max_batch)
            self._set_depth(self._depth - removed)
            if not queue.slots:
                del self._queues[queue.runner]
            if batch:
                await self._execute(queue.runner, batch)

    async def _oldest_queue(self) -> _Queue:
        """The queue whose head item has waited longest (waits until there is one)."""
        while not self._queues:
            self._wake.clear()
            await self._wake.wait()
        return min(self._queues.values(), key=_Queue.head_time)

    async def _fill(self, queue: _Queue) -> None:
        """Wait until ``queue`` holds a full batch, its head item's wait (counted from when the
        model could first take it) is over, or items have stopped arriving for the arrival gap."""
        loop = asyncio.get_running_loop()
        deadline = max(queue.head_time(), self._free_since) + self._max_wait
        while len(queue.slots) < self._max_batch:
            quiet = max(queue.newest_time(), self._free_since) + self._arrival_gap
            timeout = min(deadline, quiet) - loop.time()
            if timeout <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return

    async def _execute(self, runner: TaskRunner, batch: list[tuple[_Job, int]]) -> None:
        """Run one pass on the model thread and route its results (or its exception) back."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        for job, _ in batch:
            self._metrics.queue_wait_seconds.observe(started - job.enqueued_at)
        items = [job.items[position] for job, position in batch]
        try:
            results = await loop.run_in_executor(self._executor, runner.run, items)
            if len(results) != len(items):
                raise RuntimeError(f"runner {runner.kind!r} returned {len(results)} results for {len(items)} items")
        except asyncio.CancelledError:  # stop() during the pass
            _fail(batch, ShuttingDownError("the server is shutting down; retry elsewhere"))
            raise
        except Exception as exc:  # routed to every request in the pass, which answers 500
            log.exception("forward pass of %d items for task %r failed", len(items), runner.task.name)
            _fail(batch, exc)
            return
        finally:
            self._free_since = loop.time()
        hits = sum(1 for item in items if not item.full)
        self._metrics.record_batch(runner.task.name, runner.kind, len(items), hits, loop.time() - started)
        for (job, position), result in zip(batch, results):
            job.results[position] = result
            job.remaining -= 1
            if job.remaining == 0 and not job.future.done():
                job.future.set_result(job.results)

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._metrics.queue_depth.set(depth)

    def _retry_after(self, incoming: int) -> int:
        """Seconds until enough items have likely been answered, from the recent rate (1 to 60)."""
        rate = self._metrics.items_per_second()
        if rate <= 0:
            return 1
        return max(1, min(60, math.ceil((self._admitted + incoming - self._max_queue) / rate) + 1))


def _report_crash(task: asyncio.Task) -> None:
    """Log the loop's exception if it ever ends other than by stop() (``/healthz`` then answers 503)."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("the micro-batcher stopped", exc_info=task.exception())


def _fail(slots, exc: BaseException) -> None:
    """Resolve every still-pending request among ``slots`` with ``exc``."""
    for job, _ in slots:
        if not job.future.done():
            job.future.set_exception(exc)
