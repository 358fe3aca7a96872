"""Task runners: what the server makes of one request's items for one task.

A runner binds one task to one model. It has three parts, run on two threads:

* :meth:`TaskRunner.prepare` (a *prep* thread): turn request items into
  :class:`~prefixcache.scheduler.loop.WorkItem` token rows with the engine's own
  :meth:`~prefixcache.scheduler.loop.BoundTask.prepare` (rendering, the prefix boundary
  check and, for classification, the context check), then check the server's
  limits, naming the item that breaks one. It tokenizes with the prep thread's
  own tokenizer copy, never the model thread's.
* :meth:`TaskRunner.sequences` (the *model* thread): the items as sequences of the engine loop
  (:mod:`prefixcache.scheduler.sequence`), over the task's prefix (looked up in the pool here) or, for an
  item re-encoded in full, the empty prefix; with how many stored-prefix tokens they reuse.
* :meth:`TaskRunner.answer` (the *model* thread): a finished sequence's JSON-ready result.

A classification item is a scoring sequence whose scorer is the Classifier's own engine call; an extraction
item is a generating sequence with the Extractor's decoding settings and constraint. So a server result is
exactly what the library returns for that record: the same preparation and the same engine calls.

Runners are chosen by the task's ``kind`` through :data:`RUNNER_KINDS`:
``classify`` (:class:`ClassifyRunner`) and ``extract`` (:class:`ExtractRunner`). Both go through the same
engine thread, limits and metrics.

Prefixes come from the service's :class:`~prefixcache.cache.pool.PrefixPool`: a runner
looks its prefix up once on construction (building it, or finding it held) and
once per request, and never keeps it in between (a request's sequences hold it while they run), so the
pool's byte budget and evictions govern prefix memory. Without a pool (``pool=None``) a runner builds
its prefix once and keeps it.

This module knows nothing about HTTP or queues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Protocol, Sequence

from ..errors import ItemError, RequestTooLargeError, SequenceFailedError, SequenceTooLongError, TaskUploadError
from ..scheduler.loop import BoundTask, Failure, ForwardScorer, WorkItem
from ..scheduler.sequence import Scores, Sequence as EngineSequence, Status
from ..scheduler.extract import Extractor
from ..model.load import LoadedModel
from ..cache.pool import PrefixKey, PrefixPool
from ..engine.head_file import describe_head
from ..scheduler.classify import Classifier
from ..types import Record, RunConfig
from ..task.extract_prompt import build_extract_prompt
from ..task.prompt import build_prompt
from ..task.definition import ExtractTask, Task
from .settings import ServerSettings


@dataclass(frozen=True)
class Submitted:
    """A request's sequences (one per item, in order) and the stored-prefix tokens they do not recompute."""

    sequences: list[EngineSequence]
    prefix_tokens_reused: int


class TaskRunner(Protocol):
    """The contract every runner kind meets (the OpenAI routes' runners meet it too).

    ``prepare`` may be called from a prep thread while ``sequences`` and ``answer`` run on the
    model thread; none mutates shared state (the prefix is read-only).
    """

    kind: ClassVar[str]
    task: Task | ExtractTask
    prefix_key: PrefixKey
    """The prefix's identity in the pool (what a DELETE unpins)."""
    prefix_tokens: int
    prefix_bytes: int
    """The stored prefix's length and size, as when it was first built (the pool may evict it since)."""

    def describe(self) -> dict: ...

    def prepare(self, tokenizer, records: Sequence[Record], max_item_tokens: int) -> list[WorkItem]:
        """Tokenize ``records`` with ``tokenizer``. Raises ItemError naming the first bad item."""
        ...

    def prefix_build(self, chunk_tokens: int) -> Iterator[None] | None:
        """On the model thread, before ``sequences``: work to run between steps, one ``next`` at a time (a long
        prefix computed ``chunk_tokens`` at a time), or None when there is none."""
        ...

    def sequences(self, items: Sequence) -> Submitted:
        """On the model thread: one engine-loop sequence per item, in order (``tag``: the item)."""
        ...

    def answer(self, seq: EngineSequence) -> dict:
        """On the model thread: the JSON-ready result of a sequence that ended. Raises SequenceFailedError for a
        sequence the loop failed."""
        ...


