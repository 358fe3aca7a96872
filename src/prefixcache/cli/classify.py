"""``prefixcache classify``: one JSON line per record, locally (resumable) or on Ray workers."""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from ..io.journal import ON_ERROR
from ..io.outputs import parse_keep
from ..types import DEFAULT_WORKERS, METHODS, MODES, OVERFLOW, RunConfig
from .errors import reported, choice, err, flag, given, open_output, output_path
from .loading import check_text_field, make_pool, progress, record_folder_budget, setup_classifier
from .options import (
    RUN, BatchOpt, CacheBudgetOpt, CalibrationOpt, KeepFieldsOpt, KeepInputOpt, MinConfidenceOpt, ReviewOutOpt,
    TargetAccuracyOpt, CacheDirBudgetOpt, CacheDirOpt, DtypeOpt, EvictionOpt, HeadOpt, IdFieldOpt, KVStorageOpt,
    MethodOpt, ModelOpt, ModeOpt, TaskOpt, TextFieldOpt,
)
from .reports import report_pool

RAY_ONLY = ("ray_address", "workers", "num_gpus")  # classify options that mean something only with --ray
NOT_WITH_RAY = {  # classify options that a Ray run cannot honour, and why
    "resume": "a Ray run writes a new folder of parts; rerun into a new --out folder",
    "window": "Ray workers are handed 4 x --batch-size rows per call; there is no output window to flush",
    "cache_budget": "each Ray worker keeps the one prefix it needs; --cache-dir shares it between workers",
    "kv_storage": "Ray workers store their prefix in float",
    "eviction": "each Ray worker keeps the one prefix it needs",
    "keep_fields": "Ray parts hold the predictions only",
    "keep_input": "Ray parts hold the predictions only",
    "review_out": "Ray parts hold every prediction; select the abstained lines from them",
}


@reported
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
    threads: Optional[int] = typer.Option(
        None, "--threads", min=1, help="Torch threads (default: all cores; with --ray per worker, default 1)."
    ),
    cache_budget: Optional[str] = CacheBudgetOpt,
    cache_dir: Optional[Path] = CacheDirOpt,
    cache_dir_budget: Optional[str] = CacheDirBudgetOpt,
    kv_storage: str = KVStorageOpt,
    eviction: str = EvictionOpt,
    on_error: str = typer.Option(ON_ERROR[0], "--on-error", help="A failed record: skip (error line, go on) or fail (stop there)."),
    overflow: str = typer.Option(RUN.overflow, "--overflow", help="A record past the model's context: error, or truncate (flagged)."),
    resume: bool = typer.Option(False, "--resume", help="Continue the job in --out: keep its complete lines, run the rest."),
    window: int = typer.Option(RUN.window, "--window", min=1, help="Records length-sorted and written together; "
                               "with --out, the unit that is flushed and fsynced (a kill loses at most one)."),
    ray: bool = typer.Option(False, "--ray", help="Run on a pool of Ray actors (needs the 'ray' extra); see docs/scale-out.md."),
    ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --ray: a running cluster (auto, HOST:6379, "
                                              "ray://HOST:10001); default: start a local Ray."),
    workers: int = typer.Option(DEFAULT_WORKERS, "--workers", min=1, help="With --ray: worker processes, each with its own model and prefix."),
    num_gpus: float = typer.Option(0.0, "--num-gpus", min=0, help="With --ray: GPUs per worker (a fraction shares one)."),
    head: Optional[Path] = HeadOpt,
    calibration: Optional[Path] = CalibrationOpt,
    min_confidence: Optional[float] = MinConfidenceOpt,
    target_accuracy: Optional[float] = TargetAccuracyOpt,
    review_out: Optional[Path] = ReviewOutOpt,
    keep_fields: Optional[str] = KeepFieldsOpt,
    keep_input: bool = KeepInputOpt,
):
    """Classify every record; write one line per record: id, label, confidence, scores, margin (or error); --out's
    extension picks the format (.csv, .parquet, else JSON Lines). Under a threshold: "label": null, "abstained": true.

    Exit code 0: all classified; 1: some record failed (its line has "error"); 2: stopped (bad usage, an
    unreadable file, or --on-error fail). With --out --resume a killed job continues where it stopped.
    With --ray the records are read and classified on Ray workers; --out then names a folder of parts.
    """
    config = RunConfig(choice(mode, MODES, "--mode"), batch_size, window, choice(overflow, OVERFLOW, "--overflow"))
    policy = choice(on_error, ON_ERROR, "--on-error")
    check_ray_options(ctx, ray, input, policy)
    keep = parse_keep(keep_fields, keep_input)
    task = task_with_trust(task_with_head(task, head), calibration, min_confidence, target_accuracy)
    job = ClassifyJob(input, text_field, id_field, task, model, dtype, threads, method, config, out_path)
    if ray:
        record_folder_budget(cache_dir_budget, cache_dir)  # the workers honour the folder's recorded budget
        return classify_on_ray(job, cache_dir, ray_address, workers, num_gpus)
    output_path(out_path, "--out"), output_path(review_out, "--review-out")
    cache = (cache_budget, cache_dir, kv_storage, eviction, cache_dir_budget)
    classify_here(job, cache, policy, resume, Delivery(keep, review_out))


