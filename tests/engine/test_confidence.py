"""Calibrated confidence and abstention (issue 38): the pure pieces, on arrays (engine/confidence.py)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.extra.numpy import arrays

from prefixcache.engine.confidence import (
    Calibration, Trust, calibration_error_floor, expected_calibration_error, fit_temperature, reliability,
    risk_coverage, threshold_for_accuracy,
)
from prefixcache.types import LabelScores, Prediction

logits = arrays(np.float64, st.tuples(st.integers(1, 20), st.integers(2, 6)), elements=st.floats(-20, 20))


@settings(max_examples=60, deadline=None)
@given(logits, st.floats(0.05, 20))
def test_a_temperature_keeps_every_rows_best_label_and_normalizes(x, temperature):
    calibrated = Calibration(temperature).apply(x)
    assert np.allclose(np.exp(calibrated).sum(axis=1), 1.0)
    # a positive temperature keeps the order of each row's scores, so the best label is the same one
    # (one of the best, where scores tie to within rounding)
    chosen = calibrated.argmax(axis=1)
    assert (x[np.arange(len(x)), chosen] >= x.max(axis=1) - 1e-9).all()


def sampled(n: int, labels: int, true_temperature: float, seed: int):
    """Logits and labels drawn from softmax(logits / true_temperature): calibrated at that temperature."""
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 3, (n, labels))
    p = np.exp(Calibration(true_temperature).apply(x))
    y = np.array([rng.choice(labels, p=row) for row in p])
    return x, y


@pytest.mark.parametrize("true_temperature", [0.5, 1.0, 3.0])
def test_the_fitted_temperature_finds_the_one_the_labels_were_drawn_at(true_temperature):
    x, y = sampled(4000, 5, true_temperature, seed=0)
    fitted = fit_temperature(x, y)
    assert fitted.temperature == pytest.approx(true_temperature, rel=0.12)
    raw = expected_calibration_error(np.exp(x.max(1) - np.log(np.exp(x).sum(1))), x.argmax(1) == y)
    calibrated = fitted.apply(x)
    after = expected_calibration_error(np.exp(calibrated.max(1)), calibrated.argmax(1) == y)
    assert after < 0.03, f"calibrated ECE {after:.3f} (raw {raw:.3f})"
    if true_temperature != 1.0:
        assert after < raw


def test_ece_is_the_weighted_gap_per_bin():
    # bin (0.6, 0.667]: 2 rows at 0.65, one right (gap 0.15); bin (0.933, 1]: 2 rows at 0.95, both right (gap 0.05)
    confidence, correct = [0.65, 0.65, 0.95, 0.95], [True, False, True, True]
    assert expected_calibration_error(confidence, correct) == pytest.approx((2 * 0.15 + 2 * 0.05) / 4)
    assert [b["rows"] for b in reliability(confidence, correct)] == [2, 2]


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 1), st.booleans()), min_size=1, max_size=60), st.floats(0.3, 1.0))
def test_a_threshold_for_a_target_reaches_it_on_the_rows_it_was_chosen_on(rows, target):
    confidence, correct = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    found = threshold_for_accuracy(confidence, correct, target)
    curve = risk_coverage(confidence, correct)
    if found is None:
        assert (curve.accuracy < target).all()
        return
    accepted = confidence >= found.threshold
    assert correct[accepted].mean() >= target
    assert accepted.mean() == pytest.approx(found.coverage)
    lower = confidence[confidence < found.threshold]  # every lower threshold misses the target
    for t in set(lower.tolist()):
        assert correct[confidence >= t].mean() < target


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([0.2, 0.5, 0.7, 0.9, 1.0]), st.booleans()), min_size=1, max_size=40),
       st.floats(0.01, 1.0))
def test_accuracy_at_a_coverage_counts_rows_and_accepts_ties_together(rows, share):
    confidence, correct = np.array([r[0] for r in rows]), np.array([r[1] for r in rows])
    curve = risk_coverage(confidence, correct)
    # brute force: the highest threshold among the confidences that accepts at least `share` of the rows
    threshold = max(t for t in set(confidence.tolist()) if (confidence >= t).mean() >= share - 1e-12)
    accepted = confidence >= threshold
    assert curve.coverage[curve.reaching(share)] == pytest.approx(accepted.mean())
    assert curve.at_coverage(share) == pytest.approx(correct[accepted].mean())


@pytest.mark.parametrize("rows, p", [(10, 0.7), (40, 0.9), (5, 0.5)])
def test_the_calibration_error_floor_is_the_binomial_noise_of_a_calibrated_model(rows, p):
    from math import comb
    exact = sum(comb(rows, k) * p ** k * (1 - p) ** (rows - k) * abs(k / rows - p) for k in range(rows + 1))
    mean, p95 = calibration_error_floor(np.full(rows, p), draws=40_000)
    assert mean == pytest.approx(exact, abs=0.004)
    assert p95 > mean


def test_the_calibration_error_floor_shrinks_with_rows_and_is_zero_for_certain_rows():
    confidence = np.random.default_rng(1).uniform(0.3, 1.0, 3000)
    assert calibration_error_floor(confidence[:3000])[0] < calibration_error_floor(confidence[:100])[0] / 3
    assert calibration_error_floor(np.ones(50)) == (0.0, 0.0)
    with pytest.raises(ValueError):
        calibration_error_floor([])


def prediction(probabilities):
    return Prediction("r", LabelScores(("a", "b", "c"), tuple(np.log(probabilities))))


def test_trust_abstains_under_its_threshold_and_keeps_the_best_guess():
    sure, unsure = prediction([0.9, 0.05, 0.05]), prediction([0.4, 0.35, 0.25])
    trust = Trust(min_confidence=0.5)
    assert trust.judge(sure).label == "a" and not trust.judge(sure).abstained
    judged = trust.judge(unsure)
    assert judged.abstained and judged.label is None and judged.best_guess == "a"
    document = judged.to_json()
    assert document["label"] is None and document["abstained"] is True and document["best_guess"] == "a"
    assert document["confidence"] == pytest.approx(0.4, abs=1e-6)
    error = Prediction("x", error="bad")
    assert Trust(min_confidence=0.99).judge(error) is error


def test_calibration_round_trips_and_refuses_what_it_does_not_know():
    calibration = Calibration(1.7, 300)
    assert Calibration.from_json(calibration.to_json()) == calibration
    with pytest.raises(ValueError):
        Calibration.from_json({"method": "isotonic"})
    with pytest.raises(ValueError):
        Calibration(0.0)
