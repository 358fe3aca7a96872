# Study behind docs/benchmarks.md, "Continuous batching" (its loop-vs-static tables).
"""Records/s through the engine loop vs static batches, on the same records, in one run.

    PYTHONPATH=src python studies/extract_loop_vs_static.py --items 64 --batch-size 16 --dtype float32
    PYTHONPATH=src python studies/extract_loop_vs_static.py --task support-tickets --items 256 --batch-size 32

Prints one table (seconds, records/s, the ratio) and whether every output is identical. Both lanes run
the same extractor or classifier (the embedded model, a bundled task, the bundled tickets), each twice,
alternating; the loop lane is the task as it runs, the static lane
:func:`prefixcache.bench.extract_lanes.static_twin`.
"""

from __future__ import annotations

import argparse
import time

from prefixcache.bench.extract_lanes import static_twin
from prefixcache.bench.workload import ticket_records
from prefixcache.model.load import load_model, set_threads
from prefixcache.scheduler.classify import Classifier
from prefixcache.scheduler.extract import ExtractStats, Extractor
from prefixcache.task.definition import ExtractTask, load_any_task
from prefixcache.types import Mode, RunConfig, RunStats


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--task", default="ticket-fields")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--repeats", type=int, default=1, help="run each lane this many times, alternating")
    args = parser.parse_args()
    loaded = load_model(args.model, args.dtype, set_threads(None))
    task = load_any_task(args.task)
    extracts = isinstance(task, ExtractTask)
    bound = Extractor(loaded, task) if extracts else Classifier(loaded, task)
    bound.prefix  # built once, before the twins are made, so both lanes share it and neither pays for it
    loop, static = bound, static_twin(bound)
    records = ticket_records(args.items)
    run = (lambda bound, some, config, stats: bound.extract_all(some, config, stats=stats)) if extracts else (
        lambda bound, some, config, stats: bound.classify_all(some, config, stats=stats))
    run(loop, records[:2], RunConfig(Mode.BATCHED, 2), ExtractStats() if extracts else RunStats())  # warms the kernels
    rows, outputs = [], {}
    for name, bound in [("static", static), ("loop", loop)] * args.repeats:
        stats = ExtractStats() if extracts else RunStats()
        started = time.perf_counter()
        outputs[name] = run(bound, records, RunConfig(Mode.BATCHED, args.batch_size), stats)
        seconds = time.perf_counter() - started
        print(f"{name}: {seconds:.2f} s", flush=True)
        rows.append((name, seconds, len(records) / seconds, stats.forward_passes, getattr(stats, "tokens_generated", 0)))
    print(f"model {loaded.identity}, dtype {args.dtype}, {args.items} records, batch {args.batch_size}")
    print("| lane | seconds | records/s | passes | tokens |\n|---|---|---|---|---|")
    for name, seconds, rate, passes, tokens in rows:
        print(f"| {name} | {seconds:.2f} | {rate:.2f} | {passes} | {tokens} |")
    static_s = sum(seconds for name, seconds, *_ in rows if name == "static")
    loop_s = sum(seconds for name, seconds, *_ in rows if name == "loop")
    print(f"loop / static records/s: {static_s / loop_s:.2f}x")
    if extracts:
        same = sum(a.raw == b.raw and a.fields == b.fields for a, b in zip(outputs["static"], outputs["loop"]))
        close = all(a.confidence is None or all(abs((a.confidence[k] or 0) - (b.confidence[k] or 0)) < 1e-3
                                                for k in a.confidence) for a, b in zip(outputs["static"], outputs["loop"]))
        print(f"identical text and fields: {same}/{len(records)}; confidences within 1e-3: {close}")
    else:
        same = sum(a.label == b.label for a, b in zip(outputs["static"], outputs["loop"]))
        print(f"identical labels: {same}/{len(records)}")


if __name__ == "__main__":
    main()
