"""What the cache budget can ever hold for one request's own keys and values, checked before any work is spent.

A generating sequence (an extraction item, an OpenAI completion) keeps its own keys/values in a slot of the engine
loop's store, and that store counts in the prefix pool's byte budget beside the prefixes
(:mod:`prefixcache.scheduler.slot_budget`). Unpinned prefixes are evicted to make room for one slot, pinned ones
never, and only the operator's start-up tasks pin. So the most one sequence can ever hold is the budget less the
pinned prefixes, however idle the server is: a request whose slot needs more could never run. :class:`KVRoom`
refuses it on the prep thread, before it is queued, with
:class:`~prefixcache.errors.RequestTooLargeError` (HTTP 413), naming the limit and what the client (a shorter
prompt or item, a lower ``max_tokens``) or the operator (``cache_budget``) can change.

Counted as the engine loop counts a slot: the sequence's own tokens that may ever be written (its prompt part and
every generated token but the last), rounded up to the slot length (:func:`~prefixcache.scheduler.slot_budget.slot_length`).
For an OpenAI request that is the whole prompt: its reusable part may be held in the pool, but that entry and the
slot share the same budget, so the prompt and its output must fit together either way. Scoring sequences
(classification, guided choice) take no slot, and are bounded by the item and prompt limits alone.

Thread-safe for readers: ``pinned_bytes`` is written on the event loop's thread (as start-up tasks come and go)
and read, as one integer, on the prep threads. This module knows nothing about HTTP.
"""

from __future__ import annotations

import torch

from ..cache.config import format_bytes
from ..cache.kv import KVShape
from ..errors import RequestTooLargeError, setting
from ..scheduler.slot_budget import SLOT_ROUND, slot_length


class KVRoom:
    """The bytes one sequence's slot may take under ``budget_bytes`` over ``model`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, budget_bytes: int, token_cap: int | None = None):
        self.budget_bytes, self.token_cap = budget_bytes, token_cap
        self.per_token = KVShape.of(model.config).nbytes(1, next(model.parameters()).element_size())
        self.pinned_bytes = 0  # bytes of the pinned prefixes (the service keeps it up to date)

    @property
    def room(self) -> int:
        """Bytes one slot may take: the budget less the pinned prefixes."""
        return max(0, self.budget_bytes - self.pinned_bytes)

    @property
    def most_tokens(self) -> int:
        """The most own tokens one sequence can have (a whole number of slot rounds), and at most ``token_cap``
        (the cells of a llama.cpp context, which hold a row and its prefix together), where there is one."""
        most = self.room // self.per_token // SLOT_ROUND * SLOT_ROUND
        return most if self.token_cap is None else min(most, self.token_cap)

    def need(self, own_tokens: int) -> int:
        """Bytes of the slot a sequence with ``own_tokens`` own tokens takes."""
        return slot_length(own_tokens) * self.per_token

    def check_prompt(self, prompt_tokens: int, max_tokens: int, param: str) -> None:
        """An OpenAI-style request: its prompt and ``max_tokens`` (the prompt part of it named by ``param``).

        Raises:
            RequestTooLargeError: naming ``param``, the limit, and what to change.
        """
        own = prompt_tokens + max_tokens - 1
        if own <= self.most_tokens:
            return
        raise RequestTooLargeError(
            f"the prompt's {prompt_tokens} tokens and max_tokens={max_tokens} need {format_bytes(self.need(own))} of "
            f"keys/values, more than this server can hold for one request: {self._limit()}; shorten the prompt or "
            f"lower max_tokens so that they add up to at most {self.most_tokens} tokens (or ask the server's operator "
            f"to raise {setting('cache_budget')})", param=param)

    def check_item(self, index: int, item_id, item_tokens: int, max_new_tokens: int) -> None:
        """An extraction item: ``item_tokens`` of its own and up to ``max_new_tokens`` generated.

        Raises:
            RequestTooLargeError: naming the item, the limit, and what to change.
        """
        own = item_tokens + max_new_tokens - 1
        if own <= self.most_tokens:
            return
        raise RequestTooLargeError(
            f"item {index} (id {item_id!r}): its {item_tokens} tokens and the task's max_new_tokens={max_new_tokens} "
            f"need {format_bytes(self.need(own))} of keys/values, more than this server can hold for one item: "
            f"{self._limit()}; shorten or split it (or ask the server's operator to raise {setting('cache_budget')})",
            item=index)

    def _limit(self) -> str:
        pinned = f" less {format_bytes(self.pinned_bytes)} of pinned prefixes" if self.pinned_bytes else ""
        return (f"{setting('cache_budget')} ({format_bytes(self.budget_bytes)}){pinned} holds the keys/values of "
                f"{self.most_tokens} tokens")
