"""Duplicate ids are found exactly while each id seen costs 16 bytes (``io/seen_ids.py``, ``io/records.py``).

The reference is the plain way: a dict of every id to where it was first seen. Digests are forced to collide
(a digest function with three values), runs are kept tiny so that merges happen every few chunks, and the
answers must still be the dict's, id for id.
"""

from __future__ import annotations

import random

import pytest

from prefixcache.io import records as readers
from prefixcache.io import seen_ids
from prefixcache.io.records import Row, records_from_rows
from prefixcache.io.seen_ids import ENTRY_BYTES, SeenIds


def _reference(ids: list, wheres: list[str]) -> list[str | None]:
    first: dict = {}
    found = []
    for value, where in zip(ids, wheres):
        key = (type(value), value)
        found.append(first.get(key))
        first.setdefault(key, where)
    return found


def _random_ids(rng: random.Random, n: int) -> list:
    """Strings and integers, with many repeats, ``1`` beside ``"1"``, and text past ASCII."""
    pool = [rng.choice([str(k), k, f"id-{k}", f"é{k}\n"]) for k in range(n // 3)]
    return [rng.choice(pool) for _ in range(n)]


@pytest.mark.parametrize("collide", [False, True], ids=["real-digests", "three-digests"])
def test_first_uses_equal_a_dict_of_every_id_across_chunks_merges_and_collisions(monkeypatch, collide):
    monkeypatch.setattr(seen_ids, "MAX_RUN", 16)
    if collide:
        monkeypatch.setattr(seen_ids, "_digest", lambda key: len(key) % 3)
    rng = random.Random(7)
    ids = _random_ids(rng, 600)
    wheres = [f"in.jsonl:{n + 1}" for n in range(len(ids))]
    seen, found, start = SeenIds(), [], 0
    while start < len(ids):
        size = rng.randint(1, 40)
        found += seen.first_uses(ids[start:start + size], wheres[start:start + size])
        start += size
    assert found == _reference(ids, wheres)
    distinct = len({(type(v), v) for v in ids})
    assert len(seen) == distinct, "every distinct id is kept once"
    assert len(seen._runs) > 1, "the test must exercise lookups across several runs"
    seen.close()


def test_an_id_costs_its_digest_and_offset_and_the_runs_stay_sorted(monkeypatch):
    monkeypatch.setattr(seen_ids, "MAX_RUN", 256)
    seen = SeenIds()
    for start in range(0, 5000, 100):
        seen.first_uses([f"ticket-{n}" for n in range(start, start + 100)], [f"f:{n}" for n in range(start, start + 100)])
    held = sum(digests.nbytes + offsets.nbytes for digests, offsets in seen._runs)
    assert held == ENTRY_BYTES * 5000 == 16 * len(seen), "16 bytes an id, nothing else in memory"
    assert all((digests[1:] >= digests[:-1]).all() for digests, _ in seen._runs)
    assert max(len(digests) for digests, _ in seen._runs) <= 256
    seen.close()


def test_records_name_each_duplicate_with_its_first_row_across_id_chunks(monkeypatch):
    monkeypatch.setattr(readers, "ID_CHUNK", 3)
    values = ["a", "b", "a", 1, "1", "b", None, "c", "a", 1]
    rows = [Row(f"f:{n + 1}", {} if v is None else {"id": v, "text": "t"}) for n, v in enumerate(values)]
    rows[7] = Row("f:8", {"id": "c"}, error="f:8: not valid JSON")  # a bad row's id is taken too
    rows.append(Row("f:11", {"id": "c", "text": "t"}))
    got = [(r.id, r.error) for r in records_from_rows(rows, id_field="id")]
    assert got == [
        ("a", None), ("b", None),
        (None, "f:3: duplicate id 'a' (first used at f:1); ids must be unique"),
        (1, None), ("1", None),
        (None, "f:6: duplicate id 'b' (first used at f:2); ids must be unique"),
        (None, "f:7: missing id field 'id'"),
        ("c", "f:8: not valid JSON"),
        (None, "f:9: duplicate id 'a' (first used at f:1); ids must be unique"),
        (None, "f:10: duplicate id 1 (first used at f:4); ids must be unique"),
        (None, "f:11: duplicate id 'c' (first used at f:8); ids must be unique"),
    ]
