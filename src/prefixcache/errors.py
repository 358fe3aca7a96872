"""Domain errors: every failure a user can cause or fix has a type here.

This module is the one home of error types. Two boundaries turn them into user-facing answers:
the CLI (:mod:`prefixcache.cli.boundary`: a message and exit code 2) and the HTTP app
(``server/app.py``: a JSON body and a status code, chosen there by type). Each message says what
went wrong *and what to do next*, in neutral terms (the library's setting names, not a CLI flag);
a boundary adds its own wording. Set ``PREFIXCACHE_DEBUG=1`` to make either re-raise instead.
"""

from __future__ import annotations


class PrefixCacheError(Exception):
    """Base class of every error `prefixcache` raises on purpose."""


class TaskError(PrefixCacheError):
    """A task file is invalid. The message names the file, the line and the field."""


class ModelNotFoundError(PrefixCacheError):
    """A model spec could not be resolved to weights on this machine."""


class PromptError(PrefixCacheError):
    """A task cannot be rendered into a prefix and a suffix for this tokenizer."""


class LabelCollisionError(PromptError):
    """Two labels share their first token, so ``first-token`` scoring cannot tell them apart."""


class InputError(PrefixCacheError):
    """A record or an input file is bad. The message names the record and the field."""


class ContextOverflowError(InputError):
    """A record's prompt does not fit the model's context (under the ``error`` overflow policy)."""


class VerificationError(PrefixCacheError):
    """The cached path disagreed with full re-encoding."""


class PoolBudgetError(PrefixCacheError):
    """A prefix cannot fit in the prefix pool's byte budget (alone, or beside the pinned prefixes)."""


class CacheStoreError(PrefixCacheError):
    """The on-disk prefix store cannot be used (for example its folder is a file or not writable)."""


class ResourceError(PrefixCacheError):
    """The machine or cluster lacks what a run asks for (GPUs for the workers, say)."""


class HeadMismatchError(PrefixCacheError):
    """A fitted label head does not belong to this model, prompt, label set or feature spec.

    The message names which one differs, with what the head expects and what it found.
    """


class ExtraNotInstalledError(PrefixCacheError):
    """A feature needs an optional extra (``pip install 'prefixcache[serve]'``, say) that is not installed."""


class RayNotInstalledError(ExtraNotInstalledError):
    """``--ray`` was asked for, but Ray is not installed here."""


# --- the HTTP service's errors (their status codes are the app's: ``server/app.py``) ------------------------


class ServerError(PrefixCacheError):
    """Base of the HTTP service's errors."""


class SettingsError(ServerError):
    """A server setting is out of range (raised at start-up)."""


class UnknownTaskError(ServerError):
    """No task of that name is registered."""


class WrongTaskKindError(ServerError):
    """The task exists but is of another kind than the endpoint serves (e.g. /v1/extract on a classify task)."""


class ItemError(ServerError):
    """One item of a request is unacceptable (too long, a field missing). ``item`` is its 0-based index."""

    def __init__(self, message: str, item: int | None = None):
        super().__init__(message)
        self.item = item


class RequestLimitError(ServerError):
    """The request as a whole breaks a limit (too many items)."""


class TaskUploadError(ServerError):
    """An uploaded task cannot be served (name mismatch, prefix too long, unsupported kind or media type)."""


class QueueFullError(ServerError):
    """The model's queue is full. ``retry_after`` is a whole number of seconds to wait."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class ShuttingDownError(ServerError):
    """The server stopped before the request's items were run."""
