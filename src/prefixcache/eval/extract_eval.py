"""Scoring extraction against gold fields: per-field exact match, invented values, choice accuracy, coverage.

For every declared field that the gold rows carry (a column named as the field; a JSON null or an empty cell is a
gold null):

* ``exact``: predicted == gold after :func:`normalize` (case-folded, whitespace collapsed, a leading ``#`` and
  surrounding punctuation dropped, an empty string read as null), over every row;
* ``copy`` fields also get ``invented``: predicted values that are not a substring of the record's own text
  (exactly as written), counted and as a rate of the non-null predictions, plus ``missed`` (gold has a value,
  the prediction is null) and ``spurious`` (gold is null, the prediction is not);
* ``choice`` fields also get ``accuracy`` and ``macro_f1`` (:func:`~prefixcache.eval.metrics.compute_metrics`);
* every field gets a coverage curve: for each confidence threshold, the share of rows whose confidence reaches it
  (accepted) and the exact match among them; :func:`threshold_for` picks the lowest threshold whose accepted rows
  reach a target accuracy (on the rows given: choose it on fitting rows, measure it on held-out ones).

This module runs no model; :mod:`prefixcache.cli.evaluate_extract` feeds it an extraction's results.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Mapping, Sequence

from ..task.definition import ExtractTask
from .metrics import compute_metrics

_EDGES = " \t\r\n.,;:!?\"'()[]"


def normalize(value: object) -> str | None:
    """A value as compared: None for null or blank; else text, case-folded, spaces collapsed, edges trimmed."""
    if value is None:
        return None
    text = re.sub(r"\s+", " ", str(value)).strip(_EDGES).removeprefix("#").strip(_EDGES).casefold()
    return text or None


@dataclass(frozen=True)
class CoveragePoint:
    """At confidence ``threshold``: the share of rows ``accepted`` and their exact-match ``accuracy``."""

    threshold: float
    coverage: float
    accuracy: float | None
    accepted: int


@dataclass
class FieldReport:
    """One field's figures over ``rows`` rows (see the module notes)."""

    name: str
    kind: str
    rows: int
    exact: float
    invented: int | None = None
    invented_rate: float | None = None
    missed: int | None = None
    spurious: int | None = None
    accuracy: float | None = None
    macro_f1: float | None = None
    curve: list[CoveragePoint] = field(default_factory=list)
    wrong: list[dict] = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Scored:
    """One row as scored: the record's text, its gold and predicted fields, and the confidences."""

    id: object
    text: str
    gold: Mapping[str, object]
    predicted: Mapping[str, object]
    confidence: Mapping[str, float | None]


def field_report(task: ExtractTask, name: str, rows: Sequence[Scored], max_wrong: int = 10) -> FieldReport:
    """The figures of field ``name`` over ``rows``."""
    kind = task.kind_of(name)
    gold = [normalize(r.gold.get(name)) for r in rows]
    predicted = [normalize(r.predicted.get(name)) for r in rows]
    right = [g == p for g, p in zip(gold, predicted)]
    report = FieldReport(name, kind, len(rows), _share(right))
    report.wrong = [{"id": r.id, "gold": r.gold.get(name), "predicted": r.predicted.get(name)}
                    for r, ok in zip(rows, right) if not ok][:max_wrong]
    if kind == "copy":
        values = [(r.predicted.get(name), r.text) for r in rows if r.predicted.get(name) not in (None, "")]
        report.invented = sum(1 for value, text in values if str(value) not in text)
        report.invented_rate = report.invented / len(values) if values else 0.0
        report.missed = sum(1 for g, p in zip(gold, predicted) if g is not None and p is None)
        report.spurious = sum(1 for g, p in zip(gold, predicted) if g is None and p is not None)
    if kind == "choice":
        gold_text, predicted_text = [str(r.gold.get(name)) for r in rows], [str(r.predicted.get(name)) for r in rows]
        labels = list(task.fields[name].values or ())
        outside = sorted({*gold_text, *predicted_text} - set(labels))  # "None": no value (an answer not parsed, say)
        metrics = compute_metrics(gold_text, predicted_text, labels + outside)
        report.accuracy, report.macro_f1 = metrics.accuracy, metrics.macro_f1
    report.curve = coverage_curve([r.confidence.get(name) for r in rows], right)
    return report


def coverage_curve(confidence: Sequence[float | None], right: Sequence[bool]) -> list[CoveragePoint]:
    """Coverage and accepted accuracy at every distinct confidence (a row without one is never accepted above 0)."""
    known = [(c if c is not None else 0.0, ok) for c, ok in zip(confidence, right)]
    points = []
    for threshold in sorted({0.0} | {c for c, _ in known}):
        accepted = [ok for c, ok in known if c >= threshold]
        points.append(CoveragePoint(threshold, len(accepted) / max(len(known), 1), _share(accepted) if accepted else None,
                                    len(accepted)))
    return points


def threshold_for(curve: Sequence[CoveragePoint], target: float) -> CoveragePoint | None:
    """The point of lowest threshold whose accepted rows are at least ``target`` right (None: no threshold is)."""
    for point in curve:
        if point.accuracy is not None and point.accuracy >= target:
            return point
    return None


def at_threshold(curve: Sequence[CoveragePoint], threshold: float) -> CoveragePoint | None:
    """The curve's figures for rows whose confidence reaches ``threshold`` (the first point at or above it)."""
    return next((p for p in curve if p.threshold >= threshold), None)


def _share(flags: Sequence[bool]) -> float:
    return sum(flags) / len(flags) if flags else 0.0
