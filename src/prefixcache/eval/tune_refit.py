"""A tuned prefix with its head refitted: ``fit``'s logistic head over the states the tuned prefix gives, which is
what ``prefixcache fit --tune prefix`` writes unless told to keep the jointly trained head.

The head trained with the prefix (:mod:`prefixcache.eval.tune_prefix`) is what moves the prefix and picks its
epoch. A head fitted afresh over the tuned prefix's states measured better (docs/accuracy.md, "A tuned prefix":
93.3% -> 97.3% on the hand-written tickets, 68.2% -> 78.6% on banking77). The recipe:

1. every training row's features through the tuned prefix (:func:`~prefixcache.scheduler.feature_pass.
   collect_features` after :func:`~prefixcache.scheduler.feature_pass.tuned_prefix`);
2. :func:`~prefixcache.eval.fit_head.fit_head` on all of them, ``C`` by cross-validation, as ``fit`` fits a head;
3. the confidence calibrated on the rows tuning held out: a head fitted at the same ``C`` on the other rows scores
   them, and the temperature (and the rows ``--target-accuracy`` reads) comes from those scores. Those rows trained
   neither the prefix nor that head; the rows a cross-validation fold leaves out did train the prefix, and a
   temperature fitted on them is overconfident.

This module does not print and knows nothing about files or flags.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Sequence

import numpy as np

from ..model.load import LoadedModel
from ..scheduler.feature_pass import collect_features, tuned_prefix
from ..task.definition import Task
from ..types import RunConfig
from .fit_head import FitResult, fit_head, gold_indices, split_log_probs
from .tune_config import RefitConfig
from .tune_prefix import Tuned, calibrate, head_manifest


@dataclass(frozen=True, eq=False)
class Refitted:
    """What :func:`refit_head` returns. ``tuned``: the tuning's result with the refitted head (carrying the same
    tuned prefix) and that head's held-out figures (calibration, calibrated confidences, correctness, calibration
    error); ``joint``: the tuning's result as it came; ``fit``: the logistic fit over every row (its ``C``, its
    cross-validated figures); ``seconds``: the feature pass and the fits."""

    tuned: Tuned
    joint: Tuned
    fit: FitResult
    seconds: float


def refit_head(
    loaded: LoadedModel,
    task: Task,
    records: Sequence,
    gold_labels: Sequence[str],
    joint: Tuned,
    refit: RefitConfig = RefitConfig(),
    config: RunConfig = RunConfig(),
) -> Refitted:
    """Refit ``joint``'s head over its tuned prefix's states of ``records`` (the rows it was tuned on, in the same
    order; ``gold_labels`` row for row), as :func:`~prefixcache.eval.fit_head.fit_head` fits a head with ``refit``'s
    settings; calibrated on ``joint.heldout``. ``config``: the feature pass's (classification's) settings.

    Raises:
        InputError: a row cannot run, or a gold label is not the task's (naming the row).
        ValueError: ``records`` are not the rows ``joint`` was tuned on.
    """
    started = time.perf_counter()
    features = collect_features(loaded, task, records, feature=refit.feature, config=config,
                                tuned=tuned_prefix(joint.head)).require_complete("training row")
    last = int(joint.heldout.max(initial=-1))
    if len(features.ids) <= last or tuple(features.labels) != tuple(joint.head.labels):
        raise ValueError(f"{len(features.ids)} rows over labels {features.labels} are not the rows the prefix was "
                         f"tuned on (held out up to row {last}, labels {joint.head.labels})")
    fit = fit_head(features, gold_labels, folds=refit.folds, on_prompt=refit.on_prompt, seed=refit.seed)
    y = gold_indices(features, gold_labels)
    train = np.setdiff1d(np.arange(len(y)), joint.heldout)
    scored = split_log_probs(features, y, train, joint.heldout, fit.C, on_prompt=refit.on_prompt, seed=refit.seed)
    calibration, confidence, correct, ece = calibrate(scored, y[joint.heldout])
    head = replace(fit.head, manifest={}, prefix=joint.head.prefix)
    tuned = replace(joint, head=head, calibration=calibration, confidence=confidence, correct=correct, ece=ece)
    return Refitted(tuned, joint, fit, time.perf_counter() - started)


def refit_manifest(refitted: Refitted, joint_manifest: dict) -> dict:
    """The head file's manifest for the tuned prefix with its refitted head: ``joint_manifest`` (the joint head's,
    :func:`~prefixcache.eval.tune_prefix.tuned_manifest`: model, prompt, labels, training rows, how the prefix was
    tuned) with the refitted head's own entries (:func:`~prefixcache.eval.tune_prefix.head_manifest`: its feature,
    its held-out figures, calibration and rows), ``tuned`` saying which head it is and what the joint one reached,
    and ``refit``: how the head was fitted."""
    tuned, fit = refitted.tuned, refitted.fit
    manifest = dict(joint_manifest) | head_manifest(tuned)
    manifest["tuned"] = dict(joint_manifest["tuned"], head="refitted", heldout_accuracy=tuned.heldout_accuracy,
                             joint_heldout_accuracy=refitted.joint.heldout_accuracy)
    manifest["refit"] = {"feature": tuned.head.feature, "on_prompt": fit.on_prompt, "folds": fit.folds, "C": fit.C,
                         "cv": fit.cv_json(), "seconds": round(refitted.seconds, 1)}
    return manifest
