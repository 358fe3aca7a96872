"""What bounds the engine loop's slot store (:class:`SlotBudget`): its own ``slot_bytes``, or the prefix pool's budget.

Without a pool, ``LoopConfig.slot_bytes`` bounds the store, as its own budget. With a
:class:`~prefixcache.cache.pool.PrefixPool`, the pool's byte budget bounds prefixes and slots together:

* a store is sized from what the budget leaves beside the held prefixes and other reservations
  (:meth:`PrefixPool.room <prefixcache.cache.pool.PrefixPool.room>`): at most ``max_slots`` slots, at least one;
  for that one slot unpinned prefixes are evicted, and when even that cannot fit beside the pinned prefixes the
  pool refuses it (:class:`~prefixcache.errors.PoolReservationError`);
* its bytes are reserved in the pool (:meth:`PrefixPool.reserve <prefixcache.cache.pool.PrefixPool.reserve>`), so
  the pool's ``reserved_bytes`` counts them and later prefixes evict others to make room beside them;
* a store grows in place only into what the budget leaves (evicting nothing), through the same reservation;
* the reservation is released when the store is dropped (:meth:`SlotBudget.release`; also when the budget object
  is garbage-collected, so a loop dropped without closing gives its bytes back).

This module knows nothing about sequences or scheduling: only slot lengths, byte counts and the store.
"""

from __future__ import annotations

import itertools
import weakref

import torch

from ..cache.kv import KVShape
from ..cache.pool import PrefixPool
from ..cache.slots import SlotStore
from ..errors import SequenceTooLongError

SLOT_ROUND = 64  # slot lengths are rounded up to this many tokens, so a slightly longer record does not regrow
_OWNERS = itertools.count(1)  # numbers the loops' reservations in a pool


def slot_length(own_tokens: int) -> int:
    """The slot length (tokens) a sequence with ``own_tokens`` tokens of its own gets: rounded up to SLOT_ROUND."""
    return -(-own_tokens // SLOT_ROUND) * SLOT_ROUND


class SlotBudget:
    """The bound of one loop's slot store over ``model``: ``slot_bytes``, or ``pool``'s budget (see the module
    docstring). The model is read (shape, dtype, device) only when a store is sized, so a loop over no model
    (one that only scores) never touches it. Not thread-safe: the loop's one thread calls it."""

    def __init__(self, model: torch.nn.Module | None, slot_bytes: int, max_slots: int, pool: PrefixPool | None = None):
        self.model, self.slot_bytes, self.max_slots, self.pool = model, slot_bytes, max_slots, pool
        self.owner = f"engine loop {next(_OWNERS)}'s slot store"  # its reservation's name in the pool
        if pool is not None:
            weakref.finalize(self, pool.release, self.owner)

    @property
    def shape(self) -> KVShape:
        return KVShape.of(self.model.config)

    def per_slot(self, slot_tokens: int) -> int:
        """Bytes of one slot of ``slot_tokens`` tokens (keys and values, every layer)."""
        return self.shape.nbytes(slot_tokens, next(self.model.parameters()).element_size())

    def make(self, own_tokens: int) -> SlotStore:
        """A new store whose slots hold ``own_tokens`` tokens (rounded up), as many as the bound holds (at most
        ``max_slots``, at least one); with a pool, its bytes reserved there. Drop the old store first (its tensors
        and reservation go before the new ones are made).

        Raises:
            SequenceTooLongError: (no pool) one slot is larger than ``slot_bytes``.
            PoolReservationError: (a pool) one slot does not fit beside the pinned prefixes and other reservations.
        """
        tokens = slot_length(own_tokens)
        per_slot = self.per_slot(tokens)
        param = next(self.model.parameters())
        if self.pool is None:
            if per_slot > self.slot_bytes:
                raise SequenceTooLongError(
                    f"{own_tokens} tokens of its own need {per_slot} bytes of keys/values, more than this loop's "
                    f"{self.slot_bytes}-byte slot budget; shorten it or lower max_new_tokens")
            return SlotStore.within(self.shape, self.slot_bytes, tokens, param.dtype, param.device, self.max_slots)
        slots = max(1, min(self.max_slots, self.pool.room(self.owner) // per_slot))
        self.pool.reserve(self.owner, slots * per_slot)
        try:
            return SlotStore(self.shape, slots, tokens, param.dtype, param.device)
        except BaseException:  # not made (out of memory, say): nothing is held
            self.pool.release(self.owner)
            raise

    def grow(self, store: SlotStore, slot_tokens: int) -> bool:
        """Grow every slot of ``store`` to ``slot_tokens`` in place when the grown store fits: within
        ``slot_bytes``, or (a pool) within what its budget leaves, evicting nothing, the reservation taking the new
        size. False when it does not fit (nothing changed)."""
        grown = self.per_slot(slot_tokens) * store.slots
        if grown > (self.slot_bytes if self.pool is None else self.pool.room(self.owner)):
            return False
        if self.pool is not None:
            self.pool.reserve(self.owner, grown)
        store.grow(slot_tokens)
        return True

    def release(self) -> None:
        """The dropped store's bytes back to the pool's budget (nothing without a pool, or when none are held)."""
        if self.pool is not None:
            self.pool.release(self.owner)
