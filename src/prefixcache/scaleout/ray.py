"""The Ray Data stage: classify a dataset on a pool of Ray actors, each holding one model and one prefix.

Two entry points:

* :class:`PrefixClassifier`, a callable class for ``Dataset.map_batches`` (use
  :func:`classify_dataset` to get the arguments right). Each actor loads the
  model once, builds the task's prompt once, and gets the prefix cache once:
  from the disk tier when ``cache_dir`` is given (the first actor computes and
  stores it, the others and every later run load it), else by computing it.
* :func:`run_ray_classify`, the whole job behind ``prefixcache classify --ray``:
  read (CSV, JSONL, Parquet) with Ray Data, classify, stream the results back
  in input order, write JSONL parts, and summarize items/s per worker.

Guarantees:

* **Same answers.** Each record goes through the same :class:`~prefixcache.scheduler.classify.Classifier`
  as a local run, so labels equal the local run's record for record (scores can differ in
  the last float bits only where batches are composed differently).
* **Nothing lost, nothing twice.** A worker process that dies is restarted by Ray
  (``max_restarts``) and its unfinished batch is run again (``max_task_retries``);
  Ray Data hands each batch's output downstream once, and the driver writes rows in
  input order (``preserve_order``), so every input row gives exactly one output line.
  Exceptions raised by our own code are not retried: they are deterministic (bad input,
  a missing model) and surface on the driver as the domain error they are.

Fault injection (tests): with ``PREFIXCACHE_RAY_FAIL_ONCE=PATH`` in the workers'
environment, the first worker to start its second batch creates ``PATH`` and kills
its own process (``os._exit(1)``); later calls see ``PATH`` and go on.

This module is ``prefixcache.scaleout.ray``; ``import ray`` below is an absolute import
and gets the real Ray, never this module.
"""

from __future__ import annotations

import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pyarrow as pa
import ray
import ray.data

from ..errors import InputError, PrefixCacheError
from ..model.load import load_model, local_source
from ..scheduler.classify import Classifier
from .inputs import absolute, block_bytes, input_format
from .job import RayCluster, WorkerSpec
from .resources import check_gpus, cpus_per_worker
from .blocks import ROW, Finisher, prediction_line, record_of
from .session import data_context, domain_error, ray_session
from .sink import PartWriter, StdoutWriter
from .summary import STAT_COLUMNS, RaySummary, Tally

FAIL_ONCE_ENV = "PREFIXCACHE_RAY_FAIL_ONCE"
OUTPUT_COLUMNS = ("id", "label", "error", "prediction", *STAT_COLUMNS)

Log = Callable[[str], None]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def prefix_pool(cache_dir: str | None):
    """The disk-tier hook: a :class:`~prefixcache.cache.pool.PrefixPool` over a
    :class:`~prefixcache.cache.disk.DiskStore` in ``cache_dir``, or None (no disk tier).

    Raises:
        CacheStoreError: ``cache_dir`` cannot be used as a folder.
    """
    if cache_dir is None:
        return None
    from ..cache.pool import PoolConfig, PrefixPool
    from ..cache.disk import DiskStore

    return PrefixPool(PoolConfig(), store=DiskStore(cache_dir))


class PrefixClassifier:
    """A callable class for ``Dataset.map_batches(..., batch_format="pyarrow")`` on an actor pool.

    Construction (once per actor process): loads the model, builds the classifier and gets the
    prefix (see :func:`prefix_pool`), timing each step. A PrefixCacheError there (a model or
    task that does not work on this worker) is kept and raised by every call instead: Ray
    reports a failed construction to the driver only as text, a failed call as the error itself.

    Call: a pyarrow Table of input rows in, a pyarrow Table of :data:`OUTPUT_COLUMNS` out, one
    row per input row, in the same order. ``prediction`` is the JSON line a local run writes
    (with a null id when ids are row numbers; see :mod:`prefixcache.scaleout.blocks`). A bad row
    becomes an error row, never an exception. Does not modify its input.
    """

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.calls = 0
        self.failure: PrefixCacheError | None = None
        _quiet_transformers()
        try:
            self._start(spec)
        except PrefixCacheError as exc:
            self.failure = exc

    def _start(self, spec: WorkerSpec) -> None:
        started = time.perf_counter()
        loaded = load_model(spec.model, spec.dtype, spec.threads)
        self.load_seconds = time.perf_counter() - started
        self.classifier = Classifier(loaded, spec.task, spec.method, pool=prefix_pool(spec.cache_dir))
        self.prefix_source = "computed"
        self.prefix_seconds = 0.0
        if spec.config.mode.uses_prefix:
            started = time.perf_counter()
            self.classifier.prefix  # noqa: B018 - build (or load) it now, not in the first batch
            self.prefix_seconds = time.perf_counter() - started
            if self.classifier.last_lookup is not None:
                self.prefix_source = self.classifier.last_lookup.source

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self.failure is not None:
            raise self.failure
        _fail_once_if_asked(self.calls)
        records = [record_of(row, self.spec.text_field, self.spec.id_field) for row in batch.to_pylist()]
        started = time.perf_counter()
        predictions = self.classifier.classify_all(records, self.spec.config)
        share = (time.perf_counter() - started) / max(len(records), 1)  # each row's part of the batch time
        self.calls += 1
        n = len(predictions)
        return pa.table({
            "id": pa.array([None if p.id is ROW else p.id for p in predictions]),
            "label": pa.array([p.label for p in predictions], pa.string()),
            "error": pa.array([p.error for p in predictions], pa.string()),
            "prediction": pa.array([prediction_line(p) for p in predictions], pa.string()),
            "worker": pa.array([self.worker] * n, pa.string()),
            "seconds": pa.array([share] * n, pa.float64()),
            "load_seconds": pa.array([self.load_seconds] * n, pa.float64()),
            "prefix_seconds": pa.array([self.prefix_seconds] * n, pa.float64()),
            "prefix_source": pa.array([self.prefix_source] * n, pa.string()),
        })


