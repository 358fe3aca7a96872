"""Runner: records in, Predictions out, in input order.

The loop reads as four stages per window of records:

1. ``prepare``: render and tokenize each record, fit it to the context, check the prefix boundary;
2. ``_plan``: cut the window into batches (length-sorted in ``batched`` mode);
3. ``_run``: one :func:`~prefixcache.engine.forward.score_rows` call per batch;
4. ``_result``: a Prediction per record, yielded in input order.

Modes (:data:`MODES`): ``full`` re-encodes every whole prompt (the baseline),
``cached`` feeds one record per pass over the stored prefix (the published
recipe), ``batched`` feeds ``batch_size`` records per pass.

A record that cannot be rendered, that a reader marked bad (``Record.error``),
or whose prompt overflows the model's context under ``overflow="error"`` yields
a Prediction with ``error`` set; it is never dropped. Under
``overflow="truncate"`` an overflowing record's longest field is cut to fit and
its Prediction is flagged ``truncated`` (see :mod:`prefixcache.spec.context`).
A record whose tokens cross the prefix boundary is scored by
full re-encoding, and counted in :attr:`RunStats.boundary_fallbacks`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping

import torch

from .loop import BoundTask, WindowStats, WorkItem
from ..engine.forward import score_rows
from ..errors import InputError
from ..spec.context import OVERFLOW, ContextFit, blank_warning, context_limit, label_overhang
from ..cache.kv import PrefixKV
from ..model.load import LoadedModel
from ..cache.pool import PrefixPool
from ..spec.prompt import Encoded, Prompt, build_prompt
from ..engine.scoring import LabelHead, LabelScores
from ..spec.task import Task

MODES = ("full", "cached", "batched")


@dataclass(frozen=True)
class Record:
    """One input record: an id and its fields (``text`` and whatever the task's template reads).

    ``error`` is set on a row a reader could not turn into fields (a broken line, a duplicate
    id): the runner does not run it, and yields an error Prediction in its place.
    """

    id: object
    fields: Mapping[str, object]
    error: str | None = None


@dataclass(frozen=True)
class Prediction:
    """The result for one record. Exactly one of ``scores`` and ``error`` is set.

    ``truncated``: a field was cut to fit the model's context; ``warning`` says which and how
    (or notes blank text). Both appear in :meth:`to_json` only when set.
    """

    id: object
    scores: LabelScores | None = None
    error: str | None = None
    boundary_fallback: bool = False
    truncated: bool = False
    warning: str | None = None

    @property
    def label(self) -> str | None:
        return self.scores.label if self.scores else None

    def to_json(self) -> dict:
        if self.scores is None:
            return {"id": self.id, "label": None, "scores": None, "margin": None, "error": self.error}
        document = {
            "id": self.id,
            "label": self.scores.label,
            "scores": {k: round(v, 6) for k, v in self.scores.probabilities.items()},
            "margin": round(self.scores.margin, 6),
        }
        if self.truncated:
            document["truncated"] = True
        if self.warning is not None:
            document["warning"] = self.warning
        return document


@dataclass(frozen=True)
class RunConfig:
    """How to run. ``window`` records are read, sorted by length and batched at a time.

    ``overflow`` (one of :data:`~prefixcache.spec.context.OVERFLOW`): what happens to a record whose
    prompt does not fit the model's context: ``error`` or ``truncate``.
    """

    mode: str = "batched"
    batch_size: int = 32
    window: int = 1024
    overflow: str = "error"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {OVERFLOW}, not {self.overflow!r}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")


@dataclass
class RunStats(WindowStats):
    """Counters of one classification run: the common ones plus tokens computed and records per pass."""

    tokens_computed: int = 0
    per_batch: list[int] = field(default_factory=list)


class Classifier(BoundTask):
    """A task bound to a model: builds the prompt and the prefix cache once, then classifies records.

    Thread safety: the stored prefix is read-only and every batch uses its own fork,
    so several threads may call :meth:`classify` at once.

    With a ``pool`` (:class:`~prefixcache.cache.pool.PrefixPool`) the prefix is taken from
    the pool once per :meth:`classify` call instead of being kept by the classifier,
    so the pool's budget and evictions govern its memory; the task's ``pin`` is honoured.
    """

    stats_type = RunStats

    def __init__(self, loaded: LoadedModel, task: Task, method: str = "auto", pool: PrefixPool | None = None):
        self.prompt: Prompt = build_prompt(task, loaded.tokenizer)
        super().__init__(loaded, task, pool)
        self.method = self.prompt.resolve_method(method)
        self.head = LabelHead(loaded.model, self.prompt, self.method)
        overhang = label_overhang(self.prompt, self.method)
        self.fit = ContextFit(self.prompt, loaded.tokenizer, context_limit(loaded.model), overhang)

    def classify(
        self,
        records: Iterable[Record],
        config: RunConfig = RunConfig(),
        progress: Callable[[int], None] | None = None,
        stats: RunStats | None = None,
    ) -> Iterator[Prediction]:
        """Yield one Prediction per record, in input order."""
        yield from self._stream(records, config, progress, stats if stats is not None else self.stats_type())

    def classify_all(self, records: Iterable[Record], config: RunConfig = RunConfig(), **kw) -> list[Prediction]:
        return list(self.classify(records, config, **kw))

    def _route(self, index: int, record: Record, enc: Encoded, config: RunConfig) -> WorkItem:
        """One tokenized record as an item: fitted to the context (or failed), fed after the prefix or in full."""
        warning, truncated = blank_warning(record.fields, self.task.fields), False
        if self.fit.overflows(enc):
            try:
                fitted = self.fit.fit(record.fields, record.id, enc, config.overflow)
            except InputError as exc:
                return WorkItem(index, record, error=str(exc))
            enc, warning, truncated = fitted.encoded, fitted.warning, True
        if config.mode == "full" or enc.suffix_ids is None:
            return WorkItem(index, record, rows=enc.full_ids, full=True, truncated=truncated, warning=warning)
        return WorkItem(index, record, rows=enc.suffix_ids, truncated=truncated, warning=warning)

    def _run(self, prefix: PrefixKV, batch: list[WorkItem], stats: RunStats) -> list[LabelScores]:
        logprobs = score_rows(self.loaded.model, prefix, [it.rows for it in batch], self.head)  # [B, L]
        stats.forward_passes += 1
        stats.tokens_computed += sum(len(it.rows) for it in batch)
        stats.per_batch.append(len(batch))
        return self.head.to_scores(logprobs)

    def _result(self, item: WorkItem, scores: LabelScores, mode: str) -> Prediction:
        return Prediction(
            item.record.id, scores, boundary_fallback=item.full and mode != "full", truncated=item.truncated, warning=item.warning
        )

    def _failed(self, item: WorkItem) -> Prediction:
        return Prediction(item.record.id, error=item.error)

    def _tally(self, stats: RunStats, items: list[WorkItem], results: dict) -> None:
        stats.errors += sum(1 for i in items if i.error is not None)


def records_from_texts(texts: Iterable[str]) -> list[Record]:
    """Records with 0-based ids from plain strings."""
    return [Record(i, {"text": t}) for i, t in enumerate(texts)]


@torch.inference_mode()
def warmup(classifier: Classifier) -> None:
    """Build the prefix and run one tiny batch, so timings exclude one-time costs."""
    list(classifier.classify([Record("warmup", {f: "hello" for f in classifier.task.fields})], RunConfig("batched", 1)))