class _BoundRunner:
    """What both runner kinds share: a :class:`~prefixcache.scheduler.loop.BoundTask` (a Classifier or an
    Extractor) whose prefix is built (or found in the pool) on construction, and the three parts,
    ``prepare``, ``sequences`` and ``answer``, that go through it.

    Construct it on the model thread: building the prefix runs the model.
    ``prefix_limit`` (uploads only) is checked before the prefix is built.

    Raises (on construction):
        PromptError: the task cannot be rendered for this tokenizer.
        TaskUploadError: the prefix is longer than ``prefix_limit``.
        PoolBudgetError: the prefix cannot fit in the pool's budget.
    """

    kind: ClassVar[str]

    def __init__(self, loaded: LoadedModel, task: Task | ExtractTask, bound: BoundTask, prefix_limit: int | None):
        self.task = task
        self.bound = bound
        _check_prefix_limit(task.name, len(bound.prompt.prefix_ids), prefix_limit)
        prefix = bound.prefix  # built (or found in the pool) here; a pool lookup again per pass
        self.prefix_tokens, self.prefix_bytes = prefix.length, prefix.nbytes  # remembered: the pool may evict it
        self.prefix_key = PrefixKey.of(loaded, bound.prompt.prefix_ids)

    def prepare(self, tokenizer, records: Sequence[Record], max_item_tokens: int) -> list[WorkItem]:
        return prepare_items(self.bound, tokenizer, records, max_item_tokens)

    def prefix_build(self, chunk_tokens: int) -> None:
        """Nothing: the task's prefix was built when the task was (at start-up or upload), between steps."""
        return None

    def sequences(self, items: Sequence[WorkItem]) -> Submitted:
        """The items as sequences: after the stored prefix (looked up once, here), or after the empty prefix for
        an item re-encoded in full. The first item over the stored prefix is charged what the pool lookup
        computed (a prefix evicted and rebuilt for this request reused nothing, or only a shared leading part);
        the request's other items reused the whole prefix; an item re-encoded in full reused nothing."""
        self.bound.last_lookup = None
        stored = self.bound.prefix if any(not item.full for item in items) else None
        lookup = self.bound.last_lookup  # None: the runner keeps its own prefix (no pool), never rebuilt
        cached = [item for item in items if not item.full]
        reused = self.prefix_tokens * len(cached)
        if cached and lookup is not None:
            reused += lookup.tokens_reused - self.prefix_tokens
        seqs = [EngineSequence(self.bound.empty if item.full else stored, item.rows, self._want(item), tag=item)
                for item in items]
        return Submitted(seqs, reused)

    def answer(self, seq: EngineSequence) -> dict:
        if seq.status is not Status.FINISHED:
            raise failed(seq)
        return self.bound._result(seq.tag, seq.result).to_json()


class ClassifyRunner(_BoundRunner):
    """A classification task on a model, over :class:`~prefixcache.scheduler.classify.Classifier`: a pass is one
    :func:`~prefixcache.engine.forward.score_rows` call."""

    kind: ClassVar[str] = "classify"

    def __init__(
        self, loaded: LoadedModel, task: Task, settings: ServerSettings, prefix_limit: int | None = None,
        pool: PrefixPool | None = None,
    ):
        super().__init__(loaded, task, Classifier(loaded, task, settings.method, pool=pool), prefix_limit)
        self._scores = Scores(ForwardScorer(self.bound, self.bound.stats_type()))  # one engine call per step

    def _want(self, item: WorkItem) -> Scores:
        return self._scores

    def describe(self) -> dict:
        return {
            "name": self.task.name,
            "kind": self.kind,
            "labels": list(self.task.labels),
            "input_fields": self.task.fields,
            "method": self.bound.method,
            "head": describe_head(self.bound.fitted_head),
            "prefix_tokens": self.prefix_tokens,
            "prefix_bytes": self.prefix_bytes,
        }


class ExtractRunner(_BoundRunner):
    """An extraction task (``kind: extract``) on a model, over :class:`~prefixcache.scheduler.extract.Extractor`:
    each item is a generating sequence of the engine loop, refilled as others finish."""

    kind: ClassVar[str] = "extract"

    def __init__(
        self, loaded: LoadedModel, task: ExtractTask, settings: ServerSettings, prefix_limit: int | None = None,
        pool: PrefixPool | None = None,
    ):
        super().__init__(loaded, task, Extractor(loaded, task, pool=pool), prefix_limit)

    def _want(self, item: WorkItem):
        return self.bound.want_of(item)

    @property
    def max_new_tokens(self) -> int:
        """The most tokens an item generates (with its own tokens, what its slot must hold)."""
        return self.bound.generation.max_new_tokens

    def answer(self, seq: EngineSequence) -> dict:
        """A parsed extraction; a sequence whose constraint failed is that item's error (as the CLI reports it)."""
        if seq.status is Status.FAILED:
            return self.bound._result(seq.tag, Failure(seq.error or "failed")).to_json()
        return super().answer(seq)

    def describe(self) -> dict:
        return {
            "name": self.task.name,
            "kind": self.kind,
            "labels": [],
            "fields": list(self.task.fields),
            "input_fields": self.task.input_fields,
            "method": None,
            "max_new_tokens": self.bound.generation.max_new_tokens,
            "prefix_tokens": self.prefix_tokens,
            "prefix_bytes": self.prefix_bytes,
        }


