"""Feature collection: records in, the hidden-state features a fitted label head reads out.

:func:`collect_features` runs a task's prompt over records exactly as classification does (the same
record loop of :class:`~prefixcache.scheduler.loop.BoundTask`: windows, length-sorted batches over the
shared cached prefix, the context-fit policy, and full re-encoding for a record whose tokens cross
the prefix boundary) and keeps, per record, the features of a spec
(:mod:`prefixcache.engine.features`) and the prompt's own first-token label log-probs.

A record that cannot be rendered or does not fit the context is reported in ``FeatureSet.errors``
(id -> message), never dropped silently.

This module does not fit anything (see :mod:`prefixcache.eval.fit_head`) and does not print.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable

import numpy as np
import torch

from ..cache.disk import token_hash
from ..cache.kv import PrefixKV
from ..cache.pool import PrefixPool, TunedPrefix
from ..engine.features import FeatureSpec, RowStates, packed_features
from ..engine.head import FittedHead
from ..engine.head_file import text_hash
from ..engine.scoring import LabelScorer
from ..errors import InputError
from ..model.load import LoadedModel
from ..model.context_window import context_limit
from ..task.context import ContextFit
from ..task.prompt import Encoded, Prompt, build_prompt
from ..task.definition import Task
from ..types import DEFAULT_FEATURE, RunConfig
from .loop import BoundTask, WindowStats, WorkItem, after_prompt_prefix

RUN = RunConfig()  # the defaults feature collection shares with classification
MAX_NAMED = 5  # records that did not run, named in one message


@dataclass(frozen=True, eq=False)
class FeatureSet:
    """Features of the records that ran, row for row with ``ids``.

    Attributes:
        ids: record ids, in input order, of the records that ran.
        features: ``[N, F]`` float32, the spec's features.
        prompt_logprobs: ``[N, L]`` float32, the prompt's own label log-probs from the first-token label
            rows, normalized over the label set (labels sharing a first token get tied scores).
        labels: the task's label order (the columns of ``prompt_logprobs``).
        feature: the canonical feature spec, its layers absolute (depth fractions resolved for this model).
        prefix_hash: SHA-256 of the stored prefix's token ids (:func:`~prefixcache.cache.disk.token_hash`).
        model_identity: the model's ``identity``.
        errors: id -> message for every record that did not run.
        text_hashes: per row of ``ids``, the SHA-256 of its normalized text
            (:func:`~prefixcache.engine.head_file.text_hash`), which a head's manifest keeps for the leak check.
        dtype: the dtype the model computed the features in.
    """

    ids: list
    features: np.ndarray
    prompt_logprobs: np.ndarray
    labels: tuple[str, ...]
    feature: str
    prefix_hash: str
    model_identity: str
    errors: dict = field(default_factory=dict)
    text_hashes: list = field(default_factory=list)
    dtype: str = ""

    def require_complete(self, rows: str = "row") -> FeatureSet:
        """This set, if every record ran; else an InputError naming the first :data:`MAX_NAMED` that did not.

        ``rows`` names the records in the message (``"training row"``, ``"bench record"``).
        """
        if self.errors:
            named = "; ".join(f"{key!r}: {message}" for key, message in list(self.errors.items())[:MAX_NAMED])
            raise InputError(f"{len(self.errors)} {rows}(s) cannot be run: {named}")
        return self


@dataclass(frozen=True)
class RowFeatures:
    """One record's result: its features ``[F]`` and prompt log-probs ``[L]``, or an error."""

    id: object
    features: torch.Tensor | None = None
    prompt_logprobs: torch.Tensor | None = None
    error: str | None = None
    text_hash: str | None = None


class FeatureCollector(BoundTask):
    """A task bound to a model that yields :class:`RowFeatures` per record, in input order."""

    stats_type = WindowStats

    def __init__(
        self, loaded: LoadedModel, task: Task, feature: str | FeatureSpec = DEFAULT_FEATURE, pool: PrefixPool | None = None
    ):
        self.prompt: Prompt = build_prompt(task, loaded.tokenizer)
        super().__init__(loaded, task, pool)
        self.spec = (feature if isinstance(feature, FeatureSpec) else FeatureSpec.parse(feature)).resolve(loaded.model)
        self.label_rows = LabelScorer(loaded.model, self.prompt, "first-token")  # tied where first tokens collide
        self.fit = ContextFit(self.prompt, loaded.tokenizer, context_limit(loaded.model), 0)

    def collect(self, records: Iterable, config: RunConfig = RunConfig(), progress: Callable[[int], None] | None = None):
        """Yield one :class:`RowFeatures` per record, in input order. ``config`` is classification's own
        :class:`~prefixcache.types.RunConfig`: the same mode, batch size, window and overflow policy."""
        yield from self._stream(records, config, progress, self.stats_type())

    def _route(self, index: int, record, enc: Encoded, config) -> WorkItem:
        """As classification routes it: fitted to the context (or failed), then after the prefix or in full."""
        truncated = False
        if self.fit.overflows(enc):
            try:
                enc, truncated = self.fit.fit(record.fields, record.id, enc, config.overflow).encoded, True
            except InputError as exc:
                return WorkItem(index, record, error=str(exc))
        item = super()._route(index, record, enc, config)
        return replace(item, truncated=True) if truncated else item

    def _forward(self, prefix: PrefixKV, batch: list[WorkItem], stats) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One packed pass: per item, its features ``[F]`` and the prompt's label log-probs ``[L]``."""
        own_starts = [len(self.prompt.prefix_ids) if it.full else 0 for it in batch]
        states: RowStates = packed_features(self.loaded.model, prefix, [it.rows for it in batch], own_starts, self.spec)
        logprobs = self.label_rows.first_token(states.last)  # [B, L]
        stats.forward_passes += 1
        return list(zip(states.features, logprobs))

    def _result(self, item: WorkItem, output) -> RowFeatures:
        features, logprobs = output
        return RowFeatures(item.record.id, features, logprobs, text_hash=text_hash(item.record.fields, self.task.fields))

    def _failed(self, item: WorkItem) -> RowFeatures:
        return RowFeatures(item.record.id, error=item.error)

    def _tally(self, stats, items: list[WorkItem], results: dict) -> None:
        stats.errors += sum(1 for i in items if i.error is not None)


