"""A sequence: one record or one request, as the engine loop (:mod:`prefixcache.scheduler.engine_loop`) runs it.

A :class:`Sequence` holds the prefix it follows (a :class:`~prefixcache.cache.kv.PrefixKV`, held for as long
as the sequence lives, so a pool's eviction never pulls it from under a step), its own token ids, what it
wants, the client it counts against, and where its result goes. What it wants is one of:

* :class:`Scores`: its tokens are fed once, by the :class:`Scorer` (label tokens through the prompt's head,
  the label trie, or a fitted head), and it finishes in the step that fed them;
* :class:`Generate`: its tokens are fed (in chunks when the step's budget says so) into a slot of the loop's
  store, then one token a step is sampled (per row: its own sampling settings, stop strings, JSON-schema
  constraint and ``max_new_tokens``) until it stops.

Its status moves ``WAITING -> RUNNING -> FINISHED`` (or ``CANCELLED``/``FAILED``). The loop writes ``result``
(a scorer's output, or a :class:`~prefixcache.engine.generate.Generation`) or ``error``, then calls
``on_finish``; a generating sequence's ``on_token`` sees each token as the step that chose it ends.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Hashable, Protocol, Sequence as Seq

from ..cache.kv import PrefixKV
from ..engine.constraint import ConstrainedRows
from ..engine.generate import Decoding, RowOutput
from ..engine.sampling import TokenPicker


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"  # a generating sequence that holds a slot
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (Status.FINISHED, Status.CANCELLED, Status.FAILED)


class Scorer(Protocol):
    """Scores the sequences of one step that follow one prefix, in one engine call; one output per sequence.

    A scorer may name a ``group`` (hashable): the sequences of scorers with equal groups share a call.

    Each sequence's ``ids`` are its rows; ``tag`` carries whatever else the scorer needs (the record's item)."""

    def score(self, prefix: PrefixKV, seqs: Seq[Sequence]) -> list: ...


def scorer_group(scorer: Scorer) -> Hashable:
    """Which scorers share one engine call in a step: those with equal ``scorer.group`` (two requests with the
    same choices, say), else each scorer object alone. The call is the first sequence's scorer's."""
    return getattr(scorer, "group", None) or id(scorer)


@dataclass(frozen=True)
class Scores:
    """A scoring sequence: fed once, by ``scorer``, in a step with the other sequences of its prefix and scorer."""

    scorer: Scorer


@dataclass(frozen=True)
class Generate(Decoding):
    """A generating sequence: its own :class:`~prefixcache.engine.generate.Decoding` (sequences with different
    ones share steps; a copy constraint binds one source: this row's)."""


class Sequence:
    """One record or request. Built by a caller, then handed to the engine loop; read ``status`` and ``result``.

    ``client`` is whose turn it takes (the loop picks waiting sequences round-robin by client); ``tag`` is the
    caller's own (a record's position, say). The loop alone writes the state below the first block.
    """

    def __init__(self, prefix: PrefixKV, ids: Seq[int], want: Scores | Generate, client: Hashable = None,
                 tag: Any = None, on_token: Callable[[Sequence, int], None] | None = None,
                 on_finish: Callable[[Sequence], None] | None = None):
        if not ids:
            raise ValueError("a sequence needs at least one token of its own")
        self.prefix, self.ids, self.want = prefix, tuple(int(t) for t in ids), want
        self.client, self.tag, self.on_token, self.on_finish = client, tag, on_token, on_finish
        self.status = Status.WAITING
        self.result: Any = None
        self.error: str | None = None
        self.failure: Exception | None = None  # the typed error behind ``error``, where the loop has one
        self.cancelled = False
        self.slot: int | None = None  # the slot of its own keys/values (generating, once scheduled)
        self.fed = 0  # own tokens written to its slot so far
        self.generated: list[int] = []
        self.steps = 0  # steps it took part in
        self.admitted_at: float | None = None  # perf_counter() when a step first fed it (it took its slot)
        self.first_token_at: float | None = None  # perf_counter() when its first token was chosen
        self.output: RowOutput | None = None
        self.picker: TokenPicker | None = None
        self.rules: ConstrainedRows | None = None
        self.prompt_state = None  # [H]: the final layer's state at its last prompt token (generating sequences)

    @property
    def generates(self) -> bool:
        return isinstance(self.want, Generate)

    @property
    def own_tokens(self) -> int:
        """Own tokens it may ever write to a slot: its ids and every generated token but the last."""
        return len(self.ids) + (self.want.config.max_new_tokens - 1 if self.generates else 0)

    def pending(self) -> tuple[int, ...]:
        """The tokens to feed next: the rest of its ids, or the token it generated last."""
        return (self.ids + tuple(self.generated))[self.fed :]

    def cancel(self) -> None:
        """Ask the loop to drop it; it leaves at the next step (thread-safe: a flag the loop reads)."""
        self.cancelled = True

    def __repr__(self) -> str:
        return f"Sequence(tag={self.tag!r}, client={self.client!r}, {self.status.value}, {len(self.ids)} ids)"
