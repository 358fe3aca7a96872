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

from ..io import records as data
from ..errors import PrefixCacheError
from ..model.load import DEFAULT_MODEL, DTYPE_CHOICES, EMBEDDED, load_model
from ..cache.pool import POLICIES, PoolConfig
from ..spec.prompt import METHODS
from ..cache.layouts import STORAGES
from ..run.classify import MODES, Classifier, RunConfig, RunStats
from ..spec.task import bundled_task_names, load_any_task, load_task

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


def _load(model: str, dtype: str, threads: Optional[int], trust_remote_code: bool = False):
    """Load ``--model``, saying which and how long it took."""
    _quiet_transformers()
    started = time.perf_counter()
    loaded = load_model(model, _choice(dtype, DTYPE_CHOICES, "--dtype"), threads, trust_remote_code=trust_remote_code)
    err.print(f"model {loaded.identity} ({str(loaded.dtype).removeprefix('torch.')}) loaded in {time.perf_counter() - started:.1f} s")
    return loaded


def _setup(task: str, model: str, dtype: str, threads: Optional[int], method: str, pool=None) -> Classifier:
    spec = load_task(task)
    return Classifier(_load(model, dtype, threads), spec, _choice(method, METHODS, "--method"), pool=pool)


TaskOpt = typer.Option("support-tickets", "--task", help="A bundled task name or a path to a task YAML.")
ModelOpt = typer.Option(DEFAULT_MODEL, "--model", help="Embedded name, .gguf path, HF id or local folder.")
DtypeOpt = typer.Option("auto", "--dtype", help=f"One of {', '.join(DTYPE_CHOICES)}.")
ThreadsOpt = typer.Option(None, "--threads", help="Torch threads (default: all cores).")
MethodOpt = typer.Option("auto", "--method", help="Label scoring: auto, first-token or full.")
ModeOpt = typer.Option(DEFAULTS.mode, "--mode", help=f"One of {', '.join(MODES)}.")
BatchOpt = typer.Option(DEFAULTS.batch_size, "--batch-size", min=1, help="Records per forward pass (batched mode).")
TextFieldOpt = typer.Option("text", "--text-field", help="Field holding the record's text.")
IdFieldOpt = typer.Option(None, "--id-field", help="Field holding the record id (default: 0-based row number).")
POOL_DEFAULTS = PoolConfig()
CacheBudgetOpt = typer.Option(None, "--cache-budget", help="Prefix pool byte budget such as 256MB (setting any cache option makes a pool; default 256MB).")
CacheDirOpt = typer.Option(None, "--cache-dir", help="Disk tier: prefixes are loaded from and saved to this folder.")
KVStorageOpt = typer.Option(POOL_DEFAULTS.storage, "--kv-storage", help=f"How the pool stores prefixes: {', '.join(STORAGES)}.")
EvictionOpt = typer.Option(POOL_DEFAULTS.eviction, "--eviction", help=f"Pool eviction policy: {', '.join(POLICIES)}.")


def _progress(total: Optional[int], desc: str):
    bar = tqdm(total=total, desc=desc, unit="rec", file=sys.stderr, dynamic_ncols=True, smoothing=0.1)
    return bar


