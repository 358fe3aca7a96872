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
   large request may be split over several passes): one item per client in
   turn (each client's items in arrival order; the turn carries over to the
   next pass), so one client's 256-item requests do not hold another client's
   one item back until they have all run;
4. runs them on the model thread (``runner.run``), the one thread that touches
   the model, so the event loop never blocks on torch. Between two steps of a
   decoding pass (``runner.decodes``: extraction, generation; see
   :mod:`prefixcache.engine.steps`) it runs one pass of queued short work at
   once, so a classification is not stuck behind a long extraction;
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
of their pass, and at most ``settings.client_share`` of them for one client
(``client``: whatever the caller names it by; the HTTP app passes its role and
address, see ``middleware.CLIENT``). A request that does not fit is refused whole,
at once, with :class:`QueueFullError` (HTTP 429), before any work is spent on it.
Items admitted without a client (``client=None``) count against ``max_queue`` only,
and share one turn in the rotation.

This module knows nothing about HTTP or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import math
from concurrent.futures import Executor
from contextlib import contextmanager
from typing import Hashable, Iterator, Sequence

from .batch_queue import Job, RunnerQueue
from .prometheus import Metrics
from ..engine.steps import between_steps
from ..errors import QueueFullError, ShuttingDownError
from ..scheduler.loop import WorkItem
from .runners import TaskRunner
from .settings import ServerSettings

log = logging.getLogger(__name__)

_HANDOFF_S = 5.0  # the longest the model thread waits for the loop to hand it a short pass between steps


