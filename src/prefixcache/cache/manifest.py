"""The disk tier's folder and manifests, without torch: what ``cache ls`` and ``cache clear`` need.

One file per (prefix identity, storage): ``<digest>.<storage>.safetensors``. The safetensors header's
metadata is the :class:`Manifest`. :class:`DiskFolder` checks the folder, lists its files (reading
headers only) and clears them; :class:`prefixcache.cache.disk.DiskStore` adds reading and writing
the tensors.
"""

from __future__ import annotations

import hashlib
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from safetensors import SafetensorError, safe_open

from ..errors import CacheStoreError, setting

FORMAT = "prefixcache-kv/1"
SUFFIX = ".safetensors"


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


def token_hash(token_ids: tuple[int, ...] | list[int]) -> str:
    """SHA-256 of the token ids as comma-separated decimals (portable across platforms)."""
    return hashlib.sha256(",".join(map(str, token_ids)).encode()).hexdigest()


class DiskFolder:
    """A folder of stored prefixes: its files and their manifests (no tensors are read).

    Raises (on construction):
        CacheStoreError: ``root`` exists and is not a folder, cannot be created, or
            (``create=False``) does not exist.
    """

    def __init__(self, root: str | Path, create: bool = True):
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

    def path(self, digest: str, storage: str) -> Path:
        return self.root / f"{digest}.{storage}{SUFFIX}"

    def files(self) -> list[StoredFile]:
        """Every stored prefix file, with its manifest read from the header only (data is not loaded)."""
        out = []
        for path in sorted(self.root.glob(f"*{SUFFIX}")):
            size = path.stat().st_size
            try:
                with safe_open(str(path), framework="numpy") as fh:  # the header only: no torch
                    out.append(StoredFile(path, size, Manifest.from_metadata(fh.metadata())))
            except SafetensorError as exc:
                out.append(StoredFile(path, size, None, f"unreadable ({exc})"))
            except KeyError as exc:
                out.append(StoredFile(path, size, None, f"missing manifest field {exc}"))
        return out

    def clear(self) -> Cleared:
        """Delete every stored prefix file (and stale temporary files). Other files in the folder are kept."""
        count = size = 0
        for path in [*self.root.glob(f"*{SUFFIX}"), *self.root.glob(f".*{SUFFIX}.tmp*")]:
            size += path.stat().st_size
            path.unlink()
            count += 1
        return Cleared(count, size)
