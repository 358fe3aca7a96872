"""Eviction policies of the prefix pool: which unpinned entry leaves first when the budget is full.

A registry (:data:`POLICIES`) feeds the CLI's ``--eviction`` choices. This module knows nothing about
tensors or models: the pool hands it opaque keys under its lock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from typing import ClassVar


class EvictionPolicy(ABC):
    """Orders entries for eviction. The pool calls it under its lock and skips pinned entries itself.

    Contract: every key given to ``insert`` is in ``order()`` until ``remove``; ``order()``
    lists the first to evict first.
    """

    name: ClassVar[str]

    @abstractmethod
    def insert(self, key: str) -> None: ...

    @abstractmethod
    def access(self, key: str) -> None: ...

    @abstractmethod
    def remove(self, key: str) -> None: ...

    @abstractmethod
    def order(self) -> list[str]: ...


class LRUPolicy(EvictionPolicy):
    """Least recently used first."""

    name = "lru"

    def __init__(self):
        self._recent: OrderedDict[str, None] = OrderedDict()  # oldest first

    def insert(self, key: str) -> None:
        self._recent[key] = None
        self._recent.move_to_end(key)

    def access(self, key: str) -> None:
        self._recent.move_to_end(key)

    def remove(self, key: str) -> None:
        self._recent.pop(key, None)

    def order(self) -> list[str]:
        return list(self._recent)


class LFUPolicy(EvictionPolicy):
    """Least frequently used first; among equal counts, least recently used first.

    Inserting counts as the first use. Counts are forgotten when an entry leaves.
    """

    name = "lfu"

    def __init__(self):
        self._uses: dict[str, tuple[int, int]] = {}  # key -> (count, last tick)
        self._tick = 0

    def _touch(self, key: str, count: int) -> None:
        self._tick += 1
        self._uses[key] = (count, self._tick)

    def insert(self, key: str) -> None:
        self._touch(key, 1)

    def access(self, key: str) -> None:
        self._touch(key, self._uses[key][0] + 1)

    def remove(self, key: str) -> None:
        self._uses.pop(key, None)

    def order(self) -> list[str]:
        return sorted(self._uses, key=self._uses.__getitem__)


POLICIES: dict[str, type[EvictionPolicy]] = {cls.name: cls for cls in (LRUPolicy, LFUPolicy)}
"""``--eviction`` name -> policy class."""
