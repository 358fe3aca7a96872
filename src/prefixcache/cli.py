"""The command line: the one boundary where domain errors become messages and exit codes.

Exit codes: 0 success, 1 verification disagreement or a record failed, 2 a usage
or input error (the message says what to do). ``PREFIXCACHE_DEBUG=1`` re-raises.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from . import data
from .errors import PrefixCacheError
from .models import DEFAULT_MODEL, DTYPE_CHOICES, EMBEDDED, load_model
from .prompt import METHODS
from .runner import MODES, Classifier, RunConfig, RunStats
from .task import bundled_task_names, load_task

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="Run small language models on narrow automation jobs through a cached prompt prefix.",
)
err = Console(stderr=True)
out = Console(width=None if sys.stdout.isatty() else 120)

DEFAULTS = RunConfig()


def _choice(value: str, choices, name: str) -> str:
    if value not in choices:
        raise typer.BadParameter(f"{name} must be one of {', '.join(choices)}")
    return value


def boundary(fn):
    """Turn domain errors into a one-line message and exit code 2 (unless PREFIXCACHE_DEBUG is set)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except PrefixCacheError as exc:
            if os.environ.get("PREFIXCACHE_DEBUG"):
                raise
            err.print(f"[bold red]error:[/] {exc}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


def _quiet_transformers() -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()


def _setup(task: str, model: str, dtype: str, threads: Optional[int], method: str) -> Classifier:
    _quiet_transformers()
    spec = load_task(task)
    started = time.perf_counter()
    loaded = load_model(model, _choice(dtype, DTYPE_CHOICES, "--dtype"), threads)
    err.print(f"model {loaded.identity} ({str(loaded.dtype).removeprefix('torch.')}) loaded in {time.perf_counter() - started:.1f} s")
    return Classifier(loaded, spec, _choice(method, METHODS, "--method"))


TaskOpt = typer.Option("support-tickets", "--task", help="A bundled task name or a path to a task YAML.")
ModelOpt = typer.Option(DEFAULT_MODEL, "--model", help="Embedded name, .gguf path, HF id or local folder.")
DtypeOpt = typer.Option("auto", "--dtype", help=f"One of {', '.join(DTYPE_CHOICES)}.")
ThreadsOpt = typer.Option(None, "--threads", help="Torch threads (default: all cores).")
MethodOpt = typer.Option("auto", "--method", help="Label scoring: auto, first-token or full.")
ModeOpt = typer.Option(DEFAULTS.mode, "--mode", help=f"One of {', '.join(MODES)}.")
BatchOpt = typer.Option(DEFAULTS.batch_size, "--batch-size", min=1, help="Records per forward pass (batched mode).")
TextFieldOpt = typer.Option("text", "--text-field", help="Field holding the record's text.")
IdFieldOpt = typer.Option(None, "--id-field", help="Field holding the record id (default: 0-based row number).")


def _progress(total: Optional[int], desc: str):
    bar = tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
    return bar


@app.command()
@boundary
def classify(
    input: str = typer.Argument(..., help="Input .csv, .jsonl, .parquet, or - for JSONL on stdin."),
    task: str = TaskOpt,
    model: str = ModelOpt,
    mode: str = ModeOpt,
    batch_size: int = BatchOpt,
    method: str = MethodOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", help="Output JSONL (default: stdout)."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
):
    """Classify every record; write one JSON line per record: id, label, scores, margin."""
    config = RunConfig(_choice(mode, MODES, "--mode"), batch_size)
    classifier = _setup(task, model, dtype, threads, method)
    records = list(data.read_records(input, text_field, id_field))
    stats = RunStats()
    with (open(out_path, "w", encoding="utf-8") if out_path else nullcontext(sys.stdout)) as sink:
        with _progress(len(records), f"classify [{config.mode}]") as bar:
            for _ in data.write_jsonl(classifier.classify(records, config, progress=bar.update, stats=stats), sink):
                pass
    err.print(
        f"{stats.records} records in {stats.seconds:.1f} s ({stats.records / max(stats.seconds, 1e-9):.1f} rec/s), "
        f"{stats.errors} errors, {stats.boundary_fallbacks} boundary fallbacks"
        + (f"; wrote {out_path}" if out_path else "")
    )
    if stats.errors:
        raise typer.Exit(1)


@app.command()
@boundary
def verify(
    input: str = typer.Argument(..., help="Input .csv, .jsonl, .parquet, or - for JSONL on stdin."),
    task: str = TaskOpt,
    model: str = ModelOpt,
    mode: str = typer.Option("batched", "--mode", help="The cached mode to check: cached or batched."),
    batch_size: int = BatchOpt,
    method: str = MethodOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of a table."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
):
    """Run full re-encoding and a cached mode on every record; exit 1 if any label differs."""
    from .verify import verify as run_verify

    config = RunConfig(_choice(mode, ("cached", "batched"), "--mode"), batch_size)
    classifier = _setup(task, model, dtype, threads, method)
    records = list(data.read_records(input, text_field, id_field))
    with _progress(2 * len(records), f"verify [full + {config.mode}]") as bar:
        result = run_verify(classifier, records, config, progress=bar.update)
    agreement = result.agreement
    if as_json:
        print(json.dumps(agreement.to_json()))
    else:
        table = Table(title=f"verify: full vs {config.mode} ({classifier.method} scoring, {classifier.loaded.dtype})")
        for col in ("records", "agree", "agreement", "max |Δ log-prob|", "disagreeing ids"):
            table.add_column(col)
        table.add_row(
            str(agreement.records),
            str(agreement.agree),
            f"{100 * agreement.rate:.2f}%",
            f"{agreement.max_abs_logprob_diff:.2e}",
            ", ".join(map(str, agreement.disagreeing_ids[:20])) or "none",
        )
        out.print(table)
    if not agreement.ok:
        raise typer.Exit(1)


@app.command()
@boundary
def tasks():
    """List the bundled tasks."""
    table = Table(title="bundled tasks (pass --task NAME or --task path/to/task.yaml)")
    for col in ("name", "labels", "examples", "input template"):
        table.add_column(col)
    for name in bundled_task_names():
        spec = load_task(name)
        table.add_row(name, ", ".join(spec.labels), str(len(spec.examples)), spec.input_template)
    out.print(table)


@app.command()
def models():
    """List the embedded models and the other accepted --model forms."""
    table = Table(title="models")
    table.add_column("--model")
    table.add_column("what")
    for name, entry in EMBEDDED.items():
        table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), entry.description)
    table.add_row("path/to/model.gguf", "any llama.cpp GGUF that transformers can dequantize")
    table.add_row("Qwen/Qwen2.5-0.5B-Instruct", "a Hugging Face id (needs the hub or its local cache)")
    table.add_row("path/to/folder", "a local Hugging Face model folder")
    out.print(table)


