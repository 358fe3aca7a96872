"""How far confidence can be trusted, as tables and plots: calibration error, accuracy against coverage, reliability.

``fit`` shows these for its cross-validated out-of-fold predictions and ``eval`` for the rows it scored;
both read (confidence, correct) pairs, so the same tables serve a head, a prompt, or an extraction field.
Plots need matplotlib (imported in the functions that draw).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.table import Table

from ..engine.confidence import BINS, coverage_at_accuracies, expected_calibration_error, reliability, risk_coverage

TARGETS = (0.9, 0.95, 0.99)  # accuracies whose coverage is reported
COVERAGES = (0.5, 0.65, 0.8, 0.9)  # coverages whose accuracy is reported


@dataclass(frozen=True)
class Selective:
    """One set of scored rows: the calibration error (raw, and calibrated when known), coverage at target accuracies,
    accuracy at fixed coverages."""

    rows: int
    accuracy: float
    ece: float
    ece_raw: float | None
    coverage_at: dict[float, float]
    accuracy_at: dict[float, float]

    def to_json(self) -> dict:
        return {"rows": self.rows, "accuracy": self.accuracy, "ece": self.ece, "ece_raw": self.ece_raw, "bins": BINS,
                "coverage_at_accuracy": {repr(k): v for k, v in self.coverage_at.items()},
                "accuracy_at_coverage": {repr(k): v for k, v in self.accuracy_at.items()}}


def selective(confidence, correct, raw_confidence=None) -> Selective:
    """The figures of rows with these confidences and correctness (``raw_confidence``: before calibration)."""
    confidence, correct = np.asarray(confidence, np.float64), np.asarray(correct, bool)
    curve = risk_coverage(confidence, correct)
    raw = expected_calibration_error(raw_confidence, correct) if raw_confidence is not None else None
    return Selective(len(correct), float(correct.mean()), expected_calibration_error(confidence, correct), raw,
                     coverage_at_accuracies(confidence, correct, TARGETS), {c: curve.at_coverage(c) for c in COVERAGES})


def selective_table(figures: Selective, title: str) -> Table:
    """Calibration error and accuracy against coverage, one row per figure."""
    table = Table(title=title)
    table.add_column("figure")
    table.add_column("value", justify="right")
    if figures.ece_raw is not None:
        table.add_row(f"calibration error (ECE, {BINS} bins), raw", f"{figures.ece_raw:.1%}")
    table.add_row(f"calibration error (ECE, {BINS} bins)", f"{figures.ece:.1%}")
    for target, coverage in figures.coverage_at.items():
        table.add_row(f"coverage at {target:.0%} accuracy", f"{coverage:.1%}")
    for coverage, accuracy in figures.accuracy_at.items():
        table.add_row(f"accuracy at {coverage:.0%} coverage", f"{accuracy:.1%}")
    return table


def plot_trust(confidence, correct, path: Path, title: str) -> Path:
    """Two panels: the reliability diagram (accuracy against confidence per bin, and the diagonal) and accuracy
    against coverage. Writes a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    bins, curve = reliability(confidence, correct), risk_coverage(confidence, correct)
    figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4.2))
    centers = [(b["low"] + b["high"]) / 2 for b in bins]
    left.bar(centers, [b["accuracy"] for b in bins], width=1 / BINS, edgecolor="black", alpha=0.7, label="accuracy")
    left.plot([0, 1], [0, 1], "--", color="gray", label="calibrated")
    left.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], "o", color="C3", label="mean confidence")
    left.set(xlabel="confidence", ylabel="accuracy", xlim=(0, 1), ylim=(0, 1),
             title=f"reliability (ECE {expected_calibration_error(confidence, correct):.1%})")
    left.legend(loc="upper left")
    right.plot(curve.coverage, curve.accuracy, color="C0")
    for target in TARGETS:
        right.axhline(target, color="gray", lw=0.6, ls=":")
    right.set(xlabel="coverage (share of rows accepted)", ylabel="accuracy of accepted rows", xlim=(0, 1),
              title="accuracy against coverage")
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
