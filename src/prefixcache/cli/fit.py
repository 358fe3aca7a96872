"""``prefixcache fit``: fit a label head on labelled rows, through the task's cached prefix, and write it."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from .errors import reported, err, out, output_path
from .loading import load, progress
from ..eval.tune_config import TUNE_CHOICES, RefitConfig, TuneConfig
from .options import EpochsOpt, FeatureOpt, RefitHeadOpt, TuneLrOpt, TuneOpt, VirtualTokensOpt
from .options import BatchOpt, DtypeOpt, IdFieldOpt, LabelFieldOpt, ModelOpt, TaskOpt, TextFieldOpt, ThreadsOpt

if TYPE_CHECKING:  # annotations only: the command imports these when it runs
    from ..eval.fit_curve import CurvePoint
    from ..eval.fit_head import FitResult
    from ..scheduler.feature_pass import FeatureSet
    from ..task.prompt import Prompt


@reported
def fit(
    train: str = typer.Argument(..., help="Labelled training rows: .csv, .jsonl, .parquet, or - for JSONL on stdin."),
    task: str = TaskOpt,
    label_field: str = LabelFieldOpt,
    out_path: Optional[Path] = typer.Option(
        None, "--out", help="Where to write the head (.safetensors with its JSON manifest); with --prompt-only the "
        "calibration file (default: <task file>.calibration.json beside the task file)."),
    prompt_only: bool = typer.Option(False, "--prompt-only", help="No head: calibrate the prompt's own label scores on "
                                     "the rows and write a calibration file (name it in the task file: calibration:)."),
    feature: str = FeatureOpt,
    on_prompt: bool = typer.Option(False, "--on-prompt", help="Fit a head that corrects the prompt's own label scores."),
    folds: int = typer.Option(5, "--folds", min=2, help="Stratified cross-validation folds (capped at the smallest label's rows)."),
    curve: Optional[str] = typer.Option(None, "--curve", help="Rows per label such as 1,2,5,10,all: held-out accuracy "
                                        "of prompt, head, head on prompt."),
    seed: int = typer.Option(0, "--seed", help="Seed of the folds and the curve's split and samples."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="PNG of the cross-validated confusion matrix (and PLOT.curve.png)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of tables."),
    text_field: str = TextFieldOpt,
    id_field: Optional[str] = IdFieldOpt,
    model: str = ModelOpt,
    dtype: str = DtypeOpt,
    threads: Optional[int] = ThreadsOpt,
    batch_size: int = BatchOpt,
    field: Optional[str] = typer.Option(
        None, "--field", help="An extraction task's choice field: fit its head on the gold column named as the field."),
    tune: str = TuneOpt,
    epochs: int = EpochsOpt,
    lr: float = TuneLrOpt,
    virtual_tokens: Optional[int] = VirtualTokensOpt,
    refit_head: bool = RefitHeadOpt,
):
    """Fit a label head on labelled rows: prints the cross-validated eval report and writes the head, calibrated on its
    out-of-fold predictions. With --prompt-only: calibrate the prompt's own scores and write a calibration file.
    With --field: a head for a choice field of an extraction task (used by `extract --head FIELD=FILE`).
    With --tune prefix: the task's cached prefix tuned, written with a head refitted on its states."""
    from ..engine.features import FeatureSpec
    from ..engine.head_file import save_head
    from ..eval.fit_curve import parse_shots
    from ..task.definition import load_task
    from ..task.prompt import build_prompt
    job = FitJob(train, label_field, text_field, id_field, task, model, dtype, threads, batch_size, out_path)
    if prompt_only:
        return fit_prompt_only(job)
    _check_out(out_path, plot if field is None else None)
    if field is not None or tune != "head":
        config = TuneConfig(epochs, lr, seed=seed, virtual_tokens=virtual_tokens)
        return _fit_other(job, field, tune, config, RefitConfig(refit_head, feature, folds, on_prompt, seed), as_json)
    FeatureSpec.parse(feature)  # a bad spec is refused before the model loads
    shots = parse_shots(curve) if curve is not None else None
    spec = load_task(task)
    rows = job.labelled(spec)
    loaded = job.load()
    features, seconds = _features(loaded, spec, rows.records, feature, batch_size)
    fitted = _fit(features, rows.gold, folds, on_prompt, seed, shots)
    result = fitted.result
    result.head.manifest["task"] = spec.name
    written = save_head(result.head, out_path)
    _report(fitted, build_prompt(spec, loaded.tokenizer), batch_size, 1000 * seconds / len(rows.records), as_json, plot)
    err.print(f"wrote {written} ({len(features.labels)} labels, {features.features.shape[1]} features, fit {result.seconds:.1f} s)")


