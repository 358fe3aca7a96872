"""Evaluation: labelled records in, accuracy reports out, optionally calibrated, optionally per example count.

Two steps, so that every input problem surfaces before a model is loaded:

1. :func:`plan_eval` checks the gold labels, resolves which examples each
   prompt shows (the task's ``select``, or the steps of an example sweep), and
   refuses to go on when an evaluation row is one of those examples;
2. :func:`run_eval` classifies every record once per planned prompt (batched,
   over that prompt's cached prefix), times it, scores it with
   :mod:`prefixcache.eval.metrics`, and with :mod:`prefixcache.eval.calibration` when
   content-free inputs are given.

Timing: ``ms_per_item`` is the batched classification time per record (wall
clock) after a warm-up (one tiny batch and one untimed full-size batch),
without the one-time prefix build (reported as ``prefix_ms``) and without
calibration (a few extra rows, run afterwards). ``cpu_ms_per_item`` is the
process's CPU time over the same span (all threads summed): on a machine
shared with other work it moves far less than wall time.

This module does not print, plot or parse command lines.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from .calibration import Prior, calibrate, content_free_prior
from ..engine.confidence import Calibration
from ..engine.head import FittedHead
from ..engine.head_file import head_for, text_hash
from ..errors import InputError, setting
from .metrics import Metrics, compute_metrics
from .selective import Selective, selective
from ..model.load import LoadedModel
from ..scheduler.classify import Classifier, warmup
from ..types import Record, RunConfig, RunStats
from ..task.selection import first_examples, overlapping_rows, resolve_examples
from ..task.definition import Task

MAX_NAMED_ROWS = 10  # rows named in one error message


@dataclass(frozen=True)
class LabelledRecords:
    """Records and their gold labels, index for index."""

    records: list[Record]
    gold: list[str]


@dataclass(frozen=True)
class EvalPlan:
    """What :func:`run_eval` runs: one prompt (``tasks[0]``) or one per sweep step, over the same records."""

    data: LabelledRecords
    tasks: list[Task]
    sweep: bool
    head: FittedHead | None = None  # every prompt is scored through it


@dataclass(frozen=True)
class EvalResult:
    """One prompt's figures over the plan's records. ``calibrated`` and ``prior`` are set together."""

    task: str
    model: str
    dtype: str
    method: str
    examples: int
    prefix_tokens: int
    batch_size: int
    ms_per_item: float
    cpu_ms_per_item: float
    prefix_ms: float
    metrics: Metrics
    calibrated: Metrics | None = None
    prior: Prior | None = None
    confidence: Selective | None = None  # calibration error and accuracy against coverage of the scored rows
    rows: tuple = ()  # per record: (confidence, correct), for the reliability diagram

    def to_json(self) -> dict:
        """The report as one JSON object: run facts, then ``records, accuracy, macro_f1, per_label, confusion``,
        then ``calibrated`` (the same five keys plus the content-free inputs and the prior) when calibrated."""
        document = {
            "task": self.task,
            "model": self.model,
            "dtype": self.dtype,
            "method": self.method,
            "examples": self.examples,
            "prefix_tokens": self.prefix_tokens,
            "batch_size": self.batch_size,
            "ms_per_item": self.ms_per_item,
            "cpu_ms_per_item": self.cpu_ms_per_item,
            "prefix_ms": self.prefix_ms,
            **self.metrics.to_json(),
        }
        if self.calibrated is not None and self.prior is not None:
            document["calibrated"] = self.calibrated.to_json() | self.prior.to_json()
        if self.confidence is not None:
            document["confidence"] = self.confidence.to_json()
        return document


def _row(index: int, record: Record) -> str:
    return f"row {index}" if record.id == index else f"row {index} (id {record.id!r})"


def _named(rows: Sequence[str]) -> str:
    more = len(rows) - MAX_NAMED_ROWS
    return ", ".join(rows[:MAX_NAMED_ROWS]) + (f" and {more} more" if more > 0 else "")


def labelled_records(records: Iterable[Record], label_field: str, task: Task) -> LabelledRecords:
    """Pair each record with its gold label from ``label_field``.

    Raises:
        InputError: there are no records, or rows lack the label field or carry a label outside the
            task's taxonomy; the message names the rows (row numbers are 0-based) and the field.
    """
    records = list(records)
    gold = [str(r.fields.get(label_field)) for r in records]
    missing: list[str] = []
    unknown: dict[str, list[str]] = {}
    for index, record in enumerate(records):
        value = record.fields.get(label_field)
        if value is None or (isinstance(value, str) and not value.strip()):
            missing.append(_row(index, record))
        elif str(value) not in task.labels:
            unknown.setdefault(str(value), []).append(_row(index, record))
    if missing:
        raise InputError(f"{_named(missing)}: no gold label in field {label_field!r}; "
                         f"name the gold label's field with {setting('label_field')}")
    if unknown:
        known = ", ".join(task.labels)
        bad = "; ".join(f"{label!r} in {_named(rows)}" for label, rows in unknown.items())
        raise InputError(f"field {label_field!r} holds labels the task {task.name!r} does not have ({known}): {bad}")
    if not records:
        raise InputError("the input holds no records to evaluate")
    return LabelledRecords(records, gold)


def check_no_overlap(data: LabelledRecords, task: Task) -> None:
    """Refuse evaluation rows that are also few-shot examples of ``task`` (same normalized text).

    The examples checked are the ones the prompt shows: ``task``'s resolved examples
    (:func:`~prefixcache.task.selection.resolve_examples`, as :func:`prefixcache.task.prompt.build_prompt` renders them).

    Raises:
        InputError: naming every overlapping row (up to :data:`MAX_NAMED_ROWS`) and its text.
    """
    shown = resolve_examples(task)
    rows = ((i, r.fields) for i, r in enumerate(data.records))
    hits = overlapping_rows(rows, shown.examples, shown.fields)
    if hits:
        named = [f"{_row(i, data.records[i])} {text!r}" for i, text in hits]
        raise InputError(
            f"{len(hits)} evaluation row(s) are also few-shot examples of task {task.name!r}, so the score would "
            f"be inflated: {_named(named)}. Remove them from the input, or from the task's examples / example_pool"
        )


def check_not_fitted_on(data: LabelledRecords, head: FittedHead, task: Task) -> None:
    """Refuse evaluation rows that ``head`` was fitted on: rows whose normalized text hash
    (:func:`~prefixcache.engine.head_file.text_hash` of the task's fields) is in the head manifest's training hashes.

    Raises:
        InputError: naming every such row (up to :data:`MAX_NAMED_ROWS`) and its text.
    """
    fitted = set(head.manifest.get("training", {}).get("text_sha256", ()))
    hits = [i for i, r in enumerate(data.records) if text_hash(r.fields, task.fields) in fitted]
    if hits:
        named = [f"{_row(i, data.records[i])} {data.records[i].fields.get(task.fields[0])!r}" for i in hits]
        raise InputError(
            f"{len(hits)} evaluation row(s) are rows the head was fitted on, so the score would be inflated: "
            f"{_named(named)}. Evaluate on rows the head never saw (split them off before `prefixcache fit`)"
        )


def plan_eval(
    task: Task,
    records: Iterable[Record],
    label_field: str,
    sweep: Sequence[int] | None = None,
    seed: int | None = None,
    head: FittedHead | str | Path | None = None,
) -> EvalPlan:
    """Check the input and decide the prompts. ``sweep``: example counts, one prompt each (ascending).

    ``seed`` orders the pool for a sweep (default: the task's ``select.seed``, else 0).

    Raises:
        InputError: bad gold labels, or evaluation rows among the examples (see :func:`check_no_overlap`).
        TaskError: a sweep step asks for more examples than the task has.

    ``head``: a fitted head (or its path; default: the task's ``head:``) that scores every prompt; evaluation
    rows it was fitted on are refused (:func:`check_not_fitted_on`).
    """
    data = labelled_records(records, label_field, task)
    head = head_for(task, head)
    if sweep:
        steps = sorted(set(sweep))
        order_seed = seed if seed is not None else (task.select.seed if task.select else 0)
        tasks = [first_examples(task, n, order_seed) for n in steps]
    else:
        tasks = [resolve_examples(task)]
    check_no_overlap(data, tasks[-1])  # sweep steps are nested: the last one shows every example
    if head is not None:
        check_not_fitted_on(data, head, task)
    return EvalPlan(data, tasks, bool(sweep), head)


def check_renderable(classifier: Classifier, data: LabelledRecords) -> None:
    """Every record fills the task's template, or InputError naming the first failures."""
    problems = []
    for record in data.records:
        try:
            classifier.prompt.suffix_text(record.fields, record.id)
        except InputError as exc:
            problems.append(str(exc))
    if problems:
        raise InputError(f"{len(problems)} record(s) cannot be classified: " + "; ".join(problems[:MAX_NAMED_ROWS]))


def evaluate(
    classifier: Classifier, data: LabelledRecords, batch_size: int = 32, content_free: Sequence[str] | None = None
) -> EvalResult:
    """Classify ``data`` in batched mode over ``classifier``'s prefix and score it against the gold labels.

    ``content_free``: when given, also report contextual calibration with these inputs.

    Raises:
        InputError: a record cannot be classified (a missing field, a prompt too long for the model);
            checked before the timed run where possible, and after it otherwise.
    """
    check_renderable(classifier, data)
    config = RunConfig("batched", batch_size)
    warmup(classifier)
    classifier.classify_all(data.records[:batch_size], config)  # one untimed full-size batch
    stats = RunStats()
    cpu_started = time.process_time()
    predictions = classifier.classify_all(data.records, config, stats=stats)
    cpu_seconds = time.process_time() - cpu_started
    failed = [p.error for p in predictions if p.scores is None]  # e.g. a record too long for the context
    if failed:
        raise InputError(f"{len(failed)} record(s) could not be classified: " + "; ".join(failed[:MAX_NAMED_ROWS]))
    labels = list(classifier.task.labels)
    metrics = compute_metrics(data.gold, [p.best_guess for p in predictions], labels)  # abstained or not
    calibrated = prior = None
    if content_free is not None:
        prior = content_free_prior(classifier, content_free, batch_size)
        calibrated = compute_metrics(data.gold, [calibrate(p.scores, prior).label for p in predictions], labels)
    loaded = classifier.loaded
    return EvalResult(
        task=classifier.task.name,
        model=loaded.identity,
        dtype=str(loaded.dtype).removeprefix("torch."),
        method=classifier.method,
        examples=len(classifier.prompt.task.examples),  # the examples the prompt shows (resolved)
        prefix_tokens=len(classifier.prompt.prefix_ids),
        batch_size=batch_size,
        ms_per_item=1000 * stats.seconds / len(data.records),
        cpu_ms_per_item=1000 * cpu_seconds / len(data.records),
        prefix_ms=1000 * classifier.prefix_seconds,
        metrics=metrics,
        calibrated=calibrated,
        prior=prior,
        **_confidence(classifier, predictions, data.gold),
    )


def _confidence(classifier: Classifier, predictions, gold) -> dict:
    """The calibration error (as scored, and raw: the classifier's temperature undone) and accuracy against coverage."""
    confidence = [p.confidence for p in predictions]
    correct = [p.best_guess == g for p, g in zip(predictions, gold)]
    temperature = classifier.trust.calibration.temperature
    raw = None
    if temperature != 1.0:
        undo = Calibration(1.0 / temperature)
        raw = [float(np.exp(undo.apply(p.scores.logprobs).max())) for p in predictions]
    return {"confidence": selective(confidence, correct, raw), "rows": tuple(zip(confidence, correct))}


def run_eval(
    loaded: LoadedModel,
    plan: EvalPlan,
    batch_size: int = 32,
    method: str = "auto",
    content_free: Sequence[str] | None = None,
    on_result: Callable[[EvalResult], None] | None = None,
) -> list[EvalResult]:
    """One :func:`evaluate` per planned prompt, in order; each prompt gets its own classifier and prefix."""
    results = []
    for task in plan.tasks:
        result = evaluate(Classifier(loaded, task, method, head=plan.head), plan.data, batch_size, content_free)
        results.append(result)
        if on_result:
            on_result(result)
    return results


def parse_steps(text: str) -> list[int]:
    """``"0,3,6,12"`` -> ``[0, 3, 6, 12]``.

    Raises:
        InputError: a step is not a whole number of 0 or more.
    """
    steps = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise InputError(
                f"{setting('sweep_examples')} takes whole numbers separated by commas, like 0,3,6,12; got {part!r}"
            )
        steps.append(int(part))
    return steps
