"""How a prefix pool behaves (:class:`PoolConfig`) and byte sizes (``256MB``), without torch.

The CLI, the server settings and the Ray workers read the pool's defaults from here, so none of them
imports the engine to show ``--help``. The storage names are those of
:data:`prefixcache.cache.layouts.STORAGES` (a test keeps them equal).
"""

from __future__ import annotations

from dataclasses import dataclass

from .eviction import POLICIES

STORAGE_NAMES = ("float", "int8")  # the keys of cache/layouts.py's STORAGES


@dataclass(frozen=True)
class PoolConfig:
    """How a pool behaves. CLI defaults are read from here.

    Attributes:
        budget_bytes: most bytes the held entries may take together.
        eviction: a key of :data:`POLICIES`.
        storage: a key of :data:`~prefixcache.cache.layouts.STORAGES` (:data:`STORAGE_NAMES`).
        min_shared_tokens: shortest leading part worth reusing from another entry.
    """

    budget_bytes: int = 256 * 2**20
    eviction: str = "lru"
    storage: str = "float"
    min_shared_tokens: int = 8

    def __post_init__(self):
        if self.budget_bytes < 1:
            raise ValueError("budget_bytes must be positive")
        if self.eviction not in POLICIES:
            raise ValueError(f"eviction must be one of {', '.join(POLICIES)}, not {self.eviction!r}")
        if self.storage not in STORAGE_NAMES:
            raise ValueError(f"storage must be one of {', '.join(STORAGE_NAMES)}, not {self.storage!r}")



_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "kib": 2**10,
    "m": 10**6, "mb": 10**6, "mib": 2**20,
    "g": 10**9, "gb": 10**9, "gib": 2**30,
}


def parse_bytes(text: str) -> int:
    """``"256MB"`` -> 256_000_000, ``"1.5GiB"``, ``"4096"``. Decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units.

    Raises:
        ValueError: not a positive size.
    """
    raw = text.strip().lower().replace(" ", "").replace("_", "")
    number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = raw[len(number):]
    if unit not in _UNITS or not number:
        raise ValueError(f"not a size: {text!r} (examples: 256MB, 1.5GiB, 4096)")
    value = float(number) * _UNITS[unit]
    if value < 1:
        raise ValueError(f"a size must be at least 1 byte, not {text!r}")
    return int(value)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"
