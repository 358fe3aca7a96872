"""``prefixcache bench``: every mode (and llama.cpp) timed on the same records in one run.
Every default is :class:`~prefixcache.bench.options.BenchOptions`'."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from ..bench.options import SWEEP_TARGETS, BenchOptions
from ..model.catalog import DTYPE_CHOICES
from ..types import BACKENDS
from .errors import reported, choice, err, out, output_path
from .loading import quiet_transformers
from .options import BackendOpt, DtypeOpt, ThreadsOpt
from .reports import timing_table

BENCH = BenchOptions()
RAY_WORKERS = typer.Option(
    [], "--ray-workers", min=1, help="Instead: the same records through a local Ray of N workers (repeat for "
    "several rows) against one process with all cores and with one thread; a markdown table."
)


@reported
def bench(
    task: str = typer.Option(BENCH.task, "--task", help="Task whose prefix is cached (default: ~145 tokens, 3 labels)."),
    items: int = typer.Option(BENCH.items, "--items", min=1, help="Number of records (synthetic tickets of 20-35 tokens, or --records rows)."),
    records: Optional[str] = typer.Option(
        None, "--records", help="Sample --items records from this file (CSV/JSONL/Parquet with a text field) instead of "
        "synthetic tickets; rows that are task examples are left out."
    ),
    label_field: str = typer.Option(BENCH.label_field, "--label-field", help="The --records field holding gold labels (for --head fit)."),
    full_items: int = typer.Option(
        BENCH.full_items, "--full-items", min=1, help="Labels that share first tokens: records for the full and per-label lanes."
    ),
    before_batch_size: int = typer.Option(
        BENCH.before_batch_size, "--before-batch-size", min=1, help="Labels that share first tokens: the per-label lane's batch."
    ),
    model: str = typer.Option(BENCH.model, "--model", help="Embedded name, .gguf path, HF id or local folder."),
    model_config: Optional[str] = typer.Option(None, "--model-config", help="Architecture for --random-weights: qwen2.5-0.5b."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Random weights of --model-config (speed only)."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    batch_size: int = typer.Option(BENCH.batch_size, "--batch-size", min=1, help="Records per forward pass (batched mode)."),
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every figure as one JSON object."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write the mode comparison as a PNG chart."),
    sweep: bool = typer.Option(False, "--sweep-prefix", help="Also time full vs batched at prefixes of ~150 to 2,000 tokens."),
    sweep_plot: Optional[Path] = typer.Option(None, "--sweep-plot", help="PNG for the prefix sweep (default: next to --plot)."),
    no_llama_cpp: bool = typer.Option(False, "--no-llama-cpp", help="Skip the llama.cpp lane."),
    head: Optional[str] = typer.Option(
        None, "--head", help="A fitted label head (prefixcache fit), or 'fit' to fit one on the bench's own records "
        "first (timing only): adds full+head and batched+head lanes. Default: the task file's head:, if any."
    ),
    ray_workers: list[int] = RAY_WORKERS,
    backend: str = BackendOpt,
):
    """Time full, cached, batched (and llama.cpp) on the same records in one run; report ratios and % of peak.
    With a head, also full and batched through it (agreement measured against full+head). With labels that
    share first tokens: whole-label scoring through the label trie beside the per-label path and full."""
    from ..bench.job import run_bench

    if random_weights != bool(model_config):
        raise typer.BadParameter("--random-weights and --model-config go together")
    for path, name in ((json_path, "--json"), (plot, "--plot"), (sweep_plot, "--sweep-plot")):
        output_path(path, name)
    options = BenchOptions(
        task=task, items=items, model=model, model_config=model_config, dtype=choice(dtype, DTYPE_CHOICES, "--dtype"),
        threads=threads, batch_size=batch_size, llama_cpp=not no_llama_cpp,
        sweep_targets=SWEEP_TARGETS if sweep else (), head=head, records=records, label_field=label_field,
        full_items=full_items, before_batch_size=before_batch_size, backend=choice(backend, BACKENDS, "--backend"),
    )
    quiet_transformers()
    if ray_workers:
        return ray_lane(options, tuple(ray_workers))
    report, document = run_bench(options, log=lambda line: err.print(line, highlight=False, markup=False))
    out.print(timing_table(report.results, document_title(document)))
    if json_path:
        json_path.write_text(json.dumps(document, indent=2))
        err.print(f"wrote {json_path}")
    if plot or sweep_plot:
        write_plots(report, document, plot, sweep_plot)


def write_plots(report, document: dict, plot: Optional[Path], sweep_plot: Optional[Path]) -> None:
    """The mode chart at ``plot``; the prefix sweep's chart at ``sweep_plot`` (default: next to ``plot``)."""
    from ..bench.lanes import SweepPoint
    from ..bench.plots import plot_modes, plot_sweep

    if plot:
        floor = document.get("labels", {}).get("floor", {}).get("ms")
        err.print(f"wrote {plot_modes(report.results, plot, document_title(document), floor)}")
    if "sweep" in document:
        target = sweep_plot or (plot.with_name(plot.stem + "-sweep.png") if plot else Path("bench-sweep.png"))
        points = [SweepPoint(p["prefix_tokens"], p["examples"], p["full_ms_per_item"], p["batched_ms_per_item"])
                  for p in document["sweep"]]
        err.print(f"wrote {plot_sweep(points, target, 'per-item time vs prefix length: ' + document['model'])}")


def document_title(document: dict) -> str:
    return f"{document['model']} | {document['items']} items | prefix {document['prefix_tokens']} tok | {document['threads']} threads"


def ray_lane(options: BenchOptions, workers: tuple[int, ...]) -> None:
    """``--ray-workers``: the bench's records through one process and through local Ray; prints the table."""
    import os

    from ..bench.job import bench_records
    from ..scaleout.bench_lane import RayBench, ray_table, run_ray_bench

    if options.model_config:
        raise typer.BadParameter("--ray-workers loads --model in every worker; use --model random:ARCH instead")
    cores = len(os.sched_getaffinity(0))
    setup = RayBench(options.task, options.model, options.dtype, options.batch_size, cores, workers)
    records = bench_records(options)
    rows = run_ray_bench(setup, records, log=lambda line: err.print(line, highlight=False))
    load = os.getloadavg()
    out.print(f"{options.model} ({rows[0].dtype}), task {options.task}, {len(records)} records, batch "
              f"{options.batch_size}, {cores} cores; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f}\n",
              highlight=False)
    out.print(ray_table(rows, len(records)), highlight=False, soft_wrap=True)
