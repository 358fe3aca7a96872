"""BoundTask: a task bound to a model, what a Classifier and an Extractor share.

It owns the task's prefix (built once, or looked up in a
:class:`~prefixcache.pool.PrefixPool` on every access) and the record loop:
records are cut into windows of ``RunConfig.window``, and each window is
prepared, planned into batches (length-sorted in ``batched`` mode), run and
reported in input order; a subclass says only how to prepare a record, run a
batch, and turn an output (or an error) into its result. ``full`` mode gets the empty prefix, so it
re-encodes every prompt; the other modes get the task's prefix, held for the
one call (a pool may evict its entry meanwhile, never from under a running call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from .engine import empty_prefix
from .errors import InputError
from .kv import PrefixKV
from .models import LoadedModel
from .pool import Lookup, PrefixPool


@dataclass
class WindowStats:
    """Counters every run keeps; :class:`~prefixcache.runner.RunStats` and the extraction stats add their own."""

    records: int = 0
    errors: int = 0
    boundary_fallbacks: int = 0
    forward_passes: int = 0
    seconds: float = 0.0
    prefix_seconds: float = 0.0


@dataclass(frozen=True)
class WorkItem:
    """One record of a window, prepared: its position, its tokens, and which prefix they follow."""

    index: int  # position in the window
    record: object  # the Record
    rows: tuple[int, ...] | None = None  # tokens fed after the prefix used
    full: bool = False  # fed after the empty prefix (full re-encode or boundary fallback)
    error: str | None = None  # set: the record is reported, never run
    truncated: bool = False  # a field was cut to fit the context (classification's --overflow truncate)
    warning: str | None = None


class BoundTask:
    """Subclasses set ``self.prompt`` (with ``prefix_ids``) before calling ``__init__`` here, and define ``_window``."""

    def __init__(self, loaded: LoadedModel, task, pool: PrefixPool | None = None):
        self.loaded = loaded
        self.task = task
        self.pool = pool
        self.last_lookup: Lookup | None = None
        self.prefix_seconds = 0.0
        self._prefix: PrefixKV | None = None
        self._empty = empty_prefix(loaded.model)

    @property
    def reencode_prefix(self) -> PrefixKV:
        """The zero-length prefix: rows run after it are whole prompts, re-encoded in full."""
        return self._empty

    @property
    def prefix(self) -> PrefixKV:
        """The task's prefix cache: built on first use, or looked up in the pool on every access.

        Raises:
            PoolBudgetError: (with a pool) the prefix cannot fit in the pool's budget.
        """
        if self.pool is not None:
            lookup = self.pool.get(self.loaded, self.prompt.prefix_ids, pin=self.task.pin, name=self.task.name)
            self.last_lookup, self.prefix_seconds = lookup, lookup.seconds
            return lookup.prefix
        if self._prefix is None:
            started = time.perf_counter()
            self._prefix = PrefixKV.build(self.loaded.model, self.prompt.prefix_ids)
            self.prefix_seconds = time.perf_counter() - started
        return self._prefix

    def _stream(self, records: Iterable, config, progress: Callable[[int], None] | None, stats) -> Iterator:
        """Window the records and hand each window to ``_window`` with the prefix this mode uses."""
        prefix = self._empty
        if config.mode != "full":
            prefix = self.prefix  # held for this call only
            stats.prefix_seconds = self.prefix_seconds
        window: list = []
        for record in records:
            window.append(record)
            if len(window) >= config.window:
                yield from self._window(window, config, progress, stats, prefix)
                window = []
        if window:
            yield from self._window(window, config, progress, stats, prefix)

    def _plan(self, items: list[WorkItem], config, stored: PrefixKV) -> Iterator[tuple[PrefixKV, list[WorkItem]]]:
        """Batches, each over one prefix: full re-encodes (and boundary fallbacks) after the empty
        prefix, the rest after ``stored``. ``batched`` sorts by length to cut padding."""
        runnable = [it for it in items if it.error is None]
        size = config.batch_size if config.mode == "batched" else 1
        for use_full in (True, False):
            group = [it for it in runnable if it.full == use_full]
            if size > 1:
                group = sorted(group, key=lambda it: len(it.rows))
            prefix = self._empty if use_full else stored
            for start in range(0, len(group), size):
                yield prefix, group[start : start + size]

    def _window(self, records: list, config, progress, stats, stored: PrefixKV) -> Iterator:
        """Prepare, plan, run and report one window; yields one result per record, in input order."""
        started = time.perf_counter()
        items = self._prepare(records, config)
        results: dict[int, object] = {}
        for prefix, batch in self._plan(items, config, stored):
            for item, output in zip(batch, self._run(prefix, batch, stats)):
                results[item.index] = self._result(item, output, config.mode)
            if progress:
                progress(len(batch))
        for item in items:
            if item.error is not None:
                results[item.index] = self._failed(item)
                if progress:
                    progress(1)
        stats.records += len(items)
        stats.boundary_fallbacks += sum(1 for i in items if i.full and config.mode != "full")
        self._tally(stats, items, results)
        stats.seconds += time.perf_counter() - started
        for item in items:
            yield results[item.index]

    def _prepare(self, records: list, config) -> list[WorkItem]:
        """One WorkItem per record, in input order: rendered, tokenized as the full prompt, then routed.

        A record the reader marked bad, or whose fields do not fit the template, gets an ``error``.
        """
        texts, items = [], []
        for i, record in enumerate(records):
            if record.error is not None:  # a row the reader could not turn into fields
                items.append(WorkItem(i, record, error=record.error))
                continue
            try:
                texts.append((i, self.prompt.suffix_text(record.fields, record.id)))
            except InputError as exc:
                items.append(WorkItem(i, record, error=str(exc)))
        encoded = self.prompt.encode(self.loaded.tokenizer, [t for _, t in texts])
        for (i, _), enc in zip(texts, encoded):
            items.append(self._route(i, records[i], enc, config))
        return sorted(items, key=lambda it: it.index)

    def _route(self, index: int, record, enc, config) -> WorkItem:
        """A tokenized record as an item: after the stored prefix, or in full (``full`` mode, or a
        record whose tokens cross the prefix boundary)."""
        if config.mode == "full" or enc.suffix_ids is None:
            return WorkItem(index, record, rows=enc.full_ids, full=True)
        return WorkItem(index, record, rows=enc.suffix_ids)

    # --- what a subclass defines -------------------------------------------------------------------

    def _run(self, prefix: PrefixKV, batch: list[WorkItem], stats) -> list:
        """One engine call for ``batch`` over ``prefix``; one output per item."""
        raise NotImplementedError

    def _result(self, item: WorkItem, output, mode: str):
        """The result for an item that ran."""
        raise NotImplementedError

    def _failed(self, item: WorkItem):
        """The result for an item whose ``error`` is set (it never ran)."""
        raise NotImplementedError

    def _tally(self, stats, items: list[WorkItem], results: dict) -> None:
        """Add the window's error counts to ``stats``."""
        raise NotImplementedError
