"""Calibrating a prompt-only task: its own label scores on labelled rows, one temperature, a calibration file's document.

A task with no fitted head has no out-of-fold predictions, but its prompt's label scores are just as
over- or under-confident. :func:`calibrate_prompt` classifies labelled rows through the task's prompt
(the classifier's own method, batched over the cached prefix), fits a temperature on their label
log-probs (:func:`~prefixcache.engine.confidence.fit_temperature`), and returns the document that
:mod:`prefixcache.engine.calibration_file` stores beside the task.

This module does not print or write files.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..engine.confidence import Trust, confidence_and_correct
from ..engine.head_file import prefix_hash
from ..errors import InputError
from ..scheduler.classify import Classifier
from ..types import Record, RunConfig
from .fit_head import calibrate_oof


def calibrate_prompt(classifier: Classifier, records: Sequence[Record], gold: Sequence[str], batch_size: int = 32) -> dict:
    """The calibration document of ``classifier``'s prompt, fitted on ``records`` and their ``gold`` labels.

    Raises:
        InputError: a row cannot be scored (naming it), or the classifier scores through a fitted head (a head
            carries its own calibration: refit it with ``prefixcache fit``).
    """
    if classifier.fitted_head is not None:
        raise InputError("this task scores through a fitted head, which carries its own calibration; "
                         "refit the head with `prefixcache fit` instead")
    classifier.trust = Trust()  # the prompt's raw scores
    predictions = classifier.classify_all(records, RunConfig("batched", batch_size))
    failed = [p for p in predictions if p.scores is None]
    if failed:
        raise InputError(f"record {failed[0].id!r} cannot be scored: {failed[0].error}")
    labels = predictions[0].scores.labels
    logprobs = np.array([p.scores.logprobs for p in predictions])  # [N, L]
    y = np.array([labels.index(g) for g in gold])
    calibration, confidence, correct, (raw, calibrated) = calibrate_oof(logprobs, y)
    accuracy = float(confidence_and_correct(logprobs, y)[1].mean())
    return {
        "task": classifier.task.name, "model": classifier.loaded.identity, "prefix_sha256": prefix_hash(classifier.prompt),
        "labels": list(labels), "method": classifier.method, "calibration": calibration.to_json(),
        "rows": {"confidence": [round(float(c), 5) for c in confidence], "correct": [int(k) for k in correct]},
        "ece": {"raw": raw, "calibrated": calibrated, "bins": 15}, "accuracy": accuracy,
    }

