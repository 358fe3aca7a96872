"""Calibration and abstention on a classifier (issue 38): a tiny in-process model, rows separable by construction."""

from __future__ import annotations

import numpy as np
import pytest

from prefixcache.engine.confidence import Calibration, Trust, threshold_for_accuracy
from prefixcache.engine.head_file import head_calibration, load_head, oof_rows, save_head
from prefixcache.eval.fit_head import calibrate_oof, fit_head
from prefixcache.scheduler.classify import Classifier, RunConfig
from prefixcache.scheduler.feature_pass import collect_features

from tests.support.separable import FEATURE, separable_rows


@pytest.fixture(scope="module")
def fitted(tiny_llama, task):
    records, gold = separable_rows(60, seed=1)
    return fit_head(collect_features(tiny_llama, task, records, feature=FEATURE), gold, folds=3)


@pytest.fixture(scope="module")
def held_out():
    return separable_rows(24, seed=7)[0]


def test_fit_stores_a_calibration_and_its_out_of_fold_rows(tmp_path, fitted):
    assert fitted.oof_confidence is not None and len(fitted.oof_correct) == 60
    loaded = load_head(save_head(fitted.head, tmp_path / "h.safetensors"))
    assert head_calibration(loaded) == fitted.calibration
    confidence, correct = oof_rows(loaded.manifest)
    assert len(confidence) == 60 and np.allclose(confidence, fitted.oof_confidence, atol=1e-5)


def test_calibration_leaves_every_label_unchanged(tiny_llama, task, fitted, held_out):
    raw = Classifier(tiny_llama, task, head=fitted.head, trust=Trust()).classify_all(held_out, RunConfig("batched", 5))
    for temperature in (0.2, 2.0, 7.0):
        calibrated = Classifier(tiny_llama, task, head=fitted.head, trust=Trust(Calibration(temperature))).classify_all(
            held_out, RunConfig("batched", 5))
        assert [p.label for p in calibrated] == [p.label for p in raw], f"T={temperature} changed a label"
        changed = max(abs(a - b) for p, q in zip(raw, calibrated) for a, b in zip(p.scores.logprobs, q.scores.logprobs))
        assert changed > 1e-3, "the temperature did nothing"


def test_a_threshold_above_every_confidence_abstains_on_all_and_zero_on_none(tiny_llama, task, fitted, held_out):
    everything = Classifier(tiny_llama, task, head=fitted.head, trust=Trust(fitted.calibration, 1.01))
    predictions = everything.classify_all(held_out, RunConfig("batched", 4))
    assert all(p.abstained and p.label is None and p.best_guess is not None for p in predictions)
    nothing = Classifier(tiny_llama, task, head=fitted.head, trust=Trust(fitted.calibration, 0.0))
    kept = nothing.classify_all(held_out, RunConfig("batched", 4))
    assert not any(p.abstained for p in kept)
    assert [p.label for p in kept] == [p.best_guess for p in predictions]


@pytest.mark.parametrize("target", [0.9, 0.99, 1.0])
def test_target_accuracy_reaches_its_target_on_the_out_of_fold_rows(fitted, target):
    confidence, correct = np.array(fitted.oof_confidence), np.array(fitted.oof_correct)
    found = threshold_for_accuracy(confidence, correct, target)
    assert found is not None, "separable rows: the most confident rows are right"
    accepted = confidence >= found.threshold
    assert correct[accepted].mean() >= target and accepted.mean() == pytest.approx(found.coverage)


def test_a_temperature_is_fitted_only_where_out_of_fold_rows_are_sometimes_wrong():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 400)
    sharp = np.log(np.full((400, 3), 0.02))
    sharp[np.arange(400), y] = np.log(0.96)  # every row right, and sure of it
    assert calibrate_oof(sharp, y)[0] == Calibration(), "all right out of fold: the temperature is not identifiable"
    noisy = sharp.copy()
    flipped = rng.random(400) < 0.3  # 30% of rows wrong at 0.96 confidence: overconfident, so T > 1
    noisy[flipped] = np.roll(noisy[flipped], 1, axis=1)
    calibration, confidence, correct, (raw, calibrated) = calibrate_oof(noisy, y)
    assert calibration.temperature > 1.5 and calibrated < raw
    assert len(confidence) == 400 and correct.mean() == pytest.approx(1 - flipped.mean())
