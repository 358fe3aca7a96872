"""Features kept on disk: a pool's rows are encoded once, and every later round reads them back.

:func:`stored_features` returns the same :class:`~prefixcache.scheduler.feature_pass.FeatureSet` as
:func:`~prefixcache.scheduler.feature_pass.collect_features`, but looks each record up first in a
:class:`FeatureStore`: a folder per (model identity, stored prefix's token hash, canonical feature spec),
whose entries are keyed by the record's normalized-text hash
(:func:`~prefixcache.engine.head_file.text_hash`). Only the records it lacks go through the model, in one
batched pass, and are appended as a new shard (``shard-<n>.npz``, written to a temporary name and renamed,
so a killed run leaves whole shards only). A second round over the same pool runs no forward pass.

Two records with the same normalized text share one entry (their features are the same computation up to
spacing and case, which the hash deliberately ignores; ``eval`` calls them the same text too).

This module does not choose rows (see :mod:`prefixcache.eval.suggest`) and does not print.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..engine.features import FeatureSpec
from ..engine.head import FittedHead
from ..engine.head_file import prefix_hash, text_hash
from ..errors import InputError
from ..model.load import LoadedModel
from ..task.prompt import build_prompt
from ..task.definition import Task
from ..types import RunConfig
from .feature_pass import FeatureSet, collect_features, tuned_prefix

RUN = RunConfig()


class FeatureStore:
    """One folder of stored features: text hash -> (features ``[F]``, prompt label log-probs ``[L]``)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self.rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for shard in sorted(self.folder.glob("shard-*.npz")):
            with np.load(shard) as data:
                for key, features, prompt in zip(data["hashes"], data["features"], data["prompt"]):
                    self.rows[str(key)] = (features, prompt)

    def add(self, hashes: Sequence[str], features: np.ndarray, prompt: np.ndarray) -> None:
        """Append rows as a new shard (atomically) and keep them in memory."""
        if not len(hashes):
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        number = len(list(self.folder.glob("shard-*.npz")))
        path = self.folder / f"shard-{number:05d}.npz"
        temporary = self.folder / f".shard-{number:05d}.{os.getpid()}.npz"
        np.savez(temporary, hashes=np.array(list(hashes), dtype=str), features=features, prompt=prompt)
        os.replace(temporary, path)
        for key, f, p in zip(hashes, features, prompt):
            self.rows[key] = (f, p)


def store_folder(root: Path, loaded: LoadedModel, task: Task, feature: str | FeatureSpec, variant: str = "") -> tuple[Path, str]:
    """The folder under ``root`` for this model, prompt (``variant``: a tuned prefix's digest) and feature spec, and
    the canonical spec."""
    spec = (feature if isinstance(feature, FeatureSpec) else FeatureSpec.parse(feature)).resolve(loaded.model)
    key = [loaded.identity, prefix_hash(build_prompt(task, loaded.tokenizer)), str(spec), str(loaded.dtype).removeprefix("torch.")]
    key = json.dumps(key + [variant] if variant else key)
    return Path(root) / hashlib.sha256(key.encode()).hexdigest()[:24], str(spec)


def stored_features(
    loaded: LoadedModel,
    task: Task,
    records: Sequence,
    root: Path,
    *,
    feature: str | FeatureSpec | FittedHead,
    batch_size: int = RUN.batch_size,
    progress: Callable[[int], None] | None = None,
) -> tuple[FeatureSet, int]:
    """Every record's features, from the store under ``root`` where it has them and from one batched pass where it
    does not; returns the set (input order; records that cannot run are in ``errors``) and how many records ran.
    ``feature``: a spec, or a head, whose features are read (through its tuned prefix when it carries one).
    """
    prompt = build_prompt(task, loaded.tokenizer)
    tuned = tuned_prefix(feature) if isinstance(feature, FittedHead) else None
    feature = feature.feature if isinstance(feature, FittedHead) else feature
    folder, spec = store_folder(root, loaded, task, feature, tuned.variant if tuned is not None else "")
    store = FeatureStore(folder)
    hashes = [text_hash(r.fields, task.fields) for r in records]
    missing, seen = [], set()
    for record, key in zip(records, hashes):
        if key not in store.rows and key not in seen:
            missing.append(record)
            seen.add(key)
    errors = {}
    if missing:  # nothing missing: no pass at all, not even the prefix's
        ran = collect_features(loaded, task, missing, feature=spec, config=RunConfig(batch_size=batch_size),
                               progress=progress, tuned=tuned)
        store.add(ran.text_hashes, ran.features, ran.prompt_logprobs)
        errors = ran.errors
    if progress is not None:
        progress(len(records) - len(missing))
    kept = [(r.id, key) for r, key in zip(records, hashes) if key in store.rows]
    if not kept:
        raise InputError(f"none of the {len(records)} records can be run" + (f": {next(iter(errors.values()))}" if errors else ""))
    return FeatureSet(
        ids=[i for i, _ in kept], features=np.stack([store.rows[k][0] for _, k in kept]),
        prompt_logprobs=np.stack([store.rows[k][1] for _, k in kept]), labels=tuple(prompt.label_ids), feature=spec,
        prefix_hash=prefix_hash(prompt), model_identity=loaded.identity, errors=errors,
        text_hashes=[k for _, k in kept], dtype=str(loaded.dtype).removeprefix("torch."),
    ), len(missing)
