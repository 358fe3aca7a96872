"""Few-shot example selection: which labelled examples a task's prompt shows, and in what order.

A task may list fixed ``examples`` and a larger ``example_pool``. Two consumers
pick from them:

* :func:`resolve_examples` applies the task's ``select: {per_label, seed}``:
  the fixed examples plus ``per_label`` pool examples of every label. The
  prompt renderer (:func:`prefixcache.task.prompt.render_messages` and
  :func:`~prefixcache.task.prompt.build_prompt`) always shows these, so ``select``
  holds for every command, and the evaluation leak check tests these;
* :func:`first_examples` takes the first ``n`` of one balanced order over
  fixed examples + pool, for ``prefixcache eval --sweep-examples``. Step
  ``n`` shows a superset of step ``m < n``'s examples, so a sweep changes only
  how many examples there are.

The order (:func:`candidate_order`) is round-robin over labels, so no label
sits last in the prompt by accident: per label, the fixed examples in file
order, then its pool examples shuffled by ``random.Random(seed)``. Labels are
visited in the order they first appear in ``examples``, then in taxonomy
order. A task whose fixed examples are already interleaved (the bundled ones
are) keeps its prompt unchanged at ``n = len(examples)``. Pool entries whose
normalized text (:func:`normalize_text`) repeats an earlier candidate are
skipped.

Also here: :func:`overlapping_rows`, which finds evaluation rows whose text is
one of the prompt's examples (evaluation data must never leak into the prompt).

Everything here is deterministic: the only randomness is ``random.Random(seed)``
(no hashing, set order or clock), so one task file always resolves to the
same examples in the same order, hence the same prefix tokens and cache keys.

This module knows nothing about tokenizers or models, and imports nothing
that renders prompts (``prompt`` imports this module, not the reverse).
"""

from __future__ import annotations

import random
import re
import unicodedata
from typing import Iterable, Mapping, Sequence

from ..errors import TaskError
from .definition import Example, Task


def normalize_text(text: str) -> str:
    """Key under which two texts count as the same: NFKC, case-folded, punctuation dropped, spaces collapsed."""
    folded = unicodedata.normalize("NFKC", str(text)).casefold()
    return " ".join(re.sub(r"[^\w\s]", " ", folded).split())


def _label_order(task: Task) -> list[str]:
    seen = list(dict.fromkeys(e.label for e in task.examples))
    return seen + [label for label in task.labels if label not in seen]


def _per_label_queues(task: Task, seed: int) -> dict[str, list[Example]]:
    """Per label: fixed examples (file order), then distinct pool examples shuffled by ``seed``."""
    rng = random.Random(seed)
    seen = {normalize_text(e.text) for e in task.examples}
    queues: dict[str, list[Example]] = {label: [] for label in _label_order(task)}
    for example in task.examples:
        queues[example.label].append(example)
    for label in queues:  # one shuffle per label, in a fixed label order: deterministic for a seed
        pool = [e for e in task.example_pool if e.label == label]
        rng.shuffle(pool)
        for example in pool:
            key = normalize_text(example.text)
            if key not in seen:
                seen.add(key)
                queues[label].append(example)
    return queues


def _round_robin(queues: Mapping[str, Sequence[Example]]) -> list[Example]:
    out: list[Example] = []
    depth = max((len(q) for q in queues.values()), default=0)
    for i in range(depth):
        out += [q[i] for q in queues.values() if i < len(q)]
    return out


def candidate_order(task: Task, seed: int = 0) -> list[Example]:
    """Every distinct example of ``task`` (fixed, then pool), interleaved round-robin over labels."""
    return _round_robin(_per_label_queues(task, seed))


def first_examples(task: Task, n: int, seed: int = 0) -> Task:
    """``task`` showing the first ``n`` examples of :func:`candidate_order` (no pool, no ``select``).

    Raises:
        TaskError: the task has fewer than ``n`` distinct examples; the message says how many it has.
    """
    if n < 0:
        raise TaskError(f"the number of examples must be 0 or more, not {n}")
    order = candidate_order(task, seed)
    if n > len(order):
        raise TaskError(
            f"task {task.name!r} has {len(order)} distinct examples (examples + example_pool), "
            f"fewer than the {n} asked for; ask for fewer or add an example_pool to the task file"
        )
    return task.model_copy(update={"examples": order[:n], "example_pool": [], "select": None})


def resolve_examples(task: Task) -> Task:
    """``task`` with ``select`` applied: its ``examples`` are then exactly what the prompt shows.

    Without ``select`` the task is returned unchanged (a pool alone only feeds sweeps).
    With it: the fixed examples plus the first ``select.per_label`` pool examples of
    every label in the seeded order, interleaved round-robin over labels (a label gets
    fewer when its pool entries repeat earlier candidates). The result has no pool and
    no ``select``, so resolving twice changes nothing.
    """
    if task.select is None:
        return task
    queues = _per_label_queues(task, task.select.seed)
    fixed = {label: sum(e.label == label for e in task.examples) for label in queues}
    chosen = {label: q[: fixed[label] + task.select.per_label] for label, q in queues.items()}
    return task.model_copy(update={"examples": _round_robin(chosen), "example_pool": [], "select": None})


def overlapping_rows(
    rows: Iterable[tuple[int, Mapping[str, object]]], examples: Sequence[Example], fields: Sequence[str]
) -> list[tuple[int, str]]:
    """``(row index, text)`` for every row one of whose ``fields`` is an example's text (normalized)."""
    keys = {normalize_text(e.text) for e in examples} - {""}  # an all-punctuation example matches nothing
    hits = []
    for index, values in rows:
        for field in fields:
            value = values.get(field)
            if isinstance(value, str) and normalize_text(value) in keys:
                hits.append((index, value))
                break
    return hits
