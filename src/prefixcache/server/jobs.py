"""A request on its way through the server's model thread (:mod:`prefixcache.server.engine_thread`): its
:class:`Job` (what the thread fills in as its sequences end), a :class:`Call` of other model-thread work, and the
:class:`Answers` a request gets back.

This module knows nothing about HTTP, tokenizers or the model.
"""

from __future__ import annotations

import asyncio
import contextvars
import threading
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence as Seq

from ..scheduler.sequence import Sequence
from .runners import TaskRunner


REQUEST_ID_VAR: contextvars.ContextVar[str | None] = contextvars.ContextVar("prefixcache_request_id", default=None)
"""The id of the request the running task serves (None outside one; the HTTP middleware sets it): a job keeps it,
so that what the model thread logs for a request names it."""


@dataclass(frozen=True)
class Answers:
    """A request's results (one per item, in order) and the stored-prefix tokens its items did not recompute."""

    results: list
    prefix_tokens_reused: int


@dataclass(eq=False)
class Job:
    """One request on its way through the model thread."""

    runner: TaskRunner
    items: Seq
    client: Hashable | None
    future: asyncio.Future
    enqueued_at: float  # perf_counter() when it was submitted
    results: list = field(init=False)
    remaining: int = field(init=False)
    reused: int = 0
    seqs: list[Sequence] = field(default_factory=list)
    cancelled: bool = False
    alive: int = field(init=False)  # items whose sequence has not left the loop (or was never made)
    on_left: Callable[[], None] | None = None  # run on the event loop once ``alive`` is 0 (a deferred hold)
    lock: threading.Lock = field(default_factory=threading.Lock)
    request_id: str | None = field(default_factory=REQUEST_ID_VAR.get)  # made on the event loop, in its request's task

    def __post_init__(self):
        self.results = [None] * len(self.items)
        self.remaining = self.alive = len(self.items)

    def cancel(self, on_left: Callable[[], None] | None = None) -> None:
        """Its sequences leave at the next step (a flag each one's loop reads); ``on_left``, when given (on the
        event loop's thread), runs there once the last of them has left, or at once if none is left."""
        with self.lock:
            self.cancelled = True
            now = on_left is not None and self.alive == 0
            if on_left is not None and not now:
                self.on_left = on_left
        for seq in list(self.seqs):
            seq.cancel()
        if now:
            on_left()

    def left(self, count: int, aio: asyncio.AbstractEventLoop) -> None:
        """On the model thread: ``count`` of its items' sequences left the loop (or will never be made)."""
        with self.lock:
            self.alive -= count
            fire = self.on_left if self.alive == 0 else None
        if fire is not None:
            aio.call_soon_threadsafe(fire)


@dataclass(frozen=True)
class Call:
    """Other work for the model thread: ``fn()``, its outcome into ``future``."""

    fn: Callable[[], object]
    future: Future


def resolve(future: asyncio.Future, result=None, error: BaseException | None = None) -> None:
    """On the event loop: settle ``future`` unless it already is (a cancelled request's, say)."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)

