"""BoundTask: a task bound to a model, what a Classifier and an Extractor share.

It owns the task's prefix (built once, or looked up in a
:class:`~prefixcache.cache.pool.PrefixPool` on every access) and the record loop:
records are cut into windows of ``RunConfig.window``, and each window is
prepared, planned into batches (length-sorted in ``batched`` mode), run and
reported in input order; a subclass says only how to prepare a record, run a
batch, and turn an output (or an error) into its result. ``full`` mode gets the empty prefix, so it
re-encodes every prompt; the other modes get the task's prefix, held for the
one call (a pool may evict its entry meanwhile, never from under a running call).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Iterator, Sequence

from ..engine.forward import empty_prefix
from ..errors import InputError
from ..cache.kv import PrefixKV
from ..model.load import LoadedModel
from ..cache.pool import Lookup, PrefixPool


@dataclass
class WindowStats:
    """Counters every run keeps; :class:`~prefixcache.run.classify.RunStats` and the extraction stats add their own."""

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
    """Subclasses set ``self.prompt`` (with ``prefix_ids``) before calling ``__init__`` here, set
    ``stats_type``, and define the methods at the end of this class."""

    stats_type: type[WindowStats] = WindowStats  # the counters a run of this task kind keeps

    def __init__(self, loaded: LoadedModel, task, pool: PrefixPool | None = None):
        self.loaded = loaded
        self.task = task
        self.pool = pool
        self.last_lookup: Lookup | None = None
        self.prefix_seconds = 0.0
        self._prefix: PrefixKV | None = None
        self._empty = empty_prefix(loaded.model)

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

    def _plan(self, items: Sequence[WorkItem], size: int, stored: PrefixKV) -> Iterator[tuple[PrefixKV, list[WorkItem]]]:
        """Batches of up to ``size`` items, each over one prefix: full re-encodes (and boundary fallbacks)
        after the empty prefix, the rest after ``stored``. With ``size > 1`` items are sorted by length
        to cut padding."""
        runnable = [it for it in items if it.error is None]
        for use_full in (True, False):
            group = [it for it in runnable if it.full == use_full]
            if size > 1:
                group = sorted(group, key=lambda it: len(it.rows))
            prefix = self._empty if use_full else stored
            for start in range(0, len(group), size):
                yield prefix, group[start : start + size]

    def _execute(self, items: Sequence[WorkItem], size: int, stored: PrefixKV, stats, mode: str, progress=None) -> dict:
        """Run ``items`` (whose ``index`` values are distinct) in batches of ``size``; index -> result.
        Items with an ``error`` get their error result without running."""
        results: dict[int, object] = {}
        for prefix, batch in self._plan(items, size, stored):
            for item, output in zip(batch, self._run(prefix, batch, stats)):
                results[item.index] = self._result(item, output, mode)
            if progress:
                progress(len(batch))
        for item in items:
            if item.error is not None:
                results[item.index] = self._failed(item)
                if progress:
                    progress(1)
        return results

    def _window(self, records: list, config, progress, stats, stored: PrefixKV) -> Iterator:
        """Prepare, plan, run and report one window; yields one result per record, in input order."""
        started = time.perf_counter()
        items = self.prepare(records, config)
        size = config.batch_size if config.mode == "batched" else 1
        results = self._execute(items, size, stored, stats, config.mode, progress)
        stats.records += len(items)
        stats.boundary_fallbacks += sum(1 for i in items if i.full and config.mode != "full")
        self._tally(stats, items, results)
        stats.seconds += time.perf_counter() - started
        for item in items:
            yield results[item.index]

    def prepare(self, records: Sequence, config, tokenizer=None) -> list[WorkItem]:
        """One WorkItem per record, in input order: rendered, tokenized as the full prompt, then routed.

        A record the reader marked bad, or whose fields do not fit the template (or, for a
        classifier under ``overflow="error"``, the context), gets an ``error`` instead of rows.
        ``tokenizer`` defaults to the model's; a caller on another thread passes its own copy.
        Reads only the prompt and the task, so it may run while another thread runs the model.
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
        encoded = self.prompt.encode(tokenizer or self.loaded.tokenizer, [t for _, t in texts])
        for (i, _), enc in zip(texts, encoded):
            items.append(self._route(i, records[i], enc, config))
        return sorted(items, key=lambda it: it.index)

    def run_prepared(self, items: Sequence[WorkItem]) -> list:
        """Run already prepared ``items`` (from :meth:`prepare`, possibly of several calls) as one batch
        per prefix: the stored prefix (looked up once), and the empty one for full re-encodes.

        Returns one result per item, in the items' order (an item with ``error`` gets its error result).
        This is the server's forward pass: it is ``batched`` mode over exactly these items.
        """
        items = [replace(item, index=position) for position, item in enumerate(items)]
        needs_prefix = any(it.error is None and not it.full for it in items)
        stored = self.prefix if needs_prefix else self._empty
        results = self._execute(items, max(1, len(items)), stored, self.stats_type(), "batched")
        return [results[item.index] for item in items]

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
