"""Side-by-side timing of runner modes on the same records, in one run, as ratios.

Every mode runs after a warm-up, on the same records, in the same process, and
is compared with ``full`` (the re-encoding baseline) for speed and for labels.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .runner import Classifier, Prediction, Record, RunConfig, RunStats, warmup
from .verify import compare


@dataclass(frozen=True)
class ModeResult:
    """One mode's figures. Ratios are against the first mode run (``full``)."""

    mode: str
    batch_size: int
    records: int
    seconds: float
    speedup_vs_full: float
    label_agreement: float
    max_abs_logprob_diff: float
    tokens_computed: int

    @property
    def ms_per_item(self) -> float:
        return 1000 * self.seconds / self.records if self.records else 0.0

    @property
    def items_per_s(self) -> float:
        return self.records / self.seconds if self.seconds else 0.0


def compare_modes(
    classifier: Classifier, records: list[Record], batch_size: int = 32, modes=("full", "cached", "batched")
) -> tuple[list[ModeResult], dict[str, list[Prediction]]]:
    """Time each mode on ``records``; the first mode is the reference for ratios and agreement."""
    warmup(classifier)
    results, outputs = [], {}
    reference: list[Prediction] | None = None
    ref_seconds = 0.0
    for mode in modes:
        config = RunConfig(mode, batch_size if mode == "batched" else 1)
        stats = RunStats()
        started = time.perf_counter()
        predictions = classifier.classify_all(records, config, stats=stats)
        seconds = time.perf_counter() - started
        if reference is None:
            reference, ref_seconds = predictions, seconds
        agreement = compare(reference, predictions)
        outputs[mode] = predictions
        results.append(
            ModeResult(
                mode,
                config.batch_size,
                len(records),
                seconds,
                ref_seconds / seconds if seconds else float("inf"),
                agreement.rate,
                agreement.max_abs_logprob_diff,
                stats.tokens_computed,
            )
        )
    return results, outputs
