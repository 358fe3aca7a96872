"""``prefixcache bench --ray-workers N``: local Ray against one process, on the same records, in the same run.

The single-process rows use one process with every core (torch threads = cores, what ``prefixcache
classify`` does), then with one thread (what each Ray worker gets on two cores with two workers). Each Ray
row starts a local Ray with as many CPUs as there are cores and ``workers`` actors of ``cores // workers``
threads each. Every row runs the same task, model, dtype and batch size; labels are compared record for
record with the first row, a disagreement shown with the largest margin the first row gave such a record
(in bfloat16 batches of other shapes move scores by a few hundredths, so only near-ties flip; float32
agrees exactly).

Where the time goes, per row: ``load`` (per worker for Ray: each loads its own copy), ``prefix`` (building
the task's prefix cache, per worker), ``classify`` (tokenizing and forward passes; for Ray, the busiest
worker), ``start-up`` (for Ray, the wait for the first result: workers starting, importing torch, load and
prefix) and ``ray.init``, and ``wall``: from the model load (single) or ``ray.init`` (Ray) to the last record.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence


@dataclass(frozen=True)
class RayBench:
    """What the comparison runs: ``task`` and ``model`` (specs), at ``dtype`` and ``batch_size``, on ``cores``
    cores; one Ray row per entry of ``workers``, one single-process row per entry of ``single_threads``."""

    task: str
    model: str
    dtype: str
    batch_size: int
    cores: int
    workers: tuple[int, ...]
    single_threads: tuple[int, ...] = ()


@dataclass
class Row:
    """One row of the table: the run, its layout, its seconds, and its labels (and margins, for the first row)."""

    run: str
    layout: str
    load: float
    prefix: float
    classify: float
    wall: float
    labels: list[str]
    startup: float = 0.0
    ray_init: float = 0.0
    margins: list[float | None] = field(default_factory=list)
    per_worker: str = "-"
    dtype: str = ""


def single_process(setup: RayBench, records: Sequence, threads: int) -> Row:
    """One process with ``threads`` torch threads: load, build the prefix, classify every record (batched)."""
    from ..model.load import load_model
    from ..scheduler.classify import Classifier, RunConfig
    from ..task.definition import load_task

    started = time.perf_counter()
    loaded = load_model(setup.model, setup.dtype, threads)
    load_s = time.perf_counter() - started
    classifier = Classifier(loaded, load_task(setup.task))
    mark = time.perf_counter()
    classifier.prefix  # noqa: B018 - build it now, timed on its own
    prefix_s = time.perf_counter() - mark
    mark = time.perf_counter()
    predictions = classifier.classify_all(list(records), RunConfig("batched", setup.batch_size))
    classify_s = time.perf_counter() - mark
    return Row("single process", f"1 x {threads} threads", load_s, prefix_s, classify_s, time.perf_counter() - started,
               [p.label for p in predictions], margins=[p.scores.margin if p.scores else None for p in predictions],
               dtype=str(loaded.dtype).removeprefix("torch."))


def local_ray(setup: RayBench, source: Path, workers: int, log: Callable[[str], None]) -> Row:
    """A local Ray of ``setup.cores`` CPUs and ``workers`` actors classifying the JSONL file ``source``."""
    import ray

    from ..types import RunConfig
    from .job import RayCluster, WorkerSpec
    from .ray import run_ray_classify

    threads = max(1, setup.cores // workers)
    started = time.perf_counter()
    ray.init(num_cpus=setup.cores, include_dashboard=False, logging_level="WARNING")
    ray_init = time.perf_counter() - started
    try:
        with tempfile.TemporaryDirectory() as out:
            spec = WorkerSpec(setup.task, setup.model, setup.dtype, threads, config=RunConfig(batch_size=setup.batch_size),
                              id_field="id")
            summary = run_ray_classify(str(source), out, spec, RayCluster(workers=workers), log, progress=False)
            lines = [line for part in summary.parts for line in open(part, encoding="utf-8")]
    finally:
        ray.shutdown()
    stats = summary.workers
    return Row("local Ray", f"{workers} x {threads} threads", max(w.load_seconds for w in stats),
               max(w.prefix_seconds for w in stats), max(w.busy_seconds for w in stats),
               ray_init + summary.wall_seconds, [json.loads(line)["label"] for line in lines],
               startup=summary.startup_seconds, ray_init=ray_init,
               per_worker=", ".join(f"{w.items_per_second:.1f}" for w in sorted(stats, key=lambda w: w.worker)))


def run_ray_bench(setup: RayBench, records: Sequence, log: Callable[[str], None]) -> list[Row]:
    """Every single-process row (default: all cores, then one thread), then every Ray row, on ``records``."""
    threads = setup.single_threads or tuple(sorted({setup.cores, 1}, reverse=True))
    rows = [single_process(setup, records, t) for t in threads]
    with tempfile.TemporaryDirectory(prefix="prefixcache-ray-bench-") as folder:
        source = Path(folder) / "records.jsonl"
        source.write_text("".join(json.dumps({"id": r.id, "text": r.fields["text"]}) + "\n" for r in records))
        rows += [local_ray(setup, source, workers, log) for workers in setup.workers]
    return rows


def agreement(row: Row, reference: Row) -> str:
    """``agree/n``, and for disagreements the largest margin (log-prob gap) the reference run gave them."""
    differ = [i for i, (a, b) in enumerate(zip(row.labels, reference.labels)) if a != b]
    text = f"{len(row.labels) - len(differ)}/{len(row.labels)}"
    if differ:
        text += f" (max ref. margin {max(reference.margins[i] or 0.0 for i in differ):.3f})"
    return text


def ray_table(rows: list[Row], n: int) -> str:
    """The rows as a markdown table; items/s over ``n`` records; labels against the first row."""
    head = ("| run | workers x threads | load s | prefix s | classify s | start-up s | ray.init s | wall s "
            "| items/s (classify) | items/s (wall) | items/s per worker | labels = first row |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(
            f"| {r.run} | {r.layout} | {r.load:.1f} | {r.prefix:.2f} | {r.classify:.1f} | {r.startup:.1f} "
            f"| {r.ray_init:.1f} | {r.wall:.1f} | {n / r.classify:.1f} | {n / r.wall:.1f} | {r.per_worker} "
            f"| {agreement(r, rows[0])} |"
        )
    return "\n".join(out)
