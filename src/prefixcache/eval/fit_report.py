"""Rendering of a head fit: the ``eval`` report of its cross-validated predictions, the prompt beside it,
the rows-per-label curve as a table and a PNG, and the JSON documents ``--json`` prints.

Nothing here computes a figure; every number comes from :class:`~prefixcache.eval.fit_head.FitResult`
and :class:`~prefixcache.eval.fit_curve.CurvePoint`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from rich.table import Table

from ..scheduler.feature_pass import FeatureSet
from ..task.prompt import Prompt
from .evaluate import EvalResult
from .fit_curve import CurvePoint
from .fit_head import FitResult


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def as_eval_result(result: FitResult, features: FeatureSet, prompt: Prompt, batch_size: int, ms_per_item: float,
                   prefix_ms: float) -> EvalResult:
    """The fit's cross-validated predictions as an :class:`EvalResult`, so ``eval``'s tables and plot render it.

    ``prompt`` is the task's prompt the features were taken through: the report's task name, examples and prefix
    tokens are its own. ``method`` reads ``head:<feature>`` (``head-on-prompt:<feature>`` for a head on the prompt).
    """
    kind = "head-on-prompt" if result.on_prompt else "head"
    return EvalResult(
        task=prompt.task.name, model=features.model_identity, dtype=features.dtype, method=f"{kind}:{features.feature}",
        examples=len(prompt.task.examples), prefix_tokens=len(prompt.prefix_ids), batch_size=batch_size,
        ms_per_item=ms_per_item, cpu_ms_per_item=float("nan"), prefix_ms=prefix_ms, metrics=result.cv_metrics,
    )


def fit_table(result: FitResult) -> Table:
    """The prompt's own labels against the fitted head (cross-validated), on the same rows."""
    table = Table(title=f"fitted head vs the prompt | {result.folds}-fold cross-validation, C = {result.C:g}"
                  + (f" | {result.note}" if result.note else ""))
    for column in ("scores", "accuracy", "macro-F1"):
        table.add_column(column, justify="right")
    table.add_row("prompt (first-token)", _pct(result.prompt_metrics.accuracy), f"{result.prompt_metrics.macro_f1:.3f}")
    if result.cv_metrics is not None:
        name = "head on the prompt (CV)" if result.on_prompt else "head (CV)"
        table.add_row(name, _pct(result.cv_metrics.accuracy), f"{result.cv_metrics.macro_f1:.3f}")
    table.caption = "C tried: " + ", ".join(f"{c:g} → {_pct(a)}" for c, a in result.accuracy_by_C.items())
    table.caption += f" | fit {result.seconds:.1f} s (features excluded)"
    return table


def curve_table(points: Sequence[CurvePoint]) -> Table:
    """Held-out accuracy per rows-per-label step: the prompt alone, a head from scratch, a head on the prompt."""
    table = Table(title=f"accuracy vs rows per label | scored on {points[0].scored if points else 0} held-out rows")
    for column in ("rows/label", "rows", "prompt", "head (scratch)", "head on prompt"):
        table.add_column(column, justify="right")
    for p in points:
        table.add_row("all" if p.shots is None else str(p.shots), str(p.rows), _pct(p.prompt), _pct(p.scratch), _pct(p.on_prompt))
    return table


def plot_curve(points: Sequence[CurvePoint], path: Path, title: str, n_labels: int) -> Path:
    """Accuracy against rows per label (log scale; "all" plotted at its mean rows per label over ``n_labels``)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p.shots if p.shots is not None else p.rows / n_labels for p in points]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name, values, style in (
        ("prompt alone", [p.prompt for p in points], "k--"),
        ("head from scratch", [p.scratch for p in points], "o-"),
        ("head on the prompt", [p.on_prompt for p in points], "s-"),
    ):
        ax.plot(xs, [100 * v for v in values], style, label=name)
    ax.set_xscale("log")
    ax.set_xticks(xs, ["all" if p.shots is None else str(p.shots) for p in points])
    ax.set_xlabel("training rows per label")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    ax.set_title(title, fontsize=9, wrap=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def fit_document(result: FitResult, evaluated: EvalResult, points: Sequence[CurvePoint] | None) -> dict:
    """``eval``'s JSON report of the cross-validated predictions, plus ``prompt`` and ``fit`` (and ``curve``)."""
    document = evaluated.to_json() | {"prompt": result.prompt_metrics.to_json(), "fit": result.cv_json()}
    document["fit"]["seconds"] = result.seconds
    if points is not None:
        document["curve"] = [p.to_json() for p in points]
    return document
