"""Accuracy against rows per label: the prompt alone, a head from scratch, and a head on the prompt.

:func:`fit_curve` splits the rows once (stratified) into a training part and a held-out part. For
each number of rows per label it samples that many rows of each label from the training part (all
of them for ``None``; fewer where a label has fewer), fits both heads on them
(:func:`~prefixcache.eval.fit_head.fit_head`, ``C`` by cross-validation where every label has two
rows or more), and scores all three on the held-out part, which no fit ever sees.

This module does not run models, print or plot.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping, Sequence

import numpy as np
from sklearn.model_selection import train_test_split

from ..errors import InputError, setting
from ..scheduler.feature_pass import FeatureSet
from .fit_head import fit_head, gold_indices

SHOTS = (1, 2, 5, 10, None)  # rows per label; None: the whole training part


@dataclass(frozen=True)
class CurvePoint:
    """Held-out accuracy of the three scorers after fitting on ``shots`` rows per label (``rows`` in all)."""

    shots: int | None
    rows: int
    prompt: float
    scratch: float
    on_prompt: float
    scratch_C: float
    on_prompt_C: float
    scored: int = 0  # held-out rows scored (the same for every point of a curve)

    def to_json(self) -> dict:
        return {"shots": self.shots if self.shots is not None else "all", "rows": self.rows, "prompt": self.prompt,
                "scratch": self.scratch, "on_prompt": self.on_prompt, "scratch_C": self.scratch_C,
                "on_prompt_C": self.on_prompt_C, "scored": self.scored}


def parse_shots(text: str) -> list[int | None]:
    """``"1,2,5,10,all"`` -> ``[1, 2, 5, 10, None]``.

    Raises:
        InputError: a step is neither a whole number of 1 or more nor ``all``.
    """
    shots: list[int | None] = []
    for part in text.split(","):
        part = part.strip().lower()
        if part == "all":
            shots.append(None)
        elif part.isdigit() and int(part) > 0:
            shots.append(int(part))
        else:
            raise InputError(
                f"{setting('curve')} takes rows per label separated by commas, like 1,2,5,10,all; got {part!r}"
            )
    return shots


def subset(feature_set: FeatureSet, rows: Sequence[int]) -> FeatureSet:
    """The feature set restricted to ``rows`` (indices into ``ids``), in that order."""
    index = np.asarray(rows, dtype=np.int64)
    return replace(
        feature_set,
        ids=[feature_set.ids[i] for i in index],
        features=feature_set.features[index],
        prompt_logprobs=feature_set.prompt_logprobs[index],
        text_hashes=[feature_set.text_hashes[i] for i in index] if feature_set.text_hashes else [],
        errors={},
    )


def sample_per_label(y: np.ndarray, rows: np.ndarray, shots: int | None, rng: np.random.Generator) -> np.ndarray:
    """Up to ``shots`` of ``rows`` per label value in ``y[rows]`` (all for None), in ascending order."""
    if shots is None:
        return np.sort(rows)
    picked = [rng.permutation(rows[y[rows] == label])[:shots] for label in np.unique(y[rows])]
    return np.sort(np.concatenate(picked))


def fit_curve(
    feature_set: FeatureSet,
    gold_labels: Sequence[str] | Mapping,
    shots: Sequence[int | None] = SHOTS,
    *,
    seed: int = 0,
    held_out: float = 0.5,
    folds: int = 5,
) -> list[CurvePoint]:
    """One :class:`CurvePoint` per entry of ``shots``, all scored on the same held-out part.

    ``held_out``: the fraction of rows (stratified by label) kept for scoring.

    Raises:
        InputError: see :func:`~prefixcache.eval.fit_head.gold_indices`; or a label with fewer than two
            rows, which cannot be both fitted and scored.
    """
    y = gold_indices(feature_set, gold_labels)
    counts = np.bincount(y, minlength=len(feature_set.labels))
    if counts.min() < 2:
        label = feature_set.labels[int(counts.argmin())]
        raise InputError(f"label {label!r} has {int(counts.min())} row(s): a curve needs two per label (one to fit, one to score)")
    train, test = train_test_split(np.arange(len(y)), test_size=held_out, stratify=y, random_state=seed)
    labels = feature_set.labels
    gold_test = y[test]
    prompt = float((feature_set.prompt_logprobs[test].argmax(axis=1) == gold_test).mean())
    rng = np.random.default_rng(seed)
    points = []
    for k in shots:
        rows = sample_per_label(y, np.asarray(train), k, rng)
        part, gold = subset(feature_set, rows), [labels[j] for j in y[rows]]
        scored = {}
        for on_prompt in (False, True):
            result = fit_head(part, gold, folds=folds, on_prompt=on_prompt, seed=seed)
            predicted = result.head.log_probs(feature_set.features[test], feature_set.prompt_logprobs[test]).argmax(dim=-1)
            scored[on_prompt] = (float((predicted.numpy() == gold_test).mean()), result.C)
        points.append(CurvePoint(k, len(rows), prompt, scored[False][0], scored[True][0], scored[False][1], scored[True][1],
                                 len(test)))
    return points
