"""The disk tier's folder and manifests, without torch: what ``cache ls`` and ``cache clear`` need.

One file per (prefix identity, storage): ``<digest>.<storage>.safetensors``. The safetensors header's
metadata is the :class:`Manifest`. :class:`DiskFolder` checks the folder, lists its files (reading
headers only), clears them, and keeps the folder within its own byte budget;
:class:`prefixcache.cache.disk.DiskStore` adds reading and writing the tensors.

The folder is shared by every process given it (a server, batch jobs, Ray workers, ``cache clear``):

* **the folder manifest** ``DIR/manifest.json`` records the folder's byte budget (``cache_dir_budget``);
  every process honours the recorded budget, also one started without the setting;
* **the lock** ``DIR/.lock`` (a :class:`filelock.FileLock`) is held for the short critical sections
  only: renaming a written file in and evicting, clearing, recording the budget. Reads take no lock;
* **the LRU clock** is each file's mtime: a write and every use (a load, a pool hit) set it to now,
  so eviction deletes the files unused for longest, whichever process used them.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from contextlib import contextmanager
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path
from typing import Iterator

from filelock import FileLock, Timeout
from safetensors import SafetensorError, safe_open

from ..errors import CacheStoreError, setting

FORMAT = "prefixcache-kv/1"
SUFFIX = ".safetensors"
FOLDER_FORMAT = "prefixcache-dir/1"
FOLDER_MANIFEST = "manifest.json"  # {"format": FOLDER_FORMAT, "budget_bytes": int | null}
LOCK_NAME = ".lock"
LOCK_TIMEOUT_SECONDS = 60.0  # the critical sections take milliseconds; a minute's wait means a stuck holder
STALE_TEMP_SECONDS = 600.0  # a temporary file untouched this long is a killed writer's (a live one takes seconds)
TEMP_GLOB = f".*{SUFFIX}.tmp*"


@dataclass(frozen=True)
class Manifest:
    """What a stored prefix is. Every field is a string (safetensors metadata is ``str -> str``)."""

    format: str
    model: str  # LoadedModel.identity: names the weights (HF revision, GGUF sha256, folder path)
    dtype: str
    storage: str
    tokens: str
    token_hash: str
    transformers: str
    checksum: str
    name: str = ""  # the task that first stored it (informative only)
    created: str = ""

    def to_metadata(self) -> dict[str, str]:
        return asdict(self)

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None) -> Manifest:
        """Raises KeyError naming the first missing field."""
        meta = meta or {}
        missing = [f.name for f in fields(cls) if f.name not in meta and f.default is MISSING]
        if missing:
            raise KeyError(missing[0])
        return cls(**{f.name: meta[f.name] for f in fields(cls) if f.name in meta})


@dataclass(frozen=True)
class Expected:
    """The manifest fields a file must match to be used (everything but checksum, name and time)."""

    model: str
    dtype: str
    storage: str
    token_ids: tuple[int, ...]

    @property
    def token_hash(self) -> str:
        return token_hash(self.token_ids)


@dataclass(frozen=True)
class StoredFile:
    """One file of the store, as ``cache ls`` shows it. ``manifest`` is None when the header is unreadable."""

    path: Path
    size: int
    manifest: Manifest | None
    problem: str | None = None


@dataclass(frozen=True)
class Cleared:
    files: int
    bytes: int


@dataclass(frozen=True)
class Saved:
    """What a save did. ``path`` is None when the file alone is larger than the folder's whole budget
    (``budget_bytes``), so it was not saved; ``evicted``: the files deleted to stay within the budget."""

    path: Path | None
    bytes: int
    budget_bytes: int | None
    evicted: tuple[Path, ...] = ()


def token_hash(token_ids: tuple[int, ...] | list[int]) -> str:
    """SHA-256 of the token ids as comma-separated decimals (portable across platforms)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


