"""Classification: records in, Predictions out, in input order.

A :class:`Classifier` is a :class:`~prefixcache.scheduler.loop.BoundTask` whose record loop
(prepare, plan, run, report; see :mod:`prefixcache.scheduler.loop`) scores label tokens:

* prepare: a record that overflows the model's context is failed or cut (``RunConfig.overflow``);
* run: one :func:`~prefixcache.engine.forward.score_rows` call per batch;
* report: a :class:`~prefixcache.types.Prediction` per record.

Modes (:class:`~prefixcache.types.Mode`): ``full`` re-encodes every whole prompt (the baseline),
``cached`` feeds one record per pass over the stored prefix (the published recipe), ``batched``
feeds ``batch_size`` records per pass.

A record that cannot be rendered, that a reader marked bad (``Record.error``),
or whose prompt overflows the model's context under ``overflow="error"`` yields
a Prediction with ``error`` set; it is never dropped. Under
``overflow="truncate"`` an overflowing record's longest field is cut to fit and
its Prediction is flagged ``truncated`` (see :mod:`prefixcache.task.context`).
A record whose tokens cross the prefix boundary is scored by
full re-encoding, and counted in :attr:`RunStats.boundary_fallbacks`.

The value types (Record, Prediction, RunConfig, RunStats, LabelScores) live in
:mod:`prefixcache.types`; they are importable from here too.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch

from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool
from ..engine.confidence import Trust
from ..engine.forward import score_rows
from ..engine.head import FittedHead, head_rows
from ..engine.calibration_file import task_trust
from ..engine.head_file import check as check_head, head_for
from ..engine.scoring import LabelScorer
from ..errors import ContextOverflowError, HeadMismatchError, InputError, PromptError, setting
from ..model.load import LoadedModel
from ..model.context_window import context_limit
from ..task.context import ContextFit, blank_warning, label_overhang
from ..task.prompt import Encoded, Prompt, build_prompt
from ..task.definition import Task
from ..types import MODES, LabelScores, Mode, Prediction, Record, RunConfig, RunStats
from .feature_pass import tuned_prefix
from .loop import BoundTask, WorkItem, route

__all__ = ["MODES", "Classifier", "LabelScores", "Mode", "Prediction", "Record", "RunConfig", "RunStats",
           "records_from_texts", "warmup"]


class Classifier(BoundTask):
    """A task bound to a model: builds the prompt and the prefix cache once, then classifies records.

    Thread safety: the stored prefix is read-only and every batch uses its own fork,
    so several threads may call :meth:`classify` at once.

    With a ``pool`` (:class:`~prefixcache.cache.pool.PrefixPool`) the prefix is taken from
    the pool once per :meth:`classify` call instead of being kept by the classifier,
    so the pool's budget and evictions govern its memory; the task's ``pin`` is honoured.
    ``label_pass`` is how ``full`` scoring feeds label tokens (see :class:`~prefixcache.engine.scoring.LabelScorer`):
    the trie, or ``"per-label"``, the reference that ``bench`` times beside it.
    ``trust`` (:class:`~prefixcache.engine.confidence.Trust`): how each prediction is calibrated and when it
    abstains; by default the fitted head's stored calibration (else the task's ``calibration:`` file, else
    none) and the task's ``min_confidence`` or ``target_accuracy`` (else no threshold).
    """

    stats_type = RunStats

    def __init__(
        self,
        loaded: LoadedModel,
        task: Task,
        method: str = "auto",
        pool: PrefixPool | None = None,
        head: FittedHead | str | Path | None = None,
        label_pass: str = "trie",
        trust: Trust | None = None,
    ):
        self.prompt: Prompt = build_prompt(task, loaded.tokenizer)
        super().__init__(loaded, task, pool)
        self.fitted_head = head_for(task, head)
        self.tuned = tuned_prefix(self.fitted_head)
        self.trust = trust if trust is not None else task_trust(task, self.fitted_head, loaded, self.prompt)
        self.method = self._resolve_method(method)
        self.head = LabelScorer(loaded.model, self.prompt, "first-token" if self.fitted_head else self.method, label_pass)
        overhang = label_overhang(self.prompt, self.method)
        self.fit = ContextFit(self.prompt, loaded.tokenizer, context_limit(loaded.model), overhang)

    def _resolve_method(self, method: str) -> str:
        """The scoring method; with a fitted head (checked against this model, prompt and labels) ``head:<feature>``.

        Raises:
            HeadMismatchError: the head was fitted for another model, prompt or label set.
            PromptError: a method other than ``auto`` was asked for beside a fitted head.
        """
        if self.fitted_head is None:
            return self.prompt.resolve_method(method)
        if method != "auto":
            raise PromptError(f"{setting('method', method)} scores with the prompt's label tokens; a fitted head scores "
                              f"instead: drop {setting('method')}, or drop the head")
        head = self.fitted_head
        check_head(head.manifest, self.loaded, self.prompt, list(self.prompt.label_ids))
        head.spec.check(self.loaded.model)
        width = head.spec.width(self.loaded.model.config.get_text_config(decoder=True).hidden_size)
        if head.width != width:
            raise HeadMismatchError(f"the head reads {head.width} features, but {head.feature} gives {width} on this model")
        return f"head:{head.feature}"

    def fingerprint(self) -> dict[str, str | None]:
        """What decides this classifier's labels, as short strings (see :mod:`prefixcache.io.job_file`):
        the task's name, hashes of its prompt (prefix tokens, tail and template) and of its labels with their
        tokens, the model's identity, the scoring method, the dtype, and the fitted head's digest (or None)."""
        prompt = self.prompt
        return {
            "task": self.task.name,
            "prompt": _digest([list(prompt.prefix_ids), prompt.tail_text, self.task.input_template]),
            "labels": _digest([[label, list(ids)] for label, ids in prompt.label_ids.items()]),
            "model": self.loaded.identity,
            "method": self.method,
            "dtype": str(self.loaded.dtype).removeprefix("torch."),
            "head": self.fitted_head.digest() if self.fitted_head is not None else None,
            "calibration": _trust_text(self.trust.calibration.temperature, 1.0),
            "threshold": _trust_text(self.trust.min_confidence, None),
        }

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
                return WorkItem(index, record, error=str(exc), overflowed=isinstance(exc, ContextOverflowError))
            enc, warning, truncated = fitted.encoded, fitted.warning, True
        return route(index, record, enc, config.mode, truncated=truncated, warning=warning)

    def _forward(self, prefix: PrefixKV, batch: list[WorkItem], stats: RunStats) -> list[LabelScores]:
        rows = [it.rows for it in batch]
        if self.fitted_head is not None:  # one packed pass and one [B, F] x [F, L] product, whatever the labels
            own_starts = [len(self.prompt.prefix_ids) if it.full else 0 for it in batch]
            logprobs = head_rows(self.loaded.model, prefix, rows, own_starts, self.fitted_head, self.head)  # [B, L]
        else:
            logprobs = score_rows(self.loaded.model, prefix, rows, self.head)  # [B, L]
        stats.forward_passes += 1
        stats.tokens_computed += sum(len(it.rows) for it in batch)
        stats.per_batch.append(len(batch))
        return self.head.to_scores(logprobs)

    def _result(self, item: WorkItem, scores: LabelScores) -> Prediction:
        return self.trust.judge(Prediction(
            item.record.id, scores, boundary_fallback=item.boundary_fallback, truncated=item.truncated,
            warning=item.warning,
        ))

    def _failed(self, item: WorkItem) -> Prediction:
        return Prediction(item.record.id, error=item.error)

    def _tally(self, stats: RunStats, items: list[WorkItem], results: list[Prediction]) -> None:
        stats.errors += sum(1 for i in items if i.error is not None)
        stats.context_overflows += sum(1 for i in items if i.overflowed)


def _trust_text(value: float | None, neutral: float | None) -> str | None:
    """A calibration temperature or threshold as the job file records it (None when it changes nothing)."""
    return None if value == neutral else repr(float(value))


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value).encode()).hexdigest()[:16]


def records_from_texts(texts: Iterable[str]) -> list[Record]:
    """Records with 0-based ids from plain strings."""
    return [Record(i, {"text": t}) for i, t in enumerate(texts)]


def warmup(classifier: Classifier) -> None:
    """Build the prefix and run one tiny batch, so timings exclude one-time costs."""
    with torch.inference_mode():
        record = Record("warmup", {f: "hello" for f in classifier.task.fields})
        list(classifier.classify([record], RunConfig(Mode.BATCHED, 1)))
