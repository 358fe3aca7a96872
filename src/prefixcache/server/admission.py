"""Admission: room for a request's items, held from before tokenization until its answer (or, for a request
whose client went away, until its sequences have left the engine loop).

At most ``max_queue`` items (all clients) may be admitted and not yet answered, and at most
``settings.client_share`` of them for one named client (``client``: whatever the caller names it by; the HTTP
app passes its role and address, see ``middleware.CLIENT``). A request that does not fit is refused whole, at
once, with :class:`~prefixcache.errors.QueueFullError` (HTTP 429), before any work is spent on it, with a
``Retry-After`` from the recent rate. Items admitted without a client (``client=None``) count against
``max_queue`` only.

Used on the event loop's thread only. This module knows nothing about HTTP or the model.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

from ..errors import QueueFullError
from .prometheus import Metrics
from .settings import ServerSettings


class Hold:
    """The room one admitted request holds: ``count`` items of ``client``, given back once."""

    def __init__(self, admission: "Admission", count: int, client: Hashable | None):
        self._admission, self._count, self._client = admission, count, client
        self.released = False
        self.deferred = False

    def release(self) -> None:
        """Give the room back (again: nothing)."""
        if not self.released:
            self.released = True
            self._admission._hold(self._client, -self._count)

    def defer(self) -> Callable[[], None]:
        """Keep the room past the end of ``admit``'s block; the caller gives it back with what this returns."""
        self.deferred = True
        return self.release


class Admission:
    """The counts of items in progress, in all and per client, and the rule that bounds them."""

    def __init__(self, settings: ServerSettings, metrics: Metrics):
        self._max_queue = settings.max_queue
        self._client_share = settings.client_share
        self._metrics = metrics
        self._admitted = 0  # admitted and not yet answered (preparing, queued or running)
        self._admitted_by: dict[Hashable, int] = {}  # the same, per named client (absent: none)

    @property
    def in_progress(self) -> int:
        return self._admitted

    @contextmanager
    def admit(self, count: int, client: Hashable | None = None) -> Iterator[Hold]:
        """Hold room for ``count`` items of ``client`` while the request is prepared, queued and run.

        The block gets the :class:`Hold`; the room is given back when the block ends, unless the hold was
        deferred in it (a cancelled request whose sequences still run), and then by whoever deferred it.

        The room is under ``max_queue`` (all clients) and, for a named ``client``, under
        ``client_share`` (that client's items in progress); ``client=None`` is bound by ``max_queue`` only.

        Raises:
            QueueFullError: the room is not there; nothing was reserved.
        """
        self._reserve(count, client)
        hold = Hold(self, count, client)
        try:
            yield hold
        finally:
            if not hold.deferred:
                hold.release()

    def _reserve(self, count: int, client: Hashable | None) -> None:
        """:meth:`admit`'s check and hold (undecorated, so that it is in reach of mutation testing)."""
        held = self._admitted_by.get(client, 0) if client is not None else 0
        if client is not None and held + count > self._client_share:
            self._refuse(f"this client has {held} items in progress and one client may have at most "
                         f"{self._client_share}; retry later", held + count - self._client_share)
        if self._admitted + count > self._max_queue:
            self._refuse(f"{self._admitted} items are in progress and at most {self._max_queue} may be; retry later",
                         self._admitted + count - self._max_queue)
        self._hold(client, count)

    def _refuse(self, message: str, over: int) -> None:
        self._metrics.queue_rejections.inc()
        raise QueueFullError(message, retry_after=self._retry_after(over))

    def _hold(self, client: Hashable | None, count: int) -> None:
        """Add ``count`` (negative: give back) to the items in progress, in all and for ``client``."""
        self._admitted += count
        self._metrics.in_progress.set(self._admitted)
        if client is not None:
            held = self._admitted_by.get(client, 0) + count
            if held:
                self._admitted_by[client] = held
            else:
                del self._admitted_by[client]

    def _retry_after(self, over: int) -> int:
        """Seconds until ``over`` more items have likely been answered, from the recent rate (1 to 60)."""
        rate = self._metrics.items_per_second()
        if rate <= 0:
            return 1
        return max(1, min(60, math.ceil(over / rate) + 1))