def prepare_items(bound: BoundTask, tokenizer, records: Sequence[Record], max_item_tokens: int) -> list[WorkItem]:
    """``records`` prepared by ``bound`` (a Classifier or an Extractor) with ``tokenizer``, then checked
    against the server's limits. An item whose tokens cross the prefix boundary is re-encoded in full
    (invariant 3).

    Raises:
        ItemError: naming the first item that cannot be rendered (a missing or non-text field), does
            not fit the model's context, or has more than ``max_item_tokens`` tokens of its own.
    """
    items = bound.prepare(records, RunConfig("batched"), tokenizer)
    prefix_tokens = len(bound.prompt.prefix_ids)
    for item in items:
        if item.error is not None:
            raise ItemError(f"item {item.index}: {item.error}", item=item.index)
        own = len(item.rows) - (prefix_tokens if item.full else 0)
        if own > max_item_tokens:
            raise ItemError(
                f"item {item.index} (id {item.record.id!r}): {own} tokens, more than max_item_tokens={max_item_tokens}; "
                "shorten it or split it",
                item=item.index,
            )
    return items


def failed(seq: EngineSequence) -> SequenceFailedError | RequestTooLargeError:
    """The error for a sequence the engine loop did not finish: RequestTooLargeError when no slot could hold it (it
    was never fed; the request's own size, refused as if before any work), else SequenceFailedError (its engine call
    raised, its constraint failed: a server fault)."""
    if isinstance(seq.failure, SequenceTooLongError):
        return RequestTooLargeError(f"this request cannot be held: {seq.failure.args[0]}")
    return SequenceFailedError(f"the engine could not finish this item: {seq.error or seq.status.value}")


def check_prefix_size(task: Task | ExtractTask, tokenizer, limit: int | None) -> int:
    """Render and tokenize ``task``'s prompt with ``tokenizer`` (any thread: no model runs) and check its prefix
    against ``limit``, so an oversized upload is refused before it costs the model thread anything.

    Returns the prefix's length in tokens.

    Raises:
        TaskUploadError: the prefix is longer than ``limit``.
        PromptError: the task cannot be rendered for this tokenizer.
    """
    build = build_extract_prompt if isinstance(task, ExtractTask) else build_prompt
    length = len(build(task, tokenizer).prefix_ids)
    _check_prefix_limit(task.name, length, limit)
    return length


def _check_prefix_limit(name: str, length: int, limit: int | None) -> None:
    if limit is not None and length > limit:
        raise TaskUploadError(
            f"task {name!r} has a {length}-token prefix, more than max_prefix_tokens="
            f"{limit}; shorten its instruction or examples"
        )


RunnerFactory = Callable[..., TaskRunner]
"""``factory(loaded, task, settings, prefix_limit, pool)`` -> a runner (built on the model thread)."""

RUNNER_KINDS: dict[str, RunnerFactory] = {ClassifyRunner.kind: ClassifyRunner, ExtractRunner.kind: ExtractRunner}
"""Task kind -> runner factory (the task kinds this server runs, and the kinds a task upload may have)."""


def build_runner(
    loaded: LoadedModel, task: Task | ExtractTask, settings: ServerSettings, prefix_limit: int | None = None,
    pool: PrefixPool | None = None,
) -> TaskRunner:
    """The runner for ``task``'s kind. Call on the model thread (it builds the prefix).

    ``prefix_limit``: the most prefix tokens allowed (uploaded tasks); ``None`` for the operator's own tasks.
    ``pool``: where the prefix lives (``None``: the runner keeps its own).

    Raises:
        TaskUploadError: no runner serves this kind, or the prefix is over ``prefix_limit``.
        PoolBudgetError: the prefix cannot fit in the pool's budget.
    """
    kind = getattr(task, "kind", "classify")
    factory = RUNNER_KINDS.get(kind)
    if factory is None:
        raise TaskUploadError(
            f"task {task.name!r} is of kind {kind!r}, which this server cannot run "
            f"(it runs: {', '.join(RUNNER_KINDS)})"
        )
    return factory(loaded, task, settings, prefix_limit, pool)