def _fit_other(job: FitJob, field: Optional[str], tune: str, config: TuneConfig, head: RefitConfig,
               as_json: bool) -> None:
    """``fit --field`` (a choice field's head, cross-validated over ``head.folds``) or ``fit --tune prefix`` (a tuned
    prefix with its head, refitted on its states as ``head`` says; for an extraction task, a tuned prefix on the gold
    fields' answers)."""
    if tune not in TUNE_CHOICES:
        raise typer.BadParameter(f"{tune!r} is not one of {', '.join(TUNE_CHOICES)}", param_hint="--tune")
    if field is not None:
        if tune != "head":
            raise typer.BadParameter("a choice field's head is a head: drop --tune prefix", param_hint="--tune")
        from .fit_field import fit_field

        return fit_field(job, field, head.folds, config.seed, as_json)
    from ..task.definition import ExtractTask, load_any_task

    spec = load_any_task(job.task)
    if isinstance(spec, ExtractTask):
        from .fit_prefix_fields import fit_prefix_fields

        return fit_prefix_fields(job, spec, config, as_json)
    from .fit_prefix import fit_prefix

    return fit_prefix(job, config, head, as_json)


@dataclass(frozen=True)
class FitJob:
    """What one ``fit`` reads, with which model and task, and where it writes: the settings a head, a field's
    head (``--field``) and a calibration file (``--prompt-only``) share, parsed once by the command."""

    train: str  # a file, or - for JSONL on stdin
    label_field: str  # the gold label's column (a field's head reads the column named as the field)
    text_field: str
    id_field: Optional[str]
    task: str  # a task name or path
    model: str
    dtype: str
    threads: Optional[int]
    batch_size: int
    out_path: Optional[Path]

    def read(self):
        """The training rows as records (lazily)."""
        from ..io import records as data

        return data.read_records(self.train, self.text_field, self.id_field)

    def labelled(self, spec):
        """The training rows paired with their gold labels from ``label_field`` (:func:`~prefixcache.eval.evaluate.
        labelled_records`, which refuses, naming the rows, a missing label or one outside ``spec``'s labels)."""
        from ..eval.evaluate import labelled_records

        return labelled_records(self.read(), self.label_field, spec)

    def load(self):
        """The model as ``--model``, ``--dtype`` and ``--threads`` name it."""
        return load(self.model, self.dtype, self.threads)


@dataclass(frozen=True)
class Fitted:
    """What one head fit produced: the fit (the head and its cross-validated figures), the features it was fitted
    on, and the rows-per-label curve (None without ``--curve``)."""

    result: FitResult
    features: FeatureSet
    points: Optional[list[CurvePoint]]


def _check_out(out_path: Optional[Path], plot: Optional[Path]) -> None:
    """``--out`` is required for a head and must be writable; so must ``--plot``, with matplotlib installed."""
    from ..eval.report import check_plotting

    if out_path is None:
        raise typer.BadParameter("where to write the head", param_hint="--out")
    output_path(out_path, "--out")
    if plot:
        output_path(plot, "--plot")
        check_plotting()


