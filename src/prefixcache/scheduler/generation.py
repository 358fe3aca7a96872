"""Where the engine loop's generating sequences run: a :class:`GenerationBackend`, torch's or llama.cpp's.

The engine loop (:mod:`prefixcache.scheduler.engine_loop`) schedules, cancels, samples and constrains; a backend
only holds the rows' own keys/values and computes. Its contract, one method per stage of a row's life:

* :meth:`~GenerationBackend.take`: a slot for a waiting sequence (its own keys/values, after its prefix), or None
  when it must wait for running ones to finish; raises when not even one slot of its length can ever fit;
* :meth:`~GenerationBackend.feed`: one pass over a step's feeds (new tokens of many rows, packed), over one prefix;
  one opaque output per feed, at its last new token;
* :meth:`~GenerationBackend.logits`: the next-token logits ``[b, V]`` of some of those outputs, in one call;
* :meth:`~GenerationBackend.state`: the final layer's state ``[H]`` at an output (what a fitted head reads), or
  None where the backend has none;
* :meth:`~GenerationBackend.give`: the slot back (finished, failed or cancelled);
* :meth:`~GenerationBackend.trim` and :meth:`~GenerationBackend.close`: memory back to the budget.

:class:`TorchGeneration` is the torch backend: a :class:`~prefixcache.cache.slots.SlotStore` bounded by a
:class:`~prefixcache.scheduler.slot_budget.SlotBudget`, and :func:`~prefixcache.engine.slot_pass.forward_slots`.
Its outputs are hidden states, so a row's logits and its state are exactly what the model computes alone
(invariant 5). llama.cpp's backend is :mod:`prefixcache.scheduler.llama_generation`.
"""

from __future__ import annotations

from typing import Protocol, Sequence as Seq

import torch

from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool
from ..cache.slots import Feed, SlotStore
from ..engine.slot_pass import forward_slots
from .sequence import Sequence
from .slot_budget import SlotBudget, slot_length


class GenerationBackend(Protocol):
    """What runs generating sequences under the engine loop (see the module docstring). One thread calls it."""

    name: str

    def take(self, seq: Sequence) -> int | None: ...

    def feed(self, prefix: PrefixKV, feeds: Seq[Feed]) -> list: ...

    def logits(self, outputs: list) -> torch.Tensor: ...

    def state(self, output) -> torch.Tensor | None: ...

    def give(self, slot: int) -> None: ...

    def trim(self, running: bool) -> bool: ...

    def close(self) -> None: ...


class TorchGeneration:
    """Generating rows on the torch model: slots in a :class:`SlotStore` within ``slot_bytes`` or the pool's budget
    (:class:`SlotBudget`), passes by :func:`forward_slots`, logits through the model's output head."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, slot_bytes: int, max_seqs: int, pool: PrefixPool | None = None):
        self.model, self.max_seqs = model, max_seqs
        self.store: SlotStore | None = None
        self.slot_budget = SlotBudget(model, slot_bytes, max_seqs, pool)

    def take(self, seq: Sequence) -> int | None:
        """A slot long enough for ``seq``, or None: it waits.

        The store holds as many slots as its bound allows (at most ``max_seqs``): ``slot_bytes``, or with a pool
        what the pool's budget leaves beside the held prefixes (:class:`SlotBudget`). A longer sequence grows every
        slot in place while the grown store still fits; otherwise it waits until no sequence runs, and the store
        is made again with longer, fewer slots. An idle store far longer than a sequence needs (after a long
        request) is made again at that sequence's length, with its slot count back. So the store's bytes never
        pass ``slot_bytes`` (or, with a pool, its budget), whatever a request asks for.

        Raises:
            SequenceTooLongError: (no pool) not even one slot of ``seq``'s length fits in ``slot_bytes``.
            PoolReservationError: (a pool) not even one slot fits beside the pinned prefixes and other reservations.
        """
        store = self._store_for(seq.own_tokens)
        return None if store is None else store.take()

    def _store_for(self, own_tokens: int) -> SlotStore | None:
        need = slot_length(own_tokens)
        store = self.store
        idle = store is None or store.free == store.slots
        if store is not None and store.slot_tokens >= need and not (idle and store.slot_tokens > 2 * need
                                                                    and store.slots < self.max_seqs):
            return store if store.free else None
        if store is not None and store.slot_tokens < need and self.slot_budget.grow(store, need):
            return store if store.free else None
        if not idle:
            return None
        self._drop_store()  # the old store's tensors (and its bytes in the pool) go before the new ones are made
        self.store = self.slot_budget.make(own_tokens)
        return self.store

    def feed(self, prefix: PrefixKV, feeds: Seq[Feed]) -> list[torch.Tensor]:
        """One :func:`forward_slots` pass; each feed's hidden state ``[H]`` at its last new token."""
        return list(forward_slots(self.model, prefix, self.store, feeds))  # B x [H]

    def logits(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The rows' next-token logits ``[b, V]`` through the model's output head, in one product."""
        if not outputs:
            return torch.empty(0)
        with torch.inference_mode():
            return self.model.get_output_embeddings()(torch.stack(outputs))

    def state(self, output: torch.Tensor) -> torch.Tensor:
        return output

    def give(self, slot: int) -> None:
        self.store.give(slot)

    def trim(self, running: bool) -> bool:
        """Drop an idle store of fewer than ``max_seqs`` slots (made long and few for a long sequence), giving its
        bytes back to the budget; the next generating sequence makes one at its own length. Returns whether it did."""
        store = self.store
        if store is None or running or store.free != store.slots or store.slots >= self.max_seqs:
            return False
        self._drop_store()
        return True

    def close(self) -> None:
        """Drop the slot store, giving its bytes back to the pool's budget (when there is a pool)."""
        self._drop_store()

    def _drop_store(self) -> None:
        self.store = None
        self.slot_budget.release()
