"""Yield points between decoding steps, so a long generation can let short work through.

A decoding pass holds the model for as many steps as its longest row needs: seconds to minutes. A
scheduler that owns the model thread (the server's micro-batcher) installs a hook with
:func:`between_steps` around such a pass, and :func:`~prefixcache.engine.generate.generate_rows` calls
:func:`step_boundary` after every step. The hook may run other forward passes on the same thread
(their forks are their own, and the decoding pass's fork and tensors are untouched), then returns, and
decoding continues from where it was: the same tokens as without the hook.

The hook is context-scoped (a ``ContextVar``) and cleared while it runs, so a pass it runs cannot
itself yield, and code that never installs one pays one lookup per step.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable, Iterator

_HOOK: ContextVar[Callable[[], None] | None] = ContextVar("prefixcache_between_steps", default=None)


@contextmanager
def between_steps(hook: Callable[[], None]) -> Iterator[None]:
    """Call ``hook()`` at every decoding step boundary inside this block (on this thread)."""
    token = _HOOK.set(hook)
    try:
        yield
    finally:
        _HOOK.reset(token)


def step_boundary() -> None:
    """Run the installed hook, if any, with no hook installed while it runs."""
    hook = _HOOK.get()
    if hook is None:
        return
    token = _HOOK.set(None)
    try:
        hook()
    finally:
        _HOOK.reset(token)
