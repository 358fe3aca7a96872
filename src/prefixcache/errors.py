"""Domain errors: every failure a user can cause or fix has a type here.

This module is the one home of error types. Two boundaries turn them into user-facing answers:
the CLI (:mod:`prefixcache.cli.errors`: a message and exit code 2) and the HTTP app
(``server/app.py``: a JSON body and a status code, chosen there by type). Each message says what
went wrong *and what to do next*, in neutral terms (the library's setting names, not a CLI flag);
a boundary adds its own wording. Set ``PREFIXCACHE_DEBUG=1`` to make either re-raise instead.

Naming a setting in a message: write ``setting("cache_budget")`` or ``setting("method", "full")`` in
the text, never a flag. The contract:

* ``setting(name, value)`` returns a marker: ``name`` is the library's setting name (the CLI
  parameter's Python name, ``cache_budget``), ``value`` (optional) what to set it to.
* ``str(exc)`` is the neutral wording: ``cache_budget``, ``method="full"`` (:func:`neutral_spelling`).
* ``exc.render(spell)`` replaces each marker with ``spell(name, value)``: the CLI gives ``--method full``,
  the HTTP app a task field or a server setting. Nothing else in the text changes.
* To quote one error inside another, embed ``exc.args[0]`` (markers kept), not ``str(exc)``.

Log messages are not rendered: write them in plain words. This module imports only the standard library.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

Spelling = Callable[[str, Optional[str]], str]
"""``spell(name, value)`` -> the words a boundary shows for a setting (``value`` None: the setting itself)."""

_MARKER = re.compile("\x1f([^\x1e\x1f]+)(?:\x1e([^\x1f]*))?\x1f")  # unit and record separators: never typed


def setting(name: str, value: str | None = None) -> str:
    """A marker for the setting ``name`` (set to ``value``, if given) inside an error message."""
    return f"\x1f{name}\x1f" if value is None else f"\x1f{name}\x1e{value}\x1f"


def neutral_spelling(name: str, value: str | None = None) -> str:
    """The library's own words for a setting: ``cache_budget``, or ``method="full"`` with a value."""
    return name if value is None else f'{name}="{value}"'


class PrefixCacheError(Exception):
    """Base class of every error `prefixcache` raises on purpose.

    ``str(exc)`` names settings neutrally; :meth:`render` lets a boundary name them its own way.
    """

    def render(self, spell: Spelling) -> str:
        """The message with each :func:`setting` marker replaced by ``spell(name, value)``."""
        return _MARKER.sub(lambda m: spell(m[1], m[2]), Exception.__str__(self))

    def __str__(self) -> str:
        return self.render(neutral_spelling)


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
    """A prefix cannot fit in the prefix pool's byte budget (alone, or beside the pinned prefixes and the bytes
    reserved in it)."""


class PoolReservationError(PoolBudgetError):
    """Bytes kept outside the prefix pool's entries (an engine loop's slot store) cannot be reserved in its byte
    budget: they are more than the budget less the pinned prefixes and the other reservations."""


class CacheStoreError(PrefixCacheError):
    """The on-disk prefix store cannot be used (for example its folder is a file or not writable)."""


class ResourceError(PrefixCacheError):
    """The machine or cluster lacks what a run asks for (GPUs for the workers, say)."""


class HeadMismatchError(PrefixCacheError):
    """A fitted label head does not belong to this model, prompt, label set or feature spec.

    The message names which one differs, with what the head expects and what it found.
    """


class ConstraintError(PrefixCacheError):
    """Decoding cannot be constrained as asked: the JSON Schema is invalid, unsatisfiable or uses a keyword the
    grammar engine does not implement, or the tokenizer is not a fast one. The message says which."""


class SequenceTooLongError(PrefixCacheError):
    """A sequence needs more own-token keys/values than the engine loop's slot budget holds."""


class BackendError(PrefixCacheError):
    """A generation backend cannot run as asked (llama.cpp not built here, a model it cannot read, a call it would
    abort on). The message names the backend and what to change."""


class ExtraNotInstalledError(PrefixCacheError):
    """A feature needs an optional extra (``pip install 'prefixcache[serve]'``, say) that is not installed."""


class RayNotInstalledError(ExtraNotInstalledError):
    """A Ray run (``ray``) was asked for, but Ray is not installed here."""


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


class RequestTooLargeError(ServerError):
    """A request (or one item of it) needs more keys/values than the server's cache budget can ever hold for it,
    however idle the server: it is refused before it is queued. ``item`` (an item's index) or ``param`` (an
    OpenAI-style field) names what to shorten."""

    def __init__(self, message: str, item: int | None = None, param: str | None = None):
        super().__init__(message)
        self.item, self.param = item, param


class TaskUploadError(ServerError):
    """An uploaded task cannot be served (name mismatch, prefix too long, too many labels or examples, too many
    tasks, unsupported kind or media type)."""


class TaskTooLargeError(TaskUploadError):
    """An uploaded task's body is larger than the server takes for a task (``max_task_bytes``)."""


class ReadOnlyTaskError(ServerError):
    """A request would replace or delete a start-up task, and does not act for the operator (the admin key)."""


class QueueFullError(ServerError):
    """The model's queue is full. ``retry_after`` is a whole number of seconds to wait."""

    def __init__(self, message: str, retry_after: int):
        super().__init__(message)
        self.retry_after = retry_after


class SequenceFailedError(ServerError):
    """The engine loop could not finish one request's sequence (its engine call raised, or its constraint failed
    mid-decoding). Only that request fails; the sequences that shared its steps go on."""


class ShuttingDownError(ServerError):
    """The server stopped before the request's items were run."""


class RequestFieldError(ServerError):
    """A field of an OpenAI-style request is unsupported or out of range. ``param`` names it (``messages[2].content``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class UnknownModelError(ServerError):
    """An OpenAI-style request names a model this server does not serve."""