class MicroBatcher:
    """Merges the queued items of each runner into forward passes on one model thread.

    Contract: ``admit(n, client)`` reserves room for ``n`` items of ``client`` or raises
    ``QueueFullError`` at once; inside it, ``submit`` (with the same ``client``) returns exactly one result per item, in the items'
    order, or raises (the runner's exception if its pass failed; ``ShuttingDownError``
    if the batcher stopped first). Call every method from the event loop's thread.
    """

    def __init__(self, model_executor: Executor, settings: ServerSettings, metrics: Metrics):
        self._executor = model_executor
        self._max_batch = settings.max_batch
        self._max_wait = settings.max_wait_s
        self._arrival_gap = settings.arrival_gap_s
        self._max_queue = settings.max_queue
        self._client_share = settings.client_share
        self._metrics = metrics
        self._queues: dict[TaskRunner, RunnerQueue] = {}
        self._depth = 0  # queued, not yet in a pass
        self._admitted = 0  # admitted and not yet answered (preparing, queued or in a pass)
        self._admitted_by: dict[Hashable, int] = {}  # the same, per named client (absent: none)
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task | None = None
        self._free_since = 0.0  # loop time the model thread last became free
        self._short_queued = 0  # queued items of non-decoding runners (read by the model thread between steps)
        self._side: list[tuple[Job, int]] | None = None  # a short pass running between decoding steps

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
            _fail(queue.slots(), ShuttingDownError("the server is shutting down; retry elsewhere"))
        _fail(self._side or (), ShuttingDownError("the server is shutting down; retry elsewhere"))
        self._queues.clear()
        self._set_depth(0)
        self._short_queued = 0

    @contextmanager
    def admit(self, count: int, client: Hashable | None = None) -> Iterator[None]:
        """Hold room for ``count`` items of ``client`` while the request is prepared, queued and run.

        The room is under ``max_queue`` (all clients) and, for a named ``client``, under
        ``client_share`` (that client's items in progress); ``client=None`` is bound by ``max_queue`` only.

        Raises:
            QueueFullError: the room is not there; nothing was reserved.
        """
        self._reserve(count, client)
        try:
            yield
        finally:
            self._hold(client, -count)

    def _reserve(self, count: int, client: Hashable | None) -> None:
        """:meth:`admit`'s check and hold (undecorated, so that it is in reach of mutation testing)."""
        held = self._admitted_by.get(client, 0) if client is not None else 0
        if client is not None and held + count > self._client_share:
            self._refuse(f"this client has {held} items in progress and one client may have at most "
                         f"{self._client_share}; retry later", held + count - self._client_share)
        if self._admitted + count > self._max_queue:
            self._refuse(f"{self._admitted} items are in progress and at most {self._max_queue} may be; retry later",
                         self._admitted + count - self._max_queue)
        self._hold(client, count)

    def _refuse(self, message: str, over: int) -> None:
        self._metrics.queue_rejections.inc()
        raise QueueFullError(message, retry_after=self._retry_after(over))

    def _hold(self, client: Hashable | None, count: int) -> None:
        """Add ``count`` (negative: give back) to the items in progress, in all and for ``client``."""
        self._admitted += count
        self._metrics.in_progress.set(self._admitted)
        if client is not None:
            held = self._admitted_by.get(client, 0) + count
            if held:
                self._admitted_by[client] = held
            else:
                del self._admitted_by[client]

    async def submit(self, runner: TaskRunner, items: Sequence[WorkItem], client: Hashable | None = None) -> list[dict]:
        """Queue ``items`` for ``runner`` and wait for their results (one per item, in order).

        Call it inside ``admit(len(items), client)``: the queue bounds are enforced there. ``client``
        also names the turn the items wait in (passes take one item per client in turn).
        """
        if not items:
            return []
        if self._loop_task is None:
            raise ShuttingDownError("the server is not running")
        loop = asyncio.get_running_loop()
        job = Job(items, loop.create_future(), loop.time())
        queue = self._queues.get(runner)
        if queue is None:
            queue = self._queues[runner] = RunnerQueue(runner)
        queue.add(job, client)
        self._set_depth(self._depth + len(items))
        self._short_queued += 0 if _decodes(runner) else len(items)
        self._wake.set()
        return await job.future

    # --- the loop ----------------------------------------------------------------------------------

    async def _run_forever(self) -> None:
        while True:
            queue = await self._oldest_queue()
            await self._fill(queue)
            batch = self._take(queue)
            if batch:
                await self._execute(queue.runner, batch)

    def _take(self, queue: RunnerQueue) -> list[tuple[Job, int]]:
        """Up to ``max_batch`` live slots from ``queue``, with the counts kept (on the loop's thread)."""
        batch, removed = queue.take(self._max_batch)
        self._set_depth(self._depth - removed)
        self._short_queued -= 0 if _decodes(queue.runner) else removed
        if not queue.size:
            del self._queues[queue.runner]
        return batch

    async def _oldest_queue(self) -> RunnerQueue:
        """The queue whose head item has waited longest (waits until there is one)."""
        while not self._queues:
            self._wake.clear()
            await self._wake.wait()
        return min(self._queues.values(), key=RunnerQueue.head_time)

    async def _fill(self, queue: RunnerQueue) -> None:
        """Wait until ``queue`` holds a full batch, its head item's wait (counted from when the
        model could first take it) is over, or items have stopped arriving for the arrival gap."""
        loop = asyncio.get_running_loop()
        deadline = max(queue.head_time(), self._free_since) + self._max_wait
        while queue.size < self._max_batch:
            quiet = max(queue.newest_time(), self._free_since) + self._arrival_gap
            timeout = min(deadline, quiet) - loop.time()
            if timeout <= 0:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), timeout)
            except TimeoutError:
                return

    async def _execute(self, runner: TaskRunner, batch: list[tuple[Job, int]]) -> None:
        """Run one pass on the model thread and route its results (or its exception) back."""
        loop = asyncio.get_running_loop()
        started = self._start(batch)
        items = [job.items[position] for job, position in batch]
        try:
            results = await loop.run_in_executor(self._executor, self._run_pass, runner, items, loop)
        except asyncio.CancelledError:  # stop() during the pass
            _fail(batch, ShuttingDownError("the server is shutting down; retry elsewhere"))
            raise
        except Exception as exc:
            self._route(runner, batch, None, exc, started)
            return
        finally:
            self._free_since = loop.time()
        self._route(runner, batch, results, None, started)

    def _run_pass(self, runner: TaskRunner, items: list, loop: asyncio.AbstractEventLoop) -> list[dict]:
        """On the model thread: ``runner.run(items)``; a decoding runner lets short passes in between its steps."""
        if not _decodes(runner):
            return runner.run(items)
        with between_steps(lambda: self._interleave(loop)):
            return runner.run(items)

    def _interleave(self, loop: asyncio.AbstractEventLoop) -> None:
        """On the model thread, between two decoding steps: run one pass of the oldest queued short work."""
        if self._short_queued <= 0:  # a plain read: the loop's thread writes it; a stale value costs one step
            return
        try:
            taken = asyncio.run_coroutine_threadsafe(self._take_short(), loop).result(timeout=_HANDOFF_S)
        except Exception:  # the loop is stopping or busier than the hand-off allows: decode on, try next step
            return
        if taken is None:
            return
        runner, batch, started = taken
        items = [job.items[position] for job, position in batch]
        try:
            results, error = runner.run(items), None
        except Exception as exc:  # routed to the short pass's own requests; the decoding pass goes on
            results, error = None, exc
        try:
            loop.call_soon_threadsafe(self._route, runner, batch, results, error, started)
        except RuntimeError:  # the loop has closed: stop() already failed this batch (self._side)
            pass

    async def _take_short(self) -> tuple[TaskRunner, list[tuple[Job, int]], float] | None:
        """On the loop's thread: a batch of the oldest non-decoding queue, taken at once (no fill wait)."""
        short = [queue for queue in self._queues.values() if not _decodes(queue.runner) and queue.size]
        if not short:
            return None
        queue = min(short, key=RunnerQueue.head_time)
        batch = self._take(queue)
        self._side = batch  # stop() fails it if the server stops while it runs
        return (queue.runner, batch, self._start(batch)) if batch else None

    def _start(self, batch: list[tuple[Job, int]]) -> float:
        """The loop time a pass over ``batch`` starts; records how long each of its items waited."""
        started = asyncio.get_running_loop().time()
        for job, _ in batch:
            self._metrics.queue_wait_seconds.observe(started - job.enqueued_at)
        return started

    def _route(self, runner: TaskRunner, batch: list[tuple[Job, int]], results: list | None,
               error: BaseException | None, started: float) -> None:
        """On the loop's thread: hand each result of a finished pass to its request (or its error to all of them)."""
        self._side = None if batch is self._side else self._side
        if error is None and len(results) != len(batch):
            error = RuntimeError(f"runner {runner.kind!r} returned {len(results)} results for {len(batch)} items")
        if error is not None:  # routed to every request in the pass, which answers 500
            log.error("forward pass of %d items for task %r failed", len(batch), runner.task.name, exc_info=error)
            _fail(batch, error)
            return
        items = [job.items[position] for job, position in batch]
        hits = sum(1 for item in items if not item.full)
        seconds = asyncio.get_running_loop().time() - started
        self._metrics.record_batch(runner.task.name, runner.kind, len(items), hits, seconds)
        for (job, position), result in zip(batch, results):
            job.results[position] = result
            job.remaining -= 1
            if job.remaining == 0 and not job.future.done():
                job.future.set_result(job.results)

    def _set_depth(self, depth: int) -> None:
        self._depth = depth
        self._metrics.queue_depth.set(depth)

    def _retry_after(self, over: int) -> int:
        """Seconds until ``over`` more items have likely been answered, from the recent rate (1 to 60)."""
        rate = self._metrics.items_per_second()
        if rate <= 0:
            return 1
        return max(1, min(60, math.ceil(over / rate) + 1))


def _decodes(runner: TaskRunner) -> bool:
    """Whether ``runner``'s passes decode step by step (and so may let short passes in between)."""
    return bool(getattr(runner, "decodes", False))


def _report_crash(task: asyncio.Task) -> None:
    """Log the loop's exception if it ever ends other than by stop() (``/healthz`` then answers 503)."""
    if not task.cancelled() and task.exception() is not None:
        log.critical("the micro-batcher stopped", exc_info=task.exception())


def _fail(slots, exc: BaseException) -> None:
    """Resolve every still-pending request among ``slots`` with ``exc``."""
    for job, _ in slots:
        if not job.future.done():
            job.future.set_exception(exc)
