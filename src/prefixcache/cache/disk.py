"""The disk tier: prefixes saved as safetensors files with a manifest, so a restart loads instead of recomputing.

One file per (prefix identity, storage): ``<digest>.<storage>.safetensors`` in
the store's folder (listing and clearing it, torch-free: :mod:`prefixcache.cache.manifest`).
The safetensors header's metadata is the :class:`~prefixcache.cache.manifest.Manifest`:
model identity (which names the revision or the weights' hash), dtype, storage,
token count and token hash, transformers version, and a SHA-256 checksum of
every tensor's bytes. Manifest and data live in one file written to a
temporary name and renamed, so a reader never sees half a file.

The folder's own byte budget, its lock and its LRU clock (shared by every process
using the folder) are :class:`~prefixcache.cache.manifest.DiskFolder`'s: a save
renames the file in and evicts the least recently used files under the lock; a
load marks the file used.

:meth:`DiskStore.read` never hands back data it cannot vouch for: a file that
does not parse, whose checksum or token ids do not match, or whose manifest
names another model, dtype, storage or transformers version comes back as a
:class:`DiskRead` with ``problem`` set (the pool then recomputes the prefix,
warns, and overwrites the file).

This module knows nothing about the pool's memory budget or its eviction (that is ``cache/pool.py``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load, save_file

from .layouts import KVStorage, Packed
from .manifest import FORMAT, SUFFIX, Cleared, DiskFolder, Expected, Manifest, Saved, StoredFile, token_hash

__all__ = ["Cleared", "DiskFolder", "DiskRead", "DiskStore", "Expected", "FORMAT", "Manifest", "SUFFIX", "Saved",
           "StoredFile", "tensors_checksum", "token_hash", "transformers_version"]  # the manifest's names too, for callers of the store


@dataclass(frozen=True)
class DiskRead:
    """The outcome of :meth:`DiskStore.read`: ``packed`` when the file is good, else ``problem``; neither: no file."""

    path: Path
    packed: Packed | None = None
    problem: str | None = None


def tensors_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and raw bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


@functools.cache
def transformers_version() -> str:
    """The installed transformers' version (from its package metadata: importing it takes seconds)."""
    return importlib.metadata.version("transformers")


class DiskStore(DiskFolder):
    """A folder of stored prefixes that reads and writes their tensors (listing: :class:`DiskFolder`).

    Thread and process safety: each write goes to its own temporary name and is renamed into
    place under the folder's lock, so concurrent writers of the same prefix leave one whole file,
    and a reader sees a whole file or none.

    Raises (on construction):
        CacheStoreError: ``root`` exists and is not a folder, cannot be created, or
            (``create=False``) does not exist; ``budget_bytes`` cannot be recorded.
    """

    def read(self, digest: str, storage: KVStorage, expected: Expected, device: torch.device | str = "cpu") -> DiskRead:
        """Load a stored prefix if there is a good one. Does not modify the file.

        Returns a DiskRead with ``packed`` (verified: manifest, token ids and checksum match),
        or with ``problem`` saying why the file must not be used, or with neither when there is no file
        (also when another process evicted or cleared it a moment ago). A good file is marked used (its
        mtime, the LRU clock). The file is read through one open, so a file that another process replaces
        or deletes meanwhile gives the whole old file or none, never parts of two (``safe_open`` opens twice).
        """
        path = self.path(digest, storage.name)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return DiskRead(path)
        except OSError as exc:
            return DiskRead(path, problem=f"unreadable ({exc.strerror or exc})")
        try:
            manifest = Manifest.from_metadata(_header_metadata(data))
            mismatch = _mismatch(manifest, expected)
            if mismatch:
                return DiskRead(path, problem=f"mismatched ({mismatch})")
            tensors = load(data)
        except (SafetensorError, ValueError) as exc:
            return DiskRead(path, problem=f"unreadable ({exc})")
        except KeyError as exc:
            return DiskRead(path, problem=f"missing manifest field {exc}")
        if tensors_checksum(tensors) != manifest.checksum:
            return DiskRead(path, problem="corrupt (checksum mismatch)")
        try:
            packed = storage.from_tensors({name: t.to(device) for name, t in tensors.items()})
        except KeyError as exc:
            return DiskRead(path, problem=f"corrupt (no tensor {exc})")
        if packed.token_ids != expected.token_ids:
            return DiskRead(path, problem="mismatched (token ids differ)")
        self.touch(path)
        return DiskRead(path, packed=packed)

    def mark_used(self, digest: str, storage: str) -> None:
        """Set the LRU clock of a stored prefix to now (a pool hit in memory is a use too); no file: nothing."""
        self.touch(self.path(digest, storage))

    def write(self, digest: str, storage: str, packed: Packed, expected: Expected, name: str = "") -> Saved:
        """Save ``packed`` with its manifest, atomically (temporary file + rename), then evict least recently
        used files down to the folder's budget (never this one). A prefix larger than the whole budget is not
        saved: ``Saved.path`` is None (the caller warns).

        Raises:
            OSError: the file cannot be written (disk full, permissions).
            CacheStoreError: the folder's lock cannot be taken, or its manifest is not one.
        """
        tensors = {k: v.detach().contiguous().cpu() for k, v in packed.to_tensors().items()}
        budget, data_bytes = self.budget_bytes, sum(t.nbytes for t in tensors.values())
        if budget is not None and data_bytes > budget:  # the file only adds its header: do not write it at all
            return Saved(None, data_bytes, budget)
        manifest = Manifest(
            FORMAT, expected.model, expected.dtype, storage, str(len(expected.token_ids)), expected.token_hash,
            transformers_version(), tensors_checksum(tensors), name, time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        path = self.path(digest, storage)
        staging = self.temp_path(path)
        try:
            save_file(tensors, str(staging), metadata=manifest.to_metadata())
        except BaseException:
            staging.unlink(missing_ok=True)
            raise
        return self.put(staging, path)


def _header_metadata(data: bytes) -> dict | None:
    """The ``__metadata__`` of a safetensors file's header (an 8-byte little-endian length, then JSON).

    Raises:
        ValueError: ``data`` does not start with a safetensors header.
    """
    length = int.from_bytes(data[:8], "little")
    if len(data) < 8 or length > len(data) - 8:
        raise ValueError("no safetensors header: the file is shorter than its header says")
    header = json.loads(data[8 : 8 + length])  # JSONDecodeError and UnicodeDecodeError are ValueErrors
    if not isinstance(header, dict):
        raise ValueError("no safetensors header: not a JSON object")
    meta = header.get("__metadata__")
    return meta if isinstance(meta, dict) else None


def _mismatch(manifest: Manifest, expected: Expected) -> str | None:
    """The first manifest field that differs from what the caller needs, as ``field: stored != wanted``."""
    wanted = {
        "format": FORMAT,
        "model": expected.model,
        "dtype": expected.dtype,
        "storage": expected.storage,
        "tokens": str(len(expected.token_ids)),
        "token_hash": expected.token_hash,
        "transformers": transformers_version(),
    }
    for field, value in wanted.items():
        stored = getattr(manifest, field)
        if stored != value:
            return f"{field}: stored {stored!r}, wanted {value!r}"
    return None
