"""Own-token keys/values of running sequences, in preallocated slots beside the read-only prefix.

A sequence that generates needs its own keys/values (its tokens after the prefix, then what it
generated) from one step to the next. :class:`SlotStore` holds them: per layer one tensor
``[slots, kv_heads, slot_tokens, head_dim]``, allocated once. A sequence takes a slot
(:meth:`SlotStore.take`), each step writes its new tokens' keys/values at their places in it, and it
gives the slot back when it finishes or is cancelled (:meth:`SlotStore.give`). Nothing is concatenated
per step, and the prefix is never copied: :class:`SlotCache` (the cache object of one forward pass)
hands each attention layer a :class:`~prefixcache.attention.shared_prefix.SharedKV` of the prefix and
the rows' slots, so every row reads ``(prefix, own slot)``.

This module knows nothing about sequences, sampling or tasks: only slots, token counts and tensors.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from ..attention.shared_prefix import OwnPart, Packing, SharedKV
from .kv import KVShape, PrefixKV


class SlotStore:
    """``slots`` slots of ``slot_tokens`` own tokens each, for every layer (zeros until written).

    Contract: :meth:`take` returns the lowest free slot (or None: all are taken); a slot's tokens ``0..n-1``
    are valid once a pass has written them; :meth:`give` makes the slot free again (its contents are then
    garbage, never read: a pass reads only the tokens its rows have written). Not thread-safe: one owner
    (the engine loop) takes, gives and writes.
    """

    def __init__(self, shape: KVShape, slots: int, slot_tokens: int, dtype: torch.dtype, device: torch.device | str):
        if slots < 1 or slot_tokens < 1:
            raise ValueError(f"a slot store needs at least one slot of one token, got {slots} x {slot_tokens}")
        self.shape, self.dtype, self.device = shape, dtype, torch.device(device)
        self.slots, self.slot_tokens = slots, slot_tokens
        size = (slots, shape.kv_heads, slot_tokens, shape.head_dim)
        self.keys = [torch.zeros(size, dtype=dtype, device=self.device) for _ in range(shape.layers)]
        self.values = [torch.zeros(size, dtype=dtype, device=self.device) for _ in range(shape.layers)]
        self._free = list(range(slots))  # a heap: the lowest free slot first, so running rows stay close together

    @classmethod
    def within(cls, shape: KVShape, budget_bytes: int, slot_tokens: int, dtype: torch.dtype, device, max_slots: int,
               ) -> SlotStore:
        """As many slots as ``budget_bytes`` holds (at most ``max_slots``, at least one).

        Raises:
            ValueError: not even one slot of ``slot_tokens`` tokens fits in ``budget_bytes``.
        """
        per_slot = shape.nbytes(slot_tokens, torch.empty((), dtype=dtype).element_size())
        if per_slot > budget_bytes:
            raise ValueError(f"one slot of {slot_tokens} tokens takes {per_slot} bytes, more than the {budget_bytes}-byte budget")
        return cls(shape, min(max_slots, budget_bytes // per_slot), slot_tokens, dtype, device)

    @property
    def nbytes(self) -> int:
        """Bytes of every slot's keys and values (all allocated up front)."""
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values))

    @property
    def element_size(self) -> int:
        return self.keys[0].element_size()

    @property
    def free(self) -> int:
        return len(self._free)

    def take(self) -> int | None:
        """The lowest free slot, now taken; None when every slot is taken."""
        return heapq.heappop(self._free) if self._free else None

    def give(self, slot: int) -> None:
        """Free ``slot``. Raises ValueError when it is not taken (a double free would hand one slot to two rows)."""
        if not 0 <= slot < self.slots or slot in self._free:
            raise ValueError(f"slot {slot} is not taken")
        heapq.heappush(self._free, slot)

    def grow(self, slot_tokens: int) -> None:
        """Make every slot hold ``slot_tokens`` tokens, keeping what is written (one copy; between steps only)."""
        if slot_tokens <= self.slot_tokens:
            return
        for tensors in (self.keys, self.values):
            for i, old in enumerate(tensors):
                new = old.new_zeros((self.slots, old.shape[1], slot_tokens, old.shape[3]))
                new[:, :, : self.slot_tokens] = old
                tensors[i] = new
        self.slot_tokens = slot_tokens


