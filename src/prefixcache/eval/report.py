"""Rendering of evaluation results: rich tables for the terminal and the JSON documents ``--json`` prints.

Nothing here computes a figure; every number comes from :class:`~prefixcache.eval.evaluate.EvalResult`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Sequence

from rich.console import Console
from rich.table import Table

from ..errors import ExtraNotInstalledError
from ..model.machine import machine_info
from .evaluate import EvalResult
from .metrics import Metrics
from .selective import plot_trust, selective_table


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def title(result: EvalResult) -> str:
    return (
        f"{result.task} | {result.model} ({result.dtype}, {result.method}) | {result.examples} examples, "
        f"prefix {result.prefix_tokens} tok | {result.metrics.records} records"
    )


def summary_table(result: EvalResult) -> Table:
    """Accuracy and macro-F1, with and without calibration, plus batched time per item."""
    table = Table(title=title(result))
    for col in ("scores", "accuracy", "macro-F1", "ms/item (batched)", "CPU ms/item"):
        table.add_column(col, justify="right")
    m = result.metrics
    table.add_row("raw", _pct(m.accuracy), f"{m.macro_f1:.3f}", f"{result.ms_per_item:.2f}", f"{result.cpu_ms_per_item:.2f}")
    if result.calibrated is not None:
        table.add_row("calibrated", _pct(result.calibrated.accuracy), f"{result.calibrated.macro_f1:.3f}", "", "")
    return table


def per_label_table(result: EvalResult) -> Table:
    """Support, precision, recall and F1 per label (raw, and calibrated when present)."""
    table = Table(title="per label")
    columns = ["label", "support", "precision", "recall", "F1"]
    if result.calibrated is not None:
        columns += ["cal. precision", "cal. recall", "cal. F1"]
        prior = result.prior.probabilities if result.prior else {}
        columns.append("content-free prior")
    for col in columns:
        table.add_column(col, justify="right")
    for label, m in result.metrics.per_label.items():
        row = [label, str(m.support), f"{m.precision:.3f}", f"{m.recall:.3f}", f"{m.f1:.3f}"]
        if result.calibrated is not None:
            c = result.calibrated.per_label[label]
            row += [f"{c.precision:.3f}", f"{c.recall:.3f}", f"{c.f1:.3f}", f"{prior.get(label, 0.0):.3f}"]
        table.add_row(*row)
    return table


def confusion_table(metrics: Metrics, caption: str) -> Table:
    """Rows: gold label; columns: predicted label."""
    table = Table(title=f"confusion ({caption}): rows gold, columns predicted")
    labels = list(metrics.confusion)
    table.add_column("gold \\ predicted")
    for label in labels:
        table.add_column(label, justify="right")
    for gold in labels:
        table.add_row(gold, *(str(metrics.confusion[gold][p]) for p in labels))
    return table


def eval_tables(result: EvalResult) -> list[Table]:
    tables = [summary_table(result), per_label_table(result), confusion_table(result.metrics, "raw")]
    if result.calibrated is not None:
        tables.append(confusion_table(result.calibrated, "calibrated"))
    if result.confidence is not None:
        tables.append(selective_table(result.confidence, "confidence (the scores as classify reports them)"))
    return tables


def sweep_table(results: Sequence[EvalResult]) -> Table:
    """One row per example count: prefix length, accuracy (and calibrated), macro-F1, ms/item."""
    first = results[0]
    records = first.metrics.records
    table = Table(title=f"example sweep | {first.task} | {first.model} ({first.dtype}) | {records} records")
    calibrated = first.calibrated is not None
    columns = ["examples", "prefix tok", "accuracy", "macro-F1"]
    columns += ["cal. accuracy", "cal. macro-F1"] if calibrated else []
    columns += ["ms/item (batched)", "CPU ms/item", "prefix build ms"]
    for col in columns:
        table.add_column(col, justify="right")
    for r in results:
        row = [str(r.examples), str(r.prefix_tokens), _pct(r.metrics.accuracy), f"{r.metrics.macro_f1:.3f}"]
        if r.calibrated is not None:
            row += [_pct(r.calibrated.accuracy), f"{r.calibrated.macro_f1:.3f}"]
        row += [f"{r.ms_per_item:.2f}", f"{r.cpu_ms_per_item:.2f}", f"{r.prefix_ms:.0f}"]
        table.add_row(*row)
    return table


def sweep_document(results: Sequence[EvalResult]) -> dict:
    """``{"task", "model", "dtype", "method", "records", "steps": [each step's full report]}``."""
    first = results[0]
    return {
        "task": first.task,
        "model": first.model,
        "dtype": first.dtype,
        "method": first.method,
        "records": first.metrics.records,
        "steps": [r.to_json() for r in results],
    }


def check_plotting() -> None:
    """Raise before any work is done when a plot cannot be drawn (matplotlib is an optional extra).

    Raises:
        ExtraNotInstalledError: matplotlib is not installed.
    """
    if importlib.util.find_spec("matplotlib") is None:
        raise ExtraNotInstalledError("plotting needs matplotlib: run `pip install 'prefixcache[plot]'` (or ask for no plot)")


def emit(
    results: Sequence[EvalResult], sweep: bool, as_json: bool, plot: Path | None, out: Console, err: Console
) -> None:
    """Print the report (tables on ``out``, or one JSON object on stdout, its ``machine`` naming this machine at
    the run's dtype) and write the PNG when ``plot`` is set."""
    document = sweep_document(results) if sweep else results[0].to_json()
    document["machine"] = machine_info(results[0].dtype)
    if as_json:
        print(json.dumps(document))
    else:
        for table in [sweep_table(results)] if sweep else eval_tables(results[0]):
            out.print(table)
    if plot is None:
        return
    from .report_plots import plot_confusion, plot_example_sweep

    if sweep:
        first = results[0]
        caption = f"{first.task}: accuracy and batched time vs examples | {first.model} ({first.dtype})"
        written = plot_example_sweep(results, plot, caption)
    else:
        written = plot_confusion(results[0], plot, title(results[0]))
        if results[0].rows:
            confidence, correct = zip(*results[0].rows)
            err.print(f"wrote {plot_trust(confidence, correct, plot.with_suffix('.trust.png'), title(results[0]))}")
    err.print(f"wrote {written}")
