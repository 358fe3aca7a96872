"""The load test's judge (prefixcache.bench.loadtest.judge): how responses are compared with the sequential result.

A changed label is a flagged near tie only when the sequential margin is within twice the lane's own
log-prob drift, measured on the responses whose label did not change; any other change, a probability
off by more than the tolerance, a wrong id or an HTTP error is a failure.
"""

from __future__ import annotations

import json
import math

from prefixcache.bench.loadtest.judge import Lane, check, settle
from prefixcache.engine.scoring import LabelScores
from prefixcache.scheduler.classify import Prediction


def prediction(text: str, probs: dict[str, float]) -> Prediction:
    return Prediction(text, LabelScores(tuple(probs), tuple(math.log(p) for p in probs.values())))


def response(ids_and_probs) -> bytes:
    results = []
    for item_id, probs in ids_and_probs:
        results.append({"id": item_id, "label": max(probs, key=probs.get), "scores": probs})
    return json.dumps({"results": results}).encode()


def judge(outcomes, requests, reference, tolerance=0.05, near_tie=None):
    lane = Lane("lane", 32)
    check(lane, outcomes, requests, reference, tolerance)
    bound = settle(lane, near_tie)
    return lane, bound


def test_a_flip_inside_the_measured_drift_is_flagged_and_one_outside_fails():
    reference = {
        "tie": prediction("tie", {"a": 0.51, "b": 0.49}),  # margin log(51/49) = 0.04
        "steady": prediction("steady", {"a": 0.6, "b": 0.4}),
        "clear": prediction("clear", {"a": 0.9, "b": 0.1}),  # margin 2.2
    }
    requests = [[{"id": f"q{i}", "text": text}] for i, text in enumerate(reference)]
    noise = abs(math.log(0.43) - math.log(0.4))  # the steady record drifts by 0.072 without changing label
    steady = (1, 200, response([("q1", {"a": 0.57, "b": 0.43})]), 0.1)
    outcomes = [
        (0, 200, response([("q0", {"a": 0.49, "b": 0.51})]), 0.1),  # the tie flipped: flagged
        steady,
        (2, 200, response([("q2", {"a": 0.9, "b": 0.1})]), 0.1),
    ]
    lane, bound = judge(outcomes, requests, reference)
    assert math.isclose(bound, 2 * noise, rel_tol=1e-6)
    assert lane.near_ties == 1 and not lane.mismatches, lane.mismatches

    flipped_clear = (2, 200, response([("q2", {"a": 0.45, "b": 0.55})]), 0.1)  # drifts by 1.7, which must not excuse it
    lane, bound = judge([outcomes[0], steady, flipped_clear], requests, reference)
    assert math.isclose(bound, 2 * noise, rel_tol=1e-6), "a changed label must not widen its own excuse"
    assert lane.near_ties == 1 and len(lane.mismatches) == 1 and "q2" in lane.mismatches[0]


def test_probabilities_beyond_the_tolerance_wrong_ids_and_http_errors_fail():
    reference = {"t": prediction("t", {"a": 0.7, "b": 0.3})}
    requests = [[{"id": "q0", "text": "t"}]] * 3
    outcomes = [
        (0, 200, response([("q0", {"a": 0.6, "b": 0.4})]), 0.1),  # same label, probability off by 0.1
        (1, 200, response([("other", {"a": 0.7, "b": 0.3})]), 0.1),  # routed to the wrong id
        (2, 429, b"queue full", 0.1),
    ]
    lane, _ = judge(outcomes, requests, reference, tolerance=0.05)
    assert len(lane.mismatches) == 1 and len(lane.errors) == 2 and lane.items == 1
