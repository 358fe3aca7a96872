"""The plain lane's table, verdict and ``--json`` document."""

from __future__ import annotations

import json
import os

from .clients import machine_load
from .judge import Lane, settle
from .options import LoadTestOptions
from .reference import Ceiling


def report(lanes: list[Lane], options: LoadTestOptions, ceiling: Ceiling, tolerance: float) -> bool:
    """Settle each lane's changed labels, print the table and the summary, write ``options.json_path``; True when
    nothing failed and the throughput ratio meets the target."""
    first, second = lanes
    bounds = [settle(lane, options.near_tie) for lane in lanes]
    faster, slower = (second, first) if options.openai else (first, second)
    ratio = faster.items_per_second / slower.items_per_second if slower.items_per_second else float("inf")
    print_table(lanes)
    errors = sum(len(lane.errors) + len(lane.mismatches) for lane in lanes)
    near = sum(lane.near_ties for lane in lanes)
    diff = max(lane.max_prob_diff for lane in lanes)
    target = options.openai_target if options.openai else options.target
    if options.openai:
        print(f"\n[openai] prompt tokens reused from the pool per request: smallest {second.cached_min:.1%}, "
              f"mean {second.cached_mean:.1%} (target >= 90%)")
    print(f"\nthroughput ratio ({faster.name} / {slower.name}): {ratio:.2f}x  (target >= {target:g}x); "
          f"load average at the end {machine_load()} on {os.cpu_count()} CPUs")
    print(f"responses equal to the sequential result: {'all' if not errors else 'NOT all'}; max |prob diff| {diff:.1e} "
          f"(tolerance {tolerance:g}); max |log-prob diff| {max(lane.max_logprob_diff for lane in lanes):.1e}; "
          f"near-tie label flips flagged: {near} (margin <= {max(bounds):.2g})")
    print(f"engine in-process on the same items (no HTTP): {ceiling.one_ms:.1f} ms/item one per pass, "
          f"{ceiling.batched_ms:.1f} ms/item at B={ceiling.batch}: ceiling {ceiling.ratio:.2f}x; "
          f"at 100% of the {ceiling.dtype} matmul peak ({ceiling.peak_gflops:.0f} GFLOP/s) a batched item would take "
          f"{ceiling.ideal_ms:.3g} ms: bound {ceiling.bound:.1f}x")
    for lane in lanes:
        for line in (lane.errors + lane.mismatches)[:5]:
            print(f"  [{lane.name}] {line}")
    ok = errors == 0 and ratio >= target
    print("PASS" if ok else "FAIL")
    if options.json_path:
        summary = {"ratio": ratio, "errors": errors, "near_ties": near, "max_prob_diff": diff}
        write_json(options, lanes, ceiling, summary)
    return ok


def print_table(lanes: list[Lane]) -> None:
    head = f"{'lane':<22}{'items':>7}{'errors':>8}{'mismatch':>10}{'items/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'mean pass':>11}{'pass ms':>9}{'busy':>6}"
    print("\n" + head + "\n" + "-" * len(head))
    for lane in lanes:
        mean_pass = lane.pass_items / lane.passes if lane.passes else float("nan")
        pass_ms = 1000 * lane.pass_seconds / lane.passes if lane.passes else float("nan")
        print(f"{lane.name:<22}{lane.items:>7}{len(lane.errors):>8}{len(lane.mismatches):>10}{lane.items_per_second:>10.2f}"
              f"{lane.percentile(0.5):>9.0f}{lane.percentile(0.99):>9.0f}{mean_pass:>11.1f}{pass_ms:>9.0f}{lane.busy:>6.0%}")


def lane_figures(lane: Lane) -> dict:
    """One lane's entry of the JSON document."""
    return {"name": lane.name, "max_batch": lane.max_batch, "items": lane.items, "seconds": lane.seconds,
            "items_per_second": lane.items_per_second, "p50_ms": lane.percentile(0.5), "p99_ms": lane.percentile(0.99),
            "errors": len(lane.errors), "mismatches": len(lane.mismatches), "passes": lane.passes,
            "pass_seconds": lane.pass_seconds, "api": lane.api, "cached_min": lane.cached_min}


def write_json(options: LoadTestOptions, lanes: list[Lane], ceiling: Ceiling, summary: dict) -> None:
    """The figures as one JSON object at ``options.json_path`` (``summary``: ratio, errors, near_ties,
    max_prob_diff), with the machine it ran on."""
    from ...model.machine import machine_info  # torch: only once the figures are in

    document = {"machine": machine_info(ceiling.dtype, options.served.threads), "ratio": summary["ratio"],
                "engine_ceiling": ceiling.ratio, "arithmetic_bound": ceiling.bound, "engine_one_ms": ceiling.one_ms,
                "engine_batched_ms": ceiling.batched_ms, "cpus": os.cpu_count(), "load_average_end": os.getloadavg(),
                "errors": summary["errors"], "near_ties": summary["near_ties"], "max_prob_diff": summary["max_prob_diff"],
                "lanes": [lane_figures(lane) for lane in lanes]}
    with open(options.json_path, "w", encoding="utf-8") as fh:
        json.dump(document, fh, indent=2)
