"""The disk tier: prefixes saved as safetensors files with a manifest, so a restart loads instead of recomputing.

One file per (prefix identity, storage): ``<digest>.<storage>.safetensors`` in
the store's folder (listing and clearing it, torch-free: :mod:`prefixcache.cache.manifest`).
The safetensors header's metadata is the :class:`~prefixcache.cache.manifest.Manifest`:
model identity (which names the revision or the weights' hash), dtype, storage,
token count and token hash, transformers version, and a SHA-256 checksum of
every tensor's bytes. Manifest and data live in one file written to a
temporary name and renamed, so a reader never sees half a file.

:meth:`DiskStore.read` never hands back data it cannot vouch for: a file that
does not parse, whose checksum or token ids do not match, or whose manifest
names another model, dtype, storage or transformers version comes back as a
:class:`DiskRead` with ``problem`` set (the pool then recomputes the prefix,
warns, and overwrites the file).

This module knows nothing about budgets or eviction (that is ``cache/pool.py``).
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .layouts import KVStorage, Packed
from .manifest import FORMAT, SUFFIX, Cleared, DiskFolder, Expected, Manifest, StoredFile, token_hash

__all__ = ["Cleared", "DiskFolder", "DiskRead", "DiskStore", "Expected", "FORMAT", "Manifest", "SUFFIX", "StoredFile",
           "tensors_checksum", "token_hash", "transformers_version"]  # the manifest's names too, for callers of the store


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


def transformers_version() -> str:
    import transformers

    return transformers.__version__


class DiskStore(DiskFolder):
    """A folder of stored prefixes that reads and writes their tensors (listing: :class:`DiskFolder`).

    Thread safety: writes go to a per-process temporary name and are renamed
    into place, so concurrent writers of the same prefix leave one whole file.

    Raises (on construction):
        CacheStoreError: ``root`` exists and is not a folder, cannot be created, or
            (``create=False``) does not exist.
    """

    def read(self, digest: str, storage: KVStorage, expected: Expected, device: torch.device | str = "cpu") -> DiskRead:
        """Load a stored prefix if there is a good one. Does not modify the file.

        Returns a DiskRead with ``packed`` (verified: manifest, token ids and checksum match),
        or with ``problem`` saying why the file must not be used, or with neither when there is no file.
        """
        path = self.path(digest, storage.name)
        if not path.is_file():
            return DiskRead(path)
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as fh:
                manifest = Manifest.from_metadata(fh.metadata())
                mismatch = _mismatch(manifest, expected)
                if mismatch:
                    return DiskRead(path, problem=f"mismatched ({mismatch})")
                tensors = {name: fh.get_tensor(name) for name in fh.keys()}
        except SafetensorError as exc:
            return DiskRead(path, problem=f"unreadable ({exc})")
        except KeyError as exc:
            return DiskRead(path, problem=f"missing manifest field {exc}")
        except OSError as exc:
            return DiskRead(path, problem=f"unreadable ({exc.strerror or exc})")
        if tensors_checksum(tensors) != manifest.checksum:
            return DiskRead(path, problem="corrupt (checksum mismatch)")
        try:
            packed = storage.from_tensors(tensors)
        except KeyError as exc:
            return DiskRead(path, problem=f"corrupt (no tensor {exc})")
        if packed.token_ids != expected.token_ids:
            return DiskRead(path, problem="mismatched (token ids differ)")
        return DiskRead(path, packed=packed)

    def write(self, digest: str, storage: str, packed: Packed, expected: Expected, name: str = "") -> Path:
        """Save ``packed`` with its manifest, atomically (temporary file + rename). Returns the path.

        Raises:
            OSError: the file cannot be written (disk full, permissions).
        """
        tensors = {k: v.detach().contiguous().cpu() for k, v in packed.to_tensors().items()}
        manifest = Manifest(
            FORMAT, expected.model, expected.dtype, storage, str(len(expected.token_ids)), expected.token_hash,
            transformers_version(), tensors_checksum(tensors), name, time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        )
        path = self.path(digest, storage)
        staging = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            save_file(tensors, str(staging), metadata=manifest.to_metadata())
            staging.replace(path)
        finally:
            if staging.exists():
                staging.unlink()
        return path



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
