"""The processes of the disk-tier hammer test (tests/cache/test_cache_disk_concurrency.py): writers, a reader, a clearer.

Each runs in its own process (forked from a fresh fork server that has imported the disk tier) on one
cache folder until its deadline, and writes what it did to a JSON log that the test checks afterwards.
Kept apart from the test module so that a child imports only the disk tier (not pytest, nor conftest).

Times are ``time.monotonic_ns()``: one clock for every process of the machine.
"""

from __future__ import annotations

import json
import random
import time
from dataclasses import dataclass

import torch

from prefixcache.cache.disk import DiskFolder, DiskStore, Expected, transformers_version
from prefixcache.cache.layouts import STORAGES

STORAGE = "float"
CLEAR_EVERY_SECONDS = 3.0
QUIET_END_SECONDS = 2.0  # the clearer stops this long before the end, so saves after the last clear can be checked


@dataclass(frozen=True)
class Entry:
    """One prefix as the processes get it: its file's digest, what a read must match, and (for writers) its tensors."""

    digest: str
    expected: Expected
    tensors: dict[str, torch.Tensor] | None = None

    @property
    def file_name(self) -> str:
        return f"{self.digest}.{STORAGE}.safetensors"


def _start(barrier, seconds: float) -> int:
    transformers_version()  # import transformers before the start, not inside the hammering
    barrier.wait(timeout=120)
    return time.monotonic_ns() + int(seconds * 1e9)


def _dump(log_path: str, record: dict) -> None:
    with open(log_path, "w", encoding="utf-8") as fh:
        json.dump(record, fh)


def writer(root: str, entries: list[Entry], seconds: float, log_path: str, barrier) -> None:
    """Save random entries of ``entries`` over and over; log each save (start, end, saved, what it evicted)."""
    store, rng = DiskStore(root), random.Random(log_path)
    packed = {e.digest: STORAGES[STORAGE]().from_tensors(e.tensors) for e in entries}
    saves = []
    deadline = _start(barrier, seconds)
    while time.monotonic_ns() < deadline:
        entry = rng.choice(entries)
        t0 = time.monotonic_ns()
        saved = store.write(entry.digest, STORAGE, packed[entry.digest], entry.expected, "hammer")
        saves.append({"file": entry.file_name, "t0": t0, "t1": time.monotonic_ns(), "saved": saved.path is not None,
                      "evicted": [p.name for p in saved.evicted]})
        time.sleep(rng.random() * 0.004)
    _dump(log_path, {"saves": saves})


def reader(root: str, entries: list[Entry], seconds: float, log_path: str, barrier) -> None:
    """Load random entries and list the folder over and over; log every problem (a torn or bad file)."""
    store, rng = DiskStore(root), random.Random(log_path)
    loads = misses = listings = 0
    problems = []
    deadline = _start(barrier, seconds)
    while time.monotonic_ns() < deadline:
        entry = rng.choice(entries)
        read = store.read(entry.digest, STORAGES[STORAGE](), entry.expected)
        if read.problem is not None:
            problems.append(f"{entry.file_name}: {read.problem}")
        loads, misses = loads + (read.packed is not None), misses + (read.packed is None and read.problem is None)
        if rng.random() < 0.1:
            listings += 1
            problems += [f"listed {f.path.name}: {f.problem}" for f in store.files() if f.problem]
    _dump(log_path, {"loads": loads, "misses": misses, "listings": listings, "problems": problems})


def clearer(root: str, seconds: float, log_path: str, barrier) -> None:
    """Clear the folder (as ``prefixcache cache clear`` does) every few seconds; log each clear's start and end."""
    folder = DiskFolder(root, create=False)
    clears = []
    deadline = _start(barrier, seconds)
    quiet = deadline - int(QUIET_END_SECONDS * 1e9)
    while time.monotonic_ns() + int(CLEAR_EVERY_SECONDS * 1e9) < quiet:
        time.sleep(CLEAR_EVERY_SECONDS)
        t0 = time.monotonic_ns()
        cleared = folder.clear()
        clears.append({"t0": t0, "t1": time.monotonic_ns(), "files": cleared.files})
    _dump(log_path, {"clears": clears})
