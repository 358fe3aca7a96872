"""Feature collection for a choice field of an extraction task: what ``fit --field NAME`` fits a head on.

:func:`collect_field_features` runs the extraction prompt's prefill over records (the same cached prefix the
:class:`~prefixcache.scheduler.extract.Extractor` decodes from, in packed batches) and keeps each record's
``last`` feature: the final layer's state at the record's last token, which is exactly the state an extraction's
prefill computes before its first generated token, so applying the head costs no extra pass. The result is a
:class:`~prefixcache.scheduler.feature_pass.FeatureSet` whose labels are the field's values; its prompt
log-probs are uniform (an extraction prompt has no label rows: the fit is from scratch). For a ``copy`` field the
labels are :data:`PRESENCE`: a head that says whether the record holds a value at all (the decoder, held to
spans, copies *something* unless the model chooses null; the head decides null instead).

This module does not fit anything (see :mod:`prefixcache.eval.fit_head`) and does not print.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from ..cache.kv import PrefixKV
from ..cache.pool import TunedPrefix
from ..engine.features import FeatureSpec, packed_features
from ..engine.head_file import text_hash
from ..errors import InputError, setting
from ..model.load import LoadedModel
from ..task.definition import ExtractTask
from ..task.extract_prompt import build_extract_prompt
from ..types import RunConfig, WindowStats
from .feature_pass import FeatureSet, RowFeatures, feature_set
from .loop import BoundTask, WorkItem

FIELD_FEATURE = "last"  # the prefill's own state: a field head is applied at no extra pass
PRESENCE = ("absent", "present")  # what a copy field's head predicts: whether the record holds a value to copy


def head_labels(task: ExtractTask, field: str) -> tuple[str, ...]:
    """What a head for ``field`` predicts: a choice field's values, or a copy field's :data:`PRESENCE`.

    Raises:
        InputError: ``field`` is neither a choice nor a copy field of ``task``.
    """
    decl = task.fields.get(field)
    if decl is None or decl.kind not in ("choice", "copy"):
        fitted = ", ".join(task.names_of_kind("choice") + task.names_of_kind("copy")) or "none"
        raise InputError(f"{setting('field', field)}: not a choice or copy field of task {task.name!r} (those fields: {fitted})")
    return tuple(decl.values or ()) if decl.kind == "choice" else PRESENCE


class FieldFeatureCollector(BoundTask):
    """An extraction task's prefill bound to a model, yielding :class:`RowFeatures` (``last``) per record."""

    stats_type = WindowStats

    def __init__(self, loaded: LoadedModel, task: ExtractTask, field: str):
        self.labels = head_labels(task, field)
        self.prompt = build_extract_prompt(task, loaded.tokenizer)
        super().__init__(loaded, task)
        self.spec = FeatureSpec.parse(FIELD_FEATURE).resolve(loaded.model)

    def _forward(self, prefix: PrefixKV, batch: list[WorkItem], stats) -> list[torch.Tensor]:
        own_starts = [len(self.prompt.prefix_ids) if it.full else 0 for it in batch]
        states = packed_features(self.loaded.model, prefix, [it.rows for it in batch], own_starts, self.spec)
        stats.forward_passes += 1
        return list(states.features)

    def _result(self, item: WorkItem, output) -> RowFeatures:
        uniform = torch.full((len(self.labels),), -math.log(len(self.labels)))
        return RowFeatures(item.record.id, output, uniform, text_hash=text_hash(item.record.fields, self.task.input_fields))

    def _failed(self, item: WorkItem) -> RowFeatures:
        return RowFeatures(item.record.id, error=item.error)

    def _tally(self, stats, items: list[WorkItem], results) -> None:
        stats.errors += sum(1 for i in items if i.error is not None)


def collect_field_features(
    loaded: LoadedModel, task: ExtractTask, field: str, records: Iterable, batch_size: int = RunConfig().batch_size,
    progress: Callable[[int], None] | None = None, tuned: TunedPrefix | None = None,
) -> FeatureSet:
    """The ``last`` features of ``records`` under ``task``'s extraction prompt, labelled by ``field``'s values.
    ``tuned``: the records follow this tuned prefix instead of the prompt's (the states an extractor with that
    prefix computes before its first generated token); None: the prompt's own prefix.

    Raises:
        InputError: ``field`` is not a choice or copy field of ``task``.
    """
    collector = FieldFeatureCollector(loaded, task, field)
    collector.tuned = tuned
    rows = collector._stream(records, RunConfig("batched", batch_size), progress, collector.stats_type())
    return feature_set(rows, loaded, collector.spec, collector.labels, collector.prompt.prefix_ids)
