"""The extraction benchmark: time to first token and tokens/s, cached vs uncached, on the same records.

``prefixcache bench --task <extraction task>`` runs :func:`run_extract_bench`; its rows are the
classification benchmark's :class:`~prefixcache.bench.lanes.ModeResult`, so one table prints both.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Callable

from ..eval.verify_extract import compare_extractions
from ..run.extract import ExtractStats, Extractor
from ..types import Mode, Record, RunConfig
from .lanes import BenchReport, ModeResult, dtype_name
from .options import BenchOptions


@dataclass(frozen=True)
class ExtractLaneResult:
    """One extraction lane's figures; ``identical`` is the share of records whose output equals the ``full`` lane's."""

    mode: str
    batch_size: int
    records: int
    seconds: float
    ttft_ms_mean: float
    ttft_ms_p50: float
    tokens_generated: int
    tokens_per_s: float
    prefill_tokens: int
    identical: float
    parse_errors: int

    def to_json(self) -> dict:
        return asdict(self)


def bench_extract(
    extractor: Extractor, records: list[Record], batch_size: int, log: Callable[[str], None] = print
) -> list[ExtractLaneResult]:
    """Time full (uncached), cached and batched extraction on the same records, after a warm-up."""
    extractor.extract_all(records[:1], RunConfig(Mode.BATCHED, 1))  # builds the prefix, warms kernels
    results, reference = [], None
    for mode in Mode:  # full (the reference) first
        size = mode.pass_size(batch_size)
        log(f"running extract [{mode}] on {len(records)} records ...")
        stats = ExtractStats()
        started = time.perf_counter()
        outputs = extractor.extract_all(records, RunConfig(mode, size), stats=stats)
        seconds = time.perf_counter() - started
        reference = reference or outputs
        ttft = [1000 * s for s in stats.first_token_s] or [0.0]
        results.append(
            ExtractLaneResult(
                mode.value, size, len(records), seconds, statistics.fmean(ttft), statistics.median(ttft),
                stats.tokens_generated,
                stats.tokens_generated / seconds if seconds else 0.0, stats.prefill_tokens,
                compare_extractions(reference, outputs).rate, stats.parse_errors,
            )
        )
    return results


def run_extract_bench(options: BenchOptions, log: Callable[[str], None] = print) -> tuple[BenchReport, dict]:
    """``prefixcache bench --task <extract task>``: ``(BenchReport, document)``, like :func:`prefixcache.bench.lanes.run_bench`.

    The report's rows are :class:`~prefixcache.bench.lanes.ModeResult` (``label_agreement`` is the share of
    identical outputs); the document's ``extract`` list holds time-to-first-token and tokens/s per lane.
    """
    from ..model.load import load_model, load_random_model, set_threads
    from ..spec.task import load_any_task
    from .workload import ticket_records

    task = load_any_task(options.task)
    threads = set_threads(options.threads)
    if options.model_config:
        loaded = load_random_model(options.model_config, options.dtype, threads, tokenizer_from=options.model)
    else:
        loaded = load_model(options.model, options.dtype, threads)
    extractor = Extractor(loaded, task)
    log(f"model {loaded.identity}, {threads} threads, dtype {dtype_name(loaded.dtype)}, extract task {task.name}")
    records = ticket_records(options.items)
    lanes = bench_extract(extractor, records, options.batch_size, log)
    full_seconds = lanes[0].seconds
    for lane in lanes:
        log(
            f"extract [{lane.mode}] B={lane.batch_size}: time to first token {lane.ttft_ms_mean:.1f} ms (median "
            f"{lane.ttft_ms_p50:.1f}), {lane.tokens_per_s:.1f} tokens/s, {lane.identical:.0%} identical to uncached"
        )
    rows = [
        ModeResult(
            lane.mode, dtype_name(loaded.dtype), lane.batch_size, lane.records, lane.seconds,
            full_seconds / lane.seconds if lane.seconds else float("inf"), lane.identical, 0.0,
            lane.prefill_tokens + lane.tokens_generated,
        )
        for lane in lanes
    ]
    document = {
        "model": loaded.identity, "dtype": dtype_name(loaded.dtype), "threads": threads, "task": task.name,
        "kind": "extract", "items": len(records), "prefix_tokens": len(extractor.prompt.prefix_ids),
        "prefix_seconds": extractor.prefix_seconds, "modes": [r.to_json() for r in rows],
        "extract": [lane.to_json() for lane in lanes],
    }
    return BenchReport(rows, {}), document
