"""Value types every layer shares: a record in, a prediction out, how to run, what a run counted.

This module imports nothing but the standard library (no torch, no transformers), so the readers,
the output journal, the HTTP schemas and the Ray rows can name a Record or a Prediction without
loading the engine. It knows nothing about models, prompts or caches.

:class:`Mode` is the one place that says what each run mode means (see its properties); the record
loop asks it, and no other module compares mode strings.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Mapping


class Mode(StrEnum):
    """How records are fed to the model. A ``str``: ``Mode("full") == "full"`` and JSON writes ``"full"``.

    * ``full`` re-encodes every whole prompt (the baseline, and the reference of every check);
    * ``cached`` feeds one record per pass after the stored prefix (the published recipe);
    * ``batched`` feeds up to ``batch_size`` records per pass after the stored prefix.
    """

    FULL = "full"
    CACHED = "cached"
    BATCHED = "batched"

    @property
    def uses_prefix(self) -> bool:
        """Records follow the task's stored prefix (else they follow the empty prefix: full re-encoding)."""
        return self is not Mode.FULL

    def pass_size(self, batch_size: int) -> int:
        """Records per forward pass: ``batch_size`` in ``batched`` mode, else one."""
        return batch_size if self is Mode.BATCHED else 1


MODES = tuple(m.value for m in Mode)  # ("full", "cached", "batched"): the CLI's choices
OVERFLOW = ("error", "truncate")  # what happens to a record past the model's context (task/context.py)
BACKENDS = ("auto", "torch", "llama.cpp")  # what runs generating rows (scheduler/backend_choice.py): the CLI's choices
METHODS = ("auto", "first-token", "full")  # label scoring methods (task/prompt.py resolves auto)

# Defaults every entry point shares: the CLI's options, the library's keyword arguments and the Ray
# workers read them from here, so no default is typed twice.
TEXT_FIELD = "text"  # the record field holding its text
LABEL_FIELD = "label"  # the field holding a row's gold label (eval, fit)
DEFAULT_TASK = "support-tickets"  # the bundled classification task
DEFAULT_EXTRACT_TASK = "ticket-fields"  # the bundled extraction task
DEFAULT_FEATURE = "last+mean@3/4"  # what a fitted head reads (engine/features.py; measured in docs/accuracy.md)
DEFAULT_WORKERS = 2  # Ray workers of ``classify --ray``


@dataclass(frozen=True)
class Record:
    """One input record: an id and its fields (``text`` and whatever the task's template reads).

    ``error`` is set on a row a reader could not turn into fields (a broken line, a duplicate
    id): the runner does not run it, and yields an error Prediction in its place.
    """

    id: object
    fields: Mapping[str, object]
    error: str | None = None


@dataclass(frozen=True)
class LabelScores:
    """Scores of one record: normalized log-probs per label, in the task's label order."""

    labels: tuple[str, ...]
    logprobs: tuple[float, ...]

    @property
    def best(self) -> int:
        return max(range(len(self.logprobs)), key=self.logprobs.__getitem__)

    @property
    def label(self) -> str:
        return self.labels[self.best]

    @property
    def probabilities(self) -> dict[str, float]:
        return {label: math.exp(lp) for label, lp in zip(self.labels, self.logprobs)}

    @property
    def margin(self) -> float:
        """Log-prob gap between the best and the second-best label (``inf`` when there is one label)."""
        ordered = sorted(self.logprobs, reverse=True)
        return ordered[0] - ordered[1] if len(ordered) > 1 else float("inf")


@dataclass(frozen=True)
class Prediction:
    """The result for one record. Exactly one of ``scores`` and ``error`` is set.

    ``boundary_fallback``: the record's tokens crossed the prefix boundary, so it was scored by full
    re-encoding in a cached mode. ``truncated``: a field was cut to fit the model's context;
    ``warning`` says which and how (or notes blank text). Both appear in :meth:`to_json` only when set.
    ``abstained``: its confidence was under the run's threshold, so :attr:`label` is None and the label
    it would have had is :attr:`best_guess` (see :class:`~prefixcache.engine.confidence.Trust`).
    """

    id: object
    scores: LabelScores | None = None
    error: str | None = None
    boundary_fallback: bool = False
    truncated: bool = False
    warning: str | None = None
    abstained: bool = False

    @property
    def label(self) -> str | None:
        """The label, or None for an error or an abstention."""
        return self.scores.label if self.scores and not self.abstained else None

    @property
    def best_guess(self) -> str | None:
        """The best-scored label, abstained or not (None for an error)."""
        return self.scores.label if self.scores else None

    @property
    def confidence(self) -> float | None:
        """The probability of the best label under :attr:`scores` (calibrated when the run calibrates)."""
        return math.exp(max(self.scores.logprobs)) if self.scores else None

    def to_json(self) -> dict:
        if self.scores is None:
            return {"id": self.id, "label": None, "scores": None, "margin": None, "error": self.error}
        document = {
            "id": self.id,
            "label": self.label,
            "confidence": round(self.confidence, 6),
            "scores": {k: round(v, 6) for k, v in self.scores.probabilities.items()},
            "margin": round(self.scores.margin, 6),
        }
        if self.abstained:
            document |= {"abstained": True, "best_guess": self.best_guess}
        if self.truncated:
            document["truncated"] = True
        if self.warning is not None:
            document["warning"] = self.warning
        return document


@dataclass(frozen=True)
class RunConfig:
    """How to run. ``window`` records are read, sorted by length and batched at a time.

    ``mode`` is a :class:`Mode` (a mode string is converted). ``overflow`` (one of :data:`OVERFLOW`):
    what happens to a record whose prompt does not fit the model's context: ``error`` or ``truncate``.

    Raises:
        ValueError: an unknown mode or overflow, or a batch size below 1.
    """

    mode: Mode = Mode.BATCHED
    batch_size: int = 32
    window: int = 1024
    overflow: str = "error"

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, not {self.mode!r}")
        object.__setattr__(self, "mode", Mode(self.mode))
        if self.overflow not in OVERFLOW:
            raise ValueError(f"overflow must be one of {OVERFLOW}, not {self.overflow!r}")
        if self.batch_size < 1:
            raise ValueError("batch_size must be at least 1")


@dataclass
class WindowStats:
    """Counters every run keeps; :class:`RunStats` and the extraction stats add their own."""

    records: int = 0
    errors: int = 0
    boundary_fallbacks: int = 0
    forward_passes: int = 0
    seconds: float = 0.0
    prefix_seconds: float = 0.0


@dataclass
class RunStats(WindowStats):
    """Counters of one classification run: the common ones plus tokens computed, records per pass, and
    records that failed because their prompt does not fit the model's context (``context_overflows``)."""

    tokens_computed: int = 0
    context_overflows: int = 0
    per_batch: list[int] = field(default_factory=list)