@app.command()
@boundary
def demo(
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    batch_size: int = BatchOpt,
    subset: int = typer.Option(60, "--subset", min=1, help="Tickets in the side-by-side timing."),
    out_dir: Path = typer.Option(Path("prefixcache-out"), "--out-dir", help="Where the results folder is made."),
):
    """Classify the 600 bundled support tickets, print accuracy and a full/cached/batched timing table."""
    from .demo import run_demo

    classifier = _setup("support-tickets", model, dtype, threads, "auto")
    run_demo(classifier, batch_size, subset, out_dir, out, err)


@app.command()
@boundary
def bench(
    task: str = typer.Option("tickets-compact", "--task", help="Task whose prefix is cached (default: ~145 tokens, 3 labels)."),
    items: int = typer.Option(600, "--items", min=1, help="Number of synthetic tickets (20-35 tokens each)."),
    model: str = ModelOpt,
    model_config: Optional[str] = typer.Option(None, "--model-config", help="Architecture for --random-weights: qwen2.5-0.5b."),
    random_weights: bool = typer.Option(False, "--random-weights", help="Random weights of --model-config (speed only)."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    batch_size: int = BatchOpt,
    json_path: Optional[Path] = typer.Option(None, "--json", help="Write every figure as one JSON object."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write the mode comparison as a PNG chart."),
    sweep: bool = typer.Option(False, "--sweep-prefix", help="Also time full vs batched at prefixes of ~150 to 2,000 tokens."),
    sweep_plot: Optional[Path] = typer.Option(None, "--sweep-plot", help="PNG for the prefix sweep (default: next to --plot)."),
    no_llama_cpp: bool = typer.Option(False, "--no-llama-cpp", help="Skip the llama.cpp lane."),
):
    """Time full, cached, batched (and llama.cpp) on the same records in one run; report ratios and % of peak."""
    from .bench import BenchOptions, run_bench
    from .demo import timing_table

    if random_weights != bool(model_config):
        raise typer.BadParameter("--random-weights and --model-config go together")
    _quiet_transformers()
    options = BenchOptions(
        task=task, items=items, model=model, model_config=model_config, dtype=_choice(dtype, DTYPE_CHOICES, "--dtype"),
        threads=threads, batch_size=batch_size, llama_cpp=not no_llama_cpp,
        sweep_targets=(150, 300, 600, 1000, 1500, 2000) if sweep else (),
    )
    report, document = run_bench(options, log=lambda line: err.print(line, highlight=False))
    title = f"{document['model']} | {document['items']} items | prefix {document['prefix_tokens']} tok | {document['threads']} threads"
    out.print(timing_table(report.results, title))
    if json_path:
        json_path.write_text(json.dumps(document, indent=2))
        err.print(f"wrote {json_path}")
    if plot or sweep_plot:
        from .plots import plot_modes, plot_sweep

        if plot:
            err.print(f"wrote {plot_modes(report.results, plot, title)}")
        if "sweep" in document:
            from .bench import SweepPoint

            target = sweep_plot or (plot.with_name(plot.stem + "-sweep.png") if plot else Path("bench-sweep.png"))
            points = [SweepPoint(p["prefix_tokens"], p["examples"], p["full_ms_per_item"], p["batched_ms_per_item"]) for p in document["sweep"]]
            err.print(f"wrote {plot_sweep(points, target, 'per-item time vs prefix length: ' + document['model'])}")


def main() -> None:  # pragma: no cover - entry point
    app()
