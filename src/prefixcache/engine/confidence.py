"""Calibrated confidence and abstention: how far a label's probability can be trusted, and when to say "ask a person".

Everything here works on probabilities over a fixed set of choices, whatever produced them (a fitted
head, the prompt's own label scores, an extraction field's choices), so the same pieces serve labels
and fields:

* :class:`Calibration`: temperature scaling (Guo et al., 2017, "On Calibration of Modern Neural
  Networks"): ``log_softmax(logprobs / T)``. One number, fitted on held-out (out-of-fold) rows by
  minimising their negative log-likelihood; it never changes which choice is best (a positive
  ``T`` keeps the order of every row's scores). ``T = 1`` is the identity.
* :func:`expected_calibration_error`: the confidence-weighted gap between confidence and accuracy
  over equal-width bins (15 by default).
* :func:`risk_coverage` and :func:`threshold_for_accuracy`: rows ordered by confidence; the lowest
  threshold whose accepted rows reach a target accuracy, and the share of rows it accepts.
* :class:`Trust`: a calibration and a threshold, applied to one :class:`~prefixcache.types.Prediction`
  (:meth:`Trust.judge`): the scores are calibrated, and below the threshold the prediction abstains
  (its label becomes None; its best guess and confidence stay).

This module runs no model and reads no file; :mod:`prefixcache.eval.fit_head` fits a calibration and
the head file stores it (:mod:`prefixcache.engine.head_file`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np

from ..types import LabelScores, Prediction

BINS = 15  # equal-width confidence bins of the expected calibration error
LOG_T_BOUNDS = (-4.0, 4.0)  # the temperature is searched in [e^-4, e^4]


@dataclass(frozen=True)
class Calibration:
    """Temperature scaling: calibrated log-probs are ``log_softmax(logprobs / temperature)``.

    ``rows``: how many labelled rows it was fitted on (0: the identity, never fitted).
    """

    temperature: float = 1.0
    rows: int = 0

    def __post_init__(self):
        if not self.temperature > 0:
            raise ValueError(f"a temperature must be positive, not {self.temperature!r}")

    def apply(self, logprobs) -> np.ndarray:
        """Calibrated log-probs. ``logprobs [..., L]`` (any log-probs or logits) -> ``[..., L]`` float64, normalized."""
        from scipy.special import log_softmax  # here: scipy loads only when a temperature is applied

        return log_softmax(np.asarray(logprobs, np.float64) / self.temperature, axis=-1)

    def scores(self, scores: LabelScores) -> LabelScores:
        """``scores`` calibrated (the same labels, the same best label)."""
        if self.temperature == 1.0:
            return scores
        return LabelScores(scores.labels, tuple(float(v) for v in self.apply(scores.logprobs)))

    def to_json(self) -> dict:
        return {"method": "temperature", "temperature": self.temperature, "rows": self.rows}

    @classmethod
    def from_json(cls, document: Mapping) -> Calibration:
        """Read :meth:`to_json`'s document. Raises ValueError for another method or a bad temperature."""
        if document.get("method") != "temperature":
            raise ValueError(f"unknown calibration method {document.get('method')!r}")
        return cls(float(document["temperature"]), int(document.get("rows", 0)))


def fit_temperature(logprobs, gold) -> Calibration:
    """The temperature that minimises the negative log-likelihood of ``gold`` under ``logprobs`` scaled by it.

    ``logprobs [N, L]``, ``gold [N]`` label indices. The search is over ``log T`` (bounded, so a perfectly
    separated set gets a small finite ``T``, never 0).

    Raises:
        ValueError: no rows, or shapes that do not match.
    """
    x = np.asarray(logprobs, np.float64)
    y = np.asarray(gold, np.int64)
    if x.ndim != 2 or len(x) == 0 or y.shape != (len(x),):
        raise ValueError(f"fit_temperature needs logprobs [N, L] and gold [N] with N >= 1, got {x.shape} and {y.shape}")
    from scipy.optimize import minimize_scalar
    from scipy.special import log_softmax

    rows = np.arange(len(y))

    def nll(log_t: float) -> float:
        return float(-log_softmax(x / np.exp(log_t), axis=1)[rows, y].mean())

    best = minimize_scalar(nll, bounds=LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-4})
    return Calibration(float(np.exp(best.x)), len(y))


def confidence_and_correct(logprobs, gold) -> tuple[np.ndarray, np.ndarray]:
    """Per row: the best choice's probability, and whether the best choice is ``gold``. ``[N, L]``, ``[N]`` -> ``[N]``, ``[N]``."""
    x = np.asarray(logprobs, np.float64)
    return np.exp(x.max(axis=1)), x.argmax(axis=1) == np.asarray(gold)


def expected_calibration_error(confidence, correct, bins: int = BINS) -> float:
    """``sum_b (n_b / N) |accuracy_b - mean confidence_b|`` over ``bins`` equal-width bins of (0, 1].

    Raises:
        ValueError: no rows.
    """
    p, ok = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    if len(p) == 0:
        raise ValueError("the calibration error of no rows is undefined")
    which = np.clip(np.ceil(p * bins).astype(int) - 1, 0, bins - 1)
    total = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            total += mask.sum() * abs(ok[mask].mean() - p[mask].mean())
    return float(total / len(p))


