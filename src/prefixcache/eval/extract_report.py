"""The extraction eval's report: tables, one JSON document, and a coverage-accuracy plot.

This module prints nothing itself: it returns rich tables and documents for the CLI to print, and writes the plot
(matplotlib, the optional ``plot`` extra, imported only when a plot is asked for).
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Sequence

from rich.table import Table

from .extract_eval import FieldReport, at_threshold, threshold_for


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.1%}"


def field_table(reports: Sequence[FieldReport], title: str) -> Table:
    """Per field: exact match; for copy fields invented/missed/spurious; for choice fields accuracy and macro-F1."""
    table = Table(title=title)
    for column in ("field", "kind", "rows", "exact", "invented", "missed", "spurious", "accuracy", "macro-F1"):
        table.add_column(column, justify="left" if column in ("field", "kind") else "right")
    for r in reports:
        copy = r.kind == "copy"
        table.add_row(
            r.name, r.kind, str(r.rows), _pct(r.exact),
            f"{r.invented} ({_pct(r.invented_rate)})" if copy else "-", str(r.missed) if copy else "-",
            str(r.spurious) if copy else "-", _pct(r.accuracy), "-" if r.macro_f1 is None else f"{r.macro_f1:.3f}",
        )
    return table


def threshold_table(reports: Sequence[FieldReport], thresholds: Mapping[str, float], title: str) -> Table:
    """Per field, at its threshold: coverage (accepted share), accepted count and their exact match."""
    table = Table(title=title)
    for column in ("field", "threshold", "accepted", "flagged", "accepted right"):
        table.add_column(column, justify="left" if column == "field" else "right")
    for r in reports:
        if r.name not in thresholds:
            continue
        point = at_threshold(r.curve, thresholds[r.name])
        accepted = point.accepted if point else 0
        table.add_row(r.name, f"{thresholds[r.name]:.4f}", f"{accepted} ({_pct(accepted / max(r.rows, 1))})",
                      _pct(1 - accepted / max(r.rows, 1)), _pct(point.accuracy if point else None))
    return table


def chosen_thresholds(reports: Sequence[FieldReport], target: float) -> dict[str, float]:
    """Per field, the lowest threshold whose accepted rows reach ``target`` (fields that never do are left out)."""
    chosen = {}
    for r in reports:
        point = threshold_for(r.curve, target)
        if point is not None:
            chosen[r.name] = point.threshold
    return chosen


def document(reports: Sequence[FieldReport], meta: Mapping, thresholds: Mapping[str, float]) -> dict:
    """The eval as one JSON object: ``meta`` (task, model, rows, speed), per-field reports, and the thresholds."""
    return {**meta, "fields": {r.name: r.to_json() for r in reports}, "thresholds": dict(thresholds)}


def plot_coverage(reports: Sequence[FieldReport], path: Path, title: str) -> Path:
    """Accepted accuracy against coverage, one line per field, as the confidence threshold rises; one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in reports:
        points = [p for p in r.curve if p.accuracy is not None]
        ax.plot([p.coverage for p in points], [p.accuracy for p in points], marker=".", label=f"{r.name} ({r.kind})")
    ax.set_xlabel("coverage (share of rows accepted)")
    ax.set_ylabel("exact match of accepted rows")
    ax.set_xlim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
