"""``prefixcache eval``: a task scored against gold labels, optionally calibrated or swept over example counts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .errors import reported, err, out, output_path
from .evaluate_extract import eval_extraction, field_policy
from .loading import check_text_field, setup_classifier, setup_extractor
from .options import (
    BatchOpt, DtypeOpt, HeadOpt, IdFieldOpt, LabelFieldOpt, MethodOpt, ModelOpt, TaskOpt, TextFieldOpt, ThreadsOpt,
)


@reported
def eval_(
    input: str = typer.Argument(..., help="Labelled input .csv, .jsonl, .parquet, or - for JSONL on stdin."),
    task: str = TaskOpt,
    label_field: str = LabelFieldOpt,
    model: str = ModelOpt,
    batch_size: int = BatchOpt,
    method: str = MethodOpt,
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    calibrate: bool = typer.Option(False, "--calibrate", help="Also report contextual calibration, in the same run."),
    content_free: Optional[list[str]] = typer.Option(
        None, "--content-free",
        help="A content-free input for calibration (repeatable; implies --calibrate; default: 'N/A', '', '[MASK]').",
    ),
    sweep_examples: Optional[str] = typer.Option(
        None, "--sweep-examples", help="Example counts such as 0,3,6,12,24: one run each, drawn from examples + example_pool."
    ),
    seed: Optional[int] = typer.Option(None, "--seed", help="Seed of the sweep's example order (default: the task's select.seed, else 0)."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG: the confusion matrix, or accuracy and ms/item per sweep step."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    head: Optional[Path] = HeadOpt,
    field_head: Optional[list[str]] = typer.Option(None, "--field-head", help="Extraction: FIELD=FILE, a choice field's head."),
    min_confidence: Optional[list[str]] = typer.Option(None, "--min-confidence", help="Extraction: FIELD=P thresholds to report."),
    target_accuracy: Optional[float] = typer.Option(
        None, "--target-accuracy", min=0.0, max=1.0, help="Extraction: per field, the lowest threshold reaching this accuracy."),
):
    """Score a task against gold labels: accuracy, macro-F1, per-label precision/recall, confusion matrix.
    For an extraction task, gold fields are the columns named as its fields (docs/extraction.md)."""
    from ..eval.calibration import CONTENT_FREE
    from ..eval.evaluate import parse_steps, plan_eval, run_eval
    from ..eval.report import check_plotting, emit
    from ..io import records as data
    from ..task.definition import ExtractTask, load_any_task, load_task

    if plot:
        output_path(plot, "--plot")
        check_plotting()
    steps = parse_steps(sweep_examples) if sweep_examples is not None else None
    records = list(check_text_field(data.read_records(input, text_field, id_field), text_field))
    if isinstance(load_any_task(task), ExtractTask):
        extractor = setup_extractor(task, model, dtype, threads, None)
        extractor.policy = field_policy(extractor, field_head, None, tuned=head)  # head: the task's tuned prefix
        return eval_extraction(extractor, records, batch_size, target_accuracy, min_confidence, as_json, plot)
    _refuse_field_options(("--field-head", field_head), ("--min-confidence", min_confidence),
                          ("--target-accuracy", target_accuracy))
    plan = plan_eval(load_task(task), records, label_field, steps, seed, head)
    classifier = setup_classifier(task, model, dtype, threads, method, head=plan.head)
    neutral = tuple(content_free) if content_free else CONTENT_FREE if calibrate else None

    def progress(r):
        err.print(
            f"{r.examples} examples, prefix {r.prefix_tokens} tokens: "
            f"accuracy {r.metrics.accuracy:.1%}, {r.ms_per_item:.2f} ms/item"
        )

    results = run_eval(classifier.loaded, plan, batch_size, method, neutral, on_result=progress)
    emit(results, plan.sweep, as_json, plot, out, err)


def _refuse_field_options(*given: tuple[str, object]) -> None:
    """A classification task's eval refuses the options that only an extraction task's fields take."""
    for option, value in given:
        if value:
            raise typer.BadParameter("applies to an extraction task's fields only", param_hint=option)