@app.command()
@boundary
def classify(
    ctx: typer.Context,
    input: str = typer.Argument(..., help="Input .csv, .jsonl, .parquet (with --ray also a folder or URI), or - for JSONL on stdin."),
    task: str = TaskOpt,
    model: str = ModelOpt,
    mode: str = ModeOpt,
    batch_size: int = BatchOpt,
    method: str = MethodOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", help="Output JSONL (default: stdout); with --ray a folder for JSONL parts."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = typer.Option(None, "--threads", help="Torch threads (default: all cores; with --ray per worker, default 1)."),
    cache_budget: Optional[str] = CacheBudgetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    kv_storage: str = KVStorageOpt,
    eviction: str = EvictionOpt,
    on_error: str = typer.Option("skip", "--on-error", help="A failed record: skip (error line, go on) or fail (stop there)."),
    overflow: str = typer.Option("error", "--overflow", help="A record past the model's context: error, or truncate (flagged)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the job in --out: keep its complete lines, run the rest."),
    window: int = typer.Option(DEFAULTS.window, "--window", min=1, help="Records length-sorted and written together; "
                               "with --out, the unit that is flushed and fsynced (a kill loses at most one)."),
    ray: bool = typer.Option(False, "--ray", help="Run on a pool of Ray actors (needs the 'ray' extra); see docs/scale-out.md."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --ray: a running cluster (auto, HOST:6379, "
                                              "ray://HOST:10001); default: start a local Ray."),
    workers: int = typer.Option(2, "--workers", min=1, help="With --ray: worker processes, each with its own model and prefix."),
    num_gpus: float = typer.Option(0.0, "--num-gpus", min=0, help="With --ray: GPUs per worker (a fraction shares one)."),
):
    """Classify every record; write one JSON line per record: id, label, scores, margin (or error).

    Exit code 0: all classified; 1: some record failed (its line has "error"); 2: stopped (bad usage, an
    unreadable file, or --on-error fail). With --out --resume a killed job continues where it stopped.
    With --ray the records are read and classified on Ray workers; --out then names a folder of parts.
    """
    from ..spec.context import OVERFLOW
    from ..io.journal import ON_ERROR, Recovered, check_matches, recover, write_predictions

    config = RunConfig(_choice(mode, MODES, "--mode"), batch_size, window, _choice(overflow, OVERFLOW, "--overflow"))
    policy = _choice(on_error, ON_ERROR, "--on-error")
    _check_ray_options(ctx, ray, input, policy)
    if ray:
        return _classify_on_ray(input, task, model, config, method, text_field, id_field, out_path, dtype, threads,
                                cache_dir, ray_address, workers, num_gpus)
    if resume and out_path is None:
        raise typer.BadParameter("--resume needs --out: the output file is what it resumes")
    records = list(data.scan_records(input, text_field, id_field))
    done = recover(out_path) if resume else Recovered()
    check_matches(done, records, out_path)
    classifier = _setup(task, model, dtype, threads, method, _pool(cache_budget, cache_dir, kv_storage, eviction))
    stats = RunStats()
    with (open(out_path, "a" if resume else "w", encoding="utf-8") if out_path else nullcontext(sys.stdout)) as sink:
        with _progress(len(records), f"classify [{config.mode}]") as bar:
            bar.update(done.lines)
            predictions = classifier.classify(records[done.lines:], config, progress=bar.update, stats=stats)
            written = write_predictions(predictions, sink, policy, sync_every=config.window if out_path else None)
    err.print(
        f"{stats.records} records in {stats.seconds:.1f} s ({stats.records / max(stats.seconds, 1e-9):.1f} rec/s), "
        f"{written.failed} errors, {written.flagged} flagged, {stats.boundary_fallbacks} boundary fallbacks"
        + (f"; resumed after {done.lines} lines ({done.failed} errors)" if resume else "")
        + (f", cut a torn last line of {done.cut_bytes} bytes" if done.cut_bytes else "")
        + (f"; wrote {out_path}" if out_path else "")
    )
    _report_pool(classifier.pool)
    if done.failed + written.failed:
        raise typer.Exit(1)


RAY_ONLY = ("ray_address", "workers", "num_gpus")  # classify options that mean something only with --ray
NOT_WITH_RAY = {  # classify options that a Ray run cannot honour, and why
    "resume": "a Ray run writes a new folder of parts; rerun into a new --out folder",
    "window": "Ray workers are handed 4 x --batch-size rows per call; there is no output window to flush",
    "cache_budget": "each Ray worker keeps the one prefix it needs; --cache-dir shares it between workers",
    "kv_storage": "Ray workers store their prefix in float",
    "eviction": "each Ray worker keeps the one prefix it needs",
}


def _flag(ctx: typer.Context, name: str) -> str:
    return next(p.opts[0] for p in ctx.command.params if p.name == name)


def _given(ctx: typer.Context, name: str) -> bool:
    """Whether the option was set by the user (command line or environment), not left at its default."""
    source = ctx.get_parameter_source(name)  # a ParameterSource of click, or of the click that typer vendors
    return source is not None and source.name not in ("DEFAULT", "DEFAULT_MAP")


def _check_ray_options(ctx: typer.Context, ray: bool, input: str, on_error: str) -> None:
    """Refuse option combinations that mean nothing with (or without) ``--ray``, naming the options."""
    if not ray:
        given = [_flag(ctx, name) for name in RAY_ONLY if _given(ctx, name)]
        if given:
            verb, them = ("needs", "it") if len(given) == 1 else ("need", "them")
            raise typer.BadParameter(f"{', '.join(given)} {verb} --ray: add --ray, or drop {them} for a local run")
        return
    for name, why in NOT_WITH_RAY.items():
        if _given(ctx, name):
            raise typer.BadParameter(f"{_flag(ctx, name)} does not work with --ray: {why}")
    if on_error == "fail":
        raise typer.BadParameter("--on-error fail does not work with --ray: a failed record becomes an error line "
                                 "(as with --on-error skip) and the exit code is 1")
    if input == "-":
        raise typer.BadParameter("--ray reads files, not stdin: write the input to a .jsonl file and pass its path")


def _classify_on_ray(input, task, model, config, method, text_field, id_field, out_path, dtype, threads, cache_dir,
                     ray_address, workers, num_gpus) -> None:
    """``classify --ray``: the job is :func:`prefixcache.dist.run_ray_classify`; it prints the summary
    (items/s per worker and in total) through ``log``, on standard error, and the exit code follows its errors."""
    from ..dist import run_ray_classify

    def log(line: str) -> None:
        err.print(line, markup=False, highlight=False, soft_wrap=True)  # unwrapped: the summary is a table

    summary = run_ray_classify(
        input, out_path, task, model, workers, ray_address, num_gpus, config.batch_size, text_field, id_field,
        _choice(dtype, DTYPE_CHOICES, "--dtype"), threads, log,
        method=_choice(method, METHODS, "--method"), mode=config.mode, overflow=config.overflow, cache_dir=cache_dir,
    )
    if summary.errors:
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
    cache_budget: Optional[str] = CacheBudgetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    kv_storage: str = KVStorageOpt,
    eviction: str = EvictionOpt,
):
    """Run full re-encoding and a cached mode on every record; exit 1 if any label (or extracted output) differs."""
    from ..eval.verify import verify as run_verify

    config = RunConfig(_choice(mode, ("cached", "batched"), "--mode"), batch_size)
    pool = _pool(cache_budget, cache_dir, kv_storage, eviction)
    if _is_extract(task):
        return _verify_extract(input, task, model, config, text_field, id_field, as_json, dtype, threads, pool)
    classifier = _setup(task, model, dtype, threads, method, pool)
    records = list(data.read_records(input, text_field, id_field))
    with _progress(2 * len(records), f"verify [full + {config.mode}]") as bar:
        result = run_verify(classifier, records, config, progress=bar.update)
    agreement = result.agreement
    _report_agreement(
        as_json,
        agreement.to_json(),
        f"verify: full vs {config.mode} ({classifier.method} scoring, {classifier.loaded.dtype})",
        {
            "records": str(agreement.records),
            "agree": str(agreement.agree),
            "agreement": f"{100 * agreement.rate:.2f}%",
            "max |Δ log-prob|": f"{agreement.max_abs_logprob_diff:.2e}",
            "disagreeing ids": _some_ids(agreement.disagreeing_ids),
        },
    )
    _report_storage(classifier, records, config)
    if not agreement.ok:
        raise typer.Exit(1)