def collect_features(
    loaded: LoadedModel,
    task: Task,
    records: Iterable,
    *,
    feature: str | FeatureSpec = DEFAULT_FEATURE,
    config: RunConfig = RUN,
    progress: Callable[[int], None] | None = None,
    tuned: TunedPrefix | None = None,
) -> FeatureSet:
    """Run ``task``'s prompt over ``records`` (batched over the cached prefix) and keep their features.

    ``config`` is classification's own :class:`~prefixcache.types.RunConfig` (mode, batch size, window,
    overflow policy); mode ``full`` re-encodes every prompt (the reference the cached path must equal).
    With ``tuned`` the records follow that tuned prefix (:func:`tuned_prefix`) instead of the prompt's.

    Raises:
        InputError: ``feature`` is not a valid spec for this model.
    """
    collector = FeatureCollector(loaded, task, feature)
    collector.tuned = tuned
    rows = collector.collect(records, config, progress)
    return feature_set(rows, loaded, collector.spec, collector.label_rows.labels, collector.prompt.prefix_ids)


def tuned_prefix(head: FittedHead | None) -> TunedPrefix | None:
    """What the record loop follows for ``head``: its tuned prefix under the head's digest, or None (the prompt's)."""
    return TunedPrefix(head.digest(), head.prefix) if head is not None and head.tuned else None


def feature_set(rows: Iterable[RowFeatures], loaded: LoadedModel, spec: FeatureSpec, labels: list[str],
                prefix_ids: list[int]) -> FeatureSet:
    """The rows of one feature pass gathered into a :class:`FeatureSet` (rows with an error kept by id only)."""
    ids, features, logprobs, hashes, errors = [], [], [], [], {}
    for row in rows:
        if row.error is not None:
            errors[row.id] = row.error
            continue
        ids.append(row.id)
        features.append(row.features)  # [F]
        logprobs.append(row.prompt_logprobs)  # [labels]
        hashes.append(row.text_hash)
    width = spec.width(loaded.model.config.get_text_config(decoder=True).hidden_size)
    return FeatureSet(
        ids=ids,
        features=torch.stack(features).float().numpy() if features else np.zeros((0, width), np.float32),
        prompt_logprobs=torch.stack(logprobs).float().numpy() if logprobs else np.zeros((0, len(labels)), np.float32),
        labels=labels, feature=str(spec), prefix_hash=token_hash(prefix_ids), model_identity=loaded.identity,
        errors=errors, text_hashes=hashes, dtype=str(loaded.dtype).removeprefix("torch."),
    )


@dataclass(frozen=True)
class OwnRows:
    """Records' own token ids as fed after the prompt's prefix (what prefix tuning trains on), row for row with
    ``ids``; ``text_hashes`` as :class:`FeatureSet` keeps them."""

    ids: list
    rows: list[tuple[int, ...]]
    text_hashes: list[str]
    prompt: Prompt


def own_rows(loaded: LoadedModel, task: Task, records: list, config: RunConfig = RUN) -> OwnRows:
    """Tokenize ``records`` as classification does (template, context fit, checked boundary) and keep each one's
    own tokens after the prompt's prefix (a record whose tokens cross the boundary: its tokens after it).

    Raises:
        InputError: a record cannot be rendered, does not fit the context, or does not start with the prefix;
            naming the first :data:`MAX_NAMED`.
    """
    return bound_own_rows(FeatureCollector(loaded, task), records, task.fields, config)


def bound_own_rows(bound: BoundTask, records: list, text_fields, config: RunConfig = RUN) -> OwnRows:
    """:func:`own_rows` through any bound task's own tokenization and routing (an
    :class:`~prefixcache.scheduler.extract.Extractor`'s too); ``text_fields``: the record fields the text hashes
    read. Raises as :func:`own_rows`."""
    ids, rows, hashes, errors = [], [], [], {}
    for item in bound.prepare(records, config):
        row = after_prompt_prefix(item, bound.prompt.prefix_ids) if item.error is None else None
        if row is None:
            errors[item.record.id] = item.error or "its tokens do not start with the prompt's prefix"
            continue
        ids.append(item.record.id)
        rows.append(tuple(row))
        hashes.append(text_hash(item.record.fields, text_fields))
    if errors:
        named = "; ".join(f"{key!r}: {message}" for key, message in list(errors.items())[:MAX_NAMED])
        raise InputError(f"{len(errors)} training row(s) cannot be run: {named}")
    return OwnRows(ids, rows, hashes, bound.prompt)
