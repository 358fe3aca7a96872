"""Local Ray against one process, on the same records, in the same run; prints a markdown table.

    python scripts/ray_bench.py                      # embedded smollm2-135m, the 600 bundled tickets
    python scripts/ray_bench.py --workers 1 2        # one Ray row per pool size

The single-process runs use one process with every core (torch threads =
cores, what ``prefixcache classify`` does), then with one thread (what each Ray
worker gets on two cores with two workers). Each Ray run starts a local Ray with as many CPUs as there are cores and a pool of
``--workers`` actors, each with ``cores // workers`` threads. Both runs use the
same task, model, dtype and batch size, and the labels are compared record for
record with the first row; a disagreement is shown with the largest margin the
first row gave such a record (in bfloat16, batches of other shapes move scores
by a few hundredths, so only near-ties can flip; float32 agrees exactly).

Where the time goes, per row:

* ``load``: model load (per worker for Ray: every worker loads its own copy);
* ``prefix``: building the task's prefix cache (per worker);
* ``classify``: tokenizing and forward passes (for Ray: the busiest worker);
* ``start-up``: for Ray, the wait for the first result (worker processes starting,
  importing torch and transformers, then load and prefix), and ``ray.init`` itself;
* ``wall``: what a user waits for, from the model load (single) or ``ray.init`` (Ray)
  to the last record.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from prefixcache.io import records as data
from prefixcache.model.load import DEFAULT_MODEL, load_model
from prefixcache.scheduler.classify import Classifier, RunConfig
from prefixcache.task.definition import load_task


def single_process(args, records, threads: int) -> dict:
    started = time.perf_counter()
    loaded = load_model(args.model, args.dtype, threads)
    load_s = time.perf_counter() - started
    classifier = Classifier(loaded, load_task(args.task))
    mark = time.perf_counter()
    classifier.prefix  # noqa: B018 - build it now, timed on its own
    prefix_s = time.perf_counter() - mark
    mark = time.perf_counter()
    predictions = classifier.classify_all(records, RunConfig("batched", args.batch_size))
    classify_s = time.perf_counter() - mark
    return dict(
        run="single process", layout=f"1 x {threads} threads", load=load_s, prefix=prefix_s, classify=classify_s,
        startup=0.0, ray_init=0.0, wall=time.perf_counter() - started, labels=[p.label for p in predictions],
        margins=[p.scores.margin if p.scores else None for p in predictions], dtype=str(loaded.dtype).removeprefix("torch."),
    )


def local_ray(args, n: int, workers: int, cores: int) -> dict:
    import ray

    from prefixcache.scaleout.ray import run_ray_classify

    threads = max(1, cores // workers)
    started = time.perf_counter()
    ray.init(num_cpus=cores, include_dashboard=False, logging_level="WARNING")
    ray_init = time.perf_counter() - started
    try:
        with tempfile.TemporaryDirectory() as out:
            summary = run_ray_classify(
                args.input, out, args.task, args.model, workers=workers, batch_size=args.batch_size,
                id_field="id", dtype=args.dtype, threads=threads, log=lambda line: print(line, file=sys.stderr),
                progress=False,
            )
            lines = [line for part in summary.parts for line in open(part, encoding="utf-8")]
    finally:
        ray.shutdown()
    labels = [json.loads(line)["label"] for line in lines][:n]
    stats = summary.workers
    return dict(
        run="local Ray", layout=f"{workers} x {threads} threads", load=max(w.load_seconds for w in stats),
        prefix=max(w.prefix_seconds for w in stats), classify=max(w.busy_seconds for w in stats),
        startup=summary.startup_seconds, ray_init=ray_init, wall=ray_init + summary.wall_seconds, labels=labels,
        per_worker=", ".join(f"{w.items_per_second:.1f}" for w in sorted(stats, key=lambda w: w.worker)),
    )


def agreement(row: dict, reference: dict) -> str:
    """``agree/n``, and for disagreements the largest margin (log-prob gap) the reference run gave them."""
    differ = [i for i, (a, b) in enumerate(zip(row["labels"], reference["labels"])) if a != b]
    text = f"{len(row['labels']) - len(differ)}/{len(row['labels'])}"
    if differ:
        text += f" (max ref. margin {max(reference['margins'][i] or 0.0 for i in differ):.3f})"
    return text


def table(rows: list[dict], n: int) -> str:
    head = ("| run | workers x threads | load s | prefix s | classify s | start-up s | ray.init s | wall s "
            "| items/s (classify) | items/s (wall) | items/s per worker | labels = first row |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        out.append(
            f"| {r['run']} | {r['layout']} | {r['load']:.1f} | {r['prefix']:.2f} | {r['classify']:.1f} "
            f"| {r['startup']:.1f} | {r['ray_init']:.1f} | {r['wall']:.1f} | {n / r['classify']:.1f} "
            f"| {n / r['wall']:.1f} | {r.get('per_worker', '-')} | {agreement(r, rows[0])} |"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", default=str(data.bundled_dataset()), help="JSONL with 'id' and 'text'")
    parser.add_argument("--task", default="support-tickets")
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--cores", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--single-threads", type=int, nargs="+", default=None,
                        help="torch threads of each single-process row (default: all cores, then 1)")
    args = parser.parse_args()

    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    records = list(data.read_records(args.input, "text", "id"))
    n = len(records)
    rows = [single_process(args, records, t) for t in (args.single_threads or sorted({args.cores, 1}, reverse=True))]
    for workers in args.workers:
        rows.append(local_ray(args, n, workers, args.cores))
    load = os.getloadavg()
    print(f"{args.model} ({rows[0]['dtype']}), task {args.task}, {n} records, batch {args.batch_size}, "
          f"{args.cores} cores; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n")
    print(table(rows, n))


if __name__ == "__main__":
    main()
