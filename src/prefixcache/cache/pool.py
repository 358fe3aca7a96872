"""PrefixPool: the prefix caches of many (model, task) prefixes inside one byte budget.

A prefix's identity (:class:`PrefixKey`) is a hash of the model identity (which
names the weights and revision), the dtype and the prefix *token ids*, not the
text: two tasks whose prefixes tokenize the same share one entry.

:meth:`PrefixPool.get` returns a ready :class:`~prefixcache.cache.kv.PrefixKV`,
taking the cheapest way to it:

1. **memory**: the entry is held (a hit; its token ids are re-checked);
2. **disk**: the disk tier (:mod:`prefixcache.cache.disk`) holds a verified file;
3. **extended**: a held entry shares a leading part with it (the same system
   prompt with other examples); that part is reused and only the tail computed;
4. **computed**: the whole prefix runs through the model; or **tuned**: a fitted prefix, taken as given.

The budget is never exceeded: before anything is computed, the entry's exact
size is checked (a prefix larger than the budget, or than what pins and reservations
leave, raises :class:`~prefixcache.errors.PoolBudgetError`), and unpinned entries are
evicted in the policy's order (:data:`POLICIES`) until it fits. Pinned entries
are never evicted.

The budget also bounds bytes kept outside the entries: an owner (the engine loop's slot store)
reserves its bytes (:meth:`~PrefixPool.reserve`, which evicts unpinned entries to make room) and
gives them back when it drops them (:meth:`~PrefixPool.release`). So
``bytes_held + bytes_reserved <= budget`` after every call.

``bytes_held`` counts what the pool stores. A float entry is handed out by
reference (no copy); an int8 entry is dequantized into a transient float copy
that lives as long as the caller holds it. A caller that keeps a handed-out
prefix keeps its memory alive after eviction, so hold one per pass, not forever,
and keep :meth:`Lookup.info` (no tensor) to remember what a lookup did. Then the
prefix bytes alive are at most the budget plus the prefixes of passes in flight.

Thread safety: one lock serializes ``get`` (including the computation of a
missing prefix), so two threads asking for the same prefix compute it once.

This module knows nothing about tasks, labels or records: only models and token ids.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import CacheStoreError, PoolBudgetError, PoolReservationError, setting
from ..model.load import LoadedModel
from .config import PoolConfig, format_bytes
from .disk import DiskStore, Expected
from .eviction import POLICIES, EvictionPolicy
from .kv import KVShape, PrefixKV
from .layouts import STORAGES, KVStorage, Packed
from .pool_types import Lookup, LookupInfo, PoolStats, PrefixKey, Source, TunedPrefix  # noqa: F401  (LookupInfo, TunedPrefix: re-exported)

log = logging.getLogger(__name__)

@dataclass
class _Entry:
    key: PrefixKey
    packed: Packed
    nbytes: int
    float_bytes: int
    pinned: bool
    name: str


@dataclass
class _Counters:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    saved: int = 0
    computed: int = 0
    disk_loads: int = 0
    disk_writes: int = 0
    disk_rejected: int = 0
    partial_reuses: int = 0


# ---------------------------------------------------------------------------
# The pool
# ---------------------------------------------------------------------------


class PrefixPool:
    """Prefix caches of many prefixes within ``config.budget_bytes``; optional disk tier ``store``."""

    def __init__(self, config: PoolConfig = PoolConfig(), store: DiskStore | None = None):
        self.config = config
        self.store = store
        self.storage: KVStorage = STORAGES[config.storage]()
        self._policy: EvictionPolicy = POLICIES[config.eviction]()
        self._entries: dict[str, _Entry] = {}
        self._reserved: dict[str, int] = {}  # owner -> bytes it keeps outside the entries (reserve)
        self._count = _Counters()
        self._lock = threading.RLock()

    # -- queries ------------------------------------------------------------

    @property
    def bytes_held(self) -> int:
        """Bytes of the held entries (the prefixes)."""
        return sum(e.nbytes for e in self._entries.values())

    @property
    def bytes_reserved(self) -> int:
        """Bytes reserved by owners outside the entries (:meth:`reserve`); they count in the budget."""
        return sum(self._reserved.values())

    def __contains__(self, key: PrefixKey) -> bool:
        return key.digest in self._entries

    def keys(self) -> list[PrefixKey]:
        """Held entries, in eviction order (first to go first; pinned ones included)."""
        with self._lock:
            return [self._entries[d].key for d in self._policy.order()]

    def is_pinned(self, key: PrefixKey) -> bool:
        return key.digest in self._entries and self._entries[key.digest].pinned

    def stats(self) -> PoolStats:
        with self._lock:
            c = self._count
            entries = self._entries.values()
            return PoolStats(
                c.hits, c.misses, c.evictions, len(self._entries), sum(e.pinned for e in entries), self.bytes_held,
                self.config.budget_bytes, sum(e.float_bytes for e in entries), c.saved, c.computed, c.disk_loads,
                c.disk_writes, c.disk_rejected, c.partial_reuses, self.config.storage, self.config.eviction,
                self.bytes_reserved,
            )

    def size_of(self, loaded: LoadedModel, tokens: int) -> int:
        """Exact bytes an entry of ``tokens`` tokens takes in this pool (before it is computed)."""
        return self.storage.estimate(KVShape.of(loaded.model.config), tokens, _element_size(loaded))

    # -- the lookup ----------------------------------------------------------

    def get(
        self, loaded: LoadedModel, token_ids: Sequence[int], pin: bool = False, name: str = "", tuned: TunedPrefix | None = None
    ) -> Lookup:
        """The prefix of ``token_ids`` for ``loaded``, from memory, disk, a shared part, or computed.

        With ``tuned`` the entry is that fitted prefix (its ``token_ids`` must be ``token_ids``), held under its own
        key: from memory or disk as any entry, else taken as given (source ``"tuned"``), never computed or extended.

        Modifies the pool: counters, the policy's order, possibly evictions and an insertion
        (and a file write when there is a disk tier). Never modifies a held prefix.
        ``pin=True`` pins the entry (also when it was already held).

        Raises:
            PoolBudgetError: the prefix is larger than the budget, or than what pinned entries leave;
                raised before anything is computed.
            PromptError: ``token_ids`` is empty, or the model is not a full-attention decoder.
        """
        started = time.perf_counter()
        ids = tuple(int(t) for t in token_ids)
        if tuned is not None and tuned.prefix.token_ids != ids:
            raise ValueError("a tuned prefix stands for its own token ids")
        key = PrefixKey.of(loaded, ids, tuned.variant if tuned is not None else "")
        with self._lock:
            entry = self._entries.get(key.digest)
            if entry is not None and entry.packed.token_ids == ids:
                return self._hit(entry, pin, started, loaded)
            self._count.misses += 1
            need = self.size_of(loaded, len(ids))
            self._check_fits(need, pin, name or key.digest[:12])
            packed, source, computed = self._obtain(loaded, key, ids, name, tuned)
            self._insert(loaded, key, packed, pin, name)
            self._count.computed += computed
            self._count.saved += len(ids) - computed
            prefix = self.storage.unpack(packed, loaded.dtype)
            return Lookup(key, source, computed, len(ids) - computed, time.perf_counter() - started, prefix)

    def holds(self, loaded: LoadedModel, token_ids: Sequence[int]) -> bool:
        """Whether the prefix of ``token_ids`` is held in memory (a :meth:`get` of it would be a hit)."""
        ids = tuple(int(t) for t in token_ids)
        with self._lock:
            entry = self._entries.get(PrefixKey.of(loaded, ids).digest)
            return entry is not None and entry.packed.token_ids == ids

    def fits(self, loaded: LoadedModel, tokens: int) -> bool:
        """Whether a prefix of ``tokens`` tokens could be held now (what :meth:`get` checks before computing)."""
        with self._lock:
            try:
                self._check_fits(self.size_of(loaded, tokens), False, "")
            except PoolBudgetError:
                return False
            return True

    def hold(self, loaded: LoadedModel, prefix: PrefixKV, name: str = "") -> None:
        """Hold ``prefix``, which the caller computed whole (in chunks, say), as :meth:`get` would have held it;
        a later ``get`` of its tokens is a hit. Nothing changes when it is already held.

        Raises:
            PoolBudgetError: as :meth:`get`.
        """
        key = PrefixKey.of(loaded, prefix.token_ids)
        with self._lock:
            if key.digest in self._entries:
                return
            self._count.misses += 1
            self._check_fits(self.size_of(loaded, prefix.length), False, name or key.digest[:12])
            self._insert(loaded, key, self.storage.pack(prefix), False, name)
            self._count.computed += prefix.length

    def _insert(self, loaded: LoadedModel, key: PrefixKey, packed: Packed, pin: bool, name: str) -> None:
        """Make room for ``packed`` (evicting in the policy's order), then hold it. Call under the lock."""
        self._make_room(packed.nbytes)
        float_bytes = STORAGES["float"]().estimate(KVShape.of(loaded.model.config), key.length, _element_size(loaded))
        self._entries[key.digest] = _Entry(key, packed, packed.nbytes, float_bytes, pin, name)
        self._policy.insert(key.digest)

    def unpin(self, key: PrefixKey) -> None:
        """Make a held entry evictable again (no-op when it is not held)."""
        with self._lock:
            if key.digest in self._entries:
                self._entries[key.digest].pinned = False

    def clear(self) -> None:
        """Drop every held entry, pinned ones included (the disk tier is untouched). Counters are kept."""
        with self._lock:
            for digest in list(self._entries):
                self._policy.remove(digest)
            self._entries.clear()

    # -- bytes kept outside the entries ---------------------------------------

    def reserve(self, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` that ``owner`` keeps outside the entries (an engine loop's slot store) in the budget,
        in place of what ``owner`` reserved before (so a store that grows or is made again reserves its new size).

        Modifies the pool: ``owner``'s reservation, and evicts unpinned entries in the policy's order (counted in
        ``evictions``) until the entries and every reservation fit in the budget. Raises before changing anything.

        Raises:
            PoolReservationError: ``nbytes`` is more than the budget less the pinned entries and the other owners'
                reservations (evicting every unpinned entry would not make room).
            ValueError: ``nbytes`` is negative.
        """
        if nbytes < 0:
            raise ValueError(f"a reservation is a byte count, got {nbytes}")
        with self._lock:
            others = self.bytes_reserved - self._reserved.get(owner, 0)
            pinned = self._pinned_bytes()
            if pinned + others + nbytes > self.config.budget_bytes:
                raise PoolReservationError(
                    f"{owner} needs {format_bytes(nbytes)} of the {format_bytes(self.config.budget_bytes)} "
                    f"{setting('cache_budget')}, but pinned prefixes hold {format_bytes(pinned)} and other "
                    f"reservations {format_bytes(others)}; raise {setting('cache_budget')}, unpin a task (pin: false), "
                    "or shorten the sequences (fewer tokens of their own, a lower max_new_tokens)"
                )
            self._reserved.pop(owner, None)
            self._make_room(nbytes)
            if nbytes:
                self._reserved[owner] = nbytes

    def release(self, owner: str) -> None:
        """Give ``owner``'s reservation back to the budget (nothing when it holds none). Modifies only that."""
        with self._lock:
            self._reserved.pop(owner, None)

    def room(self, owner: str) -> int:
        """Bytes ``owner`` could reserve now without evicting anything: the budget less the held entries and the
        other owners' reservations (``owner``'s own counts as free)."""
        with self._lock:
            others = self.bytes_reserved - self._reserved.get(owner, 0)
            return max(0, self.config.budget_bytes - self.bytes_held - others)

    # -- steps of get --------------------------------------------------------

    def _hit(self, entry: _Entry, pin: bool, started: float, loaded: LoadedModel) -> Lookup:
        self._count.hits += 1
        self._count.saved += entry.key.length
        self._policy.access(entry.key.digest)
        entry.pinned = entry.pinned or pin
        if self.store is not None:  # a use of the prefix: the disk tier's LRU clock too
            self.store.mark_used(entry.key.digest, self.storage.name)
        prefix = self.storage.unpack(entry.packed, loaded.dtype)
        return Lookup(entry.key, "memory", 0, entry.key.length, time.perf_counter() - started, prefix)

    def _check_fits(self, need: int, pin: bool, label: str) -> None:
        budget = self.config.budget_bytes
        if need > budget:
            raise PoolBudgetError(
                f"prefix {label!r} needs {format_bytes(need)} but the whole {setting('cache_budget')} is "
                f"{format_bytes(budget)}; raise {setting('cache_budget')}, use {setting('kv_storage', 'int8')}, "
                "or shorten the task's instruction and examples"
            )
        pinned, reserved = self._pinned_bytes(), self.bytes_reserved
        if pinned + reserved + need > budget:
            slots = f" and running sequences' slots {format_bytes(reserved)}" if reserved else ""
            raise PoolBudgetError(
                f"prefix {label!r} needs {format_bytes(need)} but pinned prefixes hold {format_bytes(pinned)}{slots} "
                f"of the {format_bytes(budget)} {setting('cache_budget')}; raise the budget or unpin a task (pin: false)"
            )

    def _pinned_bytes(self) -> int:
        return sum(e.nbytes for e in self._entries.values() if e.pinned)

    def _obtain(
        self, loaded: LoadedModel, key: PrefixKey, ids: tuple[int, ...], name: str, tuned: TunedPrefix | None = None
    ) -> tuple[Packed, Source, int]:
        """The packed entry for ``ids`` and how many tokens were computed. Writes the disk tier when one exists."""
        expected = Expected(key.model, key.dtype, self.storage.name, ids)
        if self.store is not None:
            read = self.store.read(key.digest, self.storage, expected, loaded.device)
            if read.packed is not None:
                self._count.disk_loads += 1
                return read.packed, "disk", 0
            if read.problem is not None:
                self._count.disk_rejected += 1
                log.warning("prefix cache file %s is %s: not used; recomputing it", read.path, read.problem)
        if tuned is not None:
            prefix, source, computed = tuned.prefix.cast(loaded.dtype, loaded.device), "tuned", 0
        else:
            prefix, source, computed = self._compute(loaded, key, ids)
        packed = self.storage.pack(prefix)
        if self.store is not None:
            self._write(key, packed, expected, name)
        return packed, source, computed

    def _compute(self, loaded: LoadedModel, key: PrefixKey, ids: tuple[int, ...]) -> tuple[PrefixKV, Source, int]:
        donor, shared = self._longest_shared(key, ids)
        if donor is None:
            return PrefixKV.build(loaded.model, ids), "computed", len(ids)
        self._count.partial_reuses += 1
        self._policy.access(donor.key.digest)
        base = self.storage.unpack(donor.packed, loaded.dtype).leading(shared)
        if shared == len(ids):
            return base.copy(), "extended", 0
        return base.extend(loaded.model, ids[shared:]), "extended", len(ids) - shared

    def _longest_shared(self, key: PrefixKey, ids: tuple[int, ...]) -> tuple[_Entry | None, int]:
        """The held entry (same model and dtype) sharing the longest leading part with ``ids``, and that length."""
        best, best_len = None, 0
        for entry in self._entries.values():
            if entry.key.model != key.model or entry.key.dtype != key.dtype or entry.key.variant or key.variant:
                continue  # a tuned prefix neither lends nor borrows a leading part
            shared = _common_length(entry.packed.token_ids, ids)
            if shared > best_len:
                best, best_len = entry, shared
        if best_len < min(self.config.min_shared_tokens, len(ids)):
            return None, 0
        return best, best_len

    def _make_room(self, need: int) -> None:
        """Evict unpinned entries in policy order until ``need`` more bytes fit beside the entries and reservations."""
        held = self.bytes_held + self.bytes_reserved
        for digest in self._policy.order():
            if held + need <= self.config.budget_bytes:
                break
            entry = self._entries[digest]
            if entry.pinned:
                continue
            del self._entries[digest]
            self._policy.remove(digest)
            self._count.evictions += 1
            held -= entry.nbytes
        if held + need > self.config.budget_bytes:  # _check_fits makes this unreachable; never exceed the budget
            budget = format_bytes(self.config.budget_bytes)
            raise PoolBudgetError(f"cannot free {format_bytes(need)} within the {budget} budget")

    def _write(self, key: PrefixKey, packed: Packed, expected: Expected, name: str) -> None:
        try:
            saved = self.store.write(key.digest, self.storage.name, packed, expected, name)
        except (OSError, CacheStoreError) as exc:
            log.warning(
                "could not write prefix %s to the cache folder %s (%s); it stays in memory only", key.digest[:12], self.store.root, exc
            )
            return
        if saved.path is None:
            log.warning(
                "prefix %s takes %s, more than the cache folder %s's whole budget of %s: not saved there; raise the "
                "folder's budget to keep it", key.digest[:12], format_bytes(saved.bytes), self.store.root,
                format_bytes(saved.budget_bytes),
            )
            return
        self._count.disk_writes += 1
        if saved.evicted:
            log.info("cache folder %s: deleted %d least recently used files to stay within its budget of %s",
                     self.store.root, len(saved.evicted), format_bytes(saved.budget_bytes))


def _element_size(loaded: LoadedModel) -> int:
    """Bytes per key/value element: the model's compute dtype."""
    return torch.empty((), dtype=loaded.dtype).element_size()


def _common_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
