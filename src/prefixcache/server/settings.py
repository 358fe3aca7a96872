"""Server settings: one frozen dataclass, the single source of every limit and default.

The CLI's ``serve`` options read their defaults from here.
The two keys are never command-line flags (they would show in ``ps``): they come
from ``PREFIXCACHE_API_KEY`` (the client key) and ``PREFIXCACHE_ADMIN_KEY`` (the
admin key) through :meth:`ServerSettings.from_env`, and are never printed or logged.

This module imports nothing heavy, so the CLI can read it without FastAPI.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from ..errors import SettingsError
from ..cache.config import PoolConfig
from ..types import BACKENDS

API_KEY_ENV = "PREFIXCACHE_API_KEY"
ADMIN_KEY_ENV = "PREFIXCACHE_ADMIN_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's
DEFAULT_LOG_LEVEL = "info"


@dataclass(frozen=True)
class ServerSettings:
    """Limits and scheduling knobs of one server.

    Attributes:
        host, port: where ``serve`` listens (loopback by default; port 0 picks a free one).
        max_batch: most sequences (items and requests) in one step of the engine loop.
        max_step_tokens: most tokens one step feeds (new items' own tokens and running sequences' next ones): a
            long prompt is fed in chunks of at most this many, so what shares the loop keeps its turn.
        max_queue: most items in progress (being tokenized, queued or running; all tasks together); more gets 429.
        max_queue_per_client: most items in progress for one client (the HTTP app tells clients apart by their
            role and address); more gets 429 even while ``max_queue`` has room. None (the default) means half of
            ``max_queue``, but at least ``max_items``: see :attr:`client_share`. At least ``max_items`` (a
            request of ``max_items`` must fit) and at most ``max_queue``.
        max_items: most items in one request (422 above it).
        max_item_tokens: most tokens of one item's own part of the prompt (422 naming the item).
        max_body_bytes: largest request body accepted (413 above it).
        max_prefix_tokens: largest prefix an uploaded task may have (422 above it); start-up tasks are not limited.
        max_task_bytes: largest task upload body (``PUT /v1/tasks/{name}``; 413 above it), checked before it is parsed.
        max_labels: most labels (of an extraction task: fields) an uploaded task may have (422 above it), and
            max_examples: most examples (``examples`` and ``example_pool`` together); both are counted on the
            parsed YAML, before the task is validated.
        max_tasks: most tasks registered at once, start-up tasks included. A new task beyond it gets 422
            (replacing a registered one is allowed); more start-up tasks than this is a SettingsError.
            Each task's prefix lives in the pool, so this bounds the runners, not prefix memory, which
            ``cache_budget_bytes`` does.
        max_choice_chars: longest ``guided_choice`` choice (or completion choice) in characters (400 naming it
            above it): whole choices are scored token by token, so their length is the request's cost.
        max_choice_tokens: most tokens of a request's choices together (400 above it).
        cache_budget_bytes: byte budget of the prefix pool that holds every task's prefix (least recently
            used prefixes are evicted, and rebuilt on their next use, to stay within it; the default is
            :class:`~prefixcache.cache.config.PoolConfig`'s, 256 MiB).
        method: label scoring method for every task (``auto``, ``first-token``, ``full``).
        backend: what runs generating requests (``auto``, ``torch``, ``llama.cpp``:
            :mod:`prefixcache.scheduler.backend_choice`); scoring runs on torch whatever it is.
        api_key: the client key. When set, every endpoint but ``/healthz`` and the static page needs
            ``Authorization: Bearer <api_key>`` (or the admin key). Never printed (``repr=False``).
        admin_key: the admin key (the operator's). When set, registering, replacing and deleting tasks
            (``PUT``/``DELETE /v1/tasks/{name}``) and ``GET /metrics`` need it (the client key gets 403
            there), and only it may replace or delete a start-up task; it also works wherever the client
            key does. Unset, start-up tasks cannot be replaced or deleted through the API at all.
            Never printed (``repr=False``); must differ from ``api_key``.
    """

    host: str = "127.0.0.1"
    port: int = 8000
    max_batch: int = 32
    max_step_tokens: int = 512
    max_queue: int = 1024
    max_queue_per_client: int | None = None
    max_items: int = 256
    max_item_tokens: int = 512
    max_body_bytes: int = 1 << 20
    max_prefix_tokens: int = 8192
    max_task_bytes: int = 256 * 1024
    max_labels: int = 1000
    max_examples: int = 1000
    max_tasks: int = 100
    max_choice_chars: int = 200
    max_choice_tokens: int = 2048
    cache_budget_bytes: int = PoolConfig.budget_bytes
    method: str = "auto"
    backend: str = "auto"
    api_key: str | None = field(default=None, repr=False)
    admin_key: str | None = field(default=None, repr=False)

    def __post_init__(self):
        for name in ("max_batch", "max_step_tokens", "max_queue", "max_items", "max_item_tokens", "max_body_bytes", "max_prefix_tokens",
                     "max_task_bytes", "max_labels", "max_examples", "max_tasks", "max_choice_chars", "max_choice_tokens",
                     "cache_budget_bytes"):
            if getattr(self, name) < 1:
                raise SettingsError(f"{name} must be at least 1, not {getattr(self, name)}")
        if self.backend not in BACKENDS:
            raise SettingsError(f"backend must be one of {', '.join(BACKENDS)}, not {self.backend!r}")
        if not 0 <= self.port <= 65535:
            raise SettingsError(f"port must be between 0 and 65535, not {self.port}")
        if self.max_items > self.max_queue:
            raise SettingsError(
                f"max_items ({self.max_items}) exceeds max_queue ({self.max_queue}): such a request could never be queued"
            )
        share = self.max_queue_per_client
        if share is not None and not self.max_items <= share <= self.max_queue:
            raise SettingsError(
                f"max_queue_per_client ({share}) must be between max_items ({self.max_items}) and max_queue "
                f"({self.max_queue}): below max_items a full request could never be queued"
            )
        for env, key in ((API_KEY_ENV, self.api_key), (ADMIN_KEY_ENV, self.admin_key)):
            if key is not None and not key.strip():
                raise SettingsError(f"{env} is set but empty; unset it or give it a value")
        if self.admin_key is not None and self.admin_key == self.api_key:
            raise SettingsError(f"{ADMIN_KEY_ENV} and {API_KEY_ENV} must differ: a client holding the one key would be admin")

    @property
    def client_share(self) -> int:
        """Most items one client may have in progress: ``max_queue_per_client``, or by default
        half of ``max_queue`` but at least ``max_items``."""
        if self.max_queue_per_client is not None:
            return self.max_queue_per_client
        return max(self.max_items, self.max_queue // 2)

    @classmethod
    def from_env(cls, **overrides) -> ServerSettings:
        """Settings with ``overrides`` (``None`` values are ignored) and both keys from the environment."""
        given = {k: v for k, v in overrides.items() if v is not None}
        unknown = set(given) - {f.name for f in fields(cls)}
        if unknown:
            raise SettingsError(f"unknown server settings: {', '.join(sorted(unknown))}")
        given.setdefault("api_key", os.environ.get(API_KEY_ENV) or None)
        given.setdefault("admin_key", os.environ.get(ADMIN_KEY_ENV) or None)
        return cls(**given)

    def with_(self, **changes) -> ServerSettings:
        return replace(self, **changes)


DEFAULTS = ServerSettings()
