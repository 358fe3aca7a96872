"""Classification metrics: confusion matrix, accuracy, per-label precision/recall/F1, macro-F1.

Pure arithmetic over label strings; no torch, no models. Conventions (the same
as scikit-learn's defaults with ``zero_division=0``):

* ``confusion[gold][predicted]`` counts records; rows and columns follow the
  task's label order.
* precision of a label never predicted, and recall of a label never in the
  gold set, are 0.
* macro-F1 averages F1 over the labels that occur in the gold set or in the
  predictions; a taxonomy label absent from both does not drag it down.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence


@dataclass(frozen=True)
class LabelMetrics:
    """One label's figures. ``support`` = records whose gold label it is."""

    precision: float
    recall: float
    f1: float
    support: int
    predicted: int


@dataclass(frozen=True)
class Metrics:
    """The figures of one run over ``records`` labelled records."""

    records: int
    accuracy: float
    macro_f1: float
    per_label: dict[str, LabelMetrics]
    confusion: dict[str, dict[str, int]]

    def to_json(self) -> dict:
        return {
            "records": self.records,
            "accuracy": self.accuracy,
            "macro_f1": self.macro_f1,
            "per_label": {label: asdict(m) for label, m in self.per_label.items()},
            "confusion": self.confusion,
        }


def confusion_matrix(gold: Sequence[str], predicted: Sequence[str], labels: Sequence[str]) -> dict[str, dict[str, int]]:
    """``confusion[g][p]`` = number of records with gold ``g`` predicted as ``p``.

    Raises:
        ValueError: the sequences differ in length, or a label is not in ``labels``.
    """
    if len(gold) != len(predicted):
        raise ValueError(f"{len(gold)} gold labels but {len(predicted)} predictions")
    matrix = {g: {p: 0 for p in labels} for g in labels}
    for g, p in zip(gold, predicted):
        if g not in matrix or p not in matrix:
            raise ValueError(f"label {g if g not in matrix else p!r} is not one of {list(labels)}")
        matrix[g][p] += 1
    return matrix


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


def metrics_from_confusion(confusion: dict[str, dict[str, int]]) -> Metrics:
    """Accuracy, per-label precision/recall/F1 and macro-F1 from a square confusion matrix."""
    labels = list(confusion)
    total = sum(sum(row.values()) for row in confusion.values())
    correct = sum(confusion[label][label] for label in labels)
    per_label = {}
    for label in labels:
        hits = confusion[label][label]
        support = sum(confusion[label].values())
        predicted = sum(confusion[g][label] for g in labels)
        precision, recall = _ratio(hits, predicted), _ratio(hits, support)
        f1 = _ratio(2 * hits, support + predicted)  # = 2PR / (P + R), and 0 when both are 0
        per_label[label] = LabelMetrics(precision, recall, f1, support, predicted)
    present = [m.f1 for m in per_label.values() if m.support or m.predicted]
    macro = sum(present) / len(present) if present else 0.0
    return Metrics(total, _ratio(correct, total), macro, per_label, confusion)


def compute_metrics(gold: Sequence[str], predicted: Sequence[str], labels: Sequence[str]) -> Metrics:
    """:func:`metrics_from_confusion` of :func:`confusion_matrix`."""
    return metrics_from_confusion(confusion_matrix(gold, predicted, labels))