def fit_prompt_only(job: FitJob) -> None:
    """``fit --prompt-only``: the prompt's scores on the rows, one temperature, the calibration file (``--out``, else
    beside the task file)."""
    from ..engine.calibration_file import save_calibration
    from ..eval.prompt_calibration import calibrate_prompt
    from ..scheduler.classify import Classifier
    from ..task.definition import load_task

    out_path, task = job.out_path, job.task
    if out_path is None:
        if not Path(task).is_file():
            raise typer.BadParameter(f"task {task!r} is not a file to write beside: name the calibration file", param_hint="--out")
        out_path = Path(task).with_suffix(".calibration.json")
    output_path(out_path, "--out")
    spec = load_task(task)
    rows = job.labelled(spec)
    document = calibrate_prompt(Classifier(job.load(), spec), rows.records, rows.gold, job.batch_size)
    save_calibration(document, out_path)
    ece, temperature = document["ece"], document["calibration"]["temperature"]
    out.print(f"prompt accuracy {document['accuracy']:.1%} on {len(rows.gold)} rows; temperature {temperature:.3f}; "
              f"calibration error {ece['raw']:.1%} raw, {ece['calibrated']:.1%} calibrated (same rows)")
    err.print(f"wrote {out_path}; name it in the task file (calibration: {out_path.name}) or pass --calibration")


def _trust_tables(result) -> list:
    """The out-of-fold calibration error and accuracy against coverage (none without cross-validation)."""
    from dataclasses import replace

    from ..eval.selective import selective, selective_table

    if result.oof_confidence is None:
        return []
    figures = selective(result.oof_confidence, result.oof_correct)
    figures = replace(figures, ece_raw=result.ece[0])
    title = f"confidence (out-of-fold, temperature {result.calibration.temperature:.3f})"
    return [selective_table(figures, title)]


def _features(loaded, task, records, feature: str, batch_size: int):
    """Every row's features, with a progress bar; refuses rows that cannot run, naming them."""
    from ..scheduler.feature_pass import collect_features
    from ..types import RunConfig

    started = time.perf_counter()
    with progress(len(records), "features") as bar:
        features = collect_features(loaded, task, records, feature=feature, config=RunConfig(batch_size=batch_size),
                                    progress=bar.update)
    return features.require_complete("training row"), time.perf_counter() - started


def _fit(features, gold, folds: int, on_prompt: bool, seed: int, shots) -> Fitted:
    """The head fitted on ``features`` (``C`` by cross-validation), and the curve over ``shots`` when given."""
    from ..eval.fit_curve import fit_curve
    from ..eval.fit_head import fit_head

    err.print(f"fitting a head on {len(gold)} rows ({folds}-fold cross-validation)…")
    result = fit_head(features, gold, folds=folds, on_prompt=on_prompt, seed=seed)
    points = fit_curve(features, gold, shots, seed=seed, folds=folds) if shots else None
    return Fitted(result, features, points)


def _report(fitted: Fitted, prompt: Prompt, batch_size: int, ms_per_item: float, as_json: bool, plot: Optional[Path]):
    """Print eval's report of the cross-validated predictions (or the JSON document) and write the plots.
    ``prompt``: the task's prompt the features were taken through."""
    import json

    from ..eval.fit_report import as_eval_result, curve_table, fit_document, fit_table, plot_curve
    from ..eval.report import eval_tables, title

    result, features, points, task = fitted.result, fitted.features, fitted.points, prompt.task
    evaluated = None
    if result.cv_metrics is not None:
        evaluated = as_eval_result(result, features, prompt, batch_size, ms_per_item,
                                   prefix_ms=0.0)  # the prefix build is in ms_per_item
    if as_json:
        document = fit_document(result, evaluated, points) if evaluated else {"fit": result.cv_json()}
        print(json.dumps(document))
    else:
        for table in (eval_tables(evaluated) if evaluated else []) + [fit_table(result)] + _trust_tables(result):
            out.print(table)
        if points:
            out.print(curve_table(points))
    if plot is None:
        return
    from ..eval.report_plots import plot_confusion

    if evaluated is not None:
        err.print(f"wrote {plot_confusion(evaluated, plot, title(evaluated) + ' | cross-validated')}")
    if result.oof_confidence is not None:
        from ..eval.selective import plot_trust

        trust_path = plot_trust(result.oof_confidence, result.oof_correct, plot.with_suffix(".trust.png"),
                                f"{task.name} | out-of-fold, temperature {result.calibration.temperature:.3f}")
        err.print(f"wrote {trust_path}")
    if points:
        curve_path = plot.with_suffix(".curve.png")
        err.print(f"wrote {plot_curve(points, curve_path, f'{task.name} | {features.model_identity}', len(features.labels))}")