def _quiet_transformers() -> None:
    """No per-worker weight-loading bars or warnings in the driver's log (Ray forwards worker output)."""
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _fail_once_if_asked(calls_done: int) -> None:
    """The fault-injection hook (see the module docstring): dies once per marker path."""
    marker = os.environ.get(FAIL_ONCE_ENV)
    if not marker or calls_done < 1:
        return
    try:
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return
    os.close(fd)
    os._exit(1)


def classify_dataset(
    ds: ray.data.Dataset, spec: WorkerSpec, cluster: RayCluster, num_cpus: float | None = None
) -> ray.data.Dataset:
    """``ds`` mapped through a pool of ``cluster.workers`` :class:`PrefixClassifier` actors (lazy, like any map).

    Each actor reserves ``num_cpus`` CPUs (default ``spec.threads``; see :func:`cpus_per_worker`)
    and ``cluster.num_gpus`` GPUs, and is handed
    ``cluster.rows_per_call`` rows at a time (default: 4 x the batch size, so the classifier can sort
    them by length into batches). ``spec`` is shipped as it is: pass a :meth:`WorkerSpec.resolved` one.

    A dead actor is restarted and the call lost with it retried: without limit by default (Ray
    Data's own defaults), or at most ``cluster.max_restarts`` / ``cluster.max_task_retries`` times when given
    (Ray 2.60 warns that these two are deprecated map_batches arguments; they are passed only
    when set).
    """
    if cluster.workers < 1:
        raise ValueError("workers must be at least 1")
    rows_per_call = cluster.rows_per_call or 4 * spec.config.batch_size
    extra: dict = {"num_gpus": cluster.num_gpus} if cluster.num_gpus else {}
    if cluster.max_restarts is not None:
        extra["max_restarts"] = cluster.max_restarts
    if cluster.max_task_retries is not None:
        extra["max_task_retries"] = cluster.max_task_retries
    return ds.map_batches(
        PrefixClassifier,
        fn_constructor_args=(spec,),
        batch_size=rows_per_call,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cluster.workers),
        num_cpus=spec.threads if num_cpus is None else num_cpus,
        **extra,
    )


def read_input(source: str, fmt: str, text_columns: tuple[str, ...] = ()) -> ray.data.Dataset:
    """A Ray Dataset of the input rows (lazy). CSV columns in ``text_columns`` stay text, as a local read leaves them.

    Read tasks reserve no CPU: reading is light next to the model, and when the workers hold
    every CPU (``--workers 2`` on two cores) a read, or any other task that waits for a CPU,
    would never run. So the pipeline is read, then classify, and nothing in between.
    """
    common = dict(file_extensions=None, num_cpus=0)
    if fmt == "csv":
        import pyarrow.csv as pacsv

        options = pacsv.ConvertOptions(column_types={c: pa.string() for c in text_columns})
        return ray.data.read_csv(source, convert_options=options, **common)
    if fmt == "jsonl":
        return ray.data.read_json(source, **common)
    return ray.data.read_parquet(source, **common)


