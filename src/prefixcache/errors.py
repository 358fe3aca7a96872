"""Domain errors: every failure a user can cause or fix has a type here.

Exactly one boundary (the CLI, later the HTTP app) turns these into user-facing
messages. Each message says what went wrong *and what to do next*. Set
``PREFIXCACHE_DEBUG=1`` to make the CLI re-raise instead of printing.
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
