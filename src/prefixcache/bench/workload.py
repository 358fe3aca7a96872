"""Workloads: the records and prompts that benchmarks and sweeps run on.

* :func:`ticket_records` gives the published benchmark's records (synthetic
  support tickets of 20-35 tokens, 3 labels).
* :func:`grow_task` lengthens a task's prefix by adding few-shot examples
  drawn from a pool that is disjoint from the evaluated records.
"""

from __future__ import annotations

from ..spec.prompt import build_prompt
from ..types import Record
from ..spec.task import Example, Task
from ..datasets.tickets import generate_tickets

EXAMPLE_POOL_SEED = 7  # the example pool's seed; evaluation records use seed 0


def ticket_records(n: int = 600, seed: int = 0) -> list[Record]:
    """``n`` synthetic tickets as Records (id, text); ``n=600, seed=0`` is the bundled file."""
    return [Record(t["id"], {"text": t["text"], "label": t["label"]}) for t in generate_tickets(n, seed)]


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
