"""From options to the objects a command runs: a loaded model, a classifier, an extractor, a prefix pool.

Every function here imports the engine (torch, transformers) in its body, when a command runs: that
keeps ``prefixcache --help`` and the listing commands free of it (the layers contract's one
exception to "imports at the top"). :func:`load_model` is the seam tests replace with a fake.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from itertools import chain, islice
from typing import Iterable, Iterator, Optional

import typer

from ..cache.config import STORAGE_NAMES, PoolConfig, parse_bytes
from ..cache.eviction import POLICIES
from ..model.catalog import DTYPE_CHOICES
from ..types import METHODS
from .errors import choice, err, parsed
from .options import POOL


def open_model(spec: str, dtype: str, threads: Optional[int], **kwargs):
    """:func:`prefixcache.model.load.load_model`, imported when a command first loads a model."""
    from ..model.load import load_model as load

    return load(spec, dtype, threads, **kwargs)


def quiet_transformers() -> None:
    """transformers' and the Hugging Face hub's logging at errors only, and no progress bars of theirs.

    Without importing transformers (seconds) for a model that does not need it: where it is not imported
    yet, the environment variables it and the hub read when they are imported say the same (a value the
    user set is kept).
    """
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    elif "huggingface_hub" in sys.modules:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()


def load(model: str, dtype: str, threads: Optional[int], trust_remote_code: bool = False):
    """Load ``--model``, saying which and how long it took."""
    dtype = choice(dtype, DTYPE_CHOICES, "--dtype")
    quiet_transformers()
    started = time.perf_counter()
    loaded = open_model(model, dtype, threads, trust_remote_code=trust_remote_code)
    seconds = time.perf_counter() - started
    err.print(f"model {loaded.identity} ({str(loaded.dtype).removeprefix('torch.')}, {loaded.decoder} decoder) "
              f"loaded in {seconds:.1f} s")
    return loaded


def setup_classifier(task, model: str, dtype: str, threads: Optional[int], method: str, pool=None,
                     head: Optional[Path] = None):
    """A :class:`~prefixcache.scheduler.classify.Classifier` of ``--task`` (a name or path, or a loaded task) on
    ``--model``, scoring through ``--head`` (or the task file's ``head:``) when there is one. The head file is read
    before the model loads."""
    from ..engine.head_file import head_for

    from ..scheduler.classify import Classifier
    from ..task.definition import load_task

    method = choice(method, METHODS, "--method")
    spec = load_task(task) if isinstance(task, str) else task
    fitted = head_for(spec, head)
    return Classifier(load(model, dtype, threads), spec, method, pool=pool, head=fitted)


def is_extract(task: str) -> bool:
    from ..task.definition import ExtractTask, load_any_task

    return isinstance(load_any_task(task), ExtractTask)


def setup_extractor(task: str, model: str, dtype: str, threads: Optional[int], pool, max_new_tokens: Optional[int] = None,
                    constrained: bool = True):
    """An :class:`~prefixcache.scheduler.extract.Extractor` of ``--task`` (which must be an extraction task), decoding
    under the task's answer schema unless ``constrained`` is False."""
    from ..scheduler.extract import Extractor
    from ..task.definition import ExtractTask, load_any_task

    spec = load_any_task(task)
    if not isinstance(spec, ExtractTask):
        raise typer.BadParameter(f"task {spec.name!r} is a classification task; run it with `prefixcache classify`", param_hint="--task")
    return Extractor(load(model, dtype, threads), spec, pool=pool, max_new_tokens=max_new_tokens, constrained=constrained)


def make_pool(cache_budget: Optional[str], cache_dir: Optional[Path], kv_storage: str, eviction: str,
              cache_dir_budget: Optional[str] = None):
    """A PrefixPool when any cache option is set, else None (then a classifier keeps its own prefix).
    ``--cache-dir-budget`` is recorded in the ``--cache-dir`` folder (:func:`folder_budget`)."""
    storage = choice(kv_storage, STORAGE_NAMES, "--kv-storage")
    policy = choice(eviction, POLICIES, "--eviction")
    folder_bytes = folder_budget(cache_dir_budget, cache_dir)
    if cache_budget is None and cache_dir is None and (storage, policy) == (POOL.storage, POOL.eviction):
        return None
    from ..cache.disk import DiskStore
    from ..cache.pool import PrefixPool

    budget = parsed(parse_bytes, cache_budget, "--cache-budget") if cache_budget else POOL.budget_bytes
    store = DiskStore(cache_dir, budget_bytes=folder_bytes) if cache_dir else None
    return PrefixPool(PoolConfig(budget, policy, storage), store)


def folder_budget(cache_dir_budget: Optional[str], cache_dir: Optional[Path]) -> Optional[int]:
    """``--cache-dir-budget`` in bytes (None: not given, the folder keeps the budget it has recorded).
    The budget is the folder's, not a pool's: once recorded there, every process using the folder honours it
    (Ray workers, and runs started without the option), so it is no PoolConfig field."""
    if cache_dir_budget is None:
        return None
    budget = parsed(parse_bytes, cache_dir_budget, "--cache-dir-budget")
    if cache_dir is None:
        raise typer.BadParameter("it limits the --cache-dir folder: add --cache-dir", param_hint="--cache-dir-budget")
    return budget


def record_folder_budget(cache_dir_budget: Optional[str], cache_dir: Optional[Path]) -> None:
    """Record ``--cache-dir-budget`` in the ``--cache-dir`` folder now (for a run whose pools are built elsewhere,
    such as Ray workers: they honour the folder's recorded budget)."""
    budget = folder_budget(cache_dir_budget, cache_dir)
    if budget is not None:
        from ..cache.manifest import DiskFolder

        DiskFolder(cache_dir, budget_bytes=budget)


TEXT_FIELD_PEEK = 1024  # rows read ahead to check --text-field before a streamed job starts


def check_text_field(records: Iterable, text_field: str) -> Iterator:
    """``records``, streamed, unless ``--text-field`` names a field that none of the first
    :data:`TEXT_FIELD_PEEK` readable rows has: a typo there would otherwise fail every record one by one
    (or leave ``verify`` nothing to compare), so it is a usage error. Only those rows are read ahead."""
    records = iter(records)
    ahead = list(islice(records, TEXT_FIELD_PEEK))
    valid = [r for r in ahead if r.error is None]
    if text_field != "text" and valid and not any("text" in r.fields for r in valid):
        raise typer.BadParameter(f"no row has a field {text_field!r}", param_hint="--text-field")
    return chain(ahead, records)


def progress(total: Optional[int], desc: str):
    """A tqdm bar on standard error (a context manager; ``update(n)`` per record done)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
