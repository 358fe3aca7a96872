"""Verification: prove the cached path returns the labels full re-encoding returns (invariant 1).

``compare`` pairs two lists of Predictions record by record; ``verify`` runs
``full`` and a cached mode on the same records and compares them.

A classifier whose head carries a tuned prefix has no prompt text that re-encodes to its prefix, so for it
"the same answers" means what still holds: one record per pass (``cached``, batch 1) is the reference the
batched path must equal, and the prefix the classifier serves (from the pool, its disk tier or the file) must
equal, bit for bit in the model's dtype, the one fitted.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from ..scheduler.classify import Classifier
from ..types import Prediction, Record, RunConfig, RunStats


@dataclass(frozen=True)
class Agreement:
    """How two runs over the same records compare."""

    records: int
    agree: int
    max_abs_logprob_diff: float
    disagreeing_ids: list

    @property
    def rate(self) -> float:
        return self.agree / self.records if self.records else 1.0

    @property
    def ok(self) -> bool:
        return self.agree == self.records

    def to_json(self) -> dict:
        return asdict(self)


def compare(reference: list[Prediction], candidate: list[Prediction]) -> Agreement:
    """Compare predictions record by record (same order, same ids). Errored records must error in both."""
    if [p.id for p in reference] != [p.id for p in candidate]:
        raise ValueError("the two runs did not return the same records in the same order")
    agree, worst, disagreeing = 0, 0.0, []
    for ref, cand in zip(reference, candidate):
        if ref.scores is None or cand.scores is None:
            same = ref.error == cand.error
        else:
            same = ref.label == cand.label
            worst = max(worst, max(abs(a - b) for a, b in zip(ref.scores.logprobs, cand.scores.logprobs)))
        agree += same
        if not same:
            disagreeing.append(ref.id)
    return Agreement(len(reference), agree, worst, disagreeing)


@dataclass(frozen=True)
class Verification:
    agreement: Agreement
    reference_stats: RunStats
    candidate_stats: RunStats
    mode: str
    reference: str = "full"  # the mode the candidate is held to ("cached" at batch 1 under a tuned prefix)
    stored_prefix_equal: bool | None = None  # under a tuned prefix: the served prefix equals the fitted one

    @property
    def ok(self) -> bool:
        return self.agreement.ok and self.stored_prefix_equal is not False


def verify(
    classifier: Classifier,
    records: list[Record],
    config: RunConfig,
    progress: Callable[[int], None] | None = None,
) -> Verification:
    """Run ``full`` (under a tuned prefix: ``cached`` at batch 1) and ``config.mode`` over ``records`` and compare
    them."""
    ref_stats, cand_stats = RunStats(), RunStats()
    tuned = classifier.tuned
    reference_mode = "full" if tuned is None else "cached"
    reference = classifier.classify_all(records, RunConfig(reference_mode, 1, config.window), progress=progress,
                                        stats=ref_stats)
    candidate = classifier.classify_all(records, config, progress=progress, stats=cand_stats)
    stored = None
    if tuned is not None:  # the fitted prefix cast to the model's dtype once, on the CPU, where checksum reads it
        stored = classifier.prefix.checksum() == tuned.prefix.cast(classifier.loaded.dtype).checksum()
    return Verification(compare(reference, candidate), ref_stats, cand_stats, config.mode, reference_mode, stored)
