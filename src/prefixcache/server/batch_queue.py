"""The micro-batcher's queues: a request's items (:class:`Job`) and one runner's waiting slots, taken
one client at a time (:class:`RunnerQueue`). Plain data, used only on the event loop's thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from typing import Hashable, Iterator, Sequence

from ..scheduler.loop import WorkItem
from .runners import TaskRunner


@dataclass(eq=False)
class Job:
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
class RunnerQueue:
    """Items waiting for one runner: per client, (job, position in the job) slots in arrival order.

    ``lanes`` is in turn order: :meth:`take` serves the first lane's oldest slot, then moves
    that lane to the back, so clients take turns item by item, and the turn carries over
    from one pass to the next. A client's lane exists only while it holds slots.
    """

    runner: TaskRunner
    lanes: dict[Hashable, deque[tuple[Job, int]]] = field(default_factory=dict)
    size: int = 0
    last_arrival: float = 0.0

    def add(self, job: Job, client: Hashable) -> None:
        self.lanes.setdefault(client, deque()).extend((job, position) for position in range(len(job.items)))
        self.size += len(job.items)
        self.last_arrival = job.enqueued_at

    def head_time(self) -> float:
        """When the oldest slot still queued arrived."""
        return min(lane[0][0].enqueued_at for lane in self.lanes.values())

    def newest_time(self) -> float:
        """When the newest slot arrived."""
        return self.last_arrival

    def slots(self) -> Iterator[tuple[Job, int]]:
        """Every queued slot (in no particular order)."""
        for lane in self.lanes.values():
            yield from lane

    def take(self, limit: int) -> tuple[list[tuple[Job, int]], int]:
        """Up to ``limit`` live slots, one per client in turn, and how many slots left the queue
        (cancelled ones are dropped and do not use up their client's turn)."""
        taken, removed = [], 0
        while self.lanes and len(taken) < limit:
            client = next(iter(self.lanes))
            lane = self.lanes.pop(client)
            while lane:
                job, position = lane.popleft()
                removed += 1
                if not job.future.done():  # done early: its client went away or another pass failed
                    taken.append((job, position))
                    break
            if lane:
                self.lanes[client] = lane  # to the back: the next client's turn
        self.size -= removed
        return taken, removed
