"""Peak resident memory of one stretch of work, sampled by psutil from a background thread.

The kernel's own high-water mark (``ru_maxrss``) only ever grows, so it cannot tell one bench lane
from the one before. :class:`PeakRSS` samples this process's resident set every few milliseconds
while its block runs, which sees any peak that lasts longer than the interval (a forward pass's
activations do; torch releases the GIL while it computes). Before it starts, freed memory the C
allocator still holds is handed back (:func:`release_freed_memory`), so the peak is the block's own.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading

import psutil

INTERVAL_S = 0.005


class PeakRSS:
    """``with PeakRSS() as peak: ...``, then ``peak.bytes`` (highest RSS seen) and ``peak.start_bytes``."""

    def __init__(self, interval_s: float = INTERVAL_S):
        self._process = psutil.Process()
        self._interval = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-rss", daemon=True)
        self.start_bytes = 0
        self.bytes = 0

    def __enter__(self) -> PeakRSS:
        release_freed_memory()
        self.start_bytes = self.bytes = self._process.memory_info().rss
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.bytes = max(self.bytes, self._process.memory_info().rss)

    def _sample(self) -> None:
        while not self._stop.wait(self._interval):
            self.bytes = max(self.bytes, self._process.memory_info().rss)


def release_freed_memory() -> None:
    """Hand memory that was freed but kept by the C allocator back to the system (glibc's ``malloc_trim``),
    so that a lane's resident peak is its own and not what the lane before it left behind. A no-op
    where the C library has no such call."""
    name = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None
    if trim is not None:
        trim(0)
