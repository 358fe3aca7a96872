"""Errors of the HTTP layer. Each carries the HTTP status the app answers with.

They extend :class:`~prefixcache.errors.PrefixCacheError`, so the CLI boundary
prints them cleanly too (``SettingsError`` at start-up). The app turns every
``PrefixCacheError`` into a JSON ``{"detail": ...}`` body in exactly one place
(``app._error_response``).
"""

from __future__ import annotations

from ..errors import PrefixCacheError


class ServerError(PrefixCacheError):
    """Base of the HTTP layer's errors. ``status`` is the HTTP status code to answer with."""

    status = 500


class SettingsError(ServerError):
    """A server setting is out of range (raised at start-up)."""

    status = 500


class UnknownTaskError(ServerError):
    """No task of that name is registered."""

    status = 404


class WrongTaskKindError(ServerError):
    """The task exists but is of another kind than the endpoint serves (e.g. /v1/extract on a classify task)."""

    status = 422


class ItemError(ServerError):
    """One item of a request is unacceptable (too long, a field missing). ``item`` is its 0-based index."""

    status = 422

    def __init__(self, message: str, item: int | None = None):
        super().__init__(message)
        self.item = item


class RequestLimitError(ServerError):
    """The request as a whole breaks a limit (too many items)."""

    status = 422


class TaskUploadError(ServerError):
    """An uploaded task cannot be served (name mismatch, prefix too long, unsupported kind or media type)."""

    status = 422


class QueueFullError(ServerError):
    """The model's queue is full. ``retry_after`` is a whole number of seconds to wait."""

    status = 429

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(ServerError):
    """The server stopped before the request's items were run."""

    status = 503
