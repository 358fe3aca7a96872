"""Workloads: the records and prompts that benchmarks and sweeps run on.

* :func:`ticket_records` gives the published benchmark's records (synthetic
  support tickets of 20-35 tokens, 3 labels).
* :func:`file_records` samples records from a file (a real taxonomy's data, say);
* :func:`grow_task` lengthens a task's prefix by adding few-shot examples
  drawn from a pool that is disjoint from the evaluated records.
"""

from __future__ import annotations

import random

from ..errors import InputError, setting
from ..io.records import read_records
from ..task.prompt import build_prompt
from ..types import LABEL_FIELD, TEXT_FIELD, Record
from ..task.definition import Example, Task
from ..datasets.tickets import generate_tickets

EXAMPLE_POOL_SEED = 7  # the example pool's seed; evaluation records use seed 0


def ticket_records(n: int = 600, seed: int = 0) -> list[Record]:
    """``n`` synthetic tickets as Records (id, text); ``n=600, seed=0`` is the bundled file."""
    return [Record(t["id"], {"text": t["text"], "label": t["label"]}) for t in generate_tickets(n, seed)]


def file_records(path: str, task, items: int, label_field: str = LABEL_FIELD, seed: int = 0) -> list[Record]:
    """``items`` records drawn (seeded, in file order) from the file at ``path``, none of whose texts is one of
    ``task``'s examples (the prompt's rows are held out of what is measured); ``label_field`` becomes ``label``.

    Raises:
        InputError: the file cannot be read, or fewer than ``items`` rows are left.
    """
    examples = {example.text for example in getattr(task, "examples", [])}
    rows = [r for r in read_records(path, TEXT_FIELD) if r.fields.get("text") not in examples]
    if len(rows) < items:
        raise InputError(f"{path} has {len(rows)} rows that are not examples of task {task.name!r}; "
                         f"{setting('items', items)} asks for more")
    chosen = sorted(random.Random(seed).sample(range(len(rows)), items))
    return [_relabelled(rows[i], label_field) for i in chosen]


def fitting_records(path: str, task, per_label: int, exclude: list[Record], label_field: str = LABEL_FIELD,
                    seed: int = 1) -> list[Record]:
    """Up to ``per_label`` records of each of ``task``'s labels from the file at ``path`` (seeded), none of them
    a task example or one of the ``exclude`` records' texts: rows to fit a head on, held out of what is measured."""
    taken = {example.text for example in getattr(task, "examples", [])} | {r.fields.get("text") for r in exclude}
    rows = [_relabelled(r, label_field) for r in read_records(path, TEXT_FIELD) if r.fields.get("text") not in taken]
    random.Random(seed).shuffle(rows)
    chosen, count = [], dict.fromkeys(task.labels, 0)
    for row in rows:
        label = row.fields.get(LABEL_FIELD)
        if label in count and count[label] < per_label:
            count[label] += 1
            chosen.append(row)
    return chosen


def _relabelled(record: Record, label_field: str) -> Record:
    fields = dict(record.fields)
    if label_field in fields:
        fields[LABEL_FIELD] = fields.pop(label_field)
    return Record(record.id, fields)


def example_pool(exclude_texts: set[str], n: int = 400) -> list[Example]:
    """Labelled tickets for few-shot examples, none of whose texts is in ``exclude_texts``."""
    return [Example(text=t["text"], label=t["label"]) for t in generate_tickets(n, EXAMPLE_POOL_SEED) if t["text"] not in exclude_texts]


def grow_task(task: Task, tokenizer, target_tokens: int, pool: list[Example]) -> Task:
    """``task`` with examples appended from ``pool`` until its prefix has at least ``target_tokens`` tokens.

    Returns ``task`` unchanged when it is already that long. Raises ValueError when the pool runs out.
    """
    examples = list(task.examples)
    grown = task
    for candidate in [None, *pool]:
        if candidate is not None:
            examples.append(candidate)
            grown = task.model_copy(update={"examples": list(examples)})
        if len(build_prompt(grown, tokenizer).prefix_ids) >= target_tokens:
            return grown
    raise ValueError(f"the example pool ran out before the prefix reached {target_tokens} tokens")
