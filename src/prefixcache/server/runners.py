"""Task runners: what the server does with a batch of items for one task.

A runner binds one task to one model. It has two halves, run on two threads:

* :meth:`TaskRunner.prepare` (the *prep* thread): turn request items into
  token rows, checking every limit and naming the item that breaks one. It
  tokenizes with the prep thread's own tokenizer copy, never the model
  thread's, so the two threads never share a tokenizer.
* :meth:`TaskRunner.run` (the *model* thread): one forward pass for a batch of
  prepared items, possibly from many requests; results in the batch's order.

Runners are chosen by the task's ``kind`` through :data:`RUNNER_KINDS`. Today
only ``classify`` exists; an extraction runner (``kind: extract``) registers
itself there with the same two halves, and ``/v1/extract`` starts serving it
without any change to the app or the batcher.

This module knows nothing about HTTP or queues.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar, Protocol, Sequence

from ..engine import empty_prefix, score_rows
from ..errors import InputError
from ..models import LoadedModel
from ..runner import Classifier, Prediction, Record
from ..task import Task
from .errors import ItemError, TaskUploadError
from .settings import ServerSettings


@dataclass(frozen=True)
class Prepared:
    """One item ready for the model.

    Attributes:
        index: its 0-based position in the request (for error messages).
        record: the item as a Record (id and fields).
        rows: the tokens fed to the model after ``prefix_tokens`` cached ones.
        prefix_tokens: stored-prefix tokens reused (0 when the item is re-encoded in full).
    """

    index: int
    record: Record
    rows: tuple[int, ...]
    prefix_tokens: int

    @property
    def uses_prefix(self) -> bool:
        return self.prefix_tokens > 0


class TaskRunner(Protocol):
    """The contract every runner kind meets.

    ``prepare`` may be called from the prep thread while ``run`` executes on the
    model thread; neither mutates shared state (the prefix is read-only).
    """

    kind: ClassVar[str]
    task: Task

    @property
    def prefix_tokens(self) -> int: ...

    @property
    def prefix_bytes(self) -> int: ...

    def describe(self) -> dict: ...

    def prepare(self, tokenizer, records: Sequence[Record], max_item_tokens: int) -> list[Prepared]:
        """Tokenize ``records`` with ``tokenizer``. Raises ItemError naming the first bad item."""
        ...

    def run(self, batch: Sequence[Prepared]) -> list[dict]:
        """Forward ``batch`` (any mix of requests) and return one JSON-ready result per item, in order."""
        ...


class ClassifyRunner:
    """A classification task on a model: the task's prefix is built once, on construction.

    Construct it on the model thread: building the prefix runs the model.
    ``prefix_limit`` (uploads only) is checked before the prefix is built.

    Raises (on construction):
        PromptError: the task cannot be rendered for this tokenizer.
        TaskUploadError: the prefix is longer than ``prefix_limit``.
    """

    kind: ClassVar[str] = "classify"

    def __init__(self, loaded: LoadedModel, task: Task, settings: ServerSettings, prefix_limit: int | None = None):
        self.task = task
        self.classifier = Classifier(loaded, task, settings.method)
        length = len(self.classifier.prompt.prefix_ids)
        if prefix_limit is not None and length > prefix_limit:
            raise TaskUploadError(
                f"task {task.name!r} has a {length}-token prefix, more than max_prefix_tokens="
                f"{prefix_limit}; shorten its instruction or examples"
            )
        self._prefix = self.classifier.prefix  # built here, once
        self._empty = empty_prefix(loaded.model)

    @property
    def prefix_tokens(self) -> int:
        return self._prefix.length

    @property
    def prefix_bytes(self) -> int:
        return self._prefix.nbytes

    def describe(self) -> dict:
        return {
            "name": self.task.name,
            "kind": self.kind,
            "labels": list(self.task.labels),
            "input_fields": self.task.fields,
            "method": self.classifier.method,
            "prefix_tokens": self.prefix_tokens,
            "prefix_bytes": self.prefix_bytes,
        }

    def prepare(self, tokenizer, records: Sequence[Record], max_item_tokens: int) -> list[Prepared]:
        prompt = self.classifier.prompt
        texts = []
        for index, record in enumerate(records):
            try:
                texts.append(prompt.suffix_text(record.fields, record.id))
            except InputError as exc:
                raise ItemError(f"item {index}: {exc}", item=index) from None
        prepared = []
        for index, (record, encoded) in enumerate(zip(records, prompt.encode(tokenizer, texts))):
            own = len(encoded.full_ids) - len(prompt.prefix_ids)
            if own > max_item_tokens:
                raise ItemError(
                    f"item {index} (id {record.id!r}): {own} tokens, more than max_item_tokens={max_item_tokens}; "
                    "shorten it or split it",
                    item=index,
                )
            if encoded.suffix_ids is None:  # crosses the prefix boundary: re-encode in full (invariant 3)
                prepared.append(Prepared(index, record, encoded.full_ids, 0))
            else:
                prepared.append(Prepared(index, record, encoded.suffix_ids, self.prefix_tokens))
        return prepared

    def run(self, batch: Sequence[Prepared]) -> list[dict]:
        """One pass over the stored prefix (plus one over the empty prefix for boundary fallbacks)."""
        results: list[dict | None] = [None] * len(batch)
        for uses_prefix, prefix in ((True, self._prefix), (False, self._empty)):
            group = [i for i, item in enumerate(batch) if item.uses_prefix == uses_prefix]
            if not group:
                continue
            head = self.classifier.head
            logprobs = score_rows(self.classifier.loaded.model, prefix, [batch[i].rows for i in group], head)  # [B, L]
            for i, scores in zip(group, head.to_scores(logprobs)):
                results[i] = Prediction(batch[i].record.id, scores, boundary_fallback=not uses_prefix).to_json()
        return results  # type: ignore[return-value]  # every slot was filled above


RunnerFactory = Callable[[LoadedModel, Task, ServerSettings, "int | None"], TaskRunner]

RUNNER_KINDS: dict[str, RunnerFactory] = {ClassifyRunner.kind: ClassifyRunner}
"""Task kind -> runner factory. An extraction runner adds ``"extract"`` here."""


def build_runner(loaded: LoadedModel, task: Task, settings: ServerSettings, prefix_limit: int | None = None) -> TaskRunner:
    """The runner for ``task``'s kind. Call on the model thread (it builds the prefix).

    ``prefix_limit``: the most prefix tokens allowed (uploaded tasks); ``None`` for the operator's own tasks.

    Raises:
        TaskUploadError: no runner serves this kind yet, or the prefix is over ``prefix_limit``.
    """
    kind = getattr(task, "kind", "classify")
    factory = RUNNER_KINDS.get(kind)
    if factory is None:
        raise TaskUploadError(
            f"task {task.name!r} is of kind {kind!r}, which this server cannot run yet "
            f"(it runs: {', '.join(RUNNER_KINDS)})"
        )
    return factory(loaded, task, settings, prefix_limit)
