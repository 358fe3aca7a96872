"""Fitting a label head on labelled rows' features, with the regularization chosen by cross-validation.

Two heads (:class:`~prefixcache.engine.head.FittedHead`):

* from scratch: scikit-learn's ``Pipeline(StandardScaler, LogisticRegression)`` (multinomial, lbfgs);
* on the prompt (``on_prompt=True``): logits = ``s * prompt_logprobs + W x + b``, the prompt's own label
  log-probs as an offset the fit corrects. scikit-learn's LogisticRegression takes no offset, so
  :class:`PromptOffsetLogisticRegression` minimises the same objective (mean cross-entropy plus
  ``|W|^2 / (2 C n)``, the bias and ``s`` unpenalized) with ``torch.optim.LBFGS``.

Either way ``C`` is chosen from :data:`C_GRID` by stratified k-fold cross-validation (the accuracy of
each ``C``'s out-of-fold predictions over the same folds, as ``cross_val_predict`` gives them, each fit
stopped at :data:`SEARCH_TOLERANCE`); those cross-validated predictions of the chosen ``C`` are the
figures reported (they select ``C`` too, so they lean a little optimistic). The folds are capped at the
smallest label's row count (at least 2). The head is then refitted on every row (to :data:`TOLERANCE`),
and the standardization folded into its weights.

This module does not run models or print: features come from :mod:`prefixcache.scheduler.feature_pass`.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch
from sklearn.base import BaseEstimator, ClassifierMixin
from sklearn.linear_model import LogisticRegression
from sklearn.model_selection import StratifiedKFold
from sklearn.pipeline import Pipeline
from sklearn.preprocessing import StandardScaler
from scipy.special import log_softmax
from threadpoolctl import threadpool_limits

from ..engine.confidence import Calibration, confidence_and_correct, expected_calibration_error, fit_temperature
from ..engine.head import FittedHead, fold_standardization
from ..engine.head_file import FORMAT, library_versions
from ..errors import InputError
from ..scheduler.feature_pass import FeatureSet
from .metrics import Metrics, compute_metrics

C_GRID = (0.001, 0.01, 0.1, 1.0, 10.0)  # inverse L2 strength, over standardized features
DEFAULT_C = 0.1  # used when some label has a single row, so no stratified fold can hold it out
MAX_ITER = 500
DTYPE = torch.float32  # the on-prompt fit's arithmetic: half float64's time per step, same optimum within tolerance
# A fit stops when no gradient entry exceeds its tolerance. The head itself is fitted to scikit-learn's
# default, 1e-4. The search for C only ranks the C values, and 1e-3 does that 3.5x faster: on 1,000
# NatCS-71 rows (71 labels) the 25 cross-validation fits took 3.5 instead of 12.2 CPU s (`last`) and
# 5.1 instead of 16.9 (`last+mean@22`), each C's accuracy within 0.6 points. The final fit stays at 1e-4:
# at 1e-3 it cost 2-3 hand-written tickets of 75 (docs/accuracy.md, "Fit time").
TOLERANCE = 1e-4
SEARCH_TOLERANCE = 1e-3
MIN_ERRORS = 5  # wrong out-of-fold rows needed before a temperature is fitted (see calibrate_oof)


@contextmanager
def single_threaded():
    """Run BLAS/OpenMP and torch on one thread: these fits are many small products, and several threads
    contending for a shared machine's cores made them 5-20x slower (measured), never faster."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with threadpool_limits(limits=1):
            yield
    finally:
        torch.set_num_threads(threads)


