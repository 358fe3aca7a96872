"""Rows a probe can separate by construction (each holds one marker word per label), for the fitted-head tests."""

from __future__ import annotations

import random

from prefixcache.scheduler.classify import Record

MARKERS = {"billing": "refund", "technical": "crash", "account": "password"}
FILLER = "the my app page email please now again today it is on".split()
# The mean of the record's token embeddings (layer 0) is linear in its tokens, so a marker token makes the
# rows separable by construction; the final layer's last token (random weights) adds noise the fit must ignore.
FEATURE = "mean@0+last"


def separable_rows(n: int, seed: int) -> tuple[list[Record], list[str]]:
    """Rows whose label is decided by which marker word they contain (separable by construction)."""
    rng = random.Random(seed)
    records, gold = [], []
    for i in range(n):
        label = list(MARKERS)[i % len(MARKERS)]
        words = rng.sample(FILLER, 4)
        words.insert(rng.randrange(5), MARKERS[label])
        records.append(Record(f"r{seed}-{i}", {"text": " ".join(words)}))
        gold.append(label)
    return records, gold
