"""The end-of-run summary of a Ray run: items/s per worker and in total, and where the time went.

Every output row carries the worker that made it and that worker's timings
(:data:`STAT_COLUMNS`); :class:`Tally` adds them up on the driver. Only rows
the driver received count, so the work of a worker that died mid-batch (and
was redone elsewhere) is not counted twice. A restarted worker is a new
process, so it appears as its own line.

Per worker, ``busy`` is the time spent inside the classifier (tokenizing and
forward passes) and ``items/s`` is records / busy. The total ``items/s`` is
records / wall time of the whole run, start-up included; ``startup_seconds`` is
the wait for the first result (worker processes starting, importing, loading
the model and the prefix).

This module knows nothing about Ray or models.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

STAT_COLUMNS = ("worker", "seconds", "load_seconds", "prefix_seconds", "prefix_source")


@dataclass
class WorkerStats:
    """One worker process: what it did and what its start cost."""

    worker: str
    records: int = 0
    busy_seconds: float = 0.0
    load_seconds: float = 0.0
    prefix_seconds: float = 0.0
    prefix_source: str = ""

    @property
    def items_per_second(self) -> float:
        return self.records / self.busy_seconds if self.busy_seconds > 0 else 0.0


@dataclass(frozen=True)
class RaySummary:
    """What a Ray run did. ``parts`` are the written files (empty when lines went to stdout).

    ``wall_seconds`` runs from the start of the dataset's execution (Ray already up) to its
    last row; ``startup_seconds`` is the part of it before the first row arrived.
    """

    records: int
    errors: int
    duplicates: int
    wall_seconds: float
    startup_seconds: float
    workers_requested: int
    workers: tuple[WorkerStats, ...]
    parts: tuple[str, ...] = ()

    @property
    def items_per_second(self) -> float:
        return self.records / self.wall_seconds if self.wall_seconds > 0 else 0.0

    def to_json(self) -> dict:
        document = asdict(self)
        document["items_per_second"] = round(self.items_per_second, 3)
        for entry, stats in zip(document["workers"], self.workers):
            entry["items_per_second"] = round(stats.items_per_second, 3)
        return document

    def lines(self) -> list[str]:
        """A small text table: one line per worker, then the total."""
        out = [f"{'worker':<28} {'records':>8} {'busy s':>8} {'items/s':>8} {'load s':>7} {'prefix s':>9} prefix from"]
        for w in sorted(self.workers, key=lambda w: w.worker):
            out.append(
                f"{w.worker:<28} {w.records:>8} {w.busy_seconds:>8.2f} {w.items_per_second:>8.1f} "
                f"{w.load_seconds:>7.2f} {w.prefix_seconds:>9.3f} {w.prefix_source}"
            )
        extra = len(self.workers) - self.workers_requested
        note = f"; {extra} more worker process(es) than requested: restarts or replacements" if extra > 0 else ""
        out.append(
            f"total: {self.records} records ({self.errors} errors) in {self.wall_seconds:.1f} s wall = "
            f"{self.items_per_second:.1f} items/s with {self.workers_requested} worker(s), "
            f"{self.startup_seconds:.1f} s of it before the first result{note}"
        )
        return out


@dataclass
class Tally:
    """Adds up output rows into :class:`WorkerStats`, one per worker process."""

    workers: dict[str, WorkerStats] = field(default_factory=dict)

    def add(self, row: dict) -> None:
        """Count one output row (a dict holding at least :data:`STAT_COLUMNS`)."""
        stats = self.workers.get(row["worker"])
        if stats is None:
            stats = self.workers[row["worker"]] = WorkerStats(
                row["worker"], load_seconds=row["load_seconds"], prefix_seconds=row["prefix_seconds"],
                prefix_source=row["prefix_source"],
            )
        stats.records += 1
        stats.busy_seconds += row["seconds"]