@dataclass(frozen=True)
class ClassifyJob:
    """What one ``classify`` reads, with which model and task, how it runs and where it writes: the settings a
    local run and a Ray run share, parsed once by the command."""

    input: str  # a file, a folder or URI (Ray), or - for stdin
    text_field: str
    id_field: Optional[str]
    task: object  # a task name or path, or a loaded Task (with --head or trust settings folded in)
    model: str
    dtype: str
    threads: Optional[int]
    method: str
    config: RunConfig
    out_path: Optional[Path]


@dataclass(frozen=True)
class Delivery:
    """What a local run writes beyond the prediction lines: ``keep``, the input fields kept beside each label
    (:func:`~prefixcache.io.outputs.parse_keep`), and ``review_out``, the abstained records' rows."""

    keep: tuple[str, ...] = ()
    review_out: Optional[Path] = None


def task_with_trust(task, calibration: Optional[Path], min_confidence: Optional[float], target_accuracy: Optional[float]):
    """``--task`` with ``--calibration`` (an absolute path), ``--min-confidence`` and ``--target-accuracy`` folded into
    it, so that a local run and every Ray worker build the same :class:`~prefixcache.engine.confidence.Trust`."""
    if calibration is None and min_confidence is None and target_accuracy is None:
        return task
    if min_confidence is not None and target_accuracy is not None:
        raise typer.BadParameter("give --min-confidence or --target-accuracy, not both")
    from ..task.definition import load_task

    spec = load_task(task) if isinstance(task, str) else task
    update = {"min_confidence": min_confidence, "target_accuracy": target_accuracy}
    if calibration is not None:
        update["calibration"] = str(Path(calibration).resolve())
    return spec.model_copy(update=update)


def classify_here(job: ClassifyJob, cache, policy: str, resume: bool, delivery: Delivery = Delivery()) -> None:
    """The local run, streamed from reader to journal (memory does not grow with the input): skip what
    ``--resume`` recovered, classify the rest.
    With ``--out`` the job file goes beside it, and ``--resume`` first checks that it is the same job.
    A CSV or Parquet ``--out`` is journalled as JSON Lines beside it and written at the end (:mod:`prefixcache.io.outputs`).
    ``cache``: the pool options, as :func:`~prefixcache.cli.loading.make_pool` takes them."""
    from ..io import records as data
    from ..io.journal import Recovered, recover, skip_done, write_predictions
    from ..io.outputs import RowTap, finish_table, journal_path
    from ..types import RunStats

    input, config, out_path = job.input, job.config, job.out_path
    if resume and out_path is None:
        raise typer.BadParameter("--resume needs --out: the output file is what it resumes")
    total = data.count_rows(input)  # a cheap pass for the progress bar; the job itself streams
    records = check_text_field(data.scan_records(input, job.text_field, job.id_field), job.text_field)
    journal = journal_path(out_path) if out_path else None
    done = recover(journal) if resume else Recovered()
    records = skip_done(done, records, journal)
    classifier = setup_classifier(job.task, job.model, job.dtype, job.threads, job.method, make_pool(*cache))
    start_job(classifier, out_path, resume, done.lines)
    stats = RunStats()
    mode = "a" if resume else "w"
    with (open_output(journal, mode, "--out") if out_path else nullcontext(sys.stdout)) as sink, \
            (open_output(delivery.review_out, mode, "--review-out") if delivery.review_out else nullcontext()) as review:
        tap = RowTap(delivery.keep, review)
        with progress(total, f"classify [{config.mode}]") as bar:
            bar.update(done.lines)
            predictions = classifier.classify(tap.records(records), config, progress=bar.update, stats=stats)
            written = write_predictions(predictions, sink, policy, config.window if out_path else None, tap.render)
    if out_path and journal != out_path:
        finish_table(journal, out_path)
    err.print(tap.tally.summary(), highlight=False)
    err.print(
        f"{stats.records} records in {stats.seconds:.1f} s ({stats.records / max(stats.seconds, 1e-9):.1f} rec/s), "
        f"{written.failed} errors, {written.flagged} flagged, {stats.boundary_fallbacks} boundary fallbacks"
        + (f"; resumed after {done.lines} lines ({done.failed} errors)" if resume else "")
        + (f", cut a torn last line of {done.cut_bytes} bytes" if done.cut_bytes else "")
        + (f"; wrote {out_path}" if out_path else "")
    )
    if stats.context_overflows:
        err.print(f"{stats.context_overflows} records did not fit the model's context: shorten them, or pass "
                  "--overflow truncate to cut them to fit (they are flagged)", highlight=False)
    report_pool(classifier.pool)
    if done.failed + written.failed:
        raise typer.Exit(1)