def run_ray_classify(
    input: str,
    out_dir: str | Path | None,
    spec: WorkerSpec,
    cluster: RayCluster = RayCluster(),
    log: Log = _stderr,
    *,
    rows_per_part: int = 100_000,
    progress: bool = True,
) -> RaySummary:
    """Classify ``input`` on ``cluster.workers`` Ray actors, each building what ``spec`` says; write JSONL parts
    of ``rows_per_part`` lines to ``out_dir`` (None: stdout).

    Lines come out in input order and equal a local ``classify`` run's (ids, labels, scores).
    ``spec.threads`` is per worker (default 1; a GPU worker needs few). Without ``cluster.address`` the
    workers share this machine, so the model is resolved here first: a ``.gguf`` is converted
    once, not once per worker, and a model that is not here fails before Ray starts. An
    already initialized Ray is used as it is (``cluster.address`` then only decides that check).

    Returns the :class:`RaySummary` (also written to ``out_dir/summary.json`` and logged).

    Raises:
        InputError, TaskError, ModelNotFoundError, ...: any PrefixCacheError, also one raised on
            a worker, unwrapped from Ray's error.
    """
    spec = spec.resolved()
    source, fmt = _checked_input(input, spec, local=cluster.address is None)
    writer = PartWriter(out_dir, rows_per_part) if out_dir is not None else StdoutWriter()
    driver = _Driver(Finisher(input, spec.id_field), writer, Tally(), progress)
    try:
        errors, wall, first_row = _run_job(source, fmt, spec, cluster, driver, log)
    except BaseException:
        writer.abort()
        raise
    summary = RaySummary(
        driver.finisher.rows, errors, driver.finisher.duplicates, wall, first_row, cluster.workers,
        tuple(driver.tally.workers.values()), tuple(str(p) for p in writer.parts),
    )
    _finish(writer, summary, out_dir, log)
    return summary


def _finish(writer, summary: RaySummary, out_dir, log: Log) -> None:
    """Close the output (writing ``summary.json`` beside the parts) and log the summary."""
    writer.close(summary.to_json())
    for line in summary.lines():
        log(line)
    if writer.parts:
        log(f"wrote {len(writer.parts)} part(s) and summary.json to {out_dir}")


def _checked_input(input: str, spec: WorkerSpec, local: bool) -> tuple[str, str]:
    """The input as an absolute path or URI, and its format; fails before Ray starts when the input is not
    there, or (``local``: the workers run on this machine) when the model is not, resolving it here once
    (one GGUF conversion here, not one per worker)."""
    source = absolute(input)
    fmt = input_format(source)
    if "://" not in source and not Path(source).exists():
        raise InputError(f"{input}: no such input file or folder")
    if local:
        local_source(spec.model)
    return source, fmt


@dataclass(frozen=True)
class _Driver:
    """What the driver does with the rows that come back: finish each line (ids, repeats), write it, count it
    per worker, and show a progress bar (when ``progress``)."""

    finisher: Finisher
    writer: object  # a PartWriter or a StdoutWriter
    tally: Tally
    progress: bool


def _run_job(source: str, fmt: str, spec: WorkerSpec, cluster: RayCluster, driver: _Driver,
             log: Log) -> tuple[int, float, float]:
    """Start (or join) Ray, classify the input on the workers and drain it through ``driver``.

    Returns the error lines, the wall seconds, and the seconds until the first row arrived.
    """
    text_columns = tuple(c for c in (spec.text_field, spec.id_field, *spec.task.fields) if c)
    with ray_session(cluster.address, log), data_context(cluster.start_timeout_s, block_bytes(source, cluster.workers)):
        started = time.perf_counter()
        resources = ray.cluster_resources()
        check_gpus(cluster.num_gpus, cluster.workers, resources.get("GPU", 0), local=cluster.address is None)
        num_cpus = cpus_per_worker(spec.threads, cluster.workers, resources.get("CPU", 0))
        if num_cpus < spec.threads:
            log(f"ray: reserving {num_cpus:g} CPU per worker (each still runs {spec.threads} thread(s)) "
                "so that one CPU stays free for Ray Data's own tasks")
        ds = classify_dataset(read_input(source, fmt, text_columns), spec, cluster, num_cpus)
        errors, first = _drain(ds, driver)
        wall = time.perf_counter() - started
    return errors, wall, (first or time.perf_counter()) - started


def _drain(ds: ray.data.Dataset, driver: _Driver) -> tuple[int, float | None]:
    """Run the dataset, writing each row's final line in order.

    Returns the number of error lines and when (``perf_counter``) the first row arrived.
    """
    from tqdm import tqdm

    errors, first = 0, None
    bar = tqdm(desc="classify [ray]", unit="rec", file=sys.stderr, dynamic_ncols=True, disable=not driver.progress)
    try:
        for block in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            first = first or time.perf_counter()
            for row in block.select(list(OUTPUT_COLUMNS)).to_pylist():
                line, failed = driver.finisher.finish(row["prediction"], row["id"], row["error"])
                driver.writer.write(line)
                driver.tally.add(row)
                errors += failed
            bar.update(block.num_rows)
    except Exception as exc:
        found = domain_error(exc)
        if found is not None and found is not exc:
            raise found from exc
        raise
    finally:
        bar.close()
    return errors, first