def calibration_error_floor(confidence, bins: int = BINS, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The calibration error a perfectly calibrated model would measure with these confidences on this many rows:
    the mean and the 95th percentile over ``draws`` simulated outcomes, each row right with probability equal to its
    confidence. A measured error below the 95th percentile cannot be told apart from perfect calibration.

    Raises:
        ValueError: no rows.
    """
    p = np.asarray(confidence, np.float64)  # [N]
    if len(p) == 0:
        raise ValueError("the calibration error of no rows is undefined")
    which = np.clip(np.ceil(p * bins).astype(int) - 1, 0, bins - 1)
    members = np.eye(bins)[which]  # [N, bins]
    right = np.random.default_rng(seed).random((draws, len(p))) < p  # [draws, N]
    gap = np.abs(right @ members - p @ members)  # [draws, bins]: right rows against summed confidence, per bin
    errors = gap.sum(axis=1) / len(p)  # [draws]
    return float(errors.mean()), float(np.quantile(errors, 0.95))


def reliability(confidence, correct, bins: int = BINS) -> list[dict]:
    """Per non-empty bin: its range, rows, mean confidence and accuracy (what a reliability diagram draws)."""
    p, ok = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    which = np.clip(np.ceil(p * bins).astype(int) - 1, 0, bins - 1)
    return [{"low": b / bins, "high": (b + 1) / bins, "rows": int((which == b).sum()),
             "confidence": float(p[which == b].mean()), "accuracy": float(ok[which == b].mean())}
            for b in range(bins) if (which == b).any()]


@dataclass(frozen=True)
class RiskCoverage:
    """Rows accepted from the most confident down: ``thresholds[k]`` accepts the first ``k + 1`` rows, whose
    share of all rows is ``coverage[k]`` and whose accuracy is ``accuracy[k]``. All ``[N]``, confidence descending."""

    thresholds: np.ndarray
    coverage: np.ndarray
    accuracy: np.ndarray

    def reaching(self, share: float) -> int:
        """The index of the highest threshold whose accepted rows are at least ``share`` of all rows (the last one,
        every row, where none is). Tied rows are accepted together, so ``coverage[k]`` may exceed ``share``."""
        return min(int(np.searchsorted(self.coverage, share - 1e-12)), len(self.coverage) - 1)

    def at_coverage(self, share: float) -> float:
        """Accuracy of the rows accepted by the highest threshold that accepts at least ``share`` of the rows."""
        return float(self.accuracy[self.reaching(share)])


def risk_coverage(confidence, correct) -> RiskCoverage:
    """Accuracy against coverage; ties in confidence are accepted together (a threshold cannot split them)."""
    p, ok = np.asarray(confidence, np.float64), np.asarray(correct, np.float64)
    order = np.argsort(-p, kind="stable")
    p, ok = p[order], ok[order]
    accuracy = np.cumsum(ok) / np.arange(1, len(p) + 1)
    last_of_tie = np.r_[p[1:] != p[:-1], True]  # a row whose successor has a lower confidence
    keep = np.flatnonzero(last_of_tie)
    return RiskCoverage(p[keep], (keep + 1) / len(p), accuracy[keep])


@dataclass(frozen=True)
class Threshold:
    """A confidence threshold, the accuracy it was chosen to reach, and what it gave on the rows it was chosen on."""

    threshold: float
    target_accuracy: float | None
    coverage: float
    accuracy: float
    rows: int

    def to_json(self) -> dict:
        return {"threshold": self.threshold, "target_accuracy": self.target_accuracy, "expected_coverage": self.coverage,
                "expected_accuracy": self.accuracy, "rows": self.rows}


def threshold_for_accuracy(confidence, correct, target: float) -> Threshold | None:
    """The lowest threshold whose accepted rows (confidence >= it) reach ``target`` accuracy, or None when even the
    most confident rows do not. The lowest such threshold is the one that accepts most rows."""
    curve = risk_coverage(confidence, correct)
    reached = np.flatnonzero(curve.accuracy >= target)
    if len(reached) == 0:
        return None
    k = int(reached[-1])
    return Threshold(float(curve.thresholds[k]), target, float(curve.coverage[k]), float(curve.accuracy[k]),
                     len(np.asarray(confidence)))


def coverage_at_accuracies(confidence, correct, targets: Sequence[float] = (0.9, 0.95, 0.99)) -> dict[float, float]:
    """For each target accuracy, the coverage its threshold reaches (0.0 where it cannot be reached)."""
    found = {t: threshold_for_accuracy(confidence, correct, t) for t in targets}
    return {t: (f.coverage if f is not None else 0.0) for t, f in found.items()}


@dataclass(frozen=True)
class Trust:
    """What a classifier does to each prediction after scoring it: calibrate, then abstain below ``min_confidence``.

    ``min_confidence`` None: never abstain. ``threshold``: how it was chosen (None: given directly, or none).
    """

    calibration: Calibration = Calibration()
    min_confidence: float | None = None
    threshold: Threshold | None = None

    def judge(self, prediction: Prediction) -> Prediction:
        """``prediction`` with calibrated scores, abstaining when its confidence is under ``min_confidence``.
        A prediction with no scores (an error) is returned as it is."""
        if prediction.scores is None:
            return prediction
        scores = self.calibration.scores(prediction.scores)
        best = max(scores.logprobs)
        abstained = self.min_confidence is not None and float(np.exp(best)) < self.min_confidence
        return replace(prediction, scores=scores, abstained=abstained)

    def to_json(self) -> dict:
        document = {"calibration": self.calibration.to_json(), "min_confidence": self.min_confidence}
        if self.threshold is not None:
            document |= self.threshold.to_json()
        return document