def start_job(classifier, out_path: Optional[Path], resume: bool, done_lines: int) -> None:
    """Write the job file beside ``--out`` (under ``--resume`` after checking it is the same job), before the first
    line: lines never exist without their job file. It records the threshold and its expected coverage."""
    from ..io.job_file import check_job, write_job

    if not out_path:
        return
    fingerprint = classifier.fingerprint()
    if resume:
        check_job(out_path, fingerprint, done_lines)
    threshold = classifier.trust.threshold
    write_job(out_path, fingerprint, threshold.to_json() if threshold is not None else {})


def check_ray_options(ctx: typer.Context, ray: bool, input: str, on_error: str) -> None:
    """Refuse option combinations that mean nothing with (or without) ``--ray``, naming the options."""
    if not ray:
        named = [flag(ctx, name) for name in RAY_ONLY if given(ctx, name)]
        if named:
            verb, them = ("needs", "it") if len(named) == 1 else ("need", "them")
            raise typer.BadParameter(f"{', '.join(named)} {verb} --ray: add --ray, or drop {them} for a local run")
        return
    for name, why in NOT_WITH_RAY.items():
        if given(ctx, name):
            raise typer.BadParameter(f"{flag(ctx, name)} does not work with --ray: {why}")
    if on_error == "fail":
        raise typer.BadParameter("--on-error fail does not work with --ray: a failed record becomes an error line "
                                 "(as with --on-error skip) and the exit code is 1")
    if input == "-":
        raise typer.BadParameter("--ray reads files, not stdin: write the input to a .jsonl file and pass its path")


def task_with_head(task: str, head: Optional[Path]):
    """``--task`` as the Ray workers get it: the name or path as given, or with ``--head`` the loaded task whose
    ``head:`` is that file's absolute path. Each worker loads the head from there (like a model path, the file
    must exist on every node) and checks it against its model and prompt."""
    if head is None:
        return task
    from ..engine.head_file import load_head
    from ..task.definition import load_task

    load_head(head)  # a bad head file is refused here, before Ray starts
    return load_task(task).model_copy(update={"head": str(Path(head).resolve())})


def classify_on_ray(job: ClassifyJob, cache_dir, ray_address, workers, num_gpus) -> None:
    """``classify --ray``: the job is :func:`prefixcache.scaleout.run_ray_classify`; it prints the summary
    (items/s per worker and in total) through ``log``, on standard error, and the exit code follows its errors."""
    from ..scaleout import RayCluster, WorkerSpec, run_ray_classify
    from ..model.catalog import DTYPE_CHOICES

    def log(line: str) -> None:
        err.print(line, markup=False, highlight=False, soft_wrap=True)  # unwrapped: the summary is a table

    config = job.config
    spec = WorkerSpec(
        job.task, job.model, choice(job.dtype, DTYPE_CHOICES, "--dtype"), job.threads,
        choice(job.method, METHODS, "--method"), RunConfig(config.mode, config.batch_size, overflow=config.overflow),
        job.text_field, job.id_field, cache_dir,
    )
    summary = run_ray_classify(job.input, job.out_path, spec, RayCluster(ray_address, workers, num_gpus), log)
    if summary.errors:
        raise typer.Exit(1)
