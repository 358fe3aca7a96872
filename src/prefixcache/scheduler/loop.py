"""The record loop: a task bound to a model (:class:`BoundTask`), what a Classifier and an Extractor share.

Records are cut into windows of ``RunConfig.window``, and each window goes through four stages
(:meth:`BoundTask._window` reads as exactly these four lines):

1. :meth:`~BoundTask.prepare`: render and tokenize each record and route it (after the stored
   prefix, or in full), or mark it failed; one :class:`WorkItem` per record;
2. :meth:`~BoundTask.plan`: cut the runnable items into batches over one prefix each
   (length-sorted when a pass takes more than one record);
3. :meth:`~BoundTask.run`: add the window's items as sequences to one engine loop
   (:mod:`prefixcache.scheduler.engine_loop`), in the plan's order, and step until all are done, at most a
   batch's size per step: scoring sequences go to the subclass's ``_forward`` one step's group at a time,
   generating ones (``_sequences``) run in slots, and a row that finishes is replaced at the next step;
4. :meth:`~BoundTask.report`: one result per record, in input order, counted into the stats.

A subclass says only how to route a tokenized record (``_route``), run a batch (``_forward``; a
generating task makes its own ``_sequences``), and turn an output or an error into its result
(``_result``, ``_failed``, ``_tally``).

It owns the task's prefix (built once, or looked up in a :class:`~prefixcache.cache.pool.PrefixPool`
on every access), or a tuned prefix (``tuned``: fitted, not built; records follow it the same way, and a
record that crosses its boundary is fed its tokens after it when they start with the prompt's prefix:
:func:`after_prompt_prefix`). ``full`` mode gets the empty prefix, so it re-encodes every prompt; the other
modes get the task's prefix, held for the one call (a pool may evict its entry meanwhile, never from
under a running call). What a mode means is asked of :class:`~prefixcache.types.Mode`, nowhere else.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from itertools import islice
from typing import Callable, Iterable, Iterator, Sequence as Seq

from ..cache.kv import PrefixKV
from ..cache.pool import LookupInfo, PrefixPool, TunedPrefix
from ..engine.rows import empty_prefix
from ..errors import InputError
from ..model.load import LoadedModel
from ..task.prompt import Encoded
from ..types import Mode, Record, RunConfig, WindowStats
from .engine_loop import EngineLoop, LoopConfig
from .generation import GenerationBackend
from .sequence import Scores, Sequence

Progress = Callable[[int], None]
CLI_STEP_TOKENS = 1 << 20  # a record loop bounds a step by its batch size alone (latency is no concern there)
Batch = tuple[PrefixKV, list["WorkItem"]]  # one engine call: the prefix its rows follow, and the items


@dataclass(frozen=True)
class Failure:
    """The output of an item whose sequence failed alone in the engine loop (its constraint failed, say)."""

    error: str


@dataclass(frozen=True)
class WorkItem:
    """One record of a window, prepared: its position, its tokens, and which prefix they follow."""

    index: int  # position in the window
    record: Record
    rows: tuple[int, ...] | None = None  # tokens fed after the prefix used
    full: bool = False  # fed after the empty prefix (full re-encode or boundary fallback)
    boundary_fallback: bool = False  # full only because its tokens cross the prefix boundary (a cached mode)
    error: str | None = None  # set: the record is reported, never run
    overflowed: bool = False  # the error: its prompt does not fit the model's context
    truncated: bool = False  # a field was cut to fit the context (classification's --overflow truncate)
    warning: str | None = None


def after_prompt_prefix(item: WorkItem, stored: Seq[int]) -> tuple[int, ...] | None:
    """A prepared record's own tokens after the prompt's prefix ``stored`` (its ids): ``item.rows`` for an item routed
    after it; for one routed in full, its tokens past ``stored`` when its whole prompt starts with ``stored`` and goes
    on past it; else (or for an item that failed) None. What a tuned prefix is trained on and followed by."""
    if item.rows is None or not item.full:
        return item.rows
    stored = tuple(stored)
    if tuple(item.rows[: len(stored)]) != stored or len(item.rows) == len(stored):
        return None
    return tuple(item.rows[len(stored):])


def route(index: int, record: Record, enc: Encoded, mode: Mode, **flags) -> WorkItem:
    """A tokenized record as an item: after the stored prefix, or in full (a mode that re-encodes, or a
    record whose tokens cross the prefix boundary: a boundary fallback). ``flags``: ``truncated``, ``warning``."""
    if not mode.uses_prefix:
        return WorkItem(index, record, rows=enc.full_ids, full=True, **flags)
    if enc.suffix_ids is None:
        return WorkItem(index, record, rows=enc.full_ids, full=True, boundary_fallback=True, **flags)
    return WorkItem(index, record, rows=enc.suffix_ids, **flags)


class BoundTask:
    """Subclasses set ``self.prompt`` (with ``prefix_ids``) before calling ``__init__`` here, set
    ``stats_type``, and define the methods at the end of this class."""

    stats_type: type[WindowStats] = WindowStats  # the counters a run of this task kind keeps

    continuous = True  # run windows through the engine loop; False: static batches (the path it replaced, to compare)
    fast_forward = True  # the loop appends tokens a row's grammar forces without a step; False: a step each (to compare)

    def __init__(self, loaded: LoadedModel, task, pool: PrefixPool | None = None):
        self.loaded = loaded
        self.task = task
        self.pool = pool
        self.last_lookup: LookupInfo | None = None  # what the last pool lookup did; never the prefix itself
        self.prefix_seconds = 0.0
        self._prefix: PrefixKV | None = None
        self._empty = empty_prefix(loaded.model)
        self.tuned: TunedPrefix | None = None  # set: records follow this fitted prefix instead of the prompt's
        self.backend: GenerationBackend | None = None  # set (kept across runs): generating rows run there, not torch

    @property
    def prefix(self) -> PrefixKV:
        """The task's prefix cache: built on first use, or looked up in the pool on every access.

        With a pool, nothing here keeps the prefix (only ``last_lookup``, which holds no tensor): the caller
        holds it for one call or pass, so an entry the pool evicts is freed once its passes end.

        Raises:
            PoolBudgetError: (with a pool) the prefix cannot fit in the pool's budget.
        """
        tuned = self.tuned
        if self.pool is not None:
            ids = tuned.prefix.token_ids if tuned is not None else self.prompt.prefix_ids
            lookup = self.pool.get(self.loaded, ids, pin=self.task.pin, name=self.task.name, tuned=tuned)
            self.last_lookup, self.prefix_seconds = lookup.info(), lookup.seconds
            return lookup.prefix
        if self._prefix is None:
            started = time.perf_counter()
            if tuned is not None:
                self._prefix = tuned.prefix.cast(self.loaded.dtype, self.loaded.device)
            else:
                self._prefix = PrefixKV.build(self.loaded.model, self.prompt.prefix_ids)
            self.prefix_seconds = time.perf_counter() - started
        return self._prefix

    @property
    def empty(self) -> PrefixKV:
        """The empty prefix: what an item re-encoded in full follows."""
        return self._empty

    def _stream(self, records: Iterable[Record], config: RunConfig, progress: Progress | None, stats) -> Iterator:
        """Cut the records into windows and run each over the prefix this mode uses (held for this call)."""
        prefix = self._empty
        if Mode(config.mode).uses_prefix:
            prefix = self.prefix
            stats.prefix_seconds = self.prefix_seconds
        records = iter(records)
        while window := list(islice(records, config.window)):
            yield from self._window(window, config, progress, stats, prefix)

    def _window(self, records: list[Record], config: RunConfig, progress, stats, stored: PrefixKV) -> Iterator:
        """One window: prepare, plan, run, report. Yields one result per record, in input order."""
        started = time.perf_counter()
        items = self.prepare(records, config)
        batches = self.plan(items, Mode(config.mode).pass_size(config.batch_size), stored)
        outputs = self.run(batches, stats, progress)
        results = self.report(items, outputs, stats, progress)
        stats.seconds += time.perf_counter() - started
        yield from results

    # --- the four stages ---------------------------------------------------------------------------

    def prepare(self, records: Seq[Record], config: RunConfig, tokenizer=None) -> list[WorkItem]:
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
            item = self._route(i, records[i], enc, config)
            items.append(self._after_tuned(item) if self.tuned is not None and item.full else item)
        return sorted(items, key=lambda it: it.index)

    def _after_tuned(self, item: WorkItem) -> WorkItem:
        """A record routed in full, under a tuned prefix: its tokens after the prompt's prefix, fed after the tuned
        one, when its whole prompt starts with the prompt's prefix; else failed, named (no text re-encodes a tuned
        prefix)."""
        own = after_prompt_prefix(item, self.prompt.prefix_ids) if item.boundary_fallback else None
        if own is None:
            why = "full re-encoding" if not item.boundary_fallback else "its tokens cross the prefix's boundary"
            return replace(item, rows=None, full=False, error=f"record {item.record.id!r}: a tuned prefix has no text "
                           f"to re-encode ({why}); run it in cached or batched mode, or without the tuned head")
        return replace(item, rows=own, full=False)

    def plan(self, items: Seq[WorkItem], size: int, stored: PrefixKV) -> Iterator[Batch]:
        """Batches of up to ``size`` runnable items, each over one prefix: full re-encodes (and boundary
        fallbacks) after the empty prefix, the rest after ``stored``. With ``size > 1`` items are sorted
        by length to cut padding. Items with an ``error`` are left out (:meth:`report` answers them)."""
        runnable = [it for it in items if it.error is None]
        for use_full in (True, False):
            group = [it for it in runnable if it.full == use_full]
            if size > 1:
                group = sorted(group, key=lambda it: len(it.rows))
            prefix = self._empty if use_full else stored
            for start in range(0, len(group), size):
                yield prefix, group[start : start + size]

    def run(self, batches: Iterable[Batch], stats, progress: Progress | None = None, continuous: bool | None = None,
            ) -> dict[int, object]:
        """Every batch's items as sequences of one engine loop (:mod:`~prefixcache.scheduler.engine_loop`), stepped
        until all are done, at most a batch's size per step: a generating row that finishes is replaced at the next
        step. ``continuous=False`` (or ``self.continuous`` False) runs the batches as they are instead, one
        ``_forward`` call each (the static path, kept to compare). With a pool, the loop's slot store counts in the
        pool's budget while it runs, and is given back when the run ends. Returns item index -> its output."""
        batches = list(batches)
        if not (self.continuous if continuous is None else continuous):
            return self._run_static(batches, stats, progress)
        size = max((len(batch) for _, batch in batches), default=1)
        engine = EngineLoop(self.loaded.model, self.loaded.tokenizer, LoopConfig(CLI_STEP_TOKENS, size, fast_forward=self.fast_forward), self.pool,
                            self.backend)
        done = (lambda seq: progress(1)) if progress else None
        seqs = self._sequences(batches, stats, done)
        try:
            engine.run_until_done(seqs)
        finally:
            engine.close()  # its slot store's bytes back to the pool's budget
        self._count_loop(engine, seqs, stats)
        return {seq.tag.index: seq.result if seq.error is None else Failure(seq.error) for seq in seqs}

    def _run_static(self, batches: list[Batch], stats, progress: Progress | None) -> dict[int, object]:
        """One ``_forward`` call per batch; item index -> its output."""
        outputs: dict[int, object] = {}
        for prefix, batch in batches:
            outputs.update(zip((item.index for item in batch), self._forward(prefix, batch, stats)))
            if progress:
                progress(len(batch))
        return outputs

    def report(self, items: Seq[WorkItem], outputs: dict[int, object], stats, progress: Progress | None = None,
               ) -> list:
        """One result per item, in the items' order (an item with ``error`` gets its error result); counts
        the items into ``stats``."""
        for item in items:  # an item that never ran counts as done here, after the passes
            if item.error is not None and progress:
                progress(1)
        results = [self._failed(it) if it.error is not None else self._result(it, outputs[it.index]) for it in items]
        stats.records += len(items)
        stats.boundary_fallbacks += sum(1 for it in items if it.boundary_fallback)
        self._tally(stats, items, results)
        return results

    # --- what a subclass defines -------------------------------------------------------------------

    def _route(self, index: int, record: Record, enc: Encoded, config: RunConfig) -> WorkItem:
        """A tokenized record as an item (:func:`route`); a subclass may fit it to the context first."""
        return route(index, record, enc, Mode(config.mode))

    def _forward(self, prefix: PrefixKV, batch: list[WorkItem], stats) -> list:
        """One engine call for ``batch`` over ``prefix``; one output per item."""
        raise NotImplementedError

    def _sequences(self, batches: list[Batch], stats, on_finish) -> list[Sequence]:
        """The engine loop's sequences for every item of ``batches``, over its batch's prefix (``tag``: the item),
        in the batches' order. Here: scoring sequences, whose each step's sequences of one prefix go to one
        ``_forward`` call; a generating task says otherwise."""
        want = Scores(ForwardScorer(self, stats))
        return [Sequence(prefix, item.rows, want, tag=item, on_finish=on_finish)
                for prefix, batch in batches for item in batch]

    def _count_loop(self, engine: EngineLoop, seqs: list[Sequence], stats) -> None:
        """Add what running ``seqs`` through ``engine`` did to ``stats``;
        here nothing: ``_forward`` counts its own calls."""


class ForwardScorer:
    """A task's :class:`~prefixcache.scheduler.sequence.Scorer`: one ``_forward`` call, counted into ``stats``
    (the sequences' ``tag``: their :class:`WorkItem`)."""

    def __init__(self, bound: BoundTask, stats):
        self.bound, self.stats = bound, stats

    def score(self, prefix: PrefixKV, seqs: Seq[Sequence]) -> list:
        return self.bound._forward(prefix, [seq.tag for seq in seqs], self.stats)

    def _result(self, item: WorkItem, output):
        """The result for an item that ran (``item.boundary_fallback`` says whether it fell back to full)."""
        raise NotImplementedError

    def _failed(self, item: WorkItem):
        """The result for an item whose ``error`` is set (it never ran)."""
        raise NotImplementedError

    def _tally(self, stats, items: list[WorkItem], results: list) -> None:
        """Add the window's error counts to ``stats`` (``results`` is aligned with ``items``)."""
        raise NotImplementedError
