"""What label scoring needs from a set of labels: each label's tokens, and which method can tell them apart.

:class:`LabelSet` is shared by a task's :class:`~prefixcache.task.prompt.Prompt` and the choices of an
OpenAI-style request (:class:`~prefixcache.task.chat.Choices`): both map each label to the tokens that
would follow the prompt, and the scoring engine (``engine/scoring.py``) reads nothing else.

This module knows nothing about models or caches: only token ids.
"""

from __future__ import annotations

from ..errors import LabelCollisionError, PromptError, setting
from ..types import METHODS


class LabelSet:
    """A mixin over ``label_ids: dict[str, tuple[int, ...]]`` (each label's tokens, in label order)."""

    label_ids: dict[str, tuple[int, ...]]

    def first_token_ids(self) -> list[int]:
        return [ids[0] for ids in self.label_ids.values()]

    def resolve_method(self, method: str) -> str:
        """``auto`` becomes ``first-token`` unless two labels share a first token, then ``full``.

        Raises:
            PromptError: ``method`` is not one of :data:`~prefixcache.types.METHODS`.
            LabelCollisionError: ``first-token`` was asked for but two labels share a first token.
        """
        if method not in METHODS:
            raise PromptError(f"scoring method must be one of {METHODS}, not {method!r}")
        collision = self.first_token_collision()
        if method == "auto":
            return "full" if collision else "first-token"
        if method == "first-token" and collision:
            a, b, token = collision
            raise LabelCollisionError(
                f"labels {a!r} and {b!r} both start with token {token}; first-token scoring cannot tell them "
                f"apart. Use {setting('method', 'full')}, or rename one label."
            )
        return method

    def first_token_collision(self) -> tuple[str, str, int] | None:
        """The first two labels that start with the same token, and that token; None when all differ."""
        seen: dict[int, str] = {}
        for label, ids in self.label_ids.items():
            if ids[0] in seen:
                return seen[ids[0]], label, ids[0]
            seen[ids[0]] = label
        return None