class DiskFolder:
    """A folder of stored prefixes: its files and their manifests (no tensors are read), its budget and lock.

    Safe for many processes at once: files are written under a temporary name and renamed in
    (:meth:`put`); renaming in, evicting, clearing and recording the budget hold the folder's lock; a
    listing or a read tolerates a file that disappears under it. After every save the folder's stored
    files take at most its budget (files written later by another process included).

    Raises (on construction):
        CacheStoreError: ``root`` exists and is not a folder, cannot be created, or (``create=False``)
            does not exist; ``budget_bytes`` (recorded as the folder's budget when given) cannot be recorded.
    """

    def __init__(self, root: str | Path, create: bool = True, budget_bytes: int | None = None):
        self.root = Path(root).expanduser()
        if self.root.exists() and not self.root.is_dir():
            raise CacheStoreError(f"{setting('cache_dir', str(self.root))} is a file; pass a folder")
        if not create and not self.root.is_dir():
            raise CacheStoreError(f"{self.root}: no such cache folder")
        if create:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise CacheStoreError(f"cannot create {setting('cache_dir', str(self.root))}: {exc.strerror}") from None
        self._lock = FileLock(self.root / LOCK_NAME, timeout=LOCK_TIMEOUT_SECONDS)
        if budget_bytes is not None:
            self.set_budget(budget_bytes)

    def path(self, digest: str, storage: str) -> Path:
        return self.root / f"{digest}.{storage}{SUFFIX}"

    def temp_path(self, path: Path) -> Path:
        """A fresh temporary name beside ``path`` for one write (process id and a random part: one per writer)."""
        return path.with_name(f".{path.name}.tmp{os.getpid()}-{secrets.token_hex(4)}")

    # -- reading ----------------------------------------------------------------------------------

    def files(self) -> list[StoredFile]:
        """Every stored prefix file, with its manifest read from the header only (data is not loaded).
        Temporary files are not listed; a file deleted meanwhile (evicted, cleared) is left out."""
        out = []
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            try:
                size = path.stat().st_size
                with safe_open(str(path), framework="numpy") as fh:  # the header only: no torch
                    out.append(StoredFile(path, size, Manifest.from_metadata(fh.metadata())))
            except FileNotFoundError:
                continue
            except SafetensorError as exc:
                out.append(StoredFile(path, size, None, f"unreadable ({exc})"))
            except KeyError as exc:
                out.append(StoredFile(path, size, None, f"missing manifest field {exc}"))
        return out

    @property
    def budget_bytes(self) -> int | None:
        """The folder's byte budget, as recorded in ``DIR/manifest.json``; None when none is.

        Raises:
            CacheStoreError: that file is not a folder manifest.
        """
        path = self.root / FOLDER_MANIFEST
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            raise CacheStoreError(f"cannot read the cache folder manifest {path} ({exc}); delete it") from None
        record = record if isinstance(record, dict) else {}
        budget = record.get("budget_bytes", 0)
        if record.get("format") != FOLDER_FORMAT or not (budget is None or (type(budget) is int and budget > 0)):
            raise CacheStoreError(
                f"{path} is not a cache folder manifest ({FOLDER_FORMAT}, budget_bytes a positive integer or null); "
                f"delete it, and set {setting('cache_dir_budget')} again if the folder had one"
            )
        return budget

    def touch(self, path: Path) -> None:
        """Mark ``path`` used now: its mtime is the LRU clock. Best effort: a file gone meanwhile (evicted,
        cleared) or a read-only folder leaves the clock as it is, and a lookup never fails for it."""
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass  # the file is gone or the folder read-only: nothing to mark

    # -- changing -----------------------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the folder's lock (``DIR/.lock``, shared by every process using the folder) for a short step.

        Raises:
            CacheStoreError: another holder kept it for :data:`LOCK_TIMEOUT_SECONDS`.
        """
        try:
            self._lock.acquire()
        except Timeout:
            raise CacheStoreError(
                f"the cache folder {self.root} stayed locked by another process for {LOCK_TIMEOUT_SECONDS:.0f} s "
                f"({self.root / LOCK_NAME}); retry when it has finished"
            ) from None
        try:
            yield
        finally:
            self._lock.release()

    def set_budget(self, budget_bytes: int | None) -> tuple[Path, ...]:
        """Record ``budget_bytes`` (None: no budget) in the folder manifest, for every process using the
        folder, and evict down to it now. Returns the files evicted.

        Raises:
            ValueError: ``budget_bytes`` is below 1.
            CacheStoreError: the manifest cannot be written, or the lock not taken.
        """
        if budget_bytes is not None and budget_bytes < 1:
            raise ValueError(f"a cache folder budget must be at least 1 byte, not {budget_bytes}")
        path = self.root / FOLDER_MANIFEST
        staging = self.temp_path(path)
        with self.locked():
            try:
                staging.write_text(json.dumps({"format": FOLDER_FORMAT, "budget_bytes": budget_bytes}) + "\n")
                os.replace(staging, path)
            except OSError as exc:
                staging.unlink(missing_ok=True)
                raise CacheStoreError(f"cannot record the folder's budget in {path}: {exc.strerror or exc}") from None
            return self._evict(budget_bytes)

    def put(self, staging: Path, path: Path) -> Saved:
        """Rename the fully written ``staging`` file to ``path``, then evict least recently used files until
        the folder is within its budget (never ``path``), all under the lock. A file larger than the whole
        budget is not renamed in (``Saved.path`` None). ``staging`` is gone afterwards either way.

        Raises:
            OSError: the rename failed.  CacheStoreError: the lock or the folder manifest.
        """
        try:
            size = staging.stat().st_size
            with self.locked():
                budget = self.budget_bytes
                if budget is not None and size > budget:
                    return Saved(None, size, budget)
                os.replace(staging, path)
                self.touch(path)
                return Saved(path, size, budget, self._evict(budget, keep=path))
        finally:
            staging.unlink(missing_ok=True)

    def clear(self) -> Cleared:
        """Delete every stored prefix file, and temporary files a killed writer left (untouched for
        :data:`STALE_TEMP_SECONDS`), under the lock. Kept: other files, the folder manifest (its budget),
        and a save in progress (renamed in after the clear, it is a save that came later).

        Raises:
            CacheStoreError: the lock cannot be taken.
        """
        with self.locked():
            doomed = [*self._stored(), *self._stale_temps()]
            for _, path, _ in doomed:
                path.unlink(missing_ok=True)
        return Cleared(len(doomed), sum(size for *_, size in doomed))

    # -- under the lock -----------------------------------------------------------------------------

    def _evict(self, budget: int | None, keep: Path | None = None) -> tuple[Path, ...]:
        """Delete stale temporary files, then (with a budget) stored files by oldest mtime until the stored
        total is within ``budget``; ``keep`` is never deleted. The caller holds the lock."""
        for _, path, _ in self._stale_temps():
            path.unlink(missing_ok=True)
        if budget is None:
            return ()
        stored = sorted(self._stored())
        total = sum(size for *_, size in stored)
        evicted = []
        for _, path, size in stored:
            if total <= budget:
                break
            if path != keep:
                path.unlink(missing_ok=True)
                evicted.append(path)
                total -= size
        return tuple(evicted)

    def _stored(self) -> list[tuple[int, Path, int]]:
        """(mtime in ns, path, size) of every stored prefix file still there."""
        return [s for s in map(_stat, self.root.glob(f"*{SUFFIX}")) if s is not None]

    def _stale_temps(self) -> list[tuple[int, Path, int]]:
        cutoff = time.time_ns() - int(STALE_TEMP_SECONDS * 1e9)
        return [s for s in map(_stat, self.root.glob(TEMP_GLOB)) if s is not None and s[0] < cutoff]


def _stat(path: Path) -> tuple[int, Path, int] | None:
    """(mtime in ns, path, size), or None when the file is gone."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return None
    return st.st_mtime_ns, path, st.st_size
