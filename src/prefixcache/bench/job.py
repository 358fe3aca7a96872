"""The ``prefixcache bench`` job: load the model(s), build the lanes, run them on one workload, and
write every figure into one JSON document (an extraction task runs :mod:`.extract_lanes` instead).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Callable

import torch

from ..model.machine import machine_info
from ..model.load import LoadedModel, load_model, load_random_model, resolve_device, resolve_dtype, set_threads
from ..engine.head_file import load_head
from ..errors import InputError, setting
from ..scheduler.classify import Classifier
from ..task.definition import ExtractTask, load_any_task, load_task
from .extract_lanes import run_extract_bench
from .head_lanes import FIT, bench_head, gold_labels, head_document, head_lanes, without_head
from .lanes import BenchReport, Lane, classifier_lane, dtype_name, run_lanes, same_dtype_copy, sweep_prefix
from .options import BenchOptions
from .label_lanes import run_label_bench
from .peers import llama_cpp_lane
from .roofline import ShapePeak, matmul_peak_gflops, shape_peak
from .workload import file_records, ticket_records


def load_base(options: BenchOptions, log: Callable[[str], None]) -> tuple[LoadedModel, int, torch.dtype]:
    """The float32 model every reference lane runs on, the thread count and the run dtype."""
    threads = set_threads(options.threads)
    run_dtype = resolve_dtype(options.dtype, resolve_device(None))
    if options.model_config:
        base = load_random_model(options.model_config, "float32", threads, tokenizer_from=options.model)
    else:
        base = load_model(options.model, "float32", threads)
    log(f"model {base.identity}, {threads} threads, run dtype {dtype_name(run_dtype)}")
    return base, threads, run_dtype


def build_lanes(options: BenchOptions, records: list, log: Callable[[str], None], loaded) -> tuple[list[Lane], dict]:
    """Make the lanes: full, cached, batched in float32, then with a head (:mod:`.head_lanes`) full and
    batched through it in float32, then full and batched at the ``auto`` dtype when that differs, then
    llama.cpp when available.

    Raises:
        HeadMismatchError: the head was fitted for another model, prompt or label set.
    """
    task = load_task(options.task)
    base, threads, run_dtype = loaded
    reference = Classifier(base, without_head(task))
    lanes = [
        classifier_lane("full", reference, "full"),
        classifier_lane("cached", reference, "cached"),
        classifier_lane("batched", reference, "batched", options.batch_size),
    ]
    head = bench_head(options.head, base, task, records, options.batch_size, log)
    if head is not None:
        lanes += head_lanes(base, task, head, options.batch_size)
    if run_dtype != torch.float32:
        fast = Classifier(same_dtype_copy(base, run_dtype), without_head(task))
        lanes += [
            classifier_lane("full", fast, "full"),
            classifier_lane("batched", fast, "batched", options.batch_size),
        ]
    if options.llama_cpp and not options.model_config:
        lane = llama_cpp_lane(options.model, reference, threads, log)
        if lane is not None:
            lanes.append(lane)
    meta = {"dtype": dtype_name(run_dtype), "threads": threads, "prefix_tokens": len(reference.prompt.prefix_ids), "task": task.name, "model": base.identity}
    if head is not None:
        meta["head"] = head_document(head, options.head or str(task.head))
    return lanes, meta


def check_head_options(options: BenchOptions, records: list) -> None:
    """Refuse a head the workload cannot use before any model loads: a head beside an extraction task, or
    ``--head fit`` on records without the task's gold labels.

    Raises:
        InputError: naming the problem.
    """
    task = load_any_task(options.task)
    if options.head is not None and isinstance(task, ExtractTask):
        raise InputError(f"{setting('head')} scores labels; task {task.name!r} is an extraction task")
    if options.head == FIT:
        gold_labels(records, task)
    elif options.head is not None:
        load_head(options.head)  # a missing or unreadable file is refused here


def run_bench(options: BenchOptions, log: Callable[[str], None] = print) -> tuple[BenchReport, dict]:
    """Run every lane on the workload and return the report plus the JSON document, whose ``machine`` names
    this machine (:func:`prefixcache.model.machine.machine_info`) at the document's run dtype and threads."""
    report, document = run_workload(options, log)
    document["machine"] = machine_info(document["dtype"], document["threads"])
    return report, document


