"""How a domain error reads over HTTP: the status it gets (one table, read by the app's error handler and by a
stream's error event) and how a setting named in it is spelled (:func:`http_spelling`).

The first entry an error is an instance of wins; any other error is a 500. The 5xx statuses are the server's own
faults (logged with the request id and counted in ``prefixcache_server_errors_total``, see ``middleware.py``): every
limit a client's request can break is a 4xx that names it. ``docs/server.md`` (Status) lists every path to a 5xx.

This module knows nothing about requests or routes.
"""

from __future__ import annotations

from ..errors import (
    InputError, ItemError, PoolBudgetError, PrefixCacheError, PromptError, QueueFullError, ReadOnlyTaskError,
    RequestFieldError, RequestLimitError, RequestTooLargeError, ShuttingDownError, TaskError, TaskTooLargeError,
    TaskUploadError, UnknownModelError, UnknownTaskError, WrongTaskKindError, neutral_spelling,
)

STATUS: tuple[tuple[type[PrefixCacheError] | tuple[type[PrefixCacheError], ...], int], ...] = (
    ((UnknownTaskError, UnknownModelError), 404),
    (RequestFieldError, 400),
    ((TaskTooLargeError, RequestTooLargeError), 413),  # a body, or a request's keys/values, over what the server holds
    ((WrongTaskKindError, ItemError, RequestLimitError, TaskUploadError), 422),
    (ReadOnlyTaskError, 403),
    (QueueFullError, 429),
    (ShuttingDownError, 503),  # the server stopped (or its model thread died) before the request ran
    ((TaskError, PromptError, InputError), 422),
    (PoolBudgetError, 503),  # a task's evicted prefix no longer fits beside the pinned ones: the operator's setup
)


def status_of(exc: PrefixCacheError) -> int:
    """``exc``'s HTTP status (500 for an error the table does not name: SequenceFailedError, say)."""
    return next((status for kinds, status in STATUS if isinstance(exc, kinds)), 500)


# A library setting named in an error (``errors.setting``) as an HTTP client can act on it: a field of the task
# it uploads, or a setting the server was started with (the operator's to change).
TASK_FIELDS = {"head": "head"}
SERVER_SETTINGS = {"method": "method", "cache_budget": "cache_budget_bytes", "model": "model"}


def http_spelling(name: str, value: str | None = None) -> str:
    """``head`` -> ``the task's field 'head'``; ``("method", "full")`` -> ``the server's setting method="full"``;
    a setting this server does not have keeps its neutral name and says so."""
    if name in TASK_FIELDS:
        return f"the task's field {TASK_FIELDS[name]!r}" + ("" if value is None else f' set to "{value}"')
    if name in SERVER_SETTINGS:
        return f"the server's setting {neutral_spelling(SERVER_SETTINGS[name], value)}"
    return f"{neutral_spelling(name, value)} (not a setting of this server)"
