"""One forward pass of a step's rows over one prefix, their own keys/values kept in a slot store.

:func:`forward_slots` feeds every row's new tokens (a whole prompt, a chunk of it, or the one token a
running row generated last step) laid end to end as one sequence, so the linear layers compute no pad;
each token's keys/values are written into its row's slot, and attention reads the shared prefix and the
row's slot (:class:`~prefixcache.cache.slots.SlotCache`). A row computes exactly what it computes alone,
whatever shares the pass: rows never see each other, and every row sees the whole prefix.

This module knows nothing about sequences, sampling or tasks: only token ids and slots.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..attention.shared_prefix import use_shared_prefix_attention
from ..cache.kv import PrefixKV
from ..cache.slots import Feed, SlotCache, SlotLayout, SlotStore


def forward_slots(model: torch.nn.Module, prefix: PrefixKV, store: SlotStore, feeds: Sequence[Feed]) -> torch.Tensor:
    """Append each feed's ids to its slot (after the prefix) in one pass; return each feed's hidden state at its
    last new token, ``[B, H]``, in ``feeds`` order.

    Raises:
        ValueError: two feeds share a slot, or a feed would write past the store's ``slot_tokens``.
    """
    needed = max(f.start + len(f.ids) for f in feeds)
    if needed > store.slot_tokens:
        raise ValueError(f"a row needs {needed} own tokens, but a slot holds {store.slot_tokens}")
    with torch.inference_mode():
        use_shared_prefix_attention(model)
        layout = SlotLayout(store, prefix.length, feeds)
        cache = SlotCache(prefix, store, layout)
        out = model.base_model(input_ids=layout.ids, position_ids=layout.positions, cache=cache, use_cache=True)
        return out.last_hidden_state[0, layout.last]  # [B, H]