def run_workload(options: BenchOptions, log: Callable[[str], None]) -> tuple[BenchReport, dict]:
    """Run every lane on the workload and return the report plus the JSON document.

    An extraction task (``kind: extract``) runs :func:`prefixcache.bench.extract_lanes.run_extract_bench` instead,
    and a task whose labels share first tokens runs the many-label lanes (:mod:`.label_lanes`).
    """
    records = bench_records(options)
    check_head_options(options, records)
    if isinstance(load_any_task(options.task), ExtractTask):
        return run_extract_bench(options, log)
    loaded = load_base(options, log)
    base = loaded[0]
    task = load_task(options.task)
    if Classifier(base, without_head(task)).method == "full":
        return run_many_labels(options, base, task, records, log)
    lanes, meta = build_lanes(options, records, log, loaded)
    tokenizer = base.tokenizer
    suffix_tokens = [len(tokenizer(str(r.fields["text"]), add_special_tokens=False)["input_ids"]) for r in records]
    mean_suffix = sum(suffix_tokens) / len(suffix_tokens)
    rows = max(1, round(options.batch_size * mean_suffix))  # M of one batched pass, for the shape peak
    dtypes = sorted({lane.dtype for lane in lanes if lane.dtype in ("float32", "bfloat16", "float16")})
    peaks, shapes = measure_peaks(base, dtypes, rows, log)
    shape_peaks = {d: s.gflops for d, s in shapes.items()}
    on_lane = lambda name: log(f"running {name} on {len(records)} items ...")  # noqa: E731
    report = run_lanes(lanes, records, peaks, on_lane, shape_peaks)
    document = {
        **meta,
        "items": len(records),
        "peak_gflops": peaks.get(meta["dtype"]),
        "peaks_gflops": peaks,
        "shape_peak_gflops": shape_peaks.get(meta["dtype"]),
        "shape_peaks_gflops": shape_peaks,
        "shape_peak_rows": rows,
        "shape_peak_projections": {d: [p.to_json() for p in s.projections] for d, s in shapes.items()},
        "mean_suffix_tokens": mean_suffix,
        "modes": [r.to_json() for r in report.results],
    }
    if options.sweep_targets:
        points = sweep_prefix(
            base if meta["dtype"] == "float32" else same_dtype_copy(base, getattr(torch, meta["dtype"])),
            without_head(load_task(options.task)),
            records[: options.sweep_items],
            options.sweep_targets,
            options.batch_size,
            options.sweep_full_items,
            on_point=lambda p: log(f"sweep: prefix {p.prefix_tokens} tokens: full {p.full_ms_per_item:.1f} ms/item, batched {p.batched_ms_per_item:.2f} ms/item"),
        )
        document["sweep"] = [asdict(p) | {"speedup": p.speedup} for p in points]
    return report, document


def measure_peaks(
    base: LoadedModel, dtypes: list[str], rows: int, log: Callable[[str], None]
) -> tuple[dict[str, float], dict[str, ShapePeak]]:
    """At each dtype name in ``dtypes``: the square-matmul peak (GFLOP/s) and the peak of one decoder layer's
    projections of ``base`` at ``rows`` rows (M = batch size x mean suffix tokens: one batched pass)."""
    peaks = {d: matmul_peak_gflops(getattr(torch, d), base.device) for d in dtypes}
    shapes = {d: shape_peak(base.model, rows, getattr(torch, d), base.device) for d in dtypes}
    log("matmul peak: " + ", ".join(f"{d} {g:.0f} GFLOP/s" for d, g in peaks.items()))
    log(f"matmul peak at the model's projection shapes, M = {rows} rows: "
        + ", ".join(f"{d} {s.gflops:.0f} GFLOP/s" for d, s in shapes.items()))
    return peaks, shapes


def bench_records(options: BenchOptions) -> list:
    """The synthetic tickets, or ``options.items`` records sampled from ``options.records``."""
    if options.records is None:
        return ticket_records(options.items)
    return file_records(options.records, load_any_task(options.task), options.items, options.label_field)


def run_many_labels(options: BenchOptions, base: LoadedModel, task, records: list, log: Callable[[str], None]):
    """The many-label lanes (float32) and their document."""
    peak = matmul_peak_gflops(torch.float32, base.device)
    log(f"matmul peak: float32 {peak:.0f} GFLOP/s")
    results, labels = run_label_bench(options, base, task, records, peak, log)
    classifier = Classifier(base, without_head(task), "full")
    document = {
        "dtype": "float32", "threads": torch.get_num_threads(), "prefix_tokens": len(classifier.prompt.prefix_ids),
        "task": task.name, "model": base.identity, "items": len(records), "peak_gflops": peak,
        "peaks_gflops": {"float32": peak}, "labels": labels,
        "modes": labels["subset_modes"] + labels["modes"],
    }
    return BenchReport(results, {"float32": peak}), document
