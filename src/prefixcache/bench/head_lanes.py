"""Head lanes of ``prefixcache bench``: the same records classified through a fitted label head.

``full+head`` re-encodes every whole prompt and scores it through the head; it is the head lanes'
reference, so ``batched+head``'s labels and log-probs are measured against full re-encoding through
the same head (invariant 1, through the head). Like every lane, their speed-up is against the
prompt's ``full`` lane, so the table shows what the head costs per record next to first-token scoring.

The head is a file (``--head FILE``, else the task file's ``head:``), or :data:`FIT`: a head fitted on
the bench's own records and their gold labels first. That head is for timing only: the bench then
classifies the very rows it was fitted on, so its labels say nothing about its accuracy.
"""

from __future__ import annotations

from typing import Callable, Sequence

from ..engine.head import FittedHead
from ..engine.head_file import describe_head, head_for
from ..errors import InputError, setting
from ..eval.fit_head import fit_head
from ..model.load import LoadedModel
from ..scheduler.classify import Classifier
from ..scheduler.feature_pass import collect_features
from ..task.definition import Task
from ..types import LABEL_FIELD, Record, RunConfig
from .lanes import Lane, classifier_lane

FIT = "fit"  # ``--head fit``: fit a head on the bench's own records first
FIT_FOLDS = 3  # cross-validation folds of that fit (it only picks C; the head is for timing)
HEAD_REFERENCE = "full+head"


def without_head(task: Task) -> Task:
    """``task`` scoring with its prompt: the prompt lanes never read the task file's ``head:``."""
    return task.model_copy(update={"head": None}) if getattr(task, "head", None) else task


def gold_labels(records: Sequence[Record], task: Task) -> dict:
    """Record id -> gold label (field ``label``) of every record, for fitting a head on them.

    Raises:
        InputError: a record has no gold label, or one that is not among the task's labels (naming it).
    """
    labels = list(task.labels)
    for record in records:
        label = record.fields.get(LABEL_FIELD)
        if label not in labels:
            found = "no gold label" if label is None else f"gold label {label!r}"
            raise InputError(
                f"{setting('head', FIT)} fits a head on the bench's records' gold labels, but record {record.id!r} "
                f"has {found}, not one of task {task.name!r}'s labels ({', '.join(labels)}); "
                f"give a fitted head file with {setting('head')}"
            )
    return {record.id: record.fields[LABEL_FIELD] for record in records}


def fit_bench_head(loaded: LoadedModel, task: Task, records: list[Record], batch_size: int, log: Callable[[str], None]) -> FittedHead:
    """A head fitted on ``records`` and their gold labels (see :func:`gold_labels`).

    Raises:
        InputError: a record lacks a usable gold label, a label has no record, or a record cannot run.
    """
    gold = gold_labels(records, task)
    features = collect_features(loaded, task, records, config=RunConfig(batch_size=batch_size))
    features = features.require_complete("bench record")
    result = fit_head(features, gold, folds=FIT_FOLDS)
    head = result.head
    head.manifest["task"] = task.name
    log(f"fitted head: {len(head.labels)} labels, {head.width} features ({head.feature}), C = {result.C}, "
        f"fit {result.seconds:.1f} s")
    return head


def bench_head(head: str | None, loaded: LoadedModel, task: Task, records: list[Record], batch_size: int,
               log: Callable[[str], None]) -> FittedHead | None:
    """The head of the head lanes: fitted here (``head == "fit"``), read from ``head`` (a file), else the task
    file's ``head:``, else None (no head lanes)."""
    if head == FIT:
        log(f"fitting a head on the bench's {len(records)} records (for timing only: the bench then classifies "
            "the rows it was fitted on, so its labels say nothing about its accuracy) ...")
        return fit_bench_head(loaded, without_head(task), records, batch_size, log)
    return head_for(task, head)


def head_lanes(loaded: LoadedModel, task: Task, head: FittedHead, batch_size: int) -> list[Lane]:
    """``full+head`` (the head lanes' reference) and ``batched+head`` through ``head``.

    Raises:
        HeadMismatchError: ``head`` was fitted for another model, prompt or label set.
    """
    classifier = Classifier(loaded, without_head(task), head=head)
    return [
        classifier_lane(HEAD_REFERENCE, classifier, "full", reference=HEAD_REFERENCE),
        classifier_lane("batched+head", classifier, "batched", batch_size, reference=HEAD_REFERENCE),
    ]


def head_document(head: FittedHead, source: str) -> dict:
    """The JSON document's ``head`` entry: where the head came from and what it is."""
    return {"source": source, "fitted_on_bench_records": source == FIT, **describe_head(head)}
