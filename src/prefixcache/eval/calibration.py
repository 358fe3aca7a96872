"""Contextual calibration (Zhao et al., 2021, "Calibrate Before Use").

A few-shot prompt gives its labels a prior of its own: the majority label of
the examples, the last example's label, tokens the model simply likes. To
measure that prior, content-free inputs (``"N/A"``, ``""``, ``"[MASK]"``) are
scored through the *same* cached prefix; their mean label distribution is
``p_cf``. Each record's label probabilities ``p`` are then divided by ``p_cf``
and renormalized: ``q_i = (p_i / p_cf_i) / sum_j (p_j / p_cf_j)`` (the paper's
``W = diag(p_cf)^-1, b = 0``). A prompt without a bias has a uniform ``p_cf``
and is left unchanged.

All arithmetic is done on log-probabilities in float64, so tiny probabilities
neither underflow nor divide by zero. :func:`calibrate` is pure;
:func:`content_free_prior` runs the classifier (batched, over the stored prefix).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..errors import InputError
from ..scheduler.classify import Classifier
from ..types import LabelScores, Record, RunConfig

CONTENT_FREE = ("N/A", "", "[MASK]")


@dataclass(frozen=True)
class Prior:
    """The label prior of one prompt: mean label distribution over ``texts``, as log-probs in label order."""

    texts: tuple[str, ...]
    labels: tuple[str, ...]
    logprobs: tuple[float, ...]

    @property
    def probabilities(self) -> dict[str, float]:
        return {label: math.exp(lp) for label, lp in zip(self.labels, self.logprobs)}

    def to_json(self) -> dict:
        return {"content_free": list(self.texts), "prior": self.probabilities}


def _logsumexp(values: Sequence[float]) -> float:
    top = max(values)
    if top == -math.inf:
        return -math.inf
    return top + math.log(sum(math.exp(v - top) for v in values))


def mean_distribution(rows: Sequence[Sequence[float]]) -> tuple[float, ...]:
    """Log of the mean of the distributions whose log-probs are ``rows`` (``[K][L]`` -> ``[L]``)."""
    if not rows:
        raise ValueError("at least one distribution is needed")
    k = math.log(len(rows))
    return tuple(_logsumexp(column) - k for column in zip(*rows))


def calibrate_logprobs(logprobs: Sequence[float], prior: Sequence[float]) -> tuple[float, ...]:
    """``log(p / p_cf)``, renormalized over the labels. Both inputs are log-probs in the same label order.

    Raises:
        ValueError: the lengths differ, or the prior gives a label zero probability.
    """
    if len(logprobs) != len(prior):
        raise ValueError(f"{len(logprobs)} label scores but a prior over {len(prior)} labels")
    if any(p == -math.inf for p in prior):
        raise ValueError("the content-free prior gives a label probability 0; it cannot be divided out")
    shifted = [lp - p for lp, p in zip(logprobs, prior)]
    total = _logsumexp(shifted)
    return tuple(s - total for s in shifted)


def calibrate(scores: LabelScores, prior: Prior) -> LabelScores:
    """``scores`` with ``prior`` divided out (see the module docstring).

    Raises:
        ValueError: ``scores`` and ``prior`` are over different labels.
    """
    if scores.labels != prior.labels:
        raise ValueError(f"scores are over {scores.labels} but the prior is over {prior.labels}")
    return LabelScores(scores.labels, calibrate_logprobs(scores.logprobs, prior.logprobs))


def content_free_prior(classifier: Classifier, texts: Sequence[str] = CONTENT_FREE, batch_size: int = 8) -> Prior:
    """Score ``texts`` through ``classifier``'s cached prefix and average their label distributions.

    Every record field the task's template reads is filled with the content-free text.

    Raises:
        InputError: ``texts`` is empty, or one cannot be rendered (the message names it).
    """
    if not texts:
        raise InputError("contextual calibration needs at least one content-free input, for example 'N/A'")
    fields = classifier.task.fields
    records = [Record(f"content-free {text!r}", {f: text for f in fields}) for text in texts]
    predictions = classifier.classify_all(records, RunConfig("batched", batch_size))
    failed = [p.error for p in predictions if p.scores is None]
    if failed:
        raise InputError(f"a content-free input could not be scored: {failed[0]}")
    rows = [p.scores.logprobs for p in predictions]
    return Prior(tuple(texts), predictions[0].scores.labels, mean_distribution(rows))
