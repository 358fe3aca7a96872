"""The plain lane's judge: every response compared with the sequential in-process result.

Same ids in the same order, and each probability within the tolerance. A changed label is a flagged near tie,
not a failure, only where the sequential top-two margin is within twice the lane's own log-prob drift, measured
on the responses whose label did not change (so a grossly wrong response cannot widen the bound that would
excuse it); any other change, a wrong id or an HTTP error is a failure.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field


@dataclass
class Lane:
    """One server's figures in the plain lane, filled as its responses are checked."""

    name: str
    max_batch: int
    api: str = "classify"  # or "openai": the chat route with guided_choice, through the official client
    cached_min: float = float("nan")  # openai lane: the smallest share of a prompt reused from the pool
    cached_mean: float = float("nan")
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    mismatches: list[str] = field(default_factory=list)
    near_ties: int = 0
    max_prob_diff: float = 0.0
    max_logprob_diff: float = 0.0  # the lane's largest |log-prob difference| from the sequential result
    steady_drift: float = 0.0  # the same, over responses whose label did not change: the lane's numerical noise
    flips: list = field(default_factory=list)  # (reference margin, description) of every changed label
    items: int = 0
    seconds: float = 0.0
    passes: float = 0.0
    pass_items: float = 0.0
    pass_seconds: float = 0.0  # time the model thread spent in forward passes

    @property
    def busy(self) -> float:
        """Share of the wall time the model was running a pass (the rest is HTTP, queueing and gaps)."""
        return self.pass_seconds / self.seconds if self.seconds else 0.0

    @property
    def items_per_second(self) -> float:
        return self.items / self.seconds if self.seconds else 0.0

    def percentile(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000 if ordered else float("nan")


def check(lane: Lane, outcomes, requests, reference, tolerance: float) -> None:
    """Compare every response with the sequential reference (text -> Prediction); fill the lane's figures.

    Changed labels are only collected here: whether each is a near tie depends on the lane's
    drift over all its responses (see :func:`settle`).
    """
    for n, status, data, seconds in outcomes:
        lane.latencies.append(seconds)
        if status != 200:
            lane.errors.append(f"request {n}: HTTP {status}: {data[:200]!r}")
            continue
        results = json.loads(data)["results"]
        want_ids = [item["id"] for item in requests[n]]
        if [r["id"] for r in results] != want_ids:
            lane.errors.append(f"request {n}: ids {[r['id'] for r in results]} != {want_ids}")
            continue
        lane.items += len(results)
        for item, result in zip(requests[n], results):
            check_result(lane, result, reference[item["text"]], tolerance)


def check_result(lane: Lane, result: dict, want, tolerance: float) -> None:
    """One answered item against its sequential prediction ``want``."""
    pairs = [(result["scores"][label], p) for label, p in want.scores.probabilities.items()]
    diff = max(abs(got - p) for got, p in pairs)
    drift = max(abs(math.log(got) - math.log(p)) for got, p in pairs)
    lane.max_prob_diff = max(lane.max_prob_diff, diff)
    lane.max_logprob_diff = max(lane.max_logprob_diff, drift)
    description = f"{result['id']}: {result['label']} {result['scores']} vs sequential {want.label} {want.scores.probabilities}"
    if result["label"] != want.label:
        lane.flips.append((want.scores.margin, description))
        return
    lane.steady_drift = max(lane.steady_drift, drift)
    if diff > tolerance:
        lane.mismatches.append(description)


def settle(lane: Lane, near_tie: float | None = None) -> float:
    """Sort the lane's changed labels into flagged near ties and mismatches; return the near-tie bound used.

    The default bound (``near_tie`` None) is twice the drift measured on the responses whose label did not
    change, so a grossly wrong response cannot widen the bound that would excuse it.
    """
    bound = near_tie if near_tie is not None else 2 * lane.steady_drift
    for margin, description in lane.flips:
        if margin <= bound:
            lane.near_ties += 1
        else:
            lane.mismatches.append(description)
    return bound