class PromptOffsetLogisticRegression(ClassifierMixin, BaseEstimator):
    """Multinomial logistic regression whose logits start from the prompt's label log-probs.

    ``X`` is ``[features (F columns) | prompt log-probs (n_labels columns)]``; ``y`` holds label indices
    ``0 .. n_labels-1`` (the prompt columns' order). Fitted attributes: ``scaler_`` (over the features),
    ``coef_ [L, F]`` and ``intercept_ [L]`` over standardized features, ``prompt_scale_``.
    """

    def __init__(self, C: float = 1.0, n_labels: int = 2, max_iter: int = MAX_ITER, warm_start: bool = False,
                 tol: float = TOLERANCE):
        self.C = C
        self.tol = tol
        self.n_labels = n_labels
        self.max_iter = max_iter
        self.warm_start = warm_start

    def fit(self, X, y):
        width = X.shape[1] - self.n_labels
        self.scaler_ = StandardScaler().fit(X[:, :width])
        z = torch.from_numpy(self.scaler_.transform(X[:, :width])).to(DTYPE)  # [n, F]
        prompt = torch.from_numpy(np.asarray(X[:, width:])).to(DTYPE)  # [n, L]
        target = torch.from_numpy(np.asarray(y, np.int64))  # [n]
        with torch.inference_mode(False), torch.enable_grad():
            weight, bias, scale = self._start(width)
            optimizer = torch.optim.LBFGS(
                [weight, bias, scale], max_iter=self.max_iter, tolerance_grad=self.tol, line_search_fn="strong_wolfe"
            )
            penalty = 1.0 / (2.0 * self.C * len(target))

            def closure():
                optimizer.zero_grad()
                logits = scale * prompt + z @ weight.T + bias  # [n, L]
                loss = torch.nn.functional.cross_entropy(logits, target) + penalty * weight.pow(2).sum()
                loss.backward()
                return loss

            optimizer.step(closure)
        self.coef_, self.intercept_ = weight.detach().double().numpy(), bias.detach().double().numpy()
        self.prompt_scale_ = float(scale.detach())
        self.classes_ = np.arange(self.n_labels)
        return self

    def _start(self, width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Initial ``W [L, F]``, ``b [L]``, ``s``: the last solution under ``warm_start``, else zeros and ``s = 1``
        (the prompt as it is)."""
        if self.warm_start and getattr(self, "coef_", None) is not None and self.coef_.shape == (self.n_labels, width):
            start = (self.coef_, self.intercept_, np.float64(self.prompt_scale_))
        else:
            start = (np.zeros((self.n_labels, width)), np.zeros(self.n_labels), np.float64(1.0))
        return tuple(torch.tensor(v, dtype=DTYPE, requires_grad=True) for v in start)

    def decision_function(self, X) -> np.ndarray:
        width = X.shape[1] - self.n_labels
        z = self.scaler_.transform(X[:, :width])
        return self.prompt_scale_ * np.asarray(X[:, width:], np.float64) + z @ self.coef_.T + self.intercept_

    def predict(self, X) -> np.ndarray:
        return self.classes_[self.decision_function(X).argmax(axis=1)]


@dataclass(frozen=True)
class FitResult:
    """A fitted head and its cross-validated figures.

    ``cv_metrics``: the chosen ``C``'s cross-validated predictions against the gold labels;
    ``prompt_metrics``: the prompt's own labels (first-token scores) on the same rows.
    ``accuracy_by_C``: cross-validated accuracy of every ``C`` tried. ``note``: how the folds were
    capped, or why no cross-validation ran. ``seconds``: the fit alone (features excluded), wall clock;
    ``cpu_seconds``: the process's CPU time over the same span (steadier on a shared machine).
    """

    head: FittedHead
    cv_metrics: Metrics | None
    prompt_metrics: Metrics
    folds: int
    C: float
    accuracy_by_C: dict[float, float]
    cv_predicted: list[str] | None
    seconds: float
    note: str | None = None
    on_prompt: bool = False
    cpu_seconds: float = 0.0
    calibration: Calibration = Calibration()
    oof_confidence: np.ndarray | None = None  # [N] calibrated out-of-fold confidences (None: no cross-validation)
    oof_correct: np.ndarray | None = None  # [N] whether each out-of-fold prediction was right
    ece: tuple[float, float] | None = None  # out-of-fold expected calibration error, (raw, calibrated)
    oof_logprobs: np.ndarray | None = None  # [N, L] the chosen C's out-of-fold label log-probs, before calibration

    def cv_json(self) -> dict:
        """The manifest's ``cv`` entry."""
        document = {"folds": self.folds, "C": self.C, "on_prompt": self.on_prompt, "note": self.note,
                    "prompt_accuracy": self.prompt_metrics.accuracy, "prompt_macro_f1": self.prompt_metrics.macro_f1,
                    "accuracy_by_C": {repr(c): a for c, a in self.accuracy_by_C.items()}}
        if self.cv_metrics is not None:
            document |= {"accuracy": self.cv_metrics.accuracy, "macro_f1": self.cv_metrics.macro_f1}
        if self.ece is not None:
            document |= {"ece_raw": self.ece[0], "ece_calibrated": self.ece[1]}
        return document


def gold_indices(feature_set: FeatureSet, gold_labels: Sequence[str] | Mapping) -> np.ndarray:
    """Gold labels as indices into ``feature_set.labels``, row for row with ``feature_set.ids``.

    ``gold_labels``: a sequence aligned with ``ids``, or a mapping id -> label.

    Raises:
        InputError: a row has no gold label or one outside the label set (naming the record id), a
            label has no rows, or there are fewer than two rows.
    """
    if isinstance(gold_labels, Mapping):
        missing = [i for i in feature_set.ids if i not in gold_labels]
        if missing:
            raise InputError(f"record {missing[0]!r}: no gold label given ({len(missing)} record(s) lack one)")
        gold_labels = [gold_labels[i] for i in feature_set.ids]
    if len(gold_labels) != len(feature_set.ids):
        raise ValueError(f"{len(gold_labels)} gold labels for {len(feature_set.ids)} rows")
    position = {label: j for j, label in enumerate(feature_set.labels)}
    for record_id, label in zip(feature_set.ids, gold_labels):
        if label not in position:
            raise InputError(f"record {record_id!r}: label {label!r} is not one of the task's labels "
                             f"({', '.join(feature_set.labels)})")
    y = np.array([position[label] for label in gold_labels], dtype=np.int64)
    empty = [label for j, label in enumerate(feature_set.labels) if not (y == j).any()]
    if empty:
        raise InputError(f"no training rows carry label(s) {empty}: a head needs at least one row per label "
                         "(two for cross-validation); add rows, or drop the label from the task")
    return y


def _estimator(on_prompt: bool, C: float, n_labels: int, seed: int, tol: float = TOLERANCE):
    """A fresh estimator that warm-starts: refitted with a larger ``C``, it starts from its last solution."""
    if on_prompt:
        return PromptOffsetLogisticRegression(C=C, n_labels=n_labels, warm_start=True, tol=tol)
    lr = LogisticRegression(C=C, max_iter=MAX_ITER, tol=tol, random_state=seed, warm_start=True)
    return Pipeline([("scale", StandardScaler()), ("lr", lr)])


def _with_C(estimator, C: float):
    return estimator.set_params(**({"C": C} if isinstance(estimator, PromptOffsetLogisticRegression) else {"lr__C": C}))


def _design(feature_set: FeatureSet, on_prompt: bool) -> np.ndarray:
    x = feature_set.features.astype(np.float64)
    return np.hstack([x, feature_set.prompt_logprobs.astype(np.float64)]) if on_prompt else x


def choose_C(x: np.ndarray, y: np.ndarray, on_prompt: bool, n_labels: int, folds: int, seed: int):
    """Cross-validate every ``C`` of :data:`C_GRID`; returns ``(C, accuracy_by_C, out-of-fold log-probs of C, folds,
    note)``, the log-probs ``[N, L]`` row for row with ``y``.

    Each fold fits the grid in ascending order, each fit warm-started from the more regularized one
    before it (the regularization path, as scikit-learn's ``LogisticRegressionCV`` walks it): the
    same optimum, in fewer iterations. With a label of a single row no stratified fold can hold it
    out: :data:`DEFAULT_C`, no predictions.
    """
    smallest = int(np.bincount(y, minlength=n_labels).min())
    if smallest < 2:
        return DEFAULT_C, {}, None, 0, f"a label has 1 row: no cross-validation, C = {DEFAULT_C}"
    used = max(2, min(folds, smallest))
    note = f"folds capped at {used} (the smallest label has {smallest} rows)" if used < folds else None
    splits = list(StratifiedKFold(n_splits=used, shuffle=True, random_state=seed).split(x, y))
    paths = [_fold_path(x, y, train, test, on_prompt, n_labels, seed) for train, test in splits]  # sequential:
    # two threads (or processes) on a 2-core machine shared with other work measured slower, not faster
    logprobs = {C: np.empty((len(y), n_labels)) for C in C_GRID}
    for (_, test), path in zip(splits, paths):
        for C, scored in path.items():
            logprobs[C][test] = scored
    by_C = {C: float((logprobs[C].argmax(axis=1) == y).mean()) for C in C_GRID}
    best = max(C_GRID, key=lambda c: by_C[c])  # the first (most regularized) of equals
    return best, by_C, logprobs[best], used, note


def _fold_path(x, y, train, test, on_prompt: bool, n_labels: int, seed: int) -> dict[float, np.ndarray]:
    """One fold's regularization path: C -> label log-probs ``[n_test, L]`` on ``test``, the grid fitted in ascending
    order, each fit warm-started from the one before."""
    estimator, path = _estimator(on_prompt, C_GRID[0], n_labels, seed, SEARCH_TOLERANCE), {}
    for C in sorted(C_GRID):
        path[C] = _log_probs(_with_C(estimator, C).fit(x[train], y[train]), x[test], n_labels)
    return path


def _log_probs(estimator, x: np.ndarray, n_labels: int) -> np.ndarray:
    """Label log-probs ``[n, L]`` over every label (a fold missing a label gives it -inf)."""
    if isinstance(estimator, PromptOffsetLogisticRegression):
        return log_softmax(estimator.decision_function(x), axis=1)
    scored = np.full((len(x), n_labels), -np.inf)
    scored[:, estimator.classes_] = estimator.predict_log_proba(x)
    return scored


def fit_head(
    feature_set: FeatureSet, gold_labels: Sequence[str] | Mapping, *, folds: int = 5, on_prompt: bool = False, seed: int = 0
) -> FitResult:
    """Fit a head on ``feature_set``'s rows (``C`` chosen by stratified ``folds``-fold cross-validation).

    The head's ``manifest`` holds everything but the task-independent parts a caller may add.

    Raises:
        InputError: see :func:`gold_indices`.
    """
    y = gold_indices(feature_set, gold_labels)
    labels, n_labels = feature_set.labels, len(feature_set.labels)
    started, cpu_started = time.perf_counter(), time.process_time()
    x = _design(feature_set, on_prompt)
    with single_threaded():
        C, by_C, oof, used, note = choose_C(x, y, on_prompt, n_labels, folds, seed)
        head = _to_head(_estimator(on_prompt, C, n_labels, seed).fit(x, y), feature_set, on_prompt)
    trust = calibrate_oof(oof, y)
    seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    gold = [labels[j] for j in y]
    prompt_metrics = compute_metrics(gold, [labels[j] for j in feature_set.prompt_logprobs.argmax(axis=1)], labels)
    cv_predicted = [labels[j] for j in oof.argmax(axis=1)] if oof is not None else None
    cv_metrics = compute_metrics(gold, cv_predicted, labels) if cv_predicted is not None else None
    result = FitResult(head, cv_metrics, prompt_metrics, used, C, by_C, cv_predicted, seconds, note, on_prompt, cpu_seconds,
                       *trust, oof)
    head.manifest.update(_manifest(feature_set, head, result))
    return result


def split_log_probs(feature_set: FeatureSet, y: np.ndarray, train: np.ndarray, scored: np.ndarray, C: float, *,
                    on_prompt: bool = False, seed: int = 0) -> np.ndarray:
    """Label log-probs ``[len(scored), L]`` of the rows at ``scored`` from a head fitted (at ``C``, as
    :func:`fit_head` fits its final head) on the rows at ``train`` alone; ``y``: :func:`gold_indices`."""
    x = _design(feature_set, on_prompt)
    with single_threaded():
        estimator = _estimator(on_prompt, C, len(feature_set.labels), seed).fit(x[train], y[train])
    return _log_probs(estimator, x[scored], len(feature_set.labels))


def calibrate_oof(oof: np.ndarray | None, y: np.ndarray) -> tuple:
    """A temperature fitted on the out-of-fold log-probs ``oof [N, L]``, and with it the calibrated out-of-fold
    confidences, their correctness and the (raw, calibrated) calibration error; the identity with no rows.

    With fewer than :data:`MIN_ERRORS` wrong out-of-fold rows the temperature is not identifiable: the likelihood
    only grows as it sharpens, towards calling every row certain (measured: the 600 synthetic tickets, all right
    out of fold, drove it to the search's bound, 0.018, and every confidence to 1.0, so no threshold could tell
    rows apart). The scores are then left as they are (``T = 1``)."""
    if oof is None:
        return Calibration(), None, None, None
    wrong = int((oof.argmax(axis=1) != y).sum())
    calibration = fit_temperature(oof, y) if wrong >= MIN_ERRORS else Calibration(1.0, 0)
    raw = expected_calibration_error(*confidence_and_correct(oof, y))
    confidence, correct = confidence_and_correct(calibration.apply(oof), y)
    return calibration, confidence, correct, (raw, expected_calibration_error(confidence, correct))


def _to_head(estimator, feature_set: FeatureSet, on_prompt: bool) -> FittedHead:
    """A :class:`FittedHead` over raw features from a fitted estimator (standardization folded in)."""
    if on_prompt:
        scaler, coef, intercept, scale = estimator.scaler_, estimator.coef_, estimator.intercept_, estimator.prompt_scale_
    else:
        scaler, model, scale = estimator.named_steps["scale"], estimator.named_steps["lr"], 0.0
        coef, intercept = model.coef_, model.intercept_
        if coef.shape[0] == 1:  # two labels: scikit-learn keeps one row (the second label's logit, the first's at 0)
            coef, intercept = np.vstack([np.zeros_like(coef), coef]), np.concatenate([[0.0], intercept])
    weight, bias = fold_standardization(coef, intercept, scaler.mean_, scaler.scale_)
    return FittedHead(weight, bias, float(scale), tuple(feature_set.labels), feature_set.feature, {})


def _manifest(feature_set: FeatureSet, head: FittedHead, result: FitResult) -> dict:
    return {
        "format": FORMAT,
        "model": feature_set.model_identity,
        "dtype": feature_set.dtype,
        "prefix_sha256": feature_set.prefix_hash,
        "feature": head.feature,
        "labels": list(head.labels),
        "prompt_scale": head.prompt_scale,
        "training": {"rows": len(feature_set.ids), "text_sha256": sorted(set(feature_set.text_hashes))},
        "cv": result.cv_json(),
        "versions": library_versions(),
        **oof_manifest(result.calibration, result.oof_confidence, result.oof_correct),
    }


def oof_manifest(calibration: Calibration, confidence, correct) -> dict:
    """The manifest's ``calibration`` and ``oof`` entries (none when there were no out-of-fold rows)."""
    if confidence is None:
        return {}
    return {"calibration": calibration.to_json(),
            "oof": {"confidence": [round(float(c), 5) for c in confidence], "correct": [int(k) for k in correct]}}