@dataclass(frozen=True)
class Feed:
    """One row of a step: ``ids`` appended to ``slot`` after the ``start`` own tokens already written there."""

    slot: int
    start: int
    ids: tuple[int, ...]


class SlotLayout:
    """Where a step's tokens go and what each may see, for one forward pass over one prefix.

    The feeds are sorted by slot; the pass reads the slots ``rows`` (a contiguous range as a view when the
    taken slots are close together, else the feeds' slots gathered), and each feed's tokens are packed in
    that order. Attributes (all tensors on the store's device):

    * ``ids`` ``[1, N]``, ``positions`` ``[1, N]`` (prefix length + own index);
    * ``dest_slot``/``dest_pos`` ``[N]``: where each token's keys/values are written;
    * ``packing``: the packed tokens placed at their row of ``rows``; ``parts``: the rows split into decoding
      rows (one token each) and prompt rows, each part's own attention unpacked to its own width
      (:class:`~prefixcache.attention.shared_prefix.OwnPart`);
    * ``last`` ``[B]``: each feed's last token in the packed order, in the feeds' given order.
    """

    def __init__(self, store: SlotStore, prefix_length: int, feeds: Sequence[Feed]):
        device = store.device
        order = sorted(range(len(feeds)), key=lambda i: feeds[i].slot)
        slots = [feeds[i].slot for i in order]
        if len(set(slots)) != len(slots):
            raise ValueError("two rows of one step share a slot")
        lo, hi = slots[0], slots[-1]
        self.contiguous = hi - lo + 1 <= 2 * len(slots)
        place = {s: s - lo for s in slots} if self.contiguous else {s: i for i, s in enumerate(slots)}
        count = hi - lo + 1 if self.contiguous else len(slots)
        self.rows = (lo, hi + 1) if self.contiguous else torch.tensor(slots, device=device)
        lengths, ends = [0] * count, [0] * count  # per placed row: new tokens, own tokens after the pass
        for i in order:
            lengths[place[feeds[i].slot]], ends[place[feeds[i].slot]] = len(feeds[i].ids), feeds[i].start + len(feeds[i].ids)
        self.width = max(ends)
        self.packing = Packing.of(lengths, device, allow_empty=True)
        starts = [f.start for f in (feeds[i] for i in order)]
        self.ids = torch.tensor([t for i in order for t in feeds[i].ids], dtype=torch.long, device=device)[None]  # [1, N]
        own = torch.tensor([s + k for s, i in zip(starts, order) for k in range(len(feeds[i].ids))], device=device)  # [N]
        self.positions = (prefix_length + own)[None]  # [1, N]
        self.dest_slot = torch.tensor([feeds[i].slot for i in order for _ in feeds[i].ids], device=device)  # [N]
        self.dest_pos = own
        self.parts = _own_parts(lengths, ends, self.packing, self.width, device)
        packed_last = torch.tensor(lengths, device=device).cumsum(0) - 1  # [R]: last packed token of each placed row
        last_of = {i: int(packed_last[place[feeds[i].slot]]) for i in order}
        self.last = torch.tensor([last_of[i] for i in range(len(feeds))], device=device)  # [B]

    def own(self, tensor: torch.Tensor) -> torch.Tensor:
        """The rows' own tokens of one layer's store tensor: ``[R, kv_heads, S, head_dim]`` (a view when contiguous)."""
        if self.contiguous:
            return tensor[self.rows[0] : self.rows[1], :, : self.width]
        return tensor.index_select(0, self.rows)[:, :, : self.width]


