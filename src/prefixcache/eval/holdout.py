"""Fit on part of the labelled rows, score on the rest: the prompt's own labels against a fitted head.

:func:`fit_and_score` collects every row's features in one batched pass, splits the rows once
(stratified by label, as its :class:`FitPlan` says), fits a head on one part
(:func:`~prefixcache.eval.fit_head.fit_head`) and scores the prompt and the head on the other
(:func:`fit_then_score`, which also takes two parts made elsewhere). A scored row never shares its normalized text with a fitted row
(:func:`~prefixcache.engine.head_file.text_hash`): such rows are dropped from the scored part and
counted, so a duplicated text cannot inflate the head's figure. ``make demo`` prints this.

This module does not print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
from sklearn.model_selection import train_test_split

from ..scheduler.feature_pass import FeatureSet, collect_features
from ..types import DEFAULT_FEATURE, RunConfig
from .fit_curve import subset
from .fit_head import FitResult, fit_head
from .metrics import Metrics, compute_metrics


@dataclass(frozen=True)
class HeldOut:
    """Figures on the scored part: ``prompt`` (its own first-token labels) and ``head``; ``dropped``: scored
    rows left out because a fitted row has the same normalized text."""

    fitted_rows: int
    scored_rows: int
    dropped: int
    prompt: Metrics
    head: Metrics
    fit: FitResult

    def to_json(self) -> dict:
        return {"fitted_rows": self.fitted_rows, "scored_rows": self.scored_rows, "dropped_duplicates": self.dropped,
                "prompt_accuracy": self.prompt.accuracy, "head_accuracy": self.head.accuracy,
                "head_macro_f1": self.head.macro_f1, "C": self.fit.C, "folds": self.fit.folds}


@dataclass(frozen=True)
class FitPlan:
    """How :func:`fit_and_score` splits the rows and fits the head: the share of rows scored (``held_out``), the
    seed of the split and of the folds, the feature spec, a head on the prompt's own scores or from scratch
    (``on_prompt``), and the cross-validation folds that choose its ``C``."""

    held_out: float = 0.5
    seed: int = 0
    feature: str = DEFAULT_FEATURE
    on_prompt: bool = False
    folds: int = 5


def fit_and_score(
    loaded,
    task,
    records: Sequence,
    gold: Sequence[str],
    plan: FitPlan = FitPlan(),
    *,
    batch_size: int = 32,
    progress: Callable[[int], None] | None = None,
) -> HeldOut:
    """Fit on ``1 - plan.held_out`` of ``records`` (stratified by ``gold``), score on the rest.

    Raises:
        InputError: a record cannot be run (naming it), or a gold label outside the task's labels.
    """
    features = collect_features(loaded, task, records, feature=plan.feature, config=RunConfig(batch_size=batch_size),
                                progress=progress)
    features.require_complete()
    labels = np.array(gold)
    fitted, scored = train_test_split(np.arange(len(labels)), test_size=plan.held_out, stratify=labels,
                                      random_state=plan.seed)
    seen = {features.text_hashes[i] for i in fitted}
    kept = np.array([i for i in scored if features.text_hashes[i] not in seen], dtype=np.int64)
    part, truth = subset(features, kept), list(labels[kept])
    head, result = fit_then_score(subset(features, fitted), list(labels[fitted]), part, truth,
                                  folds=plan.folds, on_prompt=plan.on_prompt, seed=plan.seed)
    order = features.labels
    prompt = [order[j] for j in part.prompt_logprobs.argmax(axis=1)]
    return HeldOut(len(fitted), len(kept), len(scored) - len(kept), compute_metrics(truth, prompt, order), head, result)


def fit_then_score(
    fit_rows: FeatureSet,
    fit_gold: Sequence[str],
    scored_rows: FeatureSet,
    scored_gold: Sequence[str],
    *,
    folds: int = 5,
    on_prompt: bool = False,
    seed: int = 0,
) -> tuple[Metrics, FitResult]:
    """Fit a head on ``fit_rows`` (C chosen by ``folds``-fold CV) and score it on ``scored_rows``, whose
    features were taken the same way: the head's figures on the scored rows, and the fit. The caller keeps
    the two parts apart (:func:`fit_and_score` drops scored rows whose text a fitted row has)."""
    result = fit_head(fit_rows, list(fit_gold), folds=folds, on_prompt=on_prompt, seed=seed)
    predicted = result.head.predict(scored_rows.features, scored_rows.prompt_logprobs)
    return compute_metrics(list(scored_gold), predicted, scored_rows.labels), result
