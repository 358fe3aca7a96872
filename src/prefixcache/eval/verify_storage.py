"""Storage agreement: a classifier whose pool stores prefixes quantized (int8), against float storage.

``verify --kv-storage int8`` reports it: the labels must agree, and the memory saved is shown beside
the log-prob drift. This module does not print.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from ..scheduler.classify import Classifier
from ..types import Record, RunConfig
from .verify import compare


@dataclass(frozen=True)
class StorageAgreement:
    """Labels of a classifier whose pool stores prefixes as ``storage``, against float storage."""

    storage: str
    records: int
    agree: int
    max_abs_logprob_diff: float
    disagreeing_ids: list
    float_bytes: int
    stored_bytes: int

    @property
    def rate(self) -> float:
        return self.agree / self.records if self.records else 1.0

    @property
    def saved_fraction(self) -> float:
        return 1 - self.stored_bytes / self.float_bytes if self.float_bytes else 0.0

    def to_json(self) -> dict:
        return {**self.__dict__, "rate": self.rate, "saved_fraction": self.saved_fraction}


def storage_agreement(classifier: Classifier, records: Sequence[Record], config: RunConfig) -> StorageAgreement:
    """Classify ``records`` with ``classifier`` (which has a pool) and with a float-prefix copy of it; compare labels.

    Runs both classifiers (so costs two passes over ``records``); modifies only ``classifier.pool``'s counters.

    Raises:
        ValueError: ``classifier`` has no pool.
    """
    if classifier.pool is None:
        raise ValueError("storage_agreement needs a classifier with a pool")
    reference_classifier = Classifier(classifier.loaded, classifier.task, classifier.method)
    reference = reference_classifier.classify_all(records, config)
    candidate = classifier.classify_all(records, config)
    agreement = compare(reference, candidate)
    tokens = len(classifier.prompt.prefix_ids)
    return StorageAgreement(
        classifier.pool.config.storage, agreement.records, agreement.agree, agreement.max_abs_logprob_diff,
        agreement.disagreeing_ids, reference_classifier.prefix.nbytes,
        classifier.pool.size_of(classifier.loaded, tokens),
    )
