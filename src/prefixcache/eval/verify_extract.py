"""Extraction agreement: cached output must be the uncached output, token for token.

:func:`verify_extract` runs ``full`` (uncached) and a cached mode over the same records with the same
extractor, so both decode under its answer schema (or both freely, ``constrained=False``), and
:func:`compare_extractions` compares them record by record. This module does not print.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

from ..scheduler.extract import Extraction, ExtractStats, Extractor
from ..types import Mode, Record, RunConfig


@dataclass(frozen=True)
class ExtractAgreement:
    """How two extraction runs over the same records compare (``identical``: same generated tokens)."""

    records: int
    identical: int
    same_fields: int
    differing_ids: list

    @property
    def rate(self) -> float:
        return self.identical / self.records if self.records else 1.0

    @property
    def ok(self) -> bool:
        return self.identical == self.records

    def to_json(self) -> dict:
        return asdict(self)


def compare_extractions(reference: list[Extraction], candidate: list[Extraction]) -> ExtractAgreement:
    """Compare record by record (same order, same ids). Records that errored before generating must error in both.

    Raises:
        ValueError: the two runs hold different records or orders.
    """
    if [e.id for e in reference] != [e.id for e in candidate]:
        raise ValueError("the two runs did not return the same records in the same order")
    identical = same_fields = 0
    differing = []
    for ref, cand in zip(reference, candidate):
        same_output = ref.token_ids == cand.token_ids and ref.raw == cand.raw
        same = same_output and (ref.raw is not None or ref.error == cand.error)
        identical += same
        same_fields += ref.fields == cand.fields
        if not same:
            differing.append(ref.id)
    return ExtractAgreement(len(reference), identical, same_fields, differing)


def verify_extract(
    extractor: Extractor, records: list[Record], config: RunConfig, progress: Callable[[int], None] | None = None
) -> tuple[ExtractAgreement, ExtractStats, ExtractStats]:
    """Run ``full`` (uncached) and ``config.mode`` over ``records``; compare their outputs token for token."""
    ref_stats, cand_stats = ExtractStats(), ExtractStats()
    reference = extractor.extract_all(records, RunConfig(Mode.FULL, 1, config.window), progress=progress, stats=ref_stats)
    candidate = extractor.extract_all(records, config, progress=progress, stats=cand_stats)
    return compare_extractions(reference, candidate), ref_stats, cand_stats
