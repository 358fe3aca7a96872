"""The server's model thread: one :class:`~prefixcache.scheduler.engine_loop.EngineLoop`, stepped on its own thread.

Requests reach the model only through here, in three calls made on the event loop's thread:

1. :meth:`EngineThread.admit` holds room for a request's items before any work is spent on it: at most
   ``max_queue`` items (all clients) may be admitted and not yet answered, and at most
   ``settings.client_share`` for one named client. A request that does not fit is refused whole, at once,
   with :class:`~prefixcache.errors.QueueFullError` (HTTP 429, with ``Retry-After``);
2. :meth:`EngineThread.submit` hands the request's prepared items and their runner to the model thread
   through a thread-safe inbox, and awaits one result per item, in the items' order;
3. :meth:`EngineThread.call` runs other model-thread work (building a task's prefix, unpinning one) between
   two steps.

The model thread loops: take what the inbox holds (waiting for it when nothing runs); turn each new request's
items into sequences (``runner.sequences``, which looks the prefix up in the pool, on this thread); add them to
the engine loop under the request's client; take one :meth:`~prefixcache.scheduler.engine_loop.EngineLoop.step`.
A request whose prefix is long and not yet held (``runner.prefix_build``: an OpenAI chat's long system prompt)
first has it computed ``max_step_tokens`` at a time, one chunk per turn of the loop, so other requests' steps
go on in between.
A sequence added between two steps joins at the next one, so a one-item classification that arrives while an
extraction decodes is scored in the next step, and rows that finish are refilled at once. Fairness is the
loop's own rule: waiting sequences are picked round-robin by client, within ``max_step_tokens`` and
``max_batch`` per step.

A request whose awaiting coroutine is cancelled (its client went away) has its sequences cancelled: they leave
at the next step and free their slots; a sequence not yet made is never made. Its admission (the ``hold`` given
to ``submit``) is kept until the last of them has left, so that dropped requests cannot crowd the loop beyond
``max_queue``.

Invariant 2 under concurrency: rows never see each other's keys and values (the loop's slots are per
sequence, the prefix is read-only), and only the model thread runs the model.

This module knows nothing about HTTP or tokenizers.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Callable, Hashable, Iterator, Sequence as Seq

from ..errors import ShuttingDownError
from ..model.allocator import release_freed_memory
from ..scheduler.engine_loop import EngineLoop
from ..scheduler.sequence import Sequence, Status
from .admission import Admission, Hold
from .jobs import Answers, Call, Job, resolve
from .prometheus import Metrics
from .runners import TaskRunner
from .settings import ServerSettings

log = logging.getLogger(__name__)


_WAKE = object()  # an inbox entry that only wakes the thread (to see that it should stop)


class EngineThread:
    """Admission, the inbox and the thread that steps ``engine``. See the module docstring for the contract.

    Call ``admit``, ``submit``, ``call``, ``start`` and ``stop`` from the event loop's thread.
    """

    def __init__(self, engine: EngineLoop, settings: ServerSettings, metrics: Metrics):
        self.engine = engine
        engine.on_schedule = self._scheduled
        self.admission = Admission(settings, metrics)
        self._metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._aio: asyncio.AbstractEventLoop | None = None
        self._jobs: dict[int, Job] = {}  # id(seq) -> its request (model thread only)
        self._done: list[Sequence] = []  # sequences that ended in the step being taken (model thread only)
        self._taken: set[int] = set()  # id(seq) of sequences fed at least once (they left the queue depth)
        self._live: set[Job] = set()  # requests submitted and not yet answered (for stop)
        self._building: deque[tuple[Job, Iterator[None]]] = deque()  # requests whose prefix is built between steps
        self._leaving: set[Job] = set()  # cancelled requests whose sequences still run (their holds, for stop)
        self._depth = 0  # items submitted and not yet fed (both threads change it, under the lock)
        self._depth_lock = threading.Lock()
        self.crashed: BaseException | None = None

    # --- state -------------------------------------------------------------------------------------

    @property
    def depth(self) -> int:
        """Items submitted and not yet taken into a step."""
        return self._depth

    @property
    def in_progress(self) -> int:
        """Items admitted and not yet answered (being prepared, queued or running)."""
        return self.admission.in_progress

    @property
    def running(self) -> bool:
        """True while the model thread takes steps (False before start, after stop, or if it died)."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    # --- lifecycle ---------------------------------------------------------------------------------

    def start(self) -> None:
        self._aio = asyncio.get_running_loop()
        self._stopping = False
        self._thread = threading.Thread(target=self._serve, name="prefixcache-model", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        """Stop taking steps (the step in progress ends first); every request not yet answered fails with
        ShuttingDownError."""
        if self._thread is None:
            return
        self._stopping = True
        self._inbox.put(_WAKE)
        await asyncio.to_thread(self._thread.join)
        self._thread = None
        error = ShuttingDownError("the server is shutting down; retry elsewhere")
        for job in list(self._live):
            resolve(job.future, error=error)
        self._live.clear()
        for job in list(self._leaving):  # the loop is gone, and with it their sequences
            job.on_left()
        while True:  # calls never taken
            try:
                entry = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(entry, Call):
                entry.future.set_exception(error)
        with self._depth_lock:
            self._depth = 0
            self._metrics.queue_depth.set(0)

    # --- admission (server/admission.py) ----------------------------------------------------------

    def admit(self, count: int, client: Hashable | None = None):
        """:meth:`Admission.admit <prefixcache.server.admission.Admission.admit>`: hold room for a request."""
        return self.admission.admit(count, client)

    # --- what requests call ------------------------------------------------------------------------

    async def submit(self, runner: TaskRunner, items: Seq, client: Hashable | None = None,
                     hold: Hold | None = None) -> Answers:
        """Run ``items`` through ``runner``'s sequences and wait for their results (one per item, in order).

        Call it inside ``admit(len(items), client)``: the queue bounds are enforced there. ``client`` names the
        turn the items' sequences wait in. Cancelling the awaiting coroutine cancels the sequences; ``hold``
        (what ``admit`` gave) is then kept until they have left the loop.

        Raises:
            ShuttingDownError: the thread is not running, or stopped before the items were answered.
            SequenceFailedError: (or what ``runner.answer`` raised) a sequence of this request failed.
        """
        if not items:
            return Answers([], 0)
        if not self.running:
            raise ShuttingDownError("the server is not running")
        job = Job(runner, items, client, asyncio.get_running_loop().create_future(), time.perf_counter())
        release = hold.defer() if hold is not None else None  # given back here, or once a cancelled job has left
        self._live.add(job)
        self._queued(len(items))
        self._inbox.put(job)
        cancelled = False
        try:
            return await job.future
        except asyncio.CancelledError:
            cancelled = True
            job.cancel(self._leave_later(job, release) if release is not None else None)
            self._metrics.abandoned.inc()  # counted once its sequences are flagged: none of them is admitted after
            raise
        finally:
            self._live.discard(job)
            if release is not None and not cancelled:
                release()

    async def call(self, fn: Callable[[], object]):
        """Run ``fn()`` on the model thread between two steps and return what it returns (or raise what it raised)."""
        if not self.running:
            raise ShuttingDownError("the server is not running")
        future: Future = Future()
        self._inbox.put(Call(fn, future))
        return await asyncio.wrap_future(future)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the model thread between two steps, without waiting (its failure is logged)."""
        future: Future = Future()
        future.add_done_callback(lambda f: f.exception() and log.error("model-thread call failed",
                                                                      exc_info=f.exception()))
        self._inbox.put(Call(fn, future))

    def _leave_later(self, job: Job, release: Callable[[], None]) -> Callable[[], None]:
        """What gives a cancelled ``job``'s room back once its sequences have left (or the thread stopped)."""
        self._leaving.add(job)

        def left() -> None:
            self._leaving.discard(job)
            release()
        return left

    # --- the model thread --------------------------------------------------------------------------

    def _serve(self) -> None:
        try:
            while not self._stopping:
                idle = not (self.engine.has_work or self._building)
                if idle and self.engine.trim():  # a long request's store, idle now: its memory back to the system
                    release_freed_memory()
                self._take_inbox(wait=idle)
                if self._stopping:
                    break
                if self._building:
                    self._build_chunk()
                if self.engine.has_work:
                    self._step()
        except BaseException as exc:  # the thread dies: /healthz answers 503, and waiting requests are told
            self.crashed = exc
            log.critical("the model thread stopped", exc_info=exc)
            for job in list(self._live):
                self._aio.call_soon_threadsafe(resolve, job.future, None, exc)

    def _take_inbox(self, wait: bool) -> None:
        """Take every inbox entry (blocking for the first one when ``wait``): add requests, run calls."""
        while True:
            try:
                entry = self._inbox.get() if wait else self._inbox.get_nowait()
            except queue.Empty:
                return
            wait = False
            if entry is _WAKE:
                continue
            if isinstance(entry, Call):
                try:
                    entry.future.set_result(entry.fn())
                except BaseException as exc:
                    entry.future.set_exception(exc)
                continue
            self._add(entry)

    def _add(self, job: Job) -> None:
        """A request's prefix build queued (when it has one), or its sequences made now."""
        if not job.cancelled:
            build = job.runner.prefix_build(self.engine.config.max_step_tokens)
            if build is not None:
                self._building.append((job, build))
                return
        self._make(job)

    def _build_chunk(self) -> None:
        """One chunk of the oldest pending prefix build (at most ``max_step_tokens`` tokens, so a step's worth of
        time); a build that is done, fails or whose request was cancelled gives way to making its sequences (a
        failed build leaves the prefix to ``runner.sequences``, as if there had been none)."""
        job, build = self._building[0]
        try:
            if not job.cancelled:
                next(build)
                return
        except StopIteration:
            release_freed_memory()  # the chunks' transient copies were many passes' worth
        except Exception as exc:
            log.warning("request %s: a prefix built in chunks for %r failed; it goes on without it", job.request_id,
                        job.runner.task.name, exc_info=exc)
        self._building.popleft()
        self._make(job)

    def _make(self, job: Job) -> None:
        """A request's sequences into the engine loop (or its error back, when they cannot be made)."""
        if job.cancelled:
            self._queued(-len(job.items))
            job.left(len(job.items), self._aio)
            return
        try:
            made = job.runner.sequences(job.items)
        except Exception as exc:
            log.error("request %s: sequences for %r could not be made", job.request_id, job.runner.task.name, exc_info=exc)
            self._queued(-len(job.items))
            job.left(len(job.items), self._aio)
            self._aio.call_soon_threadsafe(resolve, job.future, None, exc)
            return
        job.reused = made.prefix_tokens_reused
        for position, seq in enumerate(made.sequences):
            seq.client, seq.on_finish = job.client, self._finisher(job, position)
            self._jobs[id(seq)] = job
        job.seqs = list(made.sequences)
        if job.cancelled:  # cancelled while its sequences were being made
            job.cancel()
        for seq in job.seqs:
            self.engine.add(seq)

    def _finisher(self, job: Job, position: int) -> Callable[[Sequence], None]:
        def finished(seq: Sequence) -> None:
            self._done.append(seq)
            if id(seq) not in self._taken:  # it left before it was ever fed (cancelled, or failed at admission)
                self._queued(-1)
            job.left(1, self._aio)
            if seq.status is Status.CANCELLED or job.future.done():
                return
            try:
                job.results[position] = job.runner.answer(seq)
            except Exception as exc:
                for other in job.seqs:
                    other.cancel()
                self._aio.call_soon_threadsafe(resolve, job.future, None, exc)
                return
            job.remaining -= 1
            if job.remaining == 0:
                self._aio.call_soon_threadsafe(resolve, job.future, Answers(job.results, job.reused))
        return finished

    def _step(self) -> None:
        """One engine step, then its metrics: per task, the sequences it fed and how long it took."""
        started = time.perf_counter()
        try:
            self.engine.step()
        except Exception as exc:  # a step that raised outside any one sequence: its sequences fail, the loop goes on
            requests = sorted({str(job.request_id) for seq, _ in self.engine.last_plan.items
                               if (job := self._jobs.get(id(seq))) is not None})
            log.error("an engine step failed (requests %s)", ", ".join(requests) or "none", exc_info=exc)
            self._fail_scheduled(exc)
            self._forget_done()
            return
        seconds = time.perf_counter() - started
        fed: dict[tuple[str, str], list[Sequence]] = {}  # (task, kind) -> its sequences this step
        for seq, _ in self.engine.last_plan.items:
            job = self._jobs.get(id(seq))
            if job is not None:
                fed.setdefault((job.runner.task.name, job.runner.kind), []).append(seq)
        for (task, kind), seqs in fed.items():
            new = [seq for seq in seqs if seq.steps == 1]
            hits = sum(1 for seq in new if seq.prefix.length > 0)
            self._metrics.record_batch(task, kind, len(seqs), hits, seconds, new=len(new))
        self._forget_done()

    def _forget_done(self) -> None:
        """Drop the sequences that ended from the index of requests."""
        for seq in self._done:
            self._jobs.pop(id(seq), None)
            self._taken.discard(id(seq))
        self._done.clear()

    def _scheduled(self, plan) -> None:
        """Told by the engine loop what a step feeds, before it runs: sequences fed for the first time leave the
        queue depth, and how long they waited is observed."""
        now, first = time.perf_counter(), 0
        for seq, _ in plan.items:
            if id(seq) not in self._taken:
                self._taken.add(id(seq))
                first += 1
                job = self._jobs.get(id(seq))
                self._metrics.queue_wait_seconds.observe(now - job.enqueued_at if job else 0.0)
        self._queued(-first)

    def _fail_scheduled(self, exc: Exception) -> None:
        """The sequences of a step that raised: each one's request gets ``exc``, and they leave the loop."""
        for seq, _ in self.engine.last_plan.items:
            job = self._jobs.get(id(seq))
            if job is not None:
                job.cancel()
                self._aio.call_soon_threadsafe(resolve, job.future, None, exc)

    def _queued(self, count: int) -> None:
        """Add ``count`` (negative: taken into a step, or gone) to the items waiting (any thread)."""
        with self._depth_lock:
            self._depth += count
            self._metrics.queue_depth.set(self._depth)
