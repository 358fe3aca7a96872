"""What the prefix pool hands out and reports: a prefix's identity (:class:`PrefixKey`), what a lookup did
(:class:`LookupInfo`, :class:`Lookup`) and a snapshot of the pool's counters (:class:`PoolStats`).

This module knows nothing about tasks, labels or records: only models and token ids.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Literal, Sequence

from ..model.load import LoadedModel
from .kv import PrefixKV

Source = Literal["memory", "disk", "extended", "computed", "tuned"]


@dataclass(frozen=True)
class TunedPrefix:
    """A prefix fitted rather than computed (prefix tuning): ``prefix`` stands for its token ids under the key
    variant ``variant`` (a checksum of the fitted tensors), so it never answers for, nor shares a leading part
    with, the prefix the model computes from the same tokens."""

    variant: str
    prefix: PrefixKV = field(repr=False)


@dataclass(frozen=True)
class PrefixKey:
    """A prefix's identity: ``digest`` hashes model identity, dtype and token ids, and for a tuned prefix its
    ``variant`` (the tuned tensors' checksum: :meth:`~prefixcache.cache.kv.PrefixKV.checksum`); "" for a prefix the
    model computes from its tokens."""

    digest: str
    model: str
    dtype: str
    length: int
    variant: str = ""

    @classmethod
    def of(cls, loaded: LoadedModel, token_ids: Sequence[int], variant: str = "") -> PrefixKey:
        dtype = str(loaded.dtype).removeprefix("torch.")
        text = f"{loaded.identity}\0{dtype}\0{','.join(map(str, token_ids))}" + (f"\0tuned:{variant}" if variant else "")
        digest = hashlib.sha256(text.encode()).hexdigest()
        return cls(digest[:40], loaded.identity, dtype, len(token_ids), variant)


@dataclass(frozen=True)
class LookupInfo:
    """What one :meth:`PrefixPool.get` did, without the prefix: holds no tensor, so it is safe to keep.

    Attributes:
        key: the prefix's identity.
        source: how it was obtained (memory, disk, extended, computed).
        tokens_computed: prefix tokens run through the model by this call.
        tokens_reused: prefix tokens this call did not have to compute.
        seconds: wall time of the call.
    """

    key: PrefixKey
    source: Source
    tokens_computed: int
    tokens_reused: int
    seconds: float


@dataclass(frozen=True)
class Lookup(LookupInfo):
    """What :meth:`PrefixPool.get` returns: :class:`LookupInfo` and the prefix itself.

    ``prefix`` is the float prefix, read-only (fork it, never write it). With float storage it *is* the
    pool's entry, so holding it past the pass keeps an evicted entry's memory alive: keep :meth:`info`.
    """

    prefix: PrefixKV = field(repr=False)

    def info(self) -> LookupInfo:
        """This lookup without its prefix."""
        return LookupInfo(self.key, self.source, self.tokens_computed, self.tokens_reused, self.seconds)


@dataclass(frozen=True)
class PoolStats:
    """A snapshot of the pool's counters.

    ``hits`` are lookups answered from memory; every other lookup is a ``miss``
    (answered from disk, by extension, or by computing). ``prefill_tokens_saved``
    is the prefix tokens not computed thanks to the pool (hits, disk loads,
    reused leading parts). ``bytes_held`` is the held prefixes' bytes, ``reserved_bytes``
    the bytes kept outside them within the budget (the engine loop's slot store:
    :meth:`PrefixPool.reserve`); ``used_bytes``, their sum, never passes ``budget_bytes``.
    """

    hits: int
    misses: int
    evictions: int
    entries: int
    pinned: int
    bytes_held: int
    budget_bytes: int
    float_bytes: int
    prefill_tokens_saved: int
    prefill_tokens_computed: int
    disk_loads: int
    disk_writes: int
    disk_rejected: int
    partial_reuses: int
    storage: str
    eviction: str
    reserved_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        """Bytes the budget counts: the held prefixes and the reservations."""
        return self.bytes_held + self.reserved_bytes

    @property
    def bytes_saved(self) -> int:
        """Bytes the held entries would take more as float (0 for float storage)."""
        return self.float_bytes - self.bytes_held

    def to_json(self) -> dict:
        return asdict(self) | {"bytes_saved": self.bytes_saved, "used_bytes": self.used_bytes}