def _own_parts(lengths: list[int], ends: list[int], packing: Packing, span: int, device) -> tuple[OwnPart, ...]:
    """The step's placed rows as parts of like length: one part when every row feeds one token (or every row
    feeds several); else rows feeding one token (all rows read, the others padded out, so no keys are gathered)
    and rows feeding several (their keys gathered)."""
    many = [r for r, n in enumerate(lengths) if n > 1]
    if not many or len(many) == sum(1 for n in lengths if n):
        return (OwnPart(None, None, packing, _own_mask(lengths, ends, packing.width, span, device)),)
    starts = [0] + list(itertools.accumulate(lengths))[:-1]  # each placed row's first token in the packed order
    one = [1 if n == 1 else 0 for n in lengths]
    decoding = OwnPart(torch.tensor([starts[r] for r, n in enumerate(lengths) if n == 1], device=device), None,
                       Packing.of(one, device, allow_empty=True), _own_mask(one, ends, 1, span, device))
    long = [lengths[r] for r in many]
    prompts = OwnPart(torch.tensor([starts[r] + k for r in many for k in range(lengths[r])], device=device),
                      torch.tensor(many, device=device), Packing.of(long, device),
                      _own_mask(long, [ends[r] for r in many], max(long), span, device))
    return decoding, prompts


def _own_mask(lengths: list[int], ends: list[int], width: int, span: int, device) -> torch.Tensor:
    """``[R, 1, T, S]``: query ``t`` of a row that writes ``n`` tokens ending at own index ``e`` sees own tokens
    ``0 .. e - n + t``; its pads (and rows with no tokens) see what the row holds (at least token 0), so no
    query is left with nothing to attend to."""
    n = torch.tensor(lengths, device=device)[:, None]  # [R, 1]
    e = torch.tensor(ends, device=device)[:, None]
    t = torch.arange(width, device=device)[None, :]  # [1, T]
    reach = torch.where(t < n, e - n + t, (e - 1).clamp(min=0))  # [R, T]: the last own index each query sees
    return (torch.arange(span, device=device)[None, None, :] <= reach[:, :, None])[:, None]  # [R, 1, T, S]


class _SlotLayer:
    """One layer of a :class:`SlotCache`: writes the step's keys/values into the store, hands (prefix, slots) on."""

    is_croppable = False

    def __init__(self, index: int, prefix: PrefixKV, store: SlotStore, layout: SlotLayout):
        self.index, self.store, self.layout = index, store, layout
        self.prefix_keys, self.prefix_values = prefix.keys[index], prefix.values[index]  # [1, kv, P, d], read only
        self.device = store.device

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        # key_states: [1, kv_heads, N, head_dim], the step's tokens packed
        layout, keys, values = self.layout, self.store.keys[self.index], self.store.values[self.index]
        keys[layout.dest_slot, :, layout.dest_pos] = key_states[0].transpose(0, 1)  # [N, kv, d] into their places
        values[layout.dest_slot, :, layout.dest_pos] = value_states[0].transpose(0, 1)
        own_k, own_v = layout.own(keys), layout.own(values)  # [R, kv, S, d]
        return (SharedKV(self.prefix_keys, own_k, layout.packing, layout.parts),
                SharedKV(self.prefix_values, own_v, layout.packing, layout.parts))

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2]


class _PlainSlotCache:
    """The cache object of one step's forward pass over one prefix: the prefix by reference, own tokens in slots.
    Plain for the lean decoder; :func:`SlotCache` makes it a transformers ``Cache`` too once transformers is loaded
    (as :meth:`PrefixKV.fork` does), so the lean path never imports transformers."""

    def __init__(self, layers: list[_SlotLayer]):
        self.layers = layers

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].get_seq_length()


def SlotCache(prefix: PrefixKV, store: SlotStore, layout: SlotLayout):  # noqa: N802 (a class, built per kind)
    """One step's cache over ``prefix`` and the ``store``'s slots placed by ``layout``."""
    layer_class, cache_class = _slot_classes("transformers" in sys.modules)
    return cache_class([layer_class(i, prefix, store, layout) for i in range(len(prefix.keys))])


@functools.cache
def _slot_classes(transformers_loaded: bool) -> tuple[type, type]:
    if not transformers_loaded:
        return _SlotLayer, _PlainSlotCache
    from transformers.cache_utils import Cache, DynamicLayer

    class TransformersSlotLayer(_SlotLayer, DynamicLayer):
        def __init__(self, *args, **kwargs):
            DynamicLayer.__init__(self)
            _SlotLayer.__init__(self, *args, **kwargs)

    class TransformersSlotCache(_PlainSlotCache, Cache):
        def __init__(self, layers: list[_SlotLayer]):
            Cache.__init__(self, layers=layers)

    return TransformersSlotLayer, TransformersSlotCache