@app.command()
@boundary
def tasks():
    """List the bundled tasks."""
    from ..spec.selection import resolve_examples
    from ..spec.task import ExtractTask

    table = Table(title="bundled tasks (pass --task NAME or --task path/to/task.yaml)")
    for col in ("name", "kind", "labels / fields", "examples", "input template"):
        table.add_column(col)
    for name in bundled_task_names(kinds=("classify", "extract")):
        spec = load_any_task(name)
        if isinstance(spec, ExtractTask):
            table.add_row(name, "extract", ", ".join(spec.fields), str(len(spec.examples)), spec.input_template)
        else:
            shown = len(resolve_examples(spec).examples)
            table.add_row(name, "classify", ", ".join(spec.labels), str(shown), spec.input_template)
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
    from ..bench.lanes import BenchOptions, run_bench
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
        from ..bench.plots import plot_modes, plot_sweep

        if plot:
            err.print(f"wrote {plot_modes(report.results, plot, title)}")
        if "sweep" in document:
            from ..bench.lanes import SweepPoint

            target = sweep_plot or (plot.with_name(plot.stem + "-sweep.png") if plot else Path("bench-sweep.png"))
            points = [SweepPoint(p["prefix_tokens"], p["examples"], p["full_ms_per_item"], p["batched_ms_per_item"]) for p in document["sweep"]]
            err.print(f"wrote {plot_sweep(points, target, 'per-item time vs prefix length: ' + document['model'])}")


