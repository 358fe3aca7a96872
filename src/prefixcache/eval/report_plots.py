"""Plots for evaluation results (matplotlib, headless): the confusion matrix and the example-count sweep.

Each function writes one PNG and returns its path. matplotlib is the optional ``plot`` extra, so this
module is imported only where a plot is asked for.
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def plot_confusion(result, path: Path, title: str) -> Path:
    """Confusion matrix heat map(s) of an :class:`~prefixcache.eval.evaluate.EvalResult`: raw, and calibrated when present.

    Cells hold counts, shaded by the share of their gold row (recall); tick labels carry each
    label's recall (rows) and precision (columns).
    """
    panels = [("raw", result.metrics)] + ([("calibrated", result.calibrated)] if result.calibrated is not None else [])
    labels = list(result.metrics.confusion)
    size = 1.2 + 0.75 * len(labels)
    fig, axes = plt.subplots(1, len(panels), figsize=(size * len(panels) + 0.6, size + 0.6), squeeze=False)
    for ax, (name, metrics) in zip(axes[0], panels):
        counts = [[metrics.confusion[g][p] for p in labels] for g in labels]
        shares = [[c / max(sum(row), 1) for c in row] for row in counts]
        ax.imshow(shares, cmap="Blues", vmin=0, vmax=1)
        for i, row in enumerate(counts):
            for j, count in enumerate(row):
                color = "white" if shares[i][j] > 0.6 else "black"
                ax.text(j, i, str(count), ha="center", va="center", fontsize=9, color=color)
        columns = [f"{p}\nP {metrics.per_label[p].precision:.2f}" for p in labels]
        ax.set_xticks(range(len(labels)), columns, fontsize=8, rotation=30)
        ax.set_yticks(range(len(labels)), [f"{g} R {metrics.per_label[g].recall:.2f}" for g in labels], fontsize=8)
        ax.set_xlabel("predicted")
        ax.set_ylabel("gold")
        ax.set_title(f"{name}\naccuracy {100 * metrics.accuracy:.1f}%, macro-F1 {metrics.macro_f1:.3f}", fontsize=9)
    fig.suptitle(wrap_title(title, fig), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def plot_example_sweep(results: Sequence, path: Path, title: str) -> Path:
    """Accuracy (left axis) and batched ms per item, wall and CPU (right axis), against the number of examples.

    ``results``: :class:`~prefixcache.eval.evaluate.EvalResult` per sweep step. Calibrated accuracy is drawn
    dashed when present; each wall-time point is annotated with the prefix length in tokens.
    """
    fig, acc_ax = plt.subplots(figsize=(7.5, 5.0))
    xs = [r.examples for r in results]
    acc_ax.plot(xs, [100 * r.metrics.accuracy for r in results], "o-", color="#4c72b0", label="accuracy")
    if all(r.calibrated is not None for r in results):
        calibrated = [100 * r.calibrated.accuracy for r in results]
        acc_ax.plot(xs, calibrated, "s--", color="#55a868", label="accuracy, calibrated")
    acc_ax.set_xlabel("few-shot examples in the cached prefix")
    acc_ax.set_ylabel("accuracy (%)")
    acc_ax.set_ylim(0, 100)
    time_ax = acc_ax.twinx()
    ms = [r.ms_per_item for r in results]
    cpu = [r.cpu_ms_per_item for r in results]
    time_ax.plot(xs, ms, "^-", color="#dd8452", label="batched ms / item (wall)")
    time_ax.plot(xs, cpu, "v:", color="#c44e52", label="batched CPU ms / item (all threads)")
    for r in results:
        time_ax.annotate(
            f"{r.prefix_tokens} tok", (r.examples, r.ms_per_item),
            textcoords="offset points", xytext=(0, 7), ha="center", fontsize=7, color="#dd8452",
        )
    time_ax.set_ylabel("batched ms per item")
    top = max(ms + cpu, default=0)
    time_ax.set_ylim(0, top * 1.8 if top > 0 else 1)
    lines = acc_ax.get_legend_handles_labels()[0] + time_ax.get_legend_handles_labels()[0]
    acc_ax.legend(
        lines, [line.get_label() for line in lines], loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, fontsize=8
    )
    acc_ax.grid(alpha=0.3)
    acc_ax.set_title(wrap_title(title, fig), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return Path(path)


def wrap_title(title: str, fig, fontsize: float = 9) -> str:
    """``title`` wrapped to the figure's width (about 13 characters per inch at font size 9)."""
    return textwrap.fill(title, width=max(40, int(fig.get_figwidth() * 13 * 9 / fontsize)))
