"""The ids a job has seen, kept in a few bytes each, so that a duplicate id is refused without memory that grows
like the ids themselves.

A reader with an id field must refuse a row whose id an earlier row used, and name where that earlier row was.
Keeping every id with its place (a dict of strings) costs about 200 bytes a row: 20 GB for a hundred million
rows. :class:`SeenIds` keeps instead, for every id, an 8-byte digest and the 8-byte offset of an entry in an
unnamed temporary file (deleted by the system when it is closed or the process ends) that holds the id and its
place. A digest found again is checked against that entry, so the answer is exact: two ids whose
digests collide are told apart, and a duplicate is named with the place of its first use.

The digests live in sorted runs (numpy arrays of digests and offsets), looked up a chunk of ids at a time
(one ``searchsorted`` per run). A new chunk's run is merged into the last run while that one is no larger, up
to :data:`MAX_RUN` entries, so a lookup searches few runs (one per :data:`MAX_RUN` ids, and a few smaller), and
a merge needs at most one largest run's worth of memory on top.

This module knows nothing about rows or records: only ids (strings or integers) and where they were seen.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from typing import Sequence

import numpy as np

MAX_RUN = 1 << 18  # entries of the largest run a merge makes (4 MiB of digests and offsets)
ENTRY_BYTES = 16  # memory per id seen: its digest and its entry's offset
HEADER = struct.Struct("<II")  # an entry in the file: the key's and the place's sizes in bytes, then both


class SeenIds:
    """Ids seen so far, each with where it was first seen.

    Use :meth:`first_uses` on a chunk of ids in input order: it returns, for each, where an earlier id equal to it
    was first seen (None for a new id, which is then remembered). Not thread-safe."""

    def __init__(self):
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (digests sorted, offsets aligned): uint64 each
        self._file = tempfile.TemporaryFile("w+b")
        self._end = 0  # bytes written to the file

    def __len__(self) -> int:
        return sum(len(digests) for digests, _ in self._runs)

    def close(self) -> None:
        self._file.close()
        self._runs = []

    def first_uses(self, ids: Sequence[str | int], wheres: Sequence[str]) -> list[str | None]:
        """For each of ``ids`` (seen at ``wheres``, in order): where an equal id was first seen, earlier in this
        chunk or in an earlier one; None for a new id, which is remembered from now on at its ``where``."""
        keys = [_key(value) for value in ids]
        digests = np.fromiter((_digest(key) for key in keys), dtype=np.uint64, count=len(keys))
        maybe = self._maybe_seen(digests)
        chunk: dict[bytes, str] = {}
        new_digests, new_offsets, found = [], [], []
        for key, digest, seen_before, where in zip(keys, digests.tolist(), maybe.tolist(), wheres):
            first = chunk.get(key)
            if first is None and seen_before:
                first = self._lookup(key, digest)
            if first is None:
                chunk[key] = where
                new_digests.append(digest)
                new_offsets.append(self._append(key, where))
            found.append(first)
        self._add_run(np.array(new_digests, dtype=np.uint64), np.array(new_offsets, dtype=np.uint64))
        return found

    def _maybe_seen(self, digests: np.ndarray) -> np.ndarray:
        """Whether each digest is in some run (an equal id, or a collision :meth:`_lookup` rules out)."""
        hit = np.zeros(len(digests), dtype=bool)
        for run, _ in self._runs:
            places = np.minimum(np.searchsorted(run, digests), len(run) - 1)
            hit |= run[places] == digests
        return hit

    def _lookup(self, key: bytes, digest: int) -> str | None:
        """Where ``key`` was first seen, checked against the file's entries of every digest equal to its; or None."""
        self._file.flush()
        wanted = np.uint64(digest)
        for run, offsets in self._runs:
            start, stop = np.searchsorted(run, wanted, "left"), np.searchsorted(run, wanted, "right")
            for offset in offsets[start:stop].tolist():
                key_size, where_size = HEADER.unpack(os.pread(self._file.fileno(), HEADER.size, offset))
                entry = os.pread(self._file.fileno(), key_size + where_size, offset + HEADER.size)
                if entry[:key_size] == key:
                    return entry[key_size:].decode("utf-8", "surrogatepass")
        return None

    def _append(self, key: bytes, where: str) -> int:
        """Write ``key`` and ``where`` as one entry at the end of the file; its offset."""
        place = _encoded(where)
        offset = self._end
        self._file.write(HEADER.pack(len(key), len(place)) + key + place)
        self._end += HEADER.size + len(key) + len(place)
        return offset

    def _add_run(self, digests: np.ndarray, offsets: np.ndarray) -> None:
        """Add a run of new entries, merging it into the last run while that one is no larger (up to MAX_RUN)."""
        if not len(digests):
            return
        order = np.argsort(digests, kind="stable")
        run = (digests[order], offsets[order])
        while self._runs and len(self._runs[-1][0]) <= len(run[0]) and len(self._runs[-1][0]) + len(run[0]) <= MAX_RUN:
            run = _merged(self._runs.pop(), run)
        self._runs.append(run)


def _merged(first: tuple[np.ndarray, np.ndarray], second: tuple[np.ndarray, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Two sorted runs as one, in place of a sort: each entry of ``second`` goes after its equals in ``first``, so
    nothing beyond the merged arrays is allocated but ``second``'s places."""
    size = len(first[0]) + len(second[0])
    places = np.searchsorted(first[0], second[0], "right") + np.arange(len(second[0]))
    others = np.ones(size, dtype=bool)
    others[places] = False
    merged = []
    for old, new in zip(first, second):
        out = np.empty(size, dtype=np.uint64)
        out[places], out[others] = new, old
        merged.append(out)
    return merged[0], merged[1]


def _key(value: str | int) -> bytes:
    """The id as text that tells its type: ``1`` and ``"1"`` are two ids."""
    return _encoded(f"i{value}" if isinstance(value, int) else f"s{value}")


def _encoded(text: str) -> bytes:
    return text.encode("utf-8", "surrogatepass")


def _digest(key: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