@app.command("eval")
@boundary
def eval_(
    input: str = typer.Argument(..., help="Labelled input .csv, .jsonl, .parquet, or - for JSONL on stdin."),
    task: str = TaskOpt,
    label_field: str = typer.Option("label", "--label-field", help="Field holding each record's gold label."),
    model: str = ModelOpt,
    batch_size: int = BatchOpt,
    method: str = MethodOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    calibrate: bool = typer.Option(False, "--calibrate", help="Also report contextual calibration, in the same run."),
    content_free: Optional[list[str]] = typer.Option(
        None,
        "--content-free",
        help="A content-free input for calibration (repeatable; implies --calibrate; default: 'N/A', '', '[MASK]').",
    ),
    sweep_examples: Optional[str] = typer.Option(
        None,
        "--sweep-examples",
        help="Example counts such as 0,3,6,12,24: one run each, drawn from examples + example_pool.",
    ),
    seed: Optional[int] = typer.Option(
        None, "--seed", help="Seed of the sweep's example order (default: the task's select.seed, else 0)."
    ),
    plot: Optional[Path] = typer.Option(
        None, "--plot", help="PNG: the confusion matrix, or accuracy and ms/item per sweep step."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
):
    """Score a task against gold labels: accuracy, macro-F1, per-label precision/recall, confusion matrix."""
    from ..eval.calibration import CONTENT_FREE
    from ..eval.report import check_plotting, emit
    from ..eval.evaluate import parse_steps, plan_eval, run_eval

    if plot:
        check_plotting()
    steps = parse_steps(sweep_examples) if sweep_examples is not None else None
    plan = plan_eval(load_task(task), data.read_records(input, text_field, id_field), label_field, steps, seed)
    classifier = _setup(task, model, dtype, threads, method)
    neutral = tuple(content_free) if content_free else CONTENT_FREE if calibrate else None

    def progress(r):
        err.print(
            f"{r.examples} examples, prefix {r.prefix_tokens} tokens: "
            f"accuracy {r.metrics.accuracy:.1%}, {r.ms_per_item:.2f} ms/item"
        )

    results = run_eval(classifier.loaded, plan, batch_size, method, neutral, on_result=progress)
    emit(results, plan.sweep, as_json, plot, out, err)


@app.command()
@boundary
def serve(
    task: list[str] = typer.Option(["support-tickets"], "--task", help="A bundled task name or a YAML path; repeat for more."),
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    method: str = MethodOpt,
    host: str = typer.Option("127.0.0.1", "--host", help="Interface to listen on (loopback by default)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="Port (0 picks a free one)."),
    max_batch: int = typer.Option(32, "--max-batch", min=1, help="Most items merged into one forward pass."),
    max_wait_ms: float = typer.Option(50.0, "--max-wait-ms", min=0, help="Longest an item waits for companions."),
    arrival_gap_ms: float = typer.Option(
        20.0, "--arrival-gap-ms", min=0, help="A pass that is not full starts once no item has arrived for this long."
    ),
    max_queue: int = typer.Option(1024, "--max-queue", min=1, help="Most items in progress at once (all requests); more gets 429."),
    max_items: int = typer.Option(256, "--max-items", min=1, help="Most items per request (422 above)."),
    max_item_tokens: int = typer.Option(512, "--max-item-tokens", min=1, help="Most tokens per item (422 above)."),
    max_body_bytes: int = typer.Option(1 << 20, "--max-body-bytes", min=1, help="Largest request body (413 above)."),
    max_prefix_tokens: int = typer.Option(8192, "--max-prefix-tokens", min=1, help="Largest prefix of an uploaded task."),
    cache_budget: Optional[str] = typer.Option(None, "--cache-budget", help="Byte budget of the server's prefix pool, such as 256MB."),
    trust_remote_code: bool = typer.Option(False, "--trust-remote-code", help="Run a model repository's own code (only for models you trust)."),
    log_level: str = typer.Option("info", "--log-level", help="uvicorn log level."),
):
    """Serve tasks over HTTP with micro-batching (FastAPI on uvicorn). Set PREFIXCACHE_API_KEY to require a key.

    Needs the 'serve' extra: pip install 'prefixcache[serve]'.
    """
    from ..cache.pool import parse_bytes
    from ..server import ServerSettings, run_server

    settings = ServerSettings.from_env(
        host=host, port=port, max_batch=max_batch, max_wait_ms=max_wait_ms, arrival_gap_ms=arrival_gap_ms,
        max_queue=max_queue, max_items=max_items,
        max_item_tokens=max_item_tokens, max_body_bytes=max_body_bytes, max_prefix_tokens=max_prefix_tokens,
        method=_choice(method, METHODS, "--method"),
        cache_budget_bytes=parse_bytes(cache_budget) if cache_budget else None,
    )
    specs = [load_any_task(name) for name in task]
    run_server(_load(model, dtype, threads, trust_remote_code), specs, settings, log_level)


# --- the prefix pool, its disk tier, and extraction tasks -------------------------------------


def _pool(cache_budget: Optional[str], cache_dir: Optional[Path], kv_storage: str, eviction: str):
    """A PrefixPool when any cache option is set, else None (then a classifier keeps its own prefix)."""
    from ..cache.pool import PrefixPool, parse_bytes
    from ..cache.disk import DiskStore

    storage = _choice(kv_storage, STORAGES, "--kv-storage")
    policy = _choice(eviction, POLICIES, "--eviction")
    if cache_budget is None and cache_dir is None and (storage, policy) == (POOL_DEFAULTS.storage, POOL_DEFAULTS.eviction):
        return None
    try:
        budget = parse_bytes(cache_budget) if cache_budget else POOL_DEFAULTS.budget_bytes
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--cache-budget") from None
    return PrefixPool(PoolConfig(budget, policy, storage), DiskStore(cache_dir) if cache_dir else None)


def _report_pool(pool) -> None:
    """One stderr line of pool figures (nothing without a pool)."""
    from ..cache.pool import format_bytes

    if pool is None:
        return
    s = pool.stats()
    saved = f", {s.storage} storage saves {format_bytes(s.bytes_saved)} against float" if s.bytes_saved else ""
    err.print(
        f"prefix pool: {s.hits} hits, {s.misses} misses ({s.disk_loads} loaded from disk, {s.partial_reuses} extended, "
        f"{s.disk_rejected} disk files rejected), {s.evictions} evictions, {format_bytes(s.bytes_held)} held of "
        f"{format_bytes(s.budget_bytes)}{saved}; {s.prefill_tokens_saved} prefill tokens saved",
        highlight=False,
    )


def _report_storage(classifier, records, config) -> None:
    """With a quantized pool: label agreement against float storage and memory saved, on stderr."""
    from ..cache.pool import format_bytes
    from ..cache.layouts import storage_agreement

    if classifier.pool is None or classifier.pool.config.storage == "float":
        return
    result = storage_agreement(classifier, records, config)
    err.print(
        f"{result.storage} storage vs float storage: labels agree on {result.agree}/{result.records} "
        f"({100 * result.rate:.2f}%), max |Δ log-prob| {result.max_abs_logprob_diff:.2e}; the prefix takes "
        f"{format_bytes(result.stored_bytes)} instead of {format_bytes(result.float_bytes)} ({100 * result.saved_fraction:.0f}% saved)",
        highlight=False,
    )


def _is_extract(task: str) -> bool:
    from ..spec.task import ExtractTask, load_any_task

    return isinstance(load_any_task(task), ExtractTask)


def _setup_extractor(task: str, model: str, dtype: str, threads: Optional[int], pool, max_new_tokens: Optional[int] = None):
    from ..run.extract import Extractor
    from ..spec.task import ExtractTask, load_any_task

    spec = load_any_task(task)
    if not isinstance(spec, ExtractTask):
        raise typer.BadParameter(f"task {spec.name!r} is a classification task; run it with `prefixcache classify`", param_hint="--task")
    return Extractor(_load(model, dtype, threads), spec, pool=pool, max_new_tokens=max_new_tokens)


def _report_agreement(as_json: bool, document: dict, title: str, row: dict[str, str]) -> None:
    """``verify``'s answer: the JSON document, or a one-row table (column -> cell)."""
    if as_json:
        print(json.dumps(document))
        return
    table = Table(title=title)
    for column in row:
        table.add_column(column)
    table.add_row(*row.values())
    out.print(table)


def _some_ids(ids: list, limit: int = 20) -> str:
    return ", ".join(map(str, ids[:limit])) or "none"


def _verify_extract(input, task, model, config, text_field, id_field, as_json, dtype, threads, pool) -> None:
    """``verify`` for an extraction task: uncached vs cached generation must be identical, token for token."""
    from ..run.extract import verify_extract

    extractor = _setup_extractor(task, model, dtype, threads, pool)
    records = list(data.read_records(input, text_field, id_field))
    with _progress(2 * len(records), f"verify extract [full + {config.mode}]") as bar:
        agreement, _, _ = verify_extract(extractor, records, config, progress=bar.update)
    _report_agreement(
        as_json,
        agreement.to_json(),
        f"verify extract: uncached vs {config.mode} ({extractor.loaded.dtype})",
        {
            "records": str(agreement.records),
            "identical": str(agreement.identical),
            "identical %": f"{100 * agreement.rate:.2f}%",
            "same fields": str(agreement.same_fields),
            "differing ids": _some_ids(agreement.differing_ids),
        },
    )
    _report_pool(pool)
    if not agreement.ok:
        raise typer.Exit(1)


@app.command()
@boundary
def extract(
    input: str = typer.Argument(..., help="Input .csv, .jsonl, .parquet, or - for JSONL on stdin."),
    task: str = typer.Option("ticket-fields", "--task", help="A bundled extraction task or a path to a task YAML (kind: extract)."),
    model: str = ModelOpt,
    mode: str = ModeOpt,
    batch_size: int = BatchOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    out_path: Optional[Path] = typer.Option(None, "--out", help="Output JSONL (default: stdout)."),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", min=1, help="Override the task's max_new_tokens."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    cache_budget: Optional[str] = CacheBudgetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    kv_storage: str = KVStorageOpt,
    eviction: str = EvictionOpt,
):
    """Extract the task's fields from every record by greedy generation after the cached prefix.

    Writes one JSON line per record: id, fields, raw (the generated text), error (a parse failure names
    what is wrong). Exit code 1 when any record has an error.
    """
    from ..run.extract import ExtractStats

    config = RunConfig(_choice(mode, MODES, "--mode"), batch_size)
    pool = _pool(cache_budget, cache_dir, kv_storage, eviction)
    extractor = _setup_extractor(task, model, dtype, threads, pool, max_new_tokens)
    records = list(data.read_records(input, text_field, id_field))
    stats = ExtractStats()
    with (open(out_path, "w", encoding="utf-8") if out_path else nullcontext(sys.stdout)) as sink:
        with _progress(len(records), f"extract [{config.mode}]") as bar:
            for extraction in extractor.extract(records, config, progress=bar.update, stats=stats):
                sink.write(json.dumps(extraction.to_json(), ensure_ascii=False) + "\n")
                sink.flush()
    err.print(
        f"{stats.records} records in {stats.seconds:.1f} s, {stats.tokens_generated} tokens generated "
        f"({stats.tokens_generated / max(stats.seconds, 1e-9):.1f} tokens/s), {stats.errors} errors "
        f"({stats.parse_errors} unparsable outputs)" + (f"; wrote {out_path}" if out_path else ""),
        highlight=False,
    )
    _report_pool(pool)
    if stats.errors:
        raise typer.Exit(1)


cache_app = typer.Typer(no_args_is_help=True, help="The prefix pool's disk tier (--cache-dir): list or clear stored prefixes.")
app.add_typer(cache_app, name="cache")
CacheDirArg = typer.Option(..., "--cache-dir", help="The folder given to --cache-dir.")


@cache_app.command("ls")
@boundary
def cache_ls(cache_dir: Path = CacheDirArg, as_json: bool = typer.Option(False, "--json", help="One JSON object per line.")):
    """List stored prefixes with their manifests (headers only; data is not read)."""
    from ..cache.pool import format_bytes
    from ..cache.disk import DiskStore

    files = DiskStore(cache_dir, create=False).files()
    if as_json:
        for f in files:
            print(json.dumps({"file": f.path.name, "bytes": f.size, "manifest": f.manifest and f.manifest.to_metadata(), "problem": f.problem}))
        return
    table = Table(title=f"{cache_dir}: {len(files)} stored prefixes, {format_bytes(sum(f.size for f in files))}")
    for col in ("file", "task", "model", "dtype", "storage", "tokens", "size", "created"):
        table.add_column(col)
    for f in files:
        m = f.manifest
        if m is None:
            table.add_row(f.path.name, f"[red]{f.problem}[/]", "", "", "", "", format_bytes(f.size), "")
        else:
            table.add_row(f.path.name[:16], m.name, m.model, m.dtype, m.storage, m.tokens, format_bytes(f.size), m.created)
    out.print(table)


@cache_app.command("clear")
@boundary
def cache_clear(cache_dir: Path = CacheDirArg):
    """Delete every stored prefix in the folder (other files are left alone)."""
    from ..cache.pool import format_bytes
    from ..cache.disk import DiskStore

    cleared = DiskStore(cache_dir, create=False).clear()
    err.print(f"removed {cleared.files} stored prefixes ({format_bytes(cleared.bytes)}) from {cache_dir}")


def main() -> None:  # pragma: no cover - entry point
    app()
